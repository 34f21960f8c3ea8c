"""Per property: the oracle's output and the budget for one subject call, from the call's own inputs.

The property tests (properties/) and `k3num replay` (harness/repro.py) judge through these same
functions, so a replayed bundle is judged by this harness's oracle and its budget formula
(oracles/budgets.py), never by numbers read from the file. Each function takes the subject's
arguments as the subject takes them (tensors in the storage dtype) and the engine (for the
rounding its platform declares and the roundings it declares inside its path); it computes before
the call, since the subjects write their inputs in place.

`REPLAYABLE` maps a property's record name to the function that judges its bundles:
(engine, subject name, args, kwargs, detail) -> {judged location: Expected}, where the location is
what harness/repro.py records ("result", "result.0", ...).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from k3num.harness import oracle
from k3num.oracles import budgets
from k3num.refmodel import rope

LOW = torch.bfloat16  # the production storage dtype of every path here
EPS, OUT_EPS = 1e-5, 1e-6  # the norms' eps of the properties' calls (K3's rms_norm_eps; the output norm's)


def up(t: torch.Tensor) -> torch.Tensor:
    """The float64 value the subject actually saw (or returned)."""
    return t.detach().to(torch.float64)


def round_storage(engine: Any, x32: torch.Tensor) -> torch.Tensor:
    """fp32 -> storage dtype with the engine platform's rounding (round-to-nearest unless declared)."""
    return engine.storage_rounding(x32) if engine.storage_rounding is not None else x32.to(LOW)


@dataclass(frozen=True)
class Expected:
    """What one judged output must be near: the oracle's float64 output and its budget."""

    reference: torch.Tensor
    budget: budgets.Budget
    reduction_len: int


# --- AttnRes: the kernel, the read-only mixtures ----------------------------------------------------


def mixture_budget(out_ref: torch.Tensor, sources: torch.Tensor, q: torch.Tensor, hidden: int,
                   rounding: str = "nearest", logit_dtype: torch.dtype | None = None) -> budgets.Budget:
    """`oracles.budgets.mixture` for the kernel's fp32 logits at EPS and the storage dtype."""
    return budgets.mixture(out_ref, sources, q, hidden, EPS, LOW, rounding=rounding, logit_dtype=logit_dtype)


def attn_res_oracle(engine: Any, prefix: torch.Tensor, delta: torch.Tensor | None, blocks: torch.Tensor,
                    norm: torch.Tensor, qk: torch.Tensor, out_norm: torch.Tensor | None, num_blocks: int,
                    write: int, eps: float = EPS, out_eps: float = OUT_EPS) -> tuple[torch.Tensor, budgets.Budget]:
    """(the oracle's output [T,H], its budget) for one attn_res call, computed before the call (the
    subject writes prefix and bank in place). The oracle mixes the prefix the subject stores:
    fp32(prefix) + fp32(delta) rounded to storage with the engine platform's rounding (the same bits
    the write-back property checks exactly); its order is write, then mix. Budget: mixture_budget,
    plus the output norm's term when there is one."""
    p = prefix if delta is None else round_storage(engine, prefix.float() + delta.float())
    # one oracle call: its output, the sources it mixed and its mixture before the output norm
    want, _, _, sources, mixed = oracle.current().attn_res_with_sources(
        up(p), None, up(blocks), up(norm), up(qk), None if out_norm is None else up(out_norm), num_blocks, write, eps,
        out_eps)
    pre_norm = engine.extras.get("attn_res_roundings", {}).get("pre_out_norm")
    if out_norm is not None and pre_norm is not None:
        # the engine rounds the mix to storage before its output norm (declared): the mixture's budget,
        # less its own rounding, through the norm's gain, plus that rounding and the output's
        b = mixture_budget(mixed, sources, up(norm) * up(qk), prefix.shape[1], engine.rounding)
        return want, normed_after_rounding(want, mixed, b, engine.rounding)
    budget = mixture_budget(want, sources, up(norm) * up(qk), prefix.shape[1], engine.rounding)
    return want, budgets.with_output_norm(budget, LOW) if out_norm is not None else budget


def normed_after_rounding(want: torch.Tensor, mixed: torch.Tensor, b: budgets.Budget,
                          rounding: str = "nearest") -> budgets.Budget:
    """Budget of a mixture rounded to storage, then normed in fp32 with one rounding (SGLang's AttnResidual,
    TokenSpeed's torch_attn_res_fwd): the mixture's budget `b` less its final rounding is carried through
    the output norm's gain max|want| / max|mixed|; two roundings at the output's magnitude (the pre-norm
    rounding carried through the gain, and the output's)."""
    gain = want.abs().max().item() / max(mixed.abs().max().item(), 1e-300)
    return budgets.theory_rule(want.abs().max().item(), LOW, 2,
                               acc_term=(b.value - budgets.unit_roundoff(LOW) * mixed.abs().max().item()) * gain,
                               acc_rule=f"({b.rule} less its rounding)*gain(out norm)", rounding=rounding)


def mix_budget(engine: Any, name: str, want: torch.Tensor, sources: torch.Tensor, q: torch.Tensor,
               hidden: int, nvb: int) -> budgets.Budget:
    """`mixture_budget` with the logit rounding the subject declares (extras["logit_dtype"]: a dtype,
    or for a dispatching subject a function of (hidden, nvb) giving the path's)."""
    ldt = engine.extras.get("logit_dtype", {}).get(name)
    if callable(ldt):
        ldt = ldt(hidden, nvb)
    return mixture_budget(want, sources, q, hidden, engine.rounding, logit_dtype=ldt)


def read_only_mixture(engine: Any, name: str, prefix: torch.Tensor, bank: torch.Tensor, nvb: int,
                      norm: torch.Tensor, proj: torch.Tensor, eps: float = EPS) -> tuple[torch.Tensor, budgets.Budget]:
    """(oracle [T,H], budget) of a read-only pre-norm mixture of bank[:, :nvb] and the prefix."""
    want, _, _, sources, _ = oracle.current().attn_res_with_sources(up(prefix), None, up(bank), up(norm), up(proj),
                                                                    None, nvb, -1, eps, 0.0)
    return want, mix_budget(engine, name, want, sources, up(norm) * up(proj), prefix.shape[1], nvb)


def residual_mixture(engine: Any, prefix: torch.Tensor, bank: torch.Tensor, nvb: int, norm: torch.Tensor,
                     proj: torch.Tensor, out_norm: torch.Tensor,
                     eps: float = EPS) -> tuple[torch.Tensor, budgets.Budget]:
    """(oracle [T,H], budget) of the model-level aggregation (SGLang's AttnResidual.forward): the
    mixture rounded to storage, then the output norm in fp32 with one rounding. The mixture's own
    budget less its final rounding is carried through the output norm's gain."""
    want, _, _, sources, mixed = oracle.current().attn_res_with_sources(up(prefix), None, up(bank), up(norm), up(proj),
                                                                        up(out_norm), nvb, -1, eps, eps)
    b = mix_budget(engine, "attn_res_residual", mixed, sources, up(norm) * up(proj), prefix.shape[1], nvb)
    return want, normed_after_rounding(want, mixed, b, engine.rounding)


# --- the DSpark MLA context KV ----------------------------------------------------------------------


def context_kv_oracle(x: torch.Tensor, kv_a: torch.Tensor, norm: torch.Tensor, positions: torch.Tensor,
                      spec: Any, eps: float = EPS) -> tuple[torch.Tensor, torch.Tensor]:
    """(kv_c [L,N,kv_lora], k_pe [L,N,rope]) in float64."""
    return oracle.current().context_kv(up(x), up(kv_a), up(norm), positions, spec, eps)


def fused_qkv_a(kv_a: torch.Tensor, q_lora: int) -> torch.Tensor:
    """[L, q_lora + W, H]: the unfused path's weight with zero Q rows. Nothing on the KV path reads the
    Q rows, and with the same row count the GEMM computes each KV column as the real one does."""
    q = torch.zeros(kv_a.shape[0], q_lora, kv_a.shape[2], dtype=kv_a.dtype, device=kv_a.device)
    return torch.cat([q, kv_a], dim=1)


def fused_context_kv(x: torch.Tensor, kv_a: torch.Tensor, norm: torch.Tensor, positions: torch.Tensor, spec: Any,
                     eps: float, baseline: tuple[torch.Tensor, torch.Tensor]) -> dict[str, Expected]:
    """The fused context KV under the baseline rule: `baseline` is the eager unfused bf16 path's
    (kv_c, k_pe) on the same inputs (engines.mirror.context_kv.context_kv_unfused)."""
    out = {}
    for name, ref, base_out in zip(("kv_c", "k_pe"), context_kv_oracle(x, kv_a, norm, positions, spec, eps),
                                   baseline):
        base_err = (up(base_out) - ref).abs().max().item()
        out[name] = Expected(ref, budgets.baseline_rule(base_err, ref.abs().max().item(), LOW), x.shape[1])
    return out


def unfused_context_kv(x: torch.Tensor, fused_qkv: torch.Tensor, norm: torch.Tensor, positions: torch.Tensor,
                       spec: Any, eps: float = EPS) -> dict[str, Expected]:
    """The unfused path (full projection, Q discarded) under the theory rule."""
    kv_lora = norm.shape[1]
    q_lora = fused_qkv.shape[1] - (kv_lora + spec.rotary_dim)  # rows [q_lora:] are [kv_c | k_pe]
    kv_a = fused_qkv[:, q_lora:]
    ref_c, ref_pe = context_kv_oracle(x, kv_a, norm, positions, spec, eps)
    hidden = x.shape[1]
    # fp32 accumulation (probabilistic bound on |x|.|w|) mapped through the norm's gain, and the fp32
    # angle error of the rope cache (oracles.budgets.fp32_angle_rope_rtol)
    absdot = (up(x).abs() @ up(kv_a).abs().reshape(-1, hidden).T).max().item()
    y = torch.einsum("nh,lwh->lnw", up(x), up(kv_a))[..., :kv_lora]
    rms_min = y.square().mean(-1).sqrt().min().item()
    gain = up(norm).abs().max().item() / max(rms_min, 1e-300)
    acc = budgets.probabilistic(hidden, budgets.U32) * absdot
    theta = float(positions.max()) * float(rope.inv_freq(spec).max())
    angle = budgets.fp32_angle_rope_rtol(theta)
    # kv_c: GEMM output rounding (1), the rms of the rounded values (1), the output rounding (1) -> 3.
    # k_pe: GEMM output rounding carried through the rotation ((|a|+|b|) u <= 2u max|ref|: 2) and the
    # output rounding (1) -> 3, plus the fp32 rope-cache angle error.
    out = {}
    for name, ref, extra in (("kv_c", ref_c, acc * max(gain, 1.0)), ("k_pe", ref_pe, 0.0)):
        ref_max = ref.abs().max().item()
        term = extra + (angle * ref_max if name == "k_pe" else 0.0)
        out[name] = Expected(ref, budgets.theory_rule(ref_max, LOW, 3, acc_term=term, acc_rule="fp32 acc+angle"),
                             hidden)
    return out


# --- the DFlash draft context K/V, the projection -----------------------------------------------------


def draft_context_kv(ctx: torch.Tensor, k_weight: torch.Tensor, v_weight: torch.Tensor, k_norm: torch.Tensor,
                     positions: torch.Tensor, spec: Any, eps: Any = EPS) -> dict[str, Expected]:
    """Draft context K (norm + rope) and V [L,N,KVH,D] of every layer under the theory rule (eps: one
    value, or a tuple of one per layer; the norm's gain below is bounded without eps, which only lowers it)."""
    want_k, want_v = oracle.current().draft_context_kv(up(ctx), up(k_weight), up(v_weight), up(k_norm), positions,
                                                       spec, eps)
    hidden, head_dim = ctx.shape[1], k_norm.shape[1]
    absdot = max((up(ctx).abs() @ up(w).abs().transpose(1, 2)).max().item() for w in (k_weight, v_weight))
    theta = float(positions.max()) * float(rope.inv_freq(spec).max())
    kn = up(k_norm).abs().max().item()
    pre_k = (up(ctx) @ up(k_weight).transpose(1, 2)).unflatten(-1, (-1, head_dim))
    gain = kn / max(pre_k.square().mean(-1).sqrt().min().item(), 1e-300)
    acc = budgets.probabilistic(hidden, budgets.U32) * absdot
    # V: the GEMM output rounding (1). K: GEMM rounding (1), the rms of rounded values (1), the norm's
    # output rounding (1), carried through the rotation (a pair's error norm is preserved, so an
    # element's error is <= sqrt(2) times 3u: 5), plus the output rounding (1) -> 6, plus the fp32
    # accumulation through the norm's gain and the fp32 angle error of the rope cache.
    out = {}
    for name, want, roundings, term in (
        ("k", want_k, 6, 2 * acc * gain + budgets.fp32_angle_rope_rtol(theta) * want_k.abs().max().item()),
        ("v", want_v, 1, acc),
    ):
        out[name] = Expected(want, budgets.theory_rule(want.abs().max().item(), LOW, roundings, acc_term=term,
                                                       acc_rule="fp32 acc+angle"), hidden)
    return out


def projection_oracle(taps: torch.Tensor, fc: torch.Tensor, norm: torch.Tensor, eps: float = EPS) -> torch.Tensor:
    """ctx [N,H_out] = RMSNorm(concat(taps) fc^T) in float64."""
    return oracle.current().project_context(up(taps), up(fc), up(norm), eps)


def row_gain(taps: torch.Tensor, fc: torch.Tensor, norm: torch.Tensor, y: torch.Tensor | None = None) -> torch.Tensor:
    """|w_j| / rms_i of the exact pre-norm sum y (computed when not given), [N, H_out]: how the norm
    scales a pre-norm error."""
    if y is None:
        k, n, h = taps.shape
        y = up(taps).permute(1, 0, 2).reshape(n, k * h) @ up(fc).T
    return up(norm).abs()[None, :] / y.square().mean(-1, keepdim=True).sqrt().clamp(min=1e-300)


def unsharded_projection(taps: torch.Tensor, fc: torch.Tensor, norm: torch.Tensor, eps: float = EPS) -> Expected:
    """The one-stage projection (one GEMM over every tap, the norm) under the theory rule."""
    want = projection_oracle(taps, fc, norm, eps)
    k, n, h = taps.shape
    absdot = (up(taps).abs().permute(1, 0, 2).reshape(n, k * h) @ up(fc).abs().T).max().item()
    acc = 2 * budgets.probabilistic(k * h, budgets.U32) * absdot * row_gain(taps, fc, norm).max().item()
    # GEMM output rounding (1), the rms of the rounded sum (1), the output rounding (1) -> 3
    budget = budgets.theory_rule(want.abs().max().item(), LOW, 3, acc_term=acc, acc_rule="2*gain*fp32 acc")
    return Expected(want, budget, k * h)


def context_projection(x: torch.Tensor, fc: torch.Tensor, taps: int) -> Expected:
    """The taps' projection alone, x [T, taps * H] (the taps concatenated per token) times fc [H_out, taps * H]^T:
    the stage-partial oracle with one stage holding every tap (refmodel.partial_projection.stage_partials), under
    the theory rule for one GEMM with fp32 accumulation rounded once to bf16 (the context_proj layer's output,
    before the norm)."""
    from k3num.refmodel import partial_projection as ref_projection

    t, kh = x.shape
    h = kh // taps
    stacked = up(x).reshape(t, taps, h).permute(1, 0, 2).contiguous()  # [taps, T, H]
    want = ref_projection.stage_partials(stacked, up(fc), [list(range(taps))])[0]
    absdot = (up(x).abs() @ up(fc).abs().T).max().item()
    acc = 2 * budgets.probabilistic(kh, budgets.U32) * absdot
    budget = budgets.theory_rule(want.abs().max().item(), LOW, 1, acc_term=acc, acc_rule="2*fp32 acc")
    return Expected(want, budget, kh)


# --- replay: the properties whose bundles this harness judges itself ---------------------------------


def _attn_res_call(engine: Any, name: str, args: list, kwargs: dict, detail: str) -> dict[str, Expected]:
    a = _bind(args, kwargs, ("prefix", "delta", "blocks", "norm_weight", "qk_weight", "output_norm_weight",
                             "num_blocks", "block_write_idx", "eps", "output_norm_eps"))
    want, budget = attn_res_oracle(engine, *a[:8], eps=a[8], out_eps=a[9])
    return {"result": Expected(want, budget, a[0].shape[1] * (a[6] + 1))}


def _mixture_call(engine: Any, name: str, args: list, kwargs: dict, detail: str) -> dict[str, Expected]:
    a = _bind(args, kwargs, ("prefix", "bank", "nvb", "norm_weight", "proj_weight", "eps"))
    want, budget = read_only_mixture(engine, name, *a)
    return {"result": Expected(want, budget, a[0].shape[1])}


def _poisoned_call(engine: Any, name: str, args: list, kwargs: dict, detail: str) -> dict[str, Expected]:
    """The poisoned-memory and off-path properties: the bank's rows the call neither mixes nor writes
    hold NaN (they are never read); the oracle sees them as zeros, as the properties give it."""
    if name == "attn_res":
        a = _bind(args, kwargs, ("prefix", "delta", "blocks", "norm_weight", "qk_weight", "output_norm_weight",
                                 "num_blocks", "block_write_idx", "eps", "output_norm_eps"))
        a[2] = a[2].nan_to_num(0.0)
        return _attn_res_call(engine, name, a, {}, detail)
    if name == "attn_res_residual":
        a = _bind(args, kwargs, ("prefix", "bank", "nvb", "norm_weight", "proj_weight", "out_norm_weight", "eps"))
        a[1] = a[1].nan_to_num(0.0)
        want, budget = residual_mixture(engine, *a)
        return {"result": Expected(want, budget, a[0].shape[1])}
    a = _bind(args, kwargs, ("prefix", "bank", "nvb", "norm_weight", "proj_weight", "eps"))
    a[1] = a[1].nan_to_num(0.0)
    return _mixture_call(engine, name, a, {}, detail)


def _fused_call(engine: Any, name: str, args: list, kwargs: dict, detail: str) -> dict[str, Expected]:
    from k3num.engines.mirror import context_kv as eager

    x, kv_a, norm, positions, spec, eps = _bind(args, kwargs, ("context_states", "kv_a_weight", "kv_norm_weight",
                                                               "positions", "rope", "eps"))
    q = re.search(r"(?:^|;)q_lora=(\d+)", detail)
    if q is None:
        raise KeyError("the record's detail does not name q_lora (the unfused baseline's Q rows)")
    baseline = eager.context_kv_unfused(x, fused_qkv_a(kv_a, int(q.group(1))), norm, positions, spec, eps)
    got = fused_context_kv(x, kv_a, norm, positions, spec, eps, baseline)
    return {"result.0": got["kv_c"], "result.1": got["k_pe"]}


def _unfused_call(engine: Any, name: str, args: list, kwargs: dict, detail: str) -> dict[str, Expected]:
    got = unfused_context_kv(*_bind(args, kwargs, ("context_states", "fused_qkv_a_weight", "kv_norm_weight",
                                                   "positions", "rope", "eps")))
    return {"result.0": got["kv_c"], "result.1": got["k_pe"]}


def _draft_call(engine: Any, name: str, args: list, kwargs: dict, detail: str) -> dict[str, Expected]:
    got = draft_context_kv(*_bind(args, kwargs, ("ctx", "k_weight", "v_weight", "k_norm_weight", "positions",
                                                 "rope", "eps")))
    return {"result.0": got["k"], "result.1": got["v"]}


def _unsharded_call(engine: Any, name: str, args: list, kwargs: dict, detail: str) -> dict[str, Expected]:
    return {"result": unsharded_projection(*_bind(args, kwargs, ("taps", "fc_weight", "norm_weight", "eps")))}


def _bind(args: list, kwargs: dict, names: tuple[str, ...]) -> list:
    """The subject's arguments in its signature's order (engines/base.py), positional or by name."""
    if len(args) > len(names):
        raise TypeError(f"{len(args)} arguments, the subject takes {len(names)}")
    unknown = sorted(set(kwargs) - set(names[len(args):]))
    if unknown:
        raise TypeError(f"unexpected arguments {unknown}")
    missing = [n for n in names[len(args):] if n not in kwargs]
    if missing:
        raise TypeError(f"missing arguments {missing}")
    return [*args, *(kwargs[n] for n in names[len(args):])]


Judge = Callable[[Any, str, list, dict, str], dict[str, Expected]]
# record name of the property -> the judge of its bundles (the properties judge through the functions above)
REPLAYABLE: dict[str, Judge] = {
    "attn_res_within_rounding_budget": _attn_res_call,
    "written_block_mixed_with_written_value": _attn_res_call,
    "checkpoint_attn_res_within_rounding_budget": _attn_res_call,
    "read_only_mixture_within_rounding_budget": _mixture_call,
    "poisoned_output_fully_written": _poisoned_call,
    "off_path_shape_within_budget": _poisoned_call,
    "fused_within_budget_of_unfused": _fused_call,
    "unfused_within_rounding_budget": _unfused_call,
    "draft_kv_within_rounding_budget": _draft_call,
    "unsharded_within_rounding_budget": _unsharded_call,
}


# ---- the draft-KV transfer (seed 003) ----------------------------------------------------------

TRANSFER_DTYPE_BYTES = 2  # bf16 draft KV
TRANSFER_SPAN = 2**24  # bytes between two (rank, layer) buffers: more than any drawn page set needs


def transfer_buffer(side: str, rank: int, layer: int) -> int:
    """The synthetic base address of one rank's one-layer K buffer (seed 003: P 1000000, D 2000000)."""
    return (1_000_000 if side == "src" else 2_000_000) + (rank * 8 + layer) * TRANSFER_SPAN


def transfer_layouts(case: Any, layer: int) -> tuple[Any, Any]:
    from k3num.refmodel.transfer_plan import KVLayout

    return tuple(KVLayout(tp, case.heads, case.head_dim, case.page_size, TRANSFER_DTYPE_BYTES,
                          tuple(transfer_buffer(side, r, layer) for r in range(tp)), case.layout)
                 for side, tp in (("src", case.src_tp), ("dst", case.dst_tp)))


def transfer_sender(case: Any) -> int:
    """The prefill rank serving `case.dst_rank`: the owner of its first head."""
    src, dst = transfer_layouts(case, 0)
    return src.owner_of(dst.heads_of(case.dst_rank).start)


def transfer_items(blocks: Any, item: int) -> set[tuple[int, int]] | None:
    """Copies as (src, dst) pairs of `item`-byte chunks; None when a block is not whole chunks."""
    out: set[tuple[int, int]] = set()
    for s, d, n in blocks:
        if n % item:
            return None
        out |= {(s + k * item, d + k * item) for k in range(n // item)}
    return out


def transfer_oracle(case: Any, planner: Any = None) -> set[tuple[int, int]]:
    """What the sender must copy to the served decode rank: refmodel's head-aware plan (or `planner`'s, with its
    signature: the ledger's model of a defective plan), for the stage's layers, restricted to (that sender's
    buffer -> that decode rank's buffer)."""
    from k3num.refmodel.transfer_plan import head_aware_plan

    planner = planner or head_aware_plan
    s, d = transfer_sender(case), case.dst_rank
    want: set[tuple[int, int]] = set()
    for layer in case.stage:
        src, dst = transfer_layouts(case, layer)
        s0, d0 = transfer_buffer("src", s, layer), transfer_buffer("dst", d, layer)
        plan = [e for e in planner(src, dst, list(case.src_pages), list(case.dst_pages))
                if s0 <= e.src_addr < s0 + TRANSFER_SPAN and d0 <= e.dst_addr < d0 + TRANSFER_SPAN]
        want |= transfer_items([tuple(e) for e in plan], src.item_bytes) or set()
    return want
