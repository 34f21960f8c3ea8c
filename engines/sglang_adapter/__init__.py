"""SGLang 0.5.23's real code as subjects (BRIEF §4).

Import mode (supply.installed: SGLang 0.5.23 installed, CUDA): the installed
modules' kernels and functions, the lifted DFlash methods with their module's
globals; the layer objects the adapter passes in stay stand-ins (named in
`real_ops`). Source mode otherwise:
- `sglang/srt/layers/attn_residual.py`: `aggregate_stream` (ATTN_RES_MIX: the public
  entry point, which takes the Triton pair when H is a multiple of 1024 and the eager
  path otherwise), `_mix_fused` (ATTN_RES_MIX_TRITON: `_score_kernel` + `_combine_kernel`),
  `aggregate_stream_torch` (ATTN_RES_MIX_EAGER). The module is loaded with stubs for its
  three SGLang imports; its RMSNorm and ReplicatedLinear layers are stand-ins (fp32 math,
  one rounding; a torch linear in the weight dtype). Triton runs natively on a GPU, under
  the interpreter elsewhere (exec'd from source text, like vLLM's kernel).
- `sglang/srt/disaggregation/utils.py::build_transfer_entry_pairs`, lifted (a pure
  function), exposed as the `transfer_pairs` contract.
- `sglang/kernels/ops/speculative/dspark/fused_kv_write.py::fused_kv_norm_rope_write`
  (Triton) as DRAFT_CONTEXT_KV, fed by `kv_proj_only`.
- the released draft-KV transfer (`mooncake/conn.py`: `send_kvcache`, `_send_kvcache_generic`,
  `_state_stride_mismatch`, the worker's routing rule; `common/conn.py`'s PP slice), lifted and run
  on synthetic pointers (engines/sglang_adapter/transfer.py), as the `kv_transfer` contract.
- `sglang/kernels/ops/speculative/fused_kv_materialize.py::FusedKVMaterializeHelper` (DFlash's
  draft-KV writer: one GEMM, then the Triton `_fused_norm_rope_kernel_stacked`) as the extra
  `draft_kv_materialize`, with DRAFT_CONTEXT_KV's signature.
Not bound yet, each skipped with this reason: DFlash `project_target_hidden` /
`kv_proj_only`.
"""

from __future__ import annotations

import functools
import types
from collections import deque
from pathlib import Path
from typing import Any, List, Tuple

import torch

from k3num.engines import base, source, standins, triton_support
from k3num.engines.registry import EngineUnavailable
from k3num.supply import fetch, installed

PIN = fetch.PINS["sglang"]
UTILS_PY = "sglang/srt/disaggregation/utils.py"
NOT_YET = ("not in SGLang 0.5.23's bound files (the PP partial projection is the unmerged PR #33863; "
           "the MLA context KV is vLLM's and TokenSpeed's)")


IMPORT_MODULES = ("sglang/srt/layers/attn_residual.py", "sglang/kernels/ops/speculative/dspark/fused_kv_write.py",
                  "sglang/srt/models/dflash.py", UTILS_PY)
IMPORT_STANDINS = ("real: the installed kernels and functions; stand-in: the RMSNorm and ReplicatedLinear layer "
                   "objects passed in (fp32 math, one rounding; torch linear), DFlash's fc, "
                   "can_dflash_slice_qkv_weight -> (True, None) (unquantized weights)")
PAIRS_SIGNATURE = ["src_layer_ids", "dst_layer_ids", "n_src", "n_dst", "allow_positional_fallback"]


def build(src: fetch.Source, mode: str) -> base.Engine:
    """SGLang's subjects, read from `src` (the pinned cache or a local tree) in `mode` (--engine-mode)."""
    root = src.root
    inst, note = installed.select(src, mode, IMPORT_MODULES, ())
    if inst is not None:
        return _build_imported(inst)
    if not fetch.verified_manifest(src):
        raise EngineUnavailable(f"sglang {PIN.version} source is not in {root}: run `k3num fetch sglang`")
    path = root / UTILS_PY
    try:
        got = source.signature_of(path, "build_transfer_entry_pairs")
        if got != PAIRS_SIGNATURE:
            raise source.SourceError(f"build_transfer_entry_pairs signature changed: {got}")
        pairs = source.lift(path, "build_transfer_entry_pairs", {"deque": deque, "List": List, "Tuple": Tuple})
    except source.SourceError as e:
        raise EngineUnavailable(f"sglang {PIN.version}: {e}") from e
    interpret = not torch.cuda.is_available()
    if interpret:
        triton_support.require_interpreter()
        triton_support.round_bf16_to_nearest_even()
    mod = _load_attn_residual(root / ATTN_PY, interpret)
    fkw = _load_plain_triton(root / FKW_PY, interpret, "fused_kv_write")
    fkm = _load_plain_triton(root / FKM_PY, interpret, "fused_kv_materialize")
    try:
        unsharded, kv_only = _bind_dflash(root / DFLASH_PY, {"torch": torch})
    except source.SourceError as e:
        raise EngineUnavailable(f"sglang {PIN.version}: {e}") from e
    m = fetch.verified_manifest(src)
    return _engine(src.version, "source-interpreter" if interpret else "source-gpu", STANDINS,
                   mod, fkw, pairs, unsharded, kv_only, lambda rel: m[rel], interpret, note, _kv_transfer(root),
                   fkm.FusedKVMaterializeHelper)


def _build_imported(inst: installed.Installed) -> base.Engine:
    try:
        if source.signature_of(inst.file(UTILS_PY), "build_transfer_entry_pairs") != PAIRS_SIGNATURE:
            raise source.SourceError("build_transfer_entry_pairs signature changed")
        unsharded, kv_only = _bind_dflash(inst.file(DFLASH_PY), inst.namespace(DFLASH_PY, {}))
        pairs = inst.module(UTILS_PY).build_transfer_entry_pairs
    except (source.SourceError, AttributeError) as e:
        raise EngineUnavailable(f"sglang {inst.version} (installed): {e}") from e
    root = Path(str(inst.file(UTILS_PY))[: -len(UTILS_PY)])
    return _engine(inst.version, "import", IMPORT_STANDINS, inst.module(ATTN_PY), inst.module(FKW_PY), pairs,
                   unsharded, kv_only, inst.sha256, False, "", _kv_transfer(root),
                   inst.module(FKM_PY).FusedKVMaterializeHelper if FKM_PY in IMPORT_MODULES else None)


def _kv_transfer(root: Path) -> tuple[Any, str]:
    """(the released KV transfer, lifted: engines/sglang_adapter/transfer.py, ""), or (None, why it is not bound)."""
    from k3num.engines.sglang_adapter import transfer as sglang_transfer

    try:
        sglang_transfer.manager(root)  # lift everything now: a changed file is reported at build time
        return types.SimpleNamespace(manager=functools.partial(sglang_transfer.manager, root),
                                     route=sglang_transfer.routing_rule(root)), ""
    except (source.SourceError, OSError) as e:
        return None, f"the KV transfer is not bound: {e}"


def _engine(version: str, mode: str, real_ops: str, mod: Any, fkw: Any, pairs: Any, unsharded: Any, kv_only: Any,
            sha: Any, interpret: bool, note: str, kv: tuple[Any, str] = (None, ""),
            materializer: Any = None) -> base.Engine:
    subjects = {base.DRAFT_CONTEXT_KV: _draft_kv_subject(fkw.fused_kv_norm_rope_write, kv_only),
                base.PROJECT_UNSHARDED: unsharded,
                base.ATTN_RES_MIX: _mix_subject(mod.aggregate_stream),
                base.ATTN_RES_MIX_TRITON: _mix_subject(mod._mix_fused, triton_only=True),
                base.ATTN_RES_MIX_EAGER: _mix_subject(mod.aggregate_stream_torch),
                base.ATTN_RES_RESIDUAL: _residual_subject(mod.AttnResidual)}
    return base.Engine(
        name="sglang", version=version, mode=mode, subjects=subjects, real_ops=real_ops,
        source_sha256={**{s: sha(ATTN_PY) for s in subjects}, base.DRAFT_CONTEXT_KV: sha(FKW_PY),
                       base.PROJECT_UNSHARDED: sha(DFLASH_PY), "transfer_pairs": sha(UTILS_PY),
                       "kv_transfer": sha("sglang/srt/disaggregation/mooncake/conn.py"),
                       **({"draft_kv_materialize": sha(FKM_PY)} if materializer is not None else {})},
        missing={s: NOT_YET for s in base.SUBJECTS if s not in subjects},
        # the raw write kernel is for bench/engine_kernels.py (its bandwidth without the K/V GEMMs); draft_kv_write
        # runs it on given K/V rows for the rounding contract (properties/test_rounding_contracts.py);
        # the eager path rounds the normed rows and the scores to bf16 before its softmax
        extras={"transfer_pairs": pairs, "fused_kv_norm_rope_write": fkw.fused_kv_norm_rope_write,
                "draft_kv_write": _draft_kv_writer(fkw.fused_kv_norm_rope_write),
                "draft_kv_window_write": _draft_kv_window_writer(fkw.fused_kv_norm_rope_write),
                **({"kv_transfer": kv[0]} if kv[0] is not None else {"kv_transfer_missing": kv[1]}),
                **({"draft_kv_materialize": _materialize_subject(materializer)} if materializer is not None else {}),
                "logit_dtype": {base.ATTN_RES_MIX_EAGER: torch.bfloat16, base.ATTN_RES_MIX: _dispatched_logit_dtype,
                                # off the 1024 grid the model's path has no defined numerics in 0.5.23 (its
                                # Triton pair reads and writes by whole 1024 tiles, K3N-008); the budget there
                                # is that of the eager fallback aggregate_stream takes for those shapes
                                base.ATTN_RES_RESIDUAL: _dispatched_logit_dtype}},
        mode_note="; ".join(filter(None, [note, *((triton_support.RUNTIME_RANGE_ADAPTATION,
                                                  triton_support.NEAREST_EVEN_ADAPTATION) if interpret else ())])),
    )


def _takes_triton(hidden: int, nvb: int) -> bool:
    """aggregate_stream's dispatch on NVIDIA or the CPU: nvb 0 returns the prefix itself; hidden a
    multiple of _BLOCK_H (1024) takes _mix_fused; otherwise aggregate_stream_torch."""
    return nvb > 0 and hidden % 1024 == 0


def _dispatched_logit_dtype(hidden: int, nvb: int) -> torch.dtype | None:
    """The logit rounding of the path aggregate_stream takes: none for the prefix itself or
    _mix_fused (fp32 logits); bf16 for aggregate_stream_torch (normed rows and scores rounded)."""
    return torch.bfloat16 if nvb > 0 and not _takes_triton(hidden, nvb) else None


ATTN_PY = "sglang/srt/layers/attn_residual.py"
FKW_PY = "sglang/kernels/ops/speculative/dspark/fused_kv_write.py"
FKM_PY = "sglang/kernels/ops/speculative/fused_kv_materialize.py"
# what this adapter binds, for `k3num coverage`: (file, function) -> (language, K3 path, subject or contract);
# the KV transfer's are engines/sglang_transfer.BOUND
BOUND = {
    (ATTN_PY, "aggregate_stream"): ("python", "2", "attn_res_mix"),
    (ATTN_PY, "_mix_fused"): ("python", "2", "attn_res_mix_triton"),
    (ATTN_PY, "_score_kernel"): ("triton", "2", "attn_res_mix_triton"),
    (ATTN_PY, "_combine_kernel"): ("triton", "2", "attn_res_mix_triton"),
    (ATTN_PY, "aggregate_stream_torch"): ("python", "2", "attn_res_mix_eager"),
    (ATTN_PY, "AttnResidual"): ("python", "2", "attn_res_residual"),
    (FKW_PY, "fused_kv_norm_rope_write"): ("python", "3", "draft_context_kv,draft_kv_write,draft_kv_window_write"),
    (FKW_PY, "_fused_kv_norm_rope_write_kernel"): ("triton", "3",
                                                   "draft_context_kv,draft_kv_write,draft_kv_window_write"),
    ("sglang/srt/models/dflash.py", "DFlashDraftModel.project_target_hidden"): ("python", "3", "project_unsharded"),
    ("sglang/srt/models/dflash.py", "DFlashAttention.kv_proj_only"): ("python", "3", "draft_context_kv"),
    ("sglang/srt/disaggregation/utils.py", "build_transfer_entry_pairs"): ("python", "3", "transfer_pairs"),
    (FKM_PY, "FusedKVMaterializeHelper"): ("python", "3", "draft_kv_materialize"),
    (FKM_PY, "FusedKVMaterializeHelper.materialize"): ("python", "3", "draft_kv_materialize"),
    (FKM_PY, "_fused_norm_rope_stacked"): ("python", "3", "draft_kv_materialize"),
    (FKM_PY, "_fused_norm_rope_kernel_stacked"): ("triton", "3", "draft_kv_materialize"),
}


def coverage_rows() -> list[tuple[str, str, str, str, str, str]]:
    """What this adapter binds, in the one format every adapter declares for `k3num coverage` (engine, file,
    function, language, K3 path, subject or contract): BOUND, then the lifted KV transfer's functions."""
    from k3num.engines.sglang_adapter import transfer

    rows = [("sglang", file, function, *row) for (file, function), row in BOUND.items()]
    rows += [("sglang", file, function, "python", "3", "kv_transfer") for file, functions in transfer.BOUND.items()
             for function in functions]
    return rows


def _load_plain_triton(path: Path, interpret: bool, name: str) -> types.ModuleType:
    """A kernel file whose only imports are torch and triton."""
    return source.load_kernel_module(path, f"k3num_engine.sglang.{name}", {}, interpret=interpret)


DFLASH_PY = "sglang/srt/models/dflash.py"


class _FC:
    """nn.Linear stand-in for DFlash's unquantized `fc` (torch linear in the weight dtype)."""

    def __init__(self, weight: torch.Tensor) -> None:
        self.weight, self.in_features, self.input_size = weight, weight.shape[1], weight.shape[1]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(x, self.weight)


def _bind_dflash(path: Path, namespace: dict[str, Any]) -> tuple[Any, Any]:
    """DFlash `project_target_hidden` and `kv_proj_only` lifted from `path` with `namespace` (torch in
    source mode, the module's globals in import mode)."""
    for qual, want in (("DFlashDraftModel.project_target_hidden", ["self", "target_hidden"]),
                       ("DFlashAttention.kv_proj_only", ["self", "hidden_states"])):
        got = source.signature_of(path, qual)
        if got != want:
            raise source.SourceError(f"{qual} signature changed: {got}")
    project = source.lift(path, "DFlashDraftModel.project_target_hidden", namespace)
    kv_only = source.lift(path, "DFlashAttention.kv_proj_only", {
        "F": torch.nn.functional, **namespace,
        # unquantized weights: the fast path that slices the fused QKV weight
        "can_dflash_slice_qkv_weight": lambda proj: (True, None),
    })

    def unsharded(taps: torch.Tensor, fc: torch.Tensor, norm: torch.Tensor, eps: float) -> torch.Tensor:
        k, n, h = taps.shape
        model = types.SimpleNamespace(fc=_FC(fc), quantizable=False, hidden_norm=standins.RMSNorm(norm, eps),
                                      num_context_features=k, config=types.SimpleNamespace(hidden_size=fc.shape[0]))
        return project(model, taps.permute(1, 0, 2).reshape(n, k * h))

    return unsharded, kv_only


def _draft_kv_subject(write: Any, kv_only: Any) -> Any:
    """DRAFT_CONTEXT_KV through DFlash `DFlashAttention.kv_proj_only` (lifted: the K/V rows sliced out
    of the fused QKV weight, one GEMM) and `fused_kv_norm_rope_write` (Triton): per-head K RMSNorm,
    the normed K rounded to bf16, RoPE (either pairing, partial rotary), bf16 K and raw V rows written
    to per-layer pools at their slots; read back from the pools."""
    write_rows = _draft_kv_writer(write)

    def draft_kv(ctx: torch.Tensor, k_weight: torch.Tensor, v_weight: torch.Tensor, k_norm: torch.Tensor,
                 positions: torch.Tensor, rope: Any, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        num_layers, width, _ = k_weight.shape
        per_layer = []
        for layer in range(num_layers):
            q_rows = torch.zeros_like(k_weight[layer])  # Q is sliced away by kv_proj_only, never computed
            attn = types.SimpleNamespace(
                qkv_proj=types.SimpleNamespace(weight=torch.cat([q_rows, k_weight[layer], v_weight[layer]]),
                                               bias=None),
                q_size=width, kv_size=width, v_scale=None)
            k, v = kv_only(attn, ctx)
            per_layer.append(torch.cat([k, v], -1))
        return write_rows(torch.cat(per_layer, -1).contiguous(), k_norm, positions, rope, eps, num_layers, width)

    return draft_kv


def _draft_kv_writer(write: Any) -> Any:
    """`fused_kv_norm_rope_write` alone, on K/V rows given as the GEMM left them: (kv [N, L*2*W] bf16, per layer
    [K | V], W = KVH*D; k_norm [L, D], positions [N], rope, eps, L, W) -> (k, v) [L, N, KVH, D], read back from
    per-layer pools the kernel writes at slots 0..N-1; the cos/sin table is `rope_cache`'s float32 one (the
    rounding contract, properties/test_rounding_contracts.py, reads the same table)."""

    def write_rows(kv: torch.Tensor, k_norm: torch.Tensor, positions: torch.Tensor, rope: Any, eps: float,
                   num_layers: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        d, n = k_norm.shape[1], kv.shape[0]
        # the pools are left uninitialised (the poisoned-memory property fills them): every element is the kernel's
        k_bufs = [torch.empty(n, width, dtype=torch.bfloat16, device=kv.device) for _ in range(num_layers)]
        v_bufs = [torch.empty(n, width, dtype=torch.bfloat16, device=kv.device) for _ in range(num_layers)]
        _write_into_pools(write, kv, k_norm, positions, rope, eps, num_layers, width, torch.arange(n, device=kv.device),
                          k_bufs, v_bufs)
        shape = (num_layers, n, width // d, d)
        return torch.stack(k_bufs).view(shape), torch.stack(v_bufs).view(shape)

    return write_rows


def _draft_kv_window_writer(write: Any) -> Any:
    """`fused_kv_norm_rope_write` on DSpark's verify window, as `dspark.py` calls it when it has commit lengths:
    (kv [N, L*2*W] bf16, k_norm [L, D], positions [N], rope, eps, L, W, locs [N] int64 (the flattened
    [B, row_width] window of pool slots, < 0 skipped), commit_lens [B], row_width, k_pools and v_pools: L
    tensors [S, W] bf16 each) -> None, the pools written in place: only the first commit_lens[b] columns of each
    window row are written (the kernel's HAS_COMMIT_LENS branch)."""

    def write_window(kv: torch.Tensor, k_norm: torch.Tensor, positions: torch.Tensor, rope: Any, eps: float,
                     num_layers: int, width: int, locs: torch.Tensor, commit_lens: torch.Tensor, row_width: int,
                     k_pools: list[torch.Tensor], v_pools: list[torch.Tensor]) -> None:
        _write_into_pools(write, kv, k_norm, positions, rope, eps, num_layers, width, locs, k_pools, v_pools,
                          commit_lens=commit_lens, locs_row_width=row_width)

    return write_window


def _write_into_pools(write: Any, kv: torch.Tensor, k_norm: torch.Tensor, positions: torch.Tensor, rope: Any,
                      eps: float, num_layers: int, width: int, locs: torch.Tensor, k_pools: list[torch.Tensor],
                      v_pools: list[torch.Tensor], **window: Any) -> None:
    """One `fused_kv_norm_rope_write` call into the per-layer pools (L tensors [S, W] bf16 each, their row strides
    in the kernel's meta) at `locs`, with the float32 cos/sin table of `rope_cache` (the one the rounding
    contract reads); `window`: commit_lens and locs_row_width, for the verify window."""
    from k3num.engines.mirror.context_kv import rope_cache

    max_pos = int(positions.max()) + 1 if positions.numel() else 1
    cache = rope_cache(rope, max_pos, torch.float32, kv.device).contiguous()  # [P, ROT] = [cos | sin]
    meta = torch.tensor([[k.data_ptr(), v.data_ptr(), k.stride(0), v.stride(0)] for k, v in zip(k_pools, v_pools)],
                        dtype=torch.int64, device=kv.device)
    write(kv, meta, k_norm.contiguous(), cache, positions, locs, num_layers, width, k_norm.shape[1], eps,
          is_neox_style=rope.style == "neox", rotary_dim=rope.rotary_dim, **window)


def _materialize_subject(helper_cls: Any) -> Any:
    """DFlash's draft-KV writer, `FusedKVMaterializeHelper` (one GEMM over every layer's K/V rows, then
    the Triton `_fused_norm_rope_kernel_stacked`: per-head K RMSNorm, NeoX RoPE on the rotary part, K and
    V per layer), with DRAFT_CONTEXT_KV's signature. The layers are namespaces holding what its
    constructor reads (the fused QKV weight with zero Q rows, the K norm, the rotary embedding); the
    pool write is a recording `write_layer_kv`. GPT-J pairing raises NotImplementedError (the helper's).
    eps: one value, or one per layer (each layer's k_norm.variance_epsilon: the helper stacks them into
    its eps_values [L])."""

    def materialize(ctx: torch.Tensor, k_weight: torch.Tensor, v_weight: torch.Tensor, k_norm: torch.Tensor,
                    positions: torch.Tensor, rope: Any, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        from k3num.engines.mirror.context_kv import rope_cache

        num_layers, width, _ = k_weight.shape
        d = k_norm.shape[1]
        max_pos = int(positions.max()) + 1 if positions.numel() else 1
        rotary = types.SimpleNamespace(rotary_dim=rope.rotary_dim, is_neox_style=rope.style == "neox",
                                       cos_sin_cache=rope_cache(rope, max_pos, torch.float32, ctx.device).contiguous())
        layers = [types.SimpleNamespace(self_attn=types.SimpleNamespace(
            num_kv_heads=width // d, head_dim=d, rotary_emb=rotary, q_size=width, kv_size=width,
            qkv_proj=types.SimpleNamespace(weight=torch.cat([torch.zeros_like(k_weight[i]), k_weight[i], v_weight[i]])),
            k_norm=types.SimpleNamespace(weight=k_norm[i], variance_epsilon=eps[i] if isinstance(eps, (list, tuple))
                                         else eps))) for i in range(num_layers)]
        helper = helper_cls(layers, rotary, width // d, d, ctx.device)
        out: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        helper.materialize(ctx, positions, lambda i, k, v: out.__setitem__(i, (k.clone(), v.clone())))
        shape = (num_layers, ctx.shape[0], width // d, d)
        return (torch.stack([out[i][0] for i in range(num_layers)]).view(shape),
                torch.stack([out[i][1] for i in range(num_layers)]).view(shape))

    return materialize


STANDINS = "stand-in: sglang RMSNorm layer (fp32 math, one rounding), ReplicatedLinear (torch linear)"


def _load_attn_residual(path: Path, interpret: bool) -> types.ModuleType:
    triton_support.triton_modules("sglang")  # imported before the stubs go in: it stays in sys.modules

    stubs = {name: source.stub(name) for name in ("sglang", "sglang.srt", "sglang.srt.layers")}
    stubs["sglang.srt.layers.layernorm"] = source.stub("sglang.srt.layers.layernorm", RMSNorm=standins.RMSNorm)
    stubs["sglang.srt.layers.linear"] = source.stub("sglang.srt.layers.linear", ReplicatedLinear=standins.Linear)
    stubs["sglang.srt.utils"] = source.stub("sglang.srt.utils", is_cuda=torch.cuda.is_available,
                                            is_hip=lambda: False, is_npu=lambda: False)
    # _combine_kernel loops `range(0, NVB + 1)` over a runtime argument: the interpreter needs the
    # declared adaptation (engines.triton_support.RUNTIME_RANGE_ADAPTATION) to run it
    return source.load_kernel_module(
        path, "k3num_engine.sglang.attn_residual", stubs, interpret=interpret,
        interpreter_rewrite=lambda text, name: triton_support.index_runtime_ranges(text, name)[0],
        interpreter_globals={triton_support.INDEX_HELPER: triton_support.interpreter_index})


def _mix_subject(fn: Any, *, triton_only: bool = False) -> Any:
    def mix(prefix: torch.Tensor, bank: torch.Tensor, nvb: int, norm_weight: torch.Tensor,
            proj_weight: torch.Tensor, eps: float) -> torch.Tensor:
        if triton_only and prefix.shape[1] % 1024:
            raise NotImplementedError("SGLang's _mix_fused needs hidden % 1024 == 0 (BLOCK_H 1024); the model's "
                                      "path to it is bound as attn_res_residual, without this guard")
        # a fresh proj object per call: get_cw caches norm * proj on it
        return fn(prefix, bank, nvb, standins.Linear(proj_weight.unsqueeze(0)), standins.RMSNorm(norm_weight, eps))

    return mix


def _residual_subject(cls: Any) -> Any:
    """ATTN_RES_RESIDUAL through the model-level class: `AttnResidual(prefix, NB, bank[:, :nvb])` (the
    bank inherited from the previous PP rank, copied into the instance's own `new_empty` bank), then
    `forward(prefix, None, proj, norm, out_norm)`; returns the normed mixture. No adapter guard: the
    shapes reach the kernels exactly as the model would send them."""

    def residual(prefix: torch.Tensor, bank: torch.Tensor, nvb: int, norm_weight: torch.Tensor,
                 proj_weight: torch.Tensor, out_norm_weight: torch.Tensor, eps: float) -> torch.Tensor:
        # nvb 0 is layer 0: nothing banked; forward then returns out_norm(prefix)
        state = cls(prefix, bank.shape[1], bank[:, :nvb] if nvb else None)
        normed, _ = state.forward(prefix, None, standins.Linear(proj_weight.unsqueeze(0)),
                                  standins.RMSNorm(norm_weight, eps), standins.RMSNorm(out_norm_weight, eps))
        return normed

    return residual
