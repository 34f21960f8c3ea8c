"""The smallest fixes of the ledger's findings, applied to a copy of the pinned engine files.

Each fix is an edit described by where it goes (a function, an anchor line) and what it does, never
a copy of engine code: `patched_tree` copies the engine's pinned files from the hash-checked cache
into a directory, applies the fixes there and refuses (naming file and anchor) when an anchor no
longer occurs exactly once. `scripts/prove_fixes.py` then runs each fix's properties with
`--engine-src NAME=TREE`: the fix edits the files its ledger entry names, so the entry's strict xfail
does not apply there (oracles/ledger.py `files`, supply.fetch.pinned_files) and the property must pass
plainly. The upstream
drafts in docs/upstream-reports.md describe the same fixes in words.

The edits live here; which entry a fix is for, the tests that prove it and where it runs around its entry live
in the entry's own module (harness/ledger_entries: `Entry.fix`), which `FIXES` reads. The planted bugs and kernel
mutants below belong to no entry.
"""

from __future__ import annotations

import ast
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from k3num.supply import fetch

VLLM_ATTN_RES = "vllm/models/kimi_k3/nvidia/ops/attn_res.py"
ROCM_ATTN_RES = "vllm/models/kimi_k3/amd/ops/attn_res.py"
SGLANG_ATTN = "sglang/srt/layers/attn_residual.py"
SGLANG_MATERIALIZE = "sglang/kernels/ops/speculative/fused_kv_materialize.py"
SGLANG_DRAFT_KV = "sglang/kernels/ops/speculative/dspark/fused_kv_write.py"
TOKENSPEED_MODEL = "tokenspeed/runtime/models/kimi_k3_dspark.py"
TOKENSPEED_CONTEXT = "tokenspeed/runtime/execution/dspark_context.py"
TOKENSPEED_KIMI_K3 = "tokenspeed/runtime/models/kimi_k3.py"
TOKENSPEED_ROPE = "tokenspeed_kernel/ops/embedding/triton.py"
VLLM_DSPARK = "vllm/models/kimi_k3/nvidia/dspark_mla.py"
VLLM_SPECULATOR = "vllm/v1/worker/gpu/spec_decode/dspark/speculator.py"
VLLM_PARAMETER = "vllm/model_executor/parameter.py"
ROCM_LINEAR = "vllm/models/kimi_k3/amd/linear.py"


class FixError(RuntimeError):
    """A fix no longer applies to the file (its anchor is gone or ambiguous)."""


def _lines_of(text: str, func: str, path: str) -> tuple[int, int]:
    """(first, last) 0-based line numbers of the top-level function `func`."""
    for node in ast.parse(text).body:
        if isinstance(node, ast.FunctionDef) and node.name == func:
            return node.lineno - 1, (node.end_lineno or node.lineno) - 1
    raise FixError(f"{path}: function {func} not found")


def _one(lines: list[str], lo: int, hi: int, pattern: str, path: str) -> int:
    hits = [i for i in range(lo, hi + 1) if re.search(pattern, lines[i])]
    if len(hits) != 1:
        raise FixError(f"{path}: expected one line matching {pattern!r} in lines {lo + 1}-{hi + 1}, found {len(hits)}")
    return hits[0]


def _replace_in(text: str, path: str, func: str, pattern: str, old: str, new: str) -> str:
    """`text` with `old` replaced by `new` on the one line of top-level function `func` matching `pattern`
    (FixError when the function or the one line is not there)."""
    lines = text.splitlines(keepends=True)
    lo, hi = _lines_of(text, func, path)
    i = _one(lines, lo, hi, pattern, path)
    lines[i] = lines[i].replace(old, new, 1)
    return "".join(lines)


def _replace_in_method(text: str, path: str, method: str, pattern: str, old: str, new: str) -> str:
    """`text` with `old` replaced by `new` on the one line of the one method `method` (of any class) matching
    `pattern` (FixError when the method or the one line is not there)."""
    lines = text.splitlines(keepends=True)
    lo, hi = _method_lines(text, method, path)
    i = _one(lines, lo, hi, pattern, path)
    lines[i] = lines[i].replace(old, new, 1)
    return "".join(lines)


def _delta_barrier(lines: list[str], text: str, path: str) -> int:
    """The line of `if HAS_DELTA:` directly followed by `tl.debug_barrier()` in _attn_res_kernel (the
    first `if HAS_DELTA:` guards the delta load)."""
    lo, hi = _lines_of(text, "_attn_res_kernel", path)
    cands = [j for j in range(lo, hi) if re.match(r"^\s*if HAS_DELTA:\s*$", lines[j])
             and re.match(r"^\s*tl\.debug_barrier\(\)\s*$", lines[j + 1])]
    if len(cands) != 1:
        raise FixError(f"{path}: expected one `if HAS_DELTA:` guarding tl.debug_barrier(), found {len(cands)}")
    return cands[0]


def barrier_under_write_block(text: str, path: str) -> str:
    """K3N-004/005: the existing barrier before the source loads is emitted under HAS_DELTA only;
    emit it under HAS_DELTA or WRITE_BLOCK, so the bank row stored this call is visible to the
    loads of every thread."""
    lines = text.splitlines(keepends=True)
    i = _delta_barrier(lines, text, path)
    lines[i] = lines[i].replace("if HAS_DELTA:", "if HAS_DELTA or WRITE_BLOCK:")
    return "".join(lines)


def barrier_before_prefix_store(text: str, path: str) -> str:
    """K3N-007: a barrier before the in-place store of prefix + delta, so no thread's (re)load of the
    prefix can see the updated value (the compiled kernel reloads the prefix in the tile layout)."""
    lines = text.splitlines(keepends=True)
    lo, hi = _lines_of(text, "_attn_res_kernel", path)
    cast = _one(lines, lo, hi, r"^\s*updated_prefix = updated_prefix\.to\(", path)
    store = next((j for j in range(cast + 1, hi + 1) if re.match(r"^\s*tl\.store\(\s*$", lines[j])), None)
    if store is None:
        raise FixError(f"{path}: no tl.store( after the prefix cast")
    indent = re.match(r"^(\s*)", lines[store]).group(1)
    lines.insert(store, f"{indent}tl.debug_barrier()  # k3num fix\n")
    return "".join(lines)


def aggregate_fused_through_dispatch(text: str, path: str) -> str:
    """K3N-008: `_aggregate_fused` calls `_mix_fused` for every shape; calling `aggregate_stream`
    instead gives it the public path's dispatch (the eager fallback when H % 1024 != 0, the same
    Triton pair otherwise)."""
    return _replace_in(text, path, "_aggregate_fused", r"_mix_fused\(", "_mix_fused(", "aggregate_stream(")


def refuse_bank_indices_outside_the_bank(text: str, path: str) -> str:
    """K3N-009/010: the wrapper refuses num_blocks outside [0, bank rows] and block_write_idx outside
    [-1, bank rows) (the checks that today gate only the SM100 native op)."""
    lines = text.splitlines(keepends=True)
    lo, hi = _lines_of(text, "attn_res", path)
    i = _one(lines, lo, hi, r"^\s*num_tokens, hidden_size = prefix\.shape\s*$", path)
    indent = re.match(r"^(\s*)", lines[i]).group(1)
    check = "0 <= num_blocks <= blocks.shape[1] and -1 <= block_write_idx < blocks.shape[1]"
    lines.insert(i + 1, f"{indent}if not ({check}):\n"
                        f"{indent}    raise ValueError(f'attn_res: num_blocks {{num_blocks}} / block_write_idx "
                        f"{{block_write_idx}} outside the bank of {{blocks.shape[1]}} rows')  # k3num fix\n")
    return "".join(lines)


def drop_delta_barrier(text: str, path: str) -> str:
    """Mutant (dropped barrier): the barrier between the in-place prefix store and the source loads
    that reload the prefix is removed. Sequential execution cannot see it; the GPU can."""
    lines = text.splitlines(keepends=True)
    i = _delta_barrier(lines, text, path) + 1
    lines[i] = lines[i].replace("tl.debug_barrier()", "pass  # k3num mutant: barrier dropped")
    return "".join(lines)


def unmask_source_columns(text: str, path: str) -> str:
    """Mutant (unmasked load): the source tile's loads keep the row mask but lose the column mask, so
    for a hidden size below the power-of-two tile they read past each row."""
    return _replace_in(text, path, "_attn_res_kernel", r"mask=source_mask\[:, None\] & d_mask\[None, :\]",
                       "source_mask[:, None] & d_mask[None, :]", "source_mask[:, None]")


def _record_calls(text: str, path: str, func: str) -> str:
    """`text` with top-level function `func` (a launcher of a planted kernel) appending the running pytest
    node id to the file K3NUM_PLANT_LOG names at its first statement, so the isolation proof knows exactly
    which tests called the broken kernel (scripts/gpu_isolation.py)."""
    lines = text.splitlines(keepends=True)
    fn = next((n for n in ast.parse(text).body if isinstance(n, ast.FunctionDef) and n.name == func), None)
    if fn is None:
        raise FixError(f"{path}: function {func} not found")
    body = fn.body[1:] if isinstance(fn.body[0], ast.Expr) and isinstance(fn.body[0].value, ast.Constant) else fn.body
    if not body:
        raise FixError(f"{path}: function {func} has no statement to instrument")
    i = body[0].lineno - 1
    indent = re.match(r"^(\s*)", lines[i]).group(1)
    lines.insert(i, f"{indent}import os as _k3os  # k3num instrumentation: who calls the planted kernel\n"
                    f"{indent}if _k3os.environ.get('K3NUM_PLANT_LOG'):\n"
                    f"{indent}    with open(_k3os.environ['K3NUM_PLANT_LOG'], 'a') as _k3log:\n"
                    f"{indent}        _k3log.write(_k3os.environ.get('PYTEST_CURRENT_TEST', '?').split(' ')[0]"
                    f" + '\\n')\n")
    return "".join(lines)


def record_mix_fused_calls(text: str, path: str) -> str:
    """Instrumentation for the planted mixture bugs: `_mix_fused` launches SGLang's score and combine kernels."""
    return _record_calls(text, path, "_mix_fused")


def record_materialize_calls(text: str, path: str) -> str:
    """Instrumentation for the planted DFlash bug: `_fused_norm_rope_stacked` launches the materializer's kernel."""
    return _record_calls(text, path, "_fused_norm_rope_stacked")


def skip_last_h_block(text: str, path: str) -> str:
    """Planted bug (unwritten memory; issue 32's plant): `_mix_fused` launches `_combine_kernel` over one
    H block fewer than the row has (at least one), so the last 1024 columns of every mixture row at H >= 2048
    are never written. The properties that judge this mixture must fail; nothing else may."""
    return _replace_in(text, path, "_mix_fused", r"^\s*n_h_blocks = H // _BLOCK_H\s*$", "H // _BLOCK_H",
                       "max(H // _BLOCK_H - 1, 1)")


def scale_materialized_v(text: str, path: str) -> str:
    """Planted bug (numeric, in a DFlash kernel): `_fused_norm_rope_kernel_stacked` stores twice each V
    element. The properties that call SGLang's DFlash materializer must fail; nothing else may."""
    return _replace_in(text, path, "_fused_norm_rope_kernel_stacked", r"^\s*tl\.store\(v_write \+ offs, v_raw, ",
                       "v_raw,", "(v_raw.to(tl.float32) * 2.0).to(v_raw.dtype),")


def scale_combined_mixture(text: str, path: str) -> str:
    """Planted bug (numeric): `_combine_kernel` stores twice the mixture. Every property that judges a
    mixture this kernel computes must fail; nothing else may."""
    return _replace_in(text, path, "_combine_kernel", r"^\s*acc\.to\(out_ptr\.dtype\.element_ty\),\s*$", "acc.to(",
                       "(acc * 2.0).to(")


def combine_store_out_of_bounds(text: str, path: str) -> str:
    """Planted bug (an illegal address): `_combine_kernel` stores 2^40 elements past its output, which
    leaves the CUDA context unusable; the harness must stop that worker's later tests as 'not run:
    CUDA context lost', not report them failed."""
    return _replace_in(text, path, "_combine_kernel", r"^\s*out_ptr \+ pid_t \* stride_om \+ offs_h,\s*$", "offs_h,",
                       "offs_h + (1 << 40),")


def scale_mixture(text: str, path: str) -> str:
    """Mutant (a wrong normalisation): vLLM's _attn_res_kernel divides the mixture by 1.01 times its
    softmax denominator, a 1% error every accuracy property sees (one bf16 rounding is 0.4%)."""
    return _replace_in(text, path, "_attn_res_kernel", r"^\s*mixed /= denominator\s*$", "mixed /= denominator",
                       "mixed /= denominator * 1.01  # k3num mutant")


def round_mixture_before_output_norm(text: str, path: str) -> str:
    """Planted bug (one extra bf16 rounding, issue 38's own on another engine and path): vLLM's _attn_res_kernel
    rounds the float32 mixture to bf16 before its output norm (as SGLang and TokenSpeed declare they do; vLLM's
    code keeps it float32). Half an ulp of the mixture, where the accuracy budget allows several."""
    return _replace_in(text, path, "_attn_res_kernel", r"^\s*output = mixed\s*$", "output = mixed",
                       "mixed = mixed.to(prefix_ptr.dtype.element_ty).to(tl.float32)  # k3num planted\n"
                       "    output = mixed")


def round_inverse_rms_to_bf16(text: str, path: str) -> str:
    """Planted bug (one extra bf16 rounding, a third engine and path: issue 38): SGLang's
    _fused_kv_norm_rope_write_kernel rounds the K norm's reciprocal root to bf16 before it scales the head (a
    norm factor kept in the activation dtype), so every element of a head carries up to half an ulp more,
    all in one direction. The code's stated roundings (the normed K once before the RoPE, the roped K at the
    store) are all still there."""
    line = "inv = 1.0 / tl.sqrt(ms + EPS)"
    return _replace_in(text, path, "_fused_kv_norm_rope_write_kernel", rf"^\s*{re.escape(line)}\s*$", line,
                       f"{line}\n        inv = inv.to(tl.bfloat16).to(tl.float32)  # k3num planted")


def split_context_projection(text: str, path: str) -> str:
    """Drift (not a bug the properties catch): project_target_hidden's one GEMM over all taps becomes two
    GEMMs over the halves of the taps, each rounded to the weight dtype, summed there: two extra roundings
    that stay within the unsharded budget while the err/budget ratios move up (the regression gate's
    proof on a real engine, tests/test_history_gate.py)."""
    lines = text.splitlines(keepends=True)
    lo, hi = _method_lines(text, "project_target_hidden", path)
    i = _one(lines, lo, hi, r"return self\.finalize_target_projection\(self\.context_proj\(target_hidden\)\[0\]\)",
             path)
    indent = lines[i][: len(lines[i]) - len(lines[i].lstrip())]
    lines[i] = (f"{indent}w, half = self.context_proj.weight, target_hidden.shape[-1] // 2  # k3num drift\n"
                f"{indent}projected = (torch.nn.functional.linear(target_hidden[..., :half], w[:, :half])\n"
                f"{indent}             + torch.nn.functional.linear(target_hidden[..., half:], w[:, half:]))\n"
                f"{indent}return self.finalize_target_projection(projected)\n")
    return "".join(lines)


def context_scaled(factor: str) -> Edit:
    """Planted latent drift (issue 40): project_target_hidden's normed projection multiplied by `factor` (a
    Python literal), the draft's context a fraction of a percent off. Small enough that a decided token rarely
    flips in the token properties' blocks, large enough that the logits leave delta: the decided-token
    property must fail it on the logit error alone."""
    def edit(text: str, path: str) -> str:
        lines = text.splitlines(keepends=True)
        lo, hi = _method_lines(text, "project_target_hidden", path)
        i = _one(lines, lo, hi, r"return self\.finalize_target_projection\(self\.context_proj\(target_hidden\)\[0\]\)",
                 path)
        lines[i] = lines[i].replace("self.finalize_target_projection(self.context_proj(target_hidden)[0])",
                                    f"(self.finalize_target_projection(self.context_proj(target_hidden)[0]) * {factor})"
                                    "  # k3num planted")
        return "".join(lines)
    return edit


def round_accumulator_per_tap(text: str, path: str) -> str:
    """Planted bug (one extra bf16 rounding per tap, issue 37/38): DSparkContextProducer.add_capture keeps the
    pipeline's running sum in float32 ("float32 accumulation avoids rounding between taps"); this rounds it
    to bf16 after every tap. Inside K3N-006's files and its test, it is not K3N-006's bug."""
    return _replace_in_method(text, path, "add_capture",
                              r"^\s*projected\.add_\(self\.model\.project_target_tap\(capture_idx, hidden\)\)\s*$",
                              "projected.add_(self.model.project_target_tap(capture_idx, hidden))",
                              "projected.copy_(projected.add(self.model.project_target_tap(capture_idx, hidden))"
                              ".bfloat16())  # k3num planted")


def rocm_tap_mixes_the_next_layer(text: str, path: str) -> str:
    """K3N-001/002: ROCm's _maybe_add_hidden_state hands the prefix sum to the Eagle mixin whatever the stream flag
    says. With VLLM_KIMI_K3_AUX_ATTN_RES_STREAM on, this taps what the NVIDIA path of the same release taps: the
    AttnRes mixture of the layer that consumes the tap (capture id i + 1: layer i + 1's pre-attention weights over
    its valid blocks; after the last layer on the last rank, the output mixture over every block of the bank), through
    the file's own _apply_attn_res (no delta, no bank write). A non-final stage's end keeps the prefix: that is
    K3N-003's disagreement, which this does not decide."""
    lines = text.splitlines(keepends=True)
    lo, hi = _method_lines(text, "_maybe_add_hidden_state", path)
    i = _one(lines, lo, hi, r"^\s*if self\.config\.attn_res_block_size is not None:\s*$", path)
    ind = re.match(r"^(\s*)", lines[i]).group(1)
    body = [
        "if (self.config.attn_res_block_size is not None and envs.VLLM_KIMI_K3_AUX_ATTN_RES_STREAM",
        "        and residual is not None and layer_idx in self.aux_hidden_state_layers):  # k3num fix",
        "    mixing = None",
        "    if layer_idx < self.end_layer:",
        "        consumer = self.layers[layer_idx]",
        "        mixing = (consumer.self_attention_res_proj, consumer.self_attention_res_norm,",
        "                  consumer.prev_valid_blocks)",
        "    elif get_pp_group().is_last_rank:",
        "        mixing = (self.output_attn_res_proj, self.output_attn_res_norm, residual.shape[1])",
        "    if mixing is not None:",
        "        aux_hidden_states.append(_apply_attn_res(hidden_states, residual, *mixing))",
        "        return aux_hidden_states",
    ]
    lines[i:i] = [f"{ind}{b}\n" for b in body]
    return "".join(lines)


def combine_softmax_without_max(text: str, path: str) -> str:
    """Planted bug (numeric, exact in exact arithmetic): SGLang's `_combine_kernel` takes exp of the raw scores
    without subtracting their maximum first. Equal to the kernel wherever |score| stays inside float32 exp's
    range; inf / inf or 0 / 0 past it (properties/test_extreme_scores.py draws scores there)."""
    return _replace_in(text, path, "_combine_kernel", r"tl\.exp\(raw - m\)", "tl.exp(raw - m)", "tl.exp(raw)")


def online_softmax_without_max(text: str, path: str) -> str:
    """Planted bug (numeric, exact in exact arithmetic): vLLM's `_attn_res_kernel` keeps its online softmax's
    running sums unscaled (exp of the raw scores, no rescale by the running maximum). The same mixture in exact
    arithmetic; inf / inf or 0 / 0 once a score leaves float32 exp's range."""
    text = _replace_in(text, path, "_attn_res_kernel", r"^\s*old_scale = tl\.exp\(max_logit - new_max_logit\)\s*$",
                       "tl.exp(max_logit - new_max_logit)", "1.0")
    return _replace_in(text, path, "_attn_res_kernel", r"^\s*block_scales = tl\.exp\(scores - new_max_logit\)\s*$",
                       "tl.exp(scores - new_max_logit)", "tl.exp(scores)")


def prefix_tap_aliases_the_running_prefix(text: str, path: str) -> str:
    """Planted bug (a lifetime slip): TokenSpeed's prefix-stream tap (`_dspark_capture_stream` with the stream
    flag off) returns the running prefix sum itself instead of `prefix_sum.clone()`. Right when judged at once;
    the next layers' in-place residual adds then change a tap already handed to the draft."""
    return _replace_in_method(text, path, "_dspark_capture_stream", r"^\s*return prefix_sum\.clone\(\)\s*$",
                              "prefix_sum.clone()", "prefix_sum")


def rope_query_heads_read_head_0(text: str, path: str) -> str:
    """Planted bug (a dropped stride term): TokenSpeed's RoPE kernel reads every query head from head 0's lanes
    (`q_ptr + token_idx * q_stride_t`, no `head_idx * q_stride_h`) and writes it to its own head. The context
    write rotates keys alone (a zero-width query), so only a property that passes query heads sees it."""
    return _replace_in(text, path, "_rope_apply_kernel", r"base_ptr = q_ptr \+ token_idx \* q_stride_t \+ head_idx",
                       " + head_idx * q_stride_h", "")


def commit_window_one_past(text: str, path: str) -> str:
    """Planted bug (an off-by-one): SGLang's draft K/V writer keeps a verify-window column while
    `col > num_commit` is false, so each row's first uncommitted column is written too (and a row with nothing
    committed writes its first slot). Only a window with commit lengths reaches the branch."""
    return _replace_in(text, path, "_fused_kv_norm_rope_write_kernel", r"if col >= num_commit:", ">=", ">")


def watermark_key_at_the_sampled_position(text: str, path: str) -> str:
    """Planted bug (an off-by-one): vLLM's DSpark speculator hands its draft watermarker the sampled token's
    position P for the key, where the plain branch (and the target) key the draw by P - 1. Only a draft with a
    watermarker takes the branch."""
    return _replace_in_method(text, path, "_sample_logits", r"^ {16}sample_pos - 1,$", "sample_pos - 1", "sample_pos")


def merged_column_rows_of_rank_0(text: str, path: str) -> str:
    """Planted bug (a lost offset): vLLM's `_ColumnvLLMParameter.load_merged_column_weight` narrows every part
    at row 0 on every TP rank, so each rank loads rank 0's rows. Exact on rank 0 of any world, which is all the
    K3 draft's own merged layer (disable_tp) ever loads."""
    tree = ast.parse(text)
    cls = next((n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "_ColumnvLLMParameter"), None)
    fn = next((n for n in (cls.body if cls else []) if isinstance(n, ast.FunctionDef)
               and n.name == "load_merged_column_weight"), None)
    if fn is None:
        raise FixError(f"{path}: _ColumnvLLMParameter.load_merged_column_weight not found")
    lines = text.splitlines(keepends=True)
    i = _one(lines, fn.lineno - 1, (fn.end_lineno or fn.lineno) - 1, r"self\.tp_rank \* shard_size", path)
    lines[i] = lines[i].replace("self.tp_rank * shard_size", "0 * shard_size", 1)
    return "".join(lines)


def eager_mixture_xor(text: str, path: str) -> str:
    """Planted bug (an operator slip): SGLang's eager mixture `aggregate_stream_torch` weighs the rows with `^`
    for `*`, so torch's dispatcher raises NotImplementedError (`"bitwise_xor_cpu" not implemented for 'Float'`)
    on every call. That is an accident of the code, not a mode it lacks: it must fail, not skip."""
    return _replace_in(text, path, "aggregate_stream_torch", r"mixed = \(probs\.unsqueeze\(-1\) \* rows",
                       ") * rows", ") ^ rows")


def eager_mixture_max_over_the_batch(text: str, path: str) -> str:
    """Planted bug (batch composition, issue 57 item 4): SGLang's eager mixture `aggregate_stream_torch` takes its
    softmax by hand with one maximum over the whole batch (`scores.max()`) for each row's own. Exact in exact
    arithmetic, so every accuracy property passes it at moderate scores; a row's probabilities then round with
    the other rows of its batch, and a row alone differs from the row in its batch in its low bits."""
    return _replace_in(text, path, "aggregate_stream_torch", r"probs = torch\.softmax\(scores\.float\(\), dim=-1\)",
                       "torch.softmax(scores.float(), dim=-1)",
                       "(scores.float() - scores.float().max()).exp(); "
                       "probs = probs / probs.sum(dim=-1, keepdim=True)")


def split_the_tap_layer_not_its_consumer(text: str, path: str) -> str:
    """Planted bug (an off-by-one): TokenSpeed marks the captured layer itself for split AttnRes execution
    instead of its consumer (`layer_idx in captured` for `layer_idx - 1 in captured`), so the layer whose
    attention mixture is the tap may take the fused graph on CUDA."""
    return _replace_in_method(text, path, "_refresh_dflash_capture_fallback", r"layer_idx - 1 in captured",
                              "layer_idx - 1 in captured", "layer_idx in captured")


def tap_owner_prefix_by_name_prefix(text: str, path: str) -> str:
    """Planted bug (a lenient match): `_context_tap_owner_layer` takes any stream whose name starts with
    "prefix" for the prefix stream (`startswith`) instead of refusing it: "prefix_sum" gets an owner layer."""
    return _replace_in(text, path, "_context_tap_owner_layer", r'if aux_hidden_stream == "prefix":',
                       'aux_hidden_stream == "prefix"', 'aux_hidden_stream.startswith("prefix")')


def tap_owner_final_one_past_the_last(text: str, path: str) -> str:
    """Planted bug (an off-by-one): `_context_tap_owner_layer` gives the final AttnRes tap to layer
    `target_num_layers` (one past the last) instead of the last layer, whose stage holds the output pair."""
    return _replace_in(text, path, "_context_tap_owner_layer", r"return min\(layer_id \+ 1, target_num_layers - 1\)",
                       "target_num_layers - 1)", "target_num_layers)")


def score_norm_by_padded_width(text: str, path: str) -> str:
    """Planted bug (a masked-lane slip, issue 37/38): ROCm's _attn_res_kernel divides each source's sum of
    squares by the padded block width BLOCK_D instead of hidden_size, so every hidden size that is not a power of
    two (K3's 7168 among them) gets another softmax. Inside K3N-007's file and tests, it is not K3N-007's race."""
    line = r"^\s*tl\.sum\(values \* values, axis=1\) \* \(1\.0 / hidden_size\) \+ eps\s*$"
    return _replace_in(text, path, "_attn_res_kernel", line, "(1.0 / hidden_size)", "(1.0 / BLOCK_D)")


def bank_values_clamped_to_fp16_range(text: str, path: str) -> str:
    """Planted bug (magnitude, issue 57 item 1): ROCm's _attn_res_kernel clamps the bank rows it loads to fp16's
    largest finite value (+-65504, a sanitising clamp kept from an fp16 port) before it scores and mixes them.
    Exact for every value below it, so every property at the suite's usual magnitudes passes; a massive activation
    above it (K3's residual stream carries them) is mixed as 65504."""
    line = r"^\s*values = tl\.where\(is_prefix\[:, None\], updated_prefix\[None, :\], block_values\)\s*$"
    return _replace_in(text, path, "_attn_res_kernel", line, "block_values)",
                       "tl.clamp(block_values, -65504.0, 65504.0))")


def score_without_source_rms(text: str, path: str) -> str:
    """Planted bug (a second bug beside a known one, issue 37): ROCm's _attn_res_kernel scores each source by its
    dot product with the score weight without the source's reciprocal RMS, so the softmax weighs sources by their
    magnitude. The pinned ROCm tap never mixes (K3N-001: it returns the prefix), so the token properties on
    vllm-rocm, the entry's, cannot see it; around K3N-001's fix (harness/around.py) they must."""
    line = r"^\s*logits = tl\.sum\(values \* input_qk_weight\[None, :\], axis=1\) \* reciprocal_std\s*$"
    return _replace_in(text, path, "_attn_res_kernel", line, ") * reciprocal_std", ")  # k3num planted")


def layer0_norm_for_every_layer(text: str, path: str) -> str:
    """Planted bug (a copy-paste slip in real code the adapter used to replace): _build_fused_context_kv_metadata
    stacks layer 0's kv_a_layernorm weight for every draft layer, so the grouped norm normalises every layer's
    kv_c with layer 0's weight (0.33.0 stacks the list in place, 0.34.0 names it `norms` first: one line each)."""
    return _replace_in_method(text, path, "_build_fused_context_kv_metadata",
                              r"\[attn\.kv_a_layernorm\.weight\.detach\(\) for attn in attentions\]",
                              "[attn.kv_a_layernorm", "[attn0.kv_a_layernorm")


def layer0_attention_for_every_context_write(text: str, path: str) -> str:
    """Planted bug (a copy-paste slip in real code the TokenSpeed adapter used to replace): write_context_kv
    takes layer 0's attention for every draft layer, so every layer's cache gets layer 0's projection, norm
    and RoPE."""
    return _replace_in_method(text, path, "write_context_kv", r"^\s*attn = layer\.self_attn\s*$", "layer.self_attn",
                              "self.layers[0].self_attn")


# --- held-out planted bugs for the draft step (issue 40 item 5): one per kind of subject the step composes, each
# in real engine code that only a composed row reaches; `k3num impact` must move that engine's row past the noise
# floor (tests/test_impact_held_out.py), and a comment in the same file must not move it -----------------------


def stage_sum_overwritten(text: str, path: str) -> str:
    """Planted bug (a PP partial sum): DSparkContextProducer.add_capture copies each owned tap's projection into
    the pipeline's running sum instead of adding it, so a stage that owns two taps hands on only its last one's.
    A one-stage projection (project_target_hidden) never calls it."""
    return _replace_in_method(text, path, "add_capture",
                              r"^\s*projected\.add_\(self\.model\.project_target_tap\(capture_idx, hidden\)\)\s*$",
                              "projected.add_(", "projected.copy_(")


def softmax_mask_drops_the_prefix(text: str, path: str) -> str:
    """Planted bug (an off-by-one in a mixture): SGLang's _combine_kernel masks its softmax to the bank rows
    (offs_b < NVB) instead of the NVB bank rows and the prefix (<=), so the prefix source gets no weight."""
    return _replace_in(text, path, "_combine_kernel", r"^\s*mask_b = offs_b <= NVB\s*$", "<= NVB", "< NVB")


def norms_in_reverse_layer_order(text: str, path: str) -> str:
    """Planted bug (per-layer weights out of order): _build_fused_context_kv_metadata stacks the draft layers'
    kv_a_layernorm weights last layer first, so the grouped norm gives layer l layer L-1-l's weight. A one-layer
    draft, or layers with equal norms, cannot show it."""
    return _replace_in_method(text, path, "_build_fused_context_kv_metadata",
                              r"\[attn\.kv_a_layernorm\.weight\.detach\(\) for attn in attentions\]",
                              "for attn in attentions]", "for attn in attentions[::-1]]")


def comment_only(path: str) -> Edit:
    """A control: `path` with one comment line appended (the pinned code, other bytes)."""
    return lambda text, rel: text + "\n# k3num control: a comment, no code changed\n"


def _method_lines(text: str, name: str, path: str) -> tuple[int, int]:
    """(first, last) 0-based line numbers of the one method `name` of any class."""
    hits = [(n.lineno - 1, (n.end_lineno or n.lineno) - 1) for n in ast.walk(ast.parse(text))
            if isinstance(n, ast.FunctionDef) and n.name == name]
    if len(hits) != 1:
        raise FixError(f"{path}: expected one method {name}, found {len(hits)}")
    return hits[0]


Edit = Callable[[str, str], str]


@dataclass(frozen=True)
class Fix:
    id: str  # the ledger entry (or entries, "K3N-004/005")
    engine: str  # fetch pin name
    edits: tuple[tuple[str, Edit], ...]  # (file, edit)
    engines: tuple[str, ...]  # registry names whose properties prove it
    tests: tuple[str, ...]  # pytest node ids (or files with -k in `select`)
    select: str = ""  # a -k expression
    gpu: bool = False  # the failure shows on a GPU only (a race): prove it there
    # test functions of the entry's region that also run on the engine with this fix applied (harness/around.py),
    # so a second bug there is judged plainly
    around: tuple[str, ...] = ()


def __getattr__(name: str):
    """`FIXES`: the ledger entries' fixes (harness/ledger_entries: each entry's own module holds its fix), in entry
    order, read lazily (those modules import this one for `Fix` and the edits)."""
    if name == "FIXES":
        return ledger_fixes()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def ledger_fixes() -> tuple[Fix, ...]:
    """Every fix a ledger entry carries (one fix may cover two entries: its id names both, "A/B")."""
    from k3num.harness import ledger_entries

    return ledger_entries.fixes()


def entry_plants() -> tuple[Fix, ...]:
    """The bugs planted to be judged around an entry's fix (harness/around.py), from the entries' own modules."""
    from k3num.harness import ledger_entries

    return ledger_entries.plants()


# deliberately broken kernels (the hunt's families that only a kernel edit can show): each must make
# its properties fail; `gpu` ones are caught on the GPU only (scripts/prove_fixes.py --mutants)
TREE_MUTANTS: tuple[Fix, ...] = (
    Fix("dropped-barrier", "vllm", ((VLLM_ATTN_RES, drop_delta_barrier),), ("vllm",),
        ("properties/test_determinism.py::test_attn_res_in_place_prefix_rewrite_is_deterministic",), gpu=True),
    Fix("mixture-scaled", "vllm", ((VLLM_ATTN_RES, scale_mixture),), ("vllm",),
        ("properties/test_attn_res.py::test_attn_res_within_rounding_budget_of_oracle",)),
    # a masked-lane slip: caught under `ci` on the CPU since the strategies draw hidden sizes that are not powers
    # of two (fixtures/strategies.py PADDED_HIDDEN); inside K3N-007's file, not its race (issue 37/38)
    Fix("rocm-score-norm-block-d", "vllm", ((ROCM_ATTN_RES, score_norm_by_padded_width),), ("vllm-rocm",),
        ("properties/test_attn_res.py::test_attn_res_within_rounding_budget_of_oracle",)),
    # a magnitude bug of our own (issue 57 item 1): massive activations above fp16's range clamped
    Fix("rocm-bank-clamped-to-fp16", "vllm", ((ROCM_ATTN_RES, bank_values_clamped_to_fp16_range),), ("vllm-rocm",),
        ("properties/test_magnitudes.py::test_attn_res_within_budget_at_massive_tiny_and_mixed_magnitudes",)),
    # real code the vLLM adapter used to build itself (issue 38): bound now, its slip must fail the fused path
    Fix("layer0-norm-weight", "vllm", ((VLLM_DSPARK, layer0_norm_for_every_layer),), ("vllm",),
        ("properties/test_context_kv.py",)),
    # the same slip in TokenSpeed's context write, bound since the census listed it (real code the adapter replaced)
    Fix("layer0-context-write", "tokenspeed", ((TOKENSPEED_MODEL, layer0_attention_for_every_context_write),),
        ("tokenspeed",), ("properties/test_context_kv.py",)),
    Fix("unmasked-load", "vllm", ((VLLM_ATTN_RES, unmask_source_columns),), ("vllm",),
        ("properties/test_off_path_shapes.py::test_attn_res_off_path_shapes_within_budget_or_refused",
         "properties/test_poisoned_memory.py::test_attn_res_writes_every_output_element_and_nothing_outside_its_rows")),
    # softmaxes without their max subtraction, exact until a score leaves exp's range: the suite's moderate scores
    # passed them whole; properties/test_extreme_scores.py draws scores past it
    Fix("combine-softmax-without-max", "sglang", ((SGLANG_ATTN, combine_softmax_without_max),), ("sglang",),
        ("properties/test_extreme_scores.py::test_read_only_mixture_within_budget_where_scores_leave_exps_range",)),
    Fix("online-softmax-without-max", "vllm", ((VLLM_ATTN_RES, online_softmax_without_max),), ("vllm",),
        ("properties/test_extreme_scores.py::test_attn_res_within_budget_where_scores_leave_exps_range",)),
    # a tap that aliases the running prefix: right when judged at once, moved by the next layers' in-place adds
    Fix("prefix-tap-aliases-the-running-prefix", "tokenspeed",
        ((TOKENSPEED_KIMI_K3, prefix_tap_aliases_the_running_prefix),), ("tokenspeed",),
        ("properties/test_aux_tap.py::"
         "test_a_tap_handed_on_keeps_its_value_when_the_next_layers_change_their_buffers_in_place",)),
    # survivors of the first mutation sample (docs/mutation.md), each a kind no property reached: query heads
    # in the RoPE kernel, the split layers of captured AttnRes taps, a stream name beside "prefix"
    Fix("rope-query-heads-read-head-0", "tokenspeed", ((TOKENSPEED_ROPE, rope_query_heads_read_head_0),),
        ("tokenspeed",), ("properties/test_context_kv_ops.py::"
                          "test_rope_rotates_every_query_and_key_head_and_passes_the_tail_through",)),
    Fix("split-the-tap-layer-not-its-consumer", "tokenspeed",
        ((TOKENSPEED_KIMI_K3, split_the_tap_layer_not_its_consumer),), ("tokenspeed",),
        ("properties/test_pp_taps.py::test_exactly_the_consumers_of_captured_attn_res_taps_run_split",)),
    Fix("tap-owner-prefix-by-name-prefix", "tokenspeed", ((TOKENSPEED_MODEL, tap_owner_prefix_by_name_prefix),),
        ("tokenspeed",), ("properties/test_tap_owner.py::test_unknown_stream_is_refused",)),
    Fix("tap-owner-final-one-past-the-last", "tokenspeed", ((TOKENSPEED_MODEL, tap_owner_final_one_past_the_last),),
        ("tokenspeed",), ("properties/test_tap_owner.py::"
                          "test_attn_res_tap_is_produced_by_the_stage_holding_its_mixing_weights",)),
    # survivors of SGLang's first sample: the verify window's commit branch, and a torch operator's
    # NotImplementedError taken for a mode the engine lacks (a skip)
    Fix("commit-window-one-past", "sglang", ((SGLANG_DRAFT_KV, commit_window_one_past),), ("sglang",),
        ("properties/test_draft_kv_window.py::test_verify_window_writes_exactly_the_committed_columns_of_each_row",)),
    Fix("eager-mixture-xor", "sglang", ((SGLANG_ATTN, eager_mixture_xor),), ("sglang",),
        ("properties/test_attn_res_mix.py::test_read_only_mixture_within_rounding_budget_of_oracle",)),
    # a batch-composition bug of our own (issue 57 item 4): the softmax's maximum taken over the batch
    Fix("eager-mixture-max-over-the-batch", "sglang", ((SGLANG_ATTN, eager_mixture_max_over_the_batch),), ("sglang",),
        ("properties/test_batch_composition.py::"
         "test_a_row_alone_is_the_row_in_its_batch_and_at_another_position_for_every_row_independent_subject",)),
    # survivors of vLLM 0.34.0's first sample: a merged part's rows on a TP rank past 0 (only rank 0 was loaded),
    # the speculator's draft-watermarker branch, which no property took
    Fix("merged-column-rows-of-rank-0", "vllm", ((VLLM_PARAMETER, merged_column_rows_of_rank_0),), ("vllm",),
        ("properties/test_merged_loading_tp.py::test_each_tp_rank_loads_its_rows_of_every_merged_part",)),
    Fix("watermark-key-at-the-sampled-position", "vllm", ((VLLM_SPECULATOR, watermark_key_at_the_sampled_position),),
        ("vllm",), ("properties/test_markov.py::"
                    "test_a_draft_watermarker_that_marks_no_row_samples_what_the_plain_loop_samples",)),
)


# bugs planted in one kernel for the GPU isolation proof (scripts/gpu_isolation.py): the tests that fail
# must be exactly those that call the kernel (the instrumentation records them), and an illegal address
# must stop the worker's later tests as not run, not fail them
PLANTED: tuple[Fix, ...] = (
    Fix("combine-scaled", "sglang", ((SGLANG_ATTN, record_mix_fused_calls), (SGLANG_ATTN, scale_combined_mixture)),
        ("sglang",), ("properties",), gpu=True),
    Fix("combine-illegal-address", "sglang", ((SGLANG_ATTN, record_mix_fused_calls),
                                              (SGLANG_ATTN, combine_store_out_of_bounds)), ("sglang",),
        ("properties",), gpu=True),
    Fix("combine-last-block-skipped", "sglang", ((SGLANG_ATTN, record_mix_fused_calls),
                                                 (SGLANG_ATTN, skip_last_h_block)), ("sglang",),
        ("properties",), gpu=True),
    Fix("materialize-v-scaled", "sglang", ((SGLANG_MATERIALIZE, record_materialize_calls),
                                           (SGLANG_MATERIALIZE, scale_materialized_v)), ("sglang",),
        ("properties",), gpu=True),
)


# within-budget drifts of real engine code: every property still passes, the ratios move; the
# regression gate must notice (tests/test_history_gate.py)
DRIFTS: tuple[Fix, ...] = (
    Fix("split-context-projection", "tokenspeed", ((TOKENSPEED_MODEL, split_context_projection),), ("tokenspeed",),
        ("properties/test_partial_projection.py::test_unsharded_projection_within_rounding_budget_of_oracle",)),
)


# latent drifts: no decided token flips in the token properties' blocks, but the logits leave delta; the
# decided-token property must fail them on the logit error (tests/test_draft_step_oracle.py)
LATENT: tuple[Fix, ...] = (
    Fix("context-scaled", "tokenspeed", ((TOKENSPEED_MODEL, context_scaled("1.03")),), ("tokenspeed",),
        ("properties/test_draft_tokens.py::test_a_decided_token_never_flips",)),
)


# fresh bugs planted inside a ledger entry's files and tests (issue 37): "known" must mean the entry's bug, so
# each must be new under `k3num check`, and its control (a comment in the same file) must be nothing
FRESH: tuple[Fix, ...] = (
    Fix("accumulator-bf16", "tokenspeed", ((TOKENSPEED_CONTEXT, round_accumulator_per_tap),), ("tokenspeed",),
        ("properties/test_partial_projection.py::test_sharded_adds_no_rounding_beyond_its_partials_when_taps_cancel",)),
    Fix("accumulator-control", "tokenspeed", ((TOKENSPEED_CONTEXT, comment_only(TOKENSPEED_CONTEXT)),), ("tokenspeed",),
        ()),
    Fix("attn-res-control", "vllm", ((VLLM_ATTN_RES, comment_only(VLLM_ATTN_RES)),), ("vllm",), ()),
    # a second bug on vllm-rocm judged around the ROCm tap's fix: harness/ledger_entries (the entry's `plants`)
    Fix("rocm-attn-res-control", "vllm", ((ROCM_ATTN_RES, comment_only(ROCM_ATTN_RES)),), ("vllm-rocm",), ()),
    # one more bf16 rounding on another engine and path than TokenSpeed's (issue 38): the rounding contract
    # holds vLLM's AttnRes to its stated roundings; the accuracy property's budget does not see it
    Fix("attn-res-mixture-bf16", "vllm", ((VLLM_ATTN_RES, round_mixture_before_output_norm),), ("vllm",),
        ("properties/test_rounding_contracts.py::test_attn_res_rounds_only_where_its_code_says",)),
    # a third, on SGLang's draft K/V writer: the norm's reciprocal root rounded to bf16
    Fix("draft-kv-inv-bf16", "sglang", ((SGLANG_DRAFT_KV, round_inverse_rms_to_bf16),), ("sglang",),
        ("properties/test_rounding_contracts.py::test_draft_kv_write_rounds_only_where_its_code_says",)),
    Fix("draft-kv-control", "sglang", ((SGLANG_DRAFT_KV, comment_only(SGLANG_DRAFT_KV)),), ("sglang",), ()),
)


# held-out bugs for the draft step's composed rows (issue 40 item 5), each with its control (a comment in the same
# file); `tests` names the impact row each must move: the engine's row of that variant (harness/draft_step.VARIANTS)
HELD_OUT: tuple[Fix, ...] = (
    Fix("stage-sum-overwritten", "tokenspeed", ((TOKENSPEED_CONTEXT, stage_sum_overwritten),), ("tokenspeed",),
        ("pp sum",)),
    Fix("stage-sum-control", "tokenspeed", ((TOKENSPEED_CONTEXT, comment_only(TOKENSPEED_CONTEXT)),), ("tokenspeed",),
        ("pp sum",)),
    Fix("softmax-drops-prefix", "sglang", ((SGLANG_ATTN, softmax_mask_drops_the_prefix),), ("sglang",),
        ("mixture tap",)),
    Fix("softmax-control", "sglang", ((SGLANG_ATTN, comment_only(SGLANG_ATTN)),), ("sglang",), ("mixture tap",)),
    Fix("norms-reversed", "vllm", ((VLLM_DSPARK, norms_in_reverse_layer_order),), ("vllm",), ("",)),
    Fix("norms-control", "vllm", ((VLLM_DSPARK, comment_only(VLLM_DSPARK)),), ("vllm",), ("",)),
)


def by_id(fix_id: str) -> Fix:
    every = ledger_fixes() + entry_plants() + TREE_MUTANTS + DRIFTS + PLANTED + FRESH + LATENT + HELD_OUT
    for f in every:
        if f.id == fix_id:
            return f
    raise ValueError(f"unknown fix {fix_id!r}; known: {[f.id for f in every]}")


def pinned_tree(spec: str, dest: Path) -> Path:
    """Copy the pinned files of the release `spec` (ENGINE: its default; ENGINE@VERSION) from the hash-checked
    cache into `dest` (replaced if it exists), laid out like the installed package: a tree for --engine-src,
    `k3num check --head`, a patch. ValueError for a release not pinned."""
    pin = fetch.release_pin(spec)
    src = fetch.release_root(spec)
    if not fetch.verified_manifest(spec):
        raise FixError(f"{spec} is not fetched ({src}): run `k3num fetch {spec}`")
    if dest.exists():
        shutil.rmtree(dest)
    for rel in pin.files:
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src / rel, dest / rel)
    return dest


def patched_copy(fix: Fix, src: fetch.Source, dest: Path) -> Path:
    """Copy the pinned files of the release `src` is from out of `src`'s tree (the cache, or a local tree such
    as --engine-src's) into `dest` and apply `fix` there: the fix on top of whatever the tree already changes."""
    missing = fetch.missing_files(src)
    if missing:
        raise FixError(f"{src.root} lacks {missing}")
    if dest.exists():
        shutil.rmtree(dest)
    for rel in src.pin.files:
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src.root / rel, dest / rel)
    return _apply(fix, dest)


def patched_tree(fix: Fix, dest: Path) -> Path:
    """Copy the engine's pinned files from the hash-checked cache into `dest` and apply `fix`."""
    pinned_tree(fix.engine, dest)
    return _apply(fix, dest)


def _apply(fix: Fix, dest: Path) -> Path:
    for rel, edit in fix.edits:
        path = dest / rel
        path.write_text(edit(path.read_text(), rel))
    return dest


# --- bugs planted in a kernel file, for the scripts that prove a property's power on the GPU (scripts/*_plants.py)


def planted_text(text: str, name: str, plants: dict[str, tuple[str, str, str]], file: str) -> str:
    """`text` with plant `name` of `plants` (name -> (text to find, its replacement, what the bug does)) applied;
    ValueError unless its text occurs exactly once in `file`'s text (`control`, a comment, edits the first
    occurrence of whatever it names)."""
    old, new, _ = plants[name]
    n = text.count(old)
    if name != "control" and n != 1:
        raise ValueError(f"plant {name}: its text occurs {n} times in {file} (want exactly once)")
    return text.replace(old, new, 1)


def plants_main(argv: list[str] | None, description: str, plants: dict[str, tuple[str, str, str]],
                make: Callable[[Path, list[str]], list[Path]]) -> int:
    """A plants script's command line: OUT [NAME ...] -> the planted trees, one path a line."""
    import argparse

    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("out", type=Path)
    ap.add_argument("names", nargs="*", help=f"default: all ({', '.join(plants)})")
    args = ap.parse_args(argv)
    unknown = [n for n in args.names if n not in plants]
    if unknown:
        ap.error(f"unknown plant(s) {unknown}; known: {sorted(plants)}")
    for tree in make(args.out, args.names or list(plants)):
        print(tree)
    return 0
