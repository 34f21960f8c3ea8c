"""Rounding contracts (issue 38): where an engine's code states where it rounds, its output is held to exactly
those roundings. The engine's output is compared with the float64 result of the same computation with those
roundings applied at those points, within the budget of what remains (float32 accumulation; a rounding whose
input lies within that accumulation error of a bf16 boundary may go either way), so one more bf16 rounding
anywhere fails by orders of magnitude where a worst-case budget (the accuracy properties', a quarter used on a
typical case) hides it in its margin.

    engine      subject                    contract, and the source lines it comes from
    tokenspeed  stage_partial              sum_i bf16(h_i W_i^T) in float32: project_target_tap returns
                                           `linear(hidden.to(weight.dtype), weight)` (one bf16 rounding per tap);
                                           add_capture: "float32 accumulation avoids rounding between taps"
                finalize_projection        bf16(sum of the partials) then the norm in float32, rounded once:
                                           finalize_target_projection `projected.to(self.context_norm.weight.dtype)`
    vllm        attn_res                   the new prefix rounded to storage once, the norms, scores, softmax and
                                           mixture in float32, the output rounded once at its store
                                           (ATTN_RES_CONTRACT_LINES)
    sglang      draft K/V write            per head, the K norm in float32 from the GEMM's bf16 rows, rounded once
                (fused_kv_norm_rope_write) before the RoPE (`k1 = k1.to(tl.bfloat16).to(tl.float32)`), the RoPE in
                                           float32 on the float32 cos/sin table, rounded once at the store; V
                                           stored as the GEMM left it, bitwise (DRAFT_KV_CONTRACT_LINES)

K3N-006 owns the per-tap rounding (it is a known divergence where taps cancel): the contract includes it and
still fails on any other. The contract's arithmetic is the entry's bug model (harness/ledger_models.py): one
statement of what TokenSpeed computes, for the ledger and for this property. A contract whose source line is
gone (a changed release) is a contract error naming the line it expected, before any example runs.
"""

from __future__ import annotations

import re

import pytest
import torch
from hypothesis import given

from k3num.engines import base
from k3num.fixtures.builders import attn_res_inputs, draft_kv_inputs, projection_inputs
from k3num.fixtures.strategies import (
    AttnResCase,
    DraftKVCase,
    ProjectionCase,
    attn_res_cases,
    draft_kv_cases,
    projection_cases,
)
from k3num.harness import ledger_models
from k3num.harness.judges import EPS, OUT_EPS, up
from k3num.harness.ledger_models import MARGIN
from k3num.properties.checks.partial_projection import TRANSFER
from k3num.properties.checks.partial_projection import sharded_call as _sharded
from k3num.properties.support import DEVICE, LOW, round_storage

TOKENSPEED_MODEL = "tokenspeed/runtime/models/kimi_k3_dspark.py"
TOKENSPEED_CONTEXT = "tokenspeed/runtime/execution/dspark_context.py"
# engine -> the lines (file, regex) its contract comes from; each must be in the engine's file as read
CONTRACT_LINES: dict[str, tuple[tuple[str, str], ...]] = {
    "tokenspeed": (
        (TOKENSPEED_MODEL, r"return torch\.nn\.functional\.linear\(hidden\.to\(weight\.dtype\), weight\)"),
        (TOKENSPEED_CONTEXT, r"float32 accumulation avoids rounding between taps"),
        (TOKENSPEED_CONTEXT, r"projected\.\w+\(.*self\.model\.project_target_tap\(capture_idx, hidden\)"),
        (TOKENSPEED_MODEL, r"return self\.context_norm\(projected\.to\(self\.context_norm\.weight\.dtype\)\)"),
    ),
}


VLLM_ATTN_RES = "vllm/models/kimi_k3/nvidia/ops/attn_res.py"
# vLLM's AttnRes kernel (the NVIDIA Triton one): the prefix rounded to storage once, everything else in float32,
# the output rounded once where it is stored
ATTN_RES_CONTRACT_LINES: dict[str, tuple[tuple[str, str], ...]] = {
    "vllm": (
        (VLLM_ATTN_RES, r"updated_prefix = updated_prefix\.to\(prefix_ptr\.dtype\.element_ty\)\.to\(tl\.float32\)"),
        (VLLM_ATTN_RES, r"mixed = tl\.zeros\(\(BLOCK_D,\), tl\.float32\)"),
        (VLLM_ATTN_RES, r"output = mixed \* output_reciprocal_std \* output_norm_weight\n"),
        (VLLM_ATTN_RES, r"tl\.store\(\s*output_ptr \+ row_idx \* stride_output_m \+ d_offsets,\s*output,"),
    ),
}


class ContractError(AssertionError):
    """A contract names a rounding point the engine's file does not have."""


def contract_lines_missing(root, lines: tuple[tuple[str, str], ...]) -> list[str]:
    """The contract lines not found in the tree at `root` (a pathlib.Path), one message each."""
    out = []
    for rel, pattern in lines:
        path = root / rel
        text = path.read_text() if path.is_file() else ""
        if not re.search(pattern, text):
            out.append(f"contract error: {rel}: expected a line matching /{pattern}/ (the rounding point the contract "
                       "names); the file changed: restate the contract for this release")
    return out


def contract(engine, table: dict[str, tuple[tuple[str, str], ...]] | None = None,
             what: str = "its sharded projection") -> tuple[tuple[str, str], ...]:
    """The engine's contract lines in `table` (CONTRACT_LINES by default), checked against its files as read (a
    skip where it states none)."""
    from k3num.harness import run

    lines = (CONTRACT_LINES if table is None else table).get(engine.name)
    if lines is None:
        pytest.skip(f"{engine.name} states no rounding contract for {what} (properties/"
                    "test_rounding_contracts.py)")
    missing = contract_lines_missing(run.current().source(engine.name.split("-")[0]).root, lines)
    if missing:
        raise ContractError("; ".join(missing))
    return lines


@given(case=projection_cases(min_taps=2))
def test_sharded_projection_rounds_only_where_its_code_says(engine, case: ProjectionCase) -> None:
    contract(engine)
    inp = projection_inputs(case, LOW, DEVICE)
    partials, got = _sharded(engine, inp, case, TRANSFER["fp32"])
    calls = [ledger_models.Call(base.STAGE_PARTIAL, (inp.taps, inp.fc, list(m)), {}, p)
             for m, p in zip(case.stages, partials)]
    calls.append(ledger_models.Call(base.FINALIZE_PROJECTION, (partials, inp.norm, EPS, None, list(case.order)), {},
                                    got))
    why = ledger_models.tap_projections_rounded_to_bf16(calls)
    assert not why, (f"{engine.name} {engine.version} {case}: the sharded projection rounds where its code does not "
                     f"say it does: {why}")


U32 = 2.0**-24  # float32's unit roundoff


def attn_res_float32_error(sources: torch.Tensor, qkw: torch.Tensor, eps: float, mixed: torch.Tensor,
                           out_norm: torch.Tensor | None, out_eps: float) -> torch.Tensor:
    """[T, H] a first-order worst-case bound (float64) on how far a float32 evaluation of the mixture of
    `sources` [T, S, H] (scores: rms-normed dot products with `qkw` [H]; a softmax; the weighted sum `mixed`
    [T, H], float64) and of its output norm can land from the exact value, before the output's one rounding:
    the rms and the dot over H terms ((H + 2) u each), the logits' error as the weights' relative error,
    the S-term weighted sum, the output rms over H terms and its product (u = 2^-24)."""
    t, s, h = sources.shape
    ms = sources.square().mean(dim=-1) + eps  # [T, S]
    rstd = ms.rsqrt()
    dot = (sources * qkw).sum(dim=-1)  # [T, S]
    logit_err = (h + 2) * U32 * (sources * qkw).abs().sum(dim=-1) * rstd + (dot * rstd).abs() * ((h + 1) / 2 + 3) * U32
    logits = dot * rstd
    w = torch.softmax(logits, dim=-1)  # [T, S]
    weight_rel = 2 * logit_err.amax(dim=-1, keepdim=True) + (2 * s + 6) * U32  # [T, 1]
    err_mix = (w[..., None] * sources.abs()).sum(dim=1) * weight_rel  # [T, H]
    if s == 1:
        err_mix = torch.zeros_like(mixed)  # the kernel mixes nothing: the prefix itself, exact
    if out_norm is None:
        return err_mix
    r = (mixed.square().mean(dim=-1, keepdim=True) + out_eps).rsqrt()  # [T, 1]
    r_rel = ((h + 1) / 2 + 3) * U32 + (mixed.abs() * err_mix).sum(-1, keepdim=True) / (
        mixed.square().sum(-1, keepdim=True) + 1e-300)
    return out_norm.abs() * r * (err_mix + mixed.abs() * (r_rel + 2 * U32))


def rounded_once_violations(out: torch.Tensor, want: torch.Tensor, err: torch.Tensor) -> tuple[int, float]:
    """(elements of `out` that are not the round-to-nearest bf16 of `want` [float64] where `want` lies further
    than `err` from a rounding midpoint, the worst such error in ulps of `want`). Where it lies within `err`,
    either neighbour is the contract's, and any value within err of want rounded."""
    ulp = ledger_models._ulp_bf16(want)
    rn = want.to(torch.bfloat16).double()
    to_mid = (ulp / 2 - (want - rn).abs()).abs()
    dev = (out.double() - rn).abs()
    allowed = torch.where(to_mid <= err, ulp * torch.ceil((err + ulp / 2) / ulp), torch.zeros_like(ulp))
    bad = dev > allowed
    return int(bad.sum()), float((dev / ulp).where(bad, torch.zeros_like(dev)).max()) if bad.any() else 0.0


@given(case=attn_res_cases())
def test_attn_res_rounds_only_where_its_code_says(engine, case: AttnResCase) -> None:
    """vLLM's AttnRes kernel rounds the new prefix to storage once and the output once; the norms, the scores,
    the softmax and the mixture are float32. So its output is the round-to-nearest bf16 of the float64 mixture
    of those sources, except where the float64 value lies within the float32 evaluation's error of a rounding
    midpoint (`attn_res_float32_error`). One more bf16 rounding anywhere (the mixture before the output norm:
    harness/fixes.py attn-res-mixture-bf16) moves many elements to the far neighbour."""
    from k3num.harness import oracle
    from k3num.properties.checks.attn_res import as_admitted, call_attn_res

    contract(engine, ATTN_RES_CONTRACT_LINES, "its AttnRes mixture")
    case = as_admitted(engine, case)
    inp = attn_res_inputs(case, LOW, DEVICE)
    p = inp.prefix if inp.delta is None else round_storage(engine, inp.prefix.float() + inp.delta.float())
    parts = oracle.current().attn_res_with_sources(
        up(p), None, up(inp.blocks), up(inp.norm), up(inp.qk), None if inp.out_norm is None else up(inp.out_norm),
        case.num_blocks, case.block_write_idx, EPS, OUT_EPS)
    qkw = up(inp.norm.float() * inp.qk.float())  # the kernel's product of the two weights, in float32
    err = MARGIN * attn_res_float32_error(parts.sources, qkw, EPS, parts.mixture,
                                          None if inp.out_norm is None else up(inp.out_norm), OUT_EPS)
    out = call_attn_res(engine, inp, case)
    n, worst = rounded_once_violations(out, parts.output, err)
    assert n == 0, (f"{engine.name} {engine.version} {case}: attn_res rounds where its code does not say it does: "
                    f"{n} of {out.numel()} elements are not the nearest bf16 of the float32 mixture (worst {worst:.2f} "
                    f"ulp; contract lines: {VLLM_ATTN_RES})")


SGLANG_DRAFT_KV = "sglang/kernels/ops/speculative/dspark/fused_kv_write.py"
# SGLang's DSpark draft K/V writer (the Triton kernel after the K/V GEMM): the norm in float32, the normed K
# rounded to bf16 once before the RoPE, the RoPE in float32, one rounding at the store; V stored as loaded
DRAFT_KV_CONTRACT_LINES: dict[str, tuple[tuple[str, str], ...]] = {
    "sglang": (
        (SGLANG_DRAFT_KV, r"k = tl\.load\(row \+ h \* D \+ d_ar\)\.to\(tl\.float32\)"),
        (SGLANG_DRAFT_KV, r"inv = 1\.0 / tl\.sqrt\(ms \+ EPS\)"),
        (SGLANG_DRAFT_KV, r"k1 = tl\.load\(row \+ h \* D \+ off1\)\.to\(tl\.float32\) \* inv \* knw1"),
        (SGLANG_DRAFT_KV, r"k1 = k1\.to\(tl\.bfloat16\)\.to\(tl\.float32\)"),
        (SGLANG_DRAFT_KV, r"o1 = k1 \* cos - k2 \* sin"),
        (SGLANG_DRAFT_KV, r"tl\.store\(k_buf \+ loc \* ks0 \+ h \* D \+ off1, o1\.to\(tl\.bfloat16\)\)"),
        (SGLANG_DRAFT_KV, r"kp = tl\.load\(row \+ h \* D \+ pass_ar\)\.to\(tl\.float32\) \* inv \* knw_pass"),
        (SGLANG_DRAFT_KV, r"tl\.store\(v_buf \+ loc \* vs0 \+ h \* D \+ d_ar, v\)"),
    ),
}


def draft_k_rounded_at_its_two_points(kv: torch.Tensor, k_norm: torch.Tensor, positions: torch.Tensor,
                                      table: torch.Tensor, rope, eps: float, num_layers: int,
                                      width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(want, err) [L, N, KVH, D] float64: the draft K the contract allows, from the GEMM's rows `kv`
    [N, L*2*W] (per layer [K | V]), the K norms [L, D] and the float32 cos/sin `table` [P, ROT]: the per-head
    RMSNorm in float64 rounded to nearest bf16, then the RoPE on those values (the dims past ROT: the normed
    value itself), before the store's one rounding. err: the float32 evaluation's first-order worst case
    (the D-term mean square, its root and reciprocal, two products: ((D + 3) / 2 + 4) u relative; the
    rotation's two products and a sum: 3 u of its terms), plus, where the normed value lies within its error
    of a rounding midpoint, one ulp of it through the rotation (either neighbour is the contract's)."""
    n, d = kv.shape[0], k_norm.shape[1]
    x = kv.double().view(n, num_layers, 2, width // d, d)[:, :, 0].permute(1, 0, 2, 3)  # [L, N, KVH, D]
    normed = x * (x.square().mean(dim=-1, keepdim=True) + eps).rsqrt() * k_norm.double()[:, None, None, :]
    e_norm = MARGIN * ((d + 3) / 2 + 4) * U32 * normed.abs()
    ulp = ledger_models._ulp_bf16(normed)
    rn = normed.to(torch.bfloat16).double()
    either = torch.where((ulp / 2 - (normed - rn).abs()).abs() <= e_norm, ulp, torch.zeros_like(ulp))
    half = rope.rotary_dim // 2
    i1 = torch.arange(half) if rope.style == "neox" else 2 * torch.arange(half)
    i2 = i1 + half if rope.style == "neox" else i1 + 1
    cos = table[positions, :half].double()[None, :, None, :]
    sin = table[positions, half:rope.rotary_dim].double()[None, :, None, :]
    a, b = rn[..., i1], rn[..., i2]
    want, err = normed.clone(), e_norm.clone()
    want[..., i1], want[..., i2] = a * cos - b * sin, b * cos + a * sin
    spread = (a * cos).abs() + (b * sin).abs() + (b * cos).abs() + (a * sin).abs()
    err[..., i1] = MARGIN * 3 * U32 * spread + either[..., i1] * cos.abs() + either[..., i2] * sin.abs()
    err[..., i2] = MARGIN * 3 * U32 * spread + either[..., i2] * cos.abs() + either[..., i1] * sin.abs()
    return want, err


@given(case=draft_kv_cases())
def test_draft_kv_write_rounds_only_where_its_code_says(engine, case: DraftKVCase) -> None:
    """SGLang's draft K/V writer rounds the normed K to bf16 once before the RoPE and the roped K once at its
    store, and stores V as the GEMM left it: its K is the nearest bf16 of the float64 RoPE of the nearest bf16
    of the float64 norm (either neighbour where a value lies within the float32 evaluation's error of a
    midpoint), its V bitwise the input rows. One more bf16 rounding (the norm's reciprocal root: harness/fixes.py
    draft-kv-inv-bf16) moves many elements to the far neighbour."""
    from k3num.engines.mirror.context_kv import rope_cache

    contract(engine, DRAFT_KV_CONTRACT_LINES, "its draft K/V write")
    write = engine.extras.get("draft_kv_write")
    if write is None:
        pytest.skip(f"{engine.name} {engine.version}: no draft_kv_write extra (the writer alone is not bound)")
    inp = draft_kv_inputs(case, LOW, DEVICE)
    width = case.kv_heads * case.head_dim
    kv = torch.cat([torch.cat([torch.nn.functional.linear(inp.ctx, inp.k_weight[i]),
                               torch.nn.functional.linear(inp.ctx, inp.v_weight[i])], dim=-1)
                    for i in range(case.num_layers)], dim=-1).contiguous()  # the GEMM's rows, as the kernel gets them
    k, v = write(kv, inp.k_norm, inp.positions, case.rope, EPS, case.num_layers, width)
    table = rope_cache(case.rope, int(inp.positions.max()) + 1, torch.float32, "cpu")
    want, err = draft_k_rounded_at_its_two_points(kv.cpu(), inp.k_norm.cpu(), inp.positions.cpu(), table, case.rope,
                                                  EPS, case.num_layers, width)
    n, worst = rounded_once_violations(k.cpu(), want, err)
    raw_v = kv.view(case.tokens, case.num_layers, 2, case.kv_heads, case.head_dim)[:, :, 1].permute(1, 0, 2, 3)
    assert torch.equal(v.cpu(), raw_v.cpu()), f"{engine.name} {engine.version} {case}: V is not stored as loaded"
    assert n == 0, (f"{engine.name} {engine.version} {case}: the draft K/V write rounds where its code does not say "
                    f"it does: {n} of {k.numel()} K elements are not the nearest bf16 of the RoPE of the once-rounded "
                    f"norm (worst {worst:.2f} ulp; contract lines: {SGLANG_DRAFT_KV})")
