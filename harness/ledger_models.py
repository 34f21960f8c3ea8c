"""Each known divergence's model of its bug: what the defective code computes, as a function of the call
(issue 37: "known" must mean "the same bug", judged by what the kernel computed, not by where it failed).

A failing example inside an entry's region (harness/ledger_cases.py) is known only when every recorded
call the entry's model reads is explained by the model: the engine's output equals what the defective
code computes on those inputs, within the budget of what the model leaves out (float32 accumulation,
the one rounding of the output). Any other failure in the region is new. The recorder
(harness/ledger_run.py) keeps each call's inputs as they were before the call (a kernel may rewrite them
in place) and its output.

    entry      subject              the defective computation
    K3N-001/2  aux_capture          the tap returns the prefix, bf16(prefix_sum + pending), where the
                                    mixture belongs (amd/linear.py _maybe_add_hidden_state ignores the flag)
    K3N-007    attn_res             the prefix source read back after the kernel's own in-place store: a set of
                                    32-element segments bf16(bf16(p + d) + d) (amd/ops/attn_res.py; any set
                                    up to hidden 256, else at most two)
    K3N-006    stage_partial        each tap's projection rounded to bf16 (project_target_tap), the taps
                                    summed in float32 (add_capture): sum_i bf16(h_i W_i^T)
               finalize_projection  the float32 sum of the partials rounded to bf16 before the norm
                                    (finalize_target_projection), then the norm in float32, rounded once

Where a rounding's input lies within the float32 accumulation error of a rounding boundary, the model
cannot say which neighbour the engine takes: both are allowed there (`_ambiguous_ulp`), so an exact
contract holds on real code and one more bf16 rounding anywhere else is outside it. Entries with no
model here say why in ledger_cases.CASES (`no_model`); their region rule alone decides.

Shapes: as engines/base.py's subject signatures.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from k3num.engines import base

U_BF16 = 2.0**-8  # bf16's unit roundoff (oracles/budgets.py UNIT_ROUNDOFF)
U_FP32 = 2.0**-24
MARGIN = 2.0  # the doctrine's c (BRIEF §5): the model's bound is a worst case, doubled as every budget is


@dataclass(frozen=True)
class Call:
    """One subject call as the engine saw it: its inputs before the call (cloned) and its output."""

    subject: str
    args: tuple
    kwargs: dict[str, Any]
    out: Any
    engine: Any = None  # the engine that made it (its storage rounding and declared roundings)


def _ulp_bf16(x: torch.Tensor) -> torch.Tensor:
    """The spacing of bf16 numbers at |x| (float64): 2^(floor(log2 |x|) - 7), and the subnormal floor at 0."""
    a = x.abs().clamp_min(2.0**-126)
    return torch.exp2(torch.floor(torch.log2(a)) - 7)


def _ambiguous_ulp(exact: torch.Tensor, err: torch.Tensor) -> torch.Tensor:
    """Where the float64 value `exact`, known to the engine only within `err` (its float32 accumulation),
    is that close to a bf16 rounding midpoint, the engine may round either way: one bf16 ulp allowed there,
    0 elsewhere."""
    ulp = _ulp_bf16(exact)
    r = exact.to(torch.bfloat16).double()
    to_mid = (ulp / 2 - (exact - r).abs()).abs()  # distance of the exact value to the nearer midpoint
    return torch.where(to_mid <= err, ulp, torch.zeros_like(ulp))


def _within(out: torch.Tensor, want: torch.Tensor, bound: torch.Tensor, what: str) -> str:
    """'' when |out - want| <= MARGIN * bound everywhere (NaN never passes), else why not."""
    err = (out.double() - want).abs()
    over = ~(err <= MARGIN * bound)
    if not bool(over.any()):
        return ""
    i = int(torch.argmax(torch.where(over, err / bound.clamp_min(1e-300), torch.zeros_like(err))).item())
    return (f"{what}: {int(over.sum())} of {over.numel()} elements outside the model (worst {err.flatten()[i]:.3g} "
            f"vs {MARGIN * bound.flatten()[i]:.3g})")


# ---- K3N-001 / K3N-002: the ROCm tap returns the prefix -------------------------------------------


def tap_returns_the_prefix(calls: list[Call]) -> str:
    """The tap's output is the prefix it would mix, bf16(prefix_sum + pending) (one rounding of the sum)."""
    if not calls:
        return "no aux_capture call was made"
    for c in calls:
        prefix_sum, pending = c.args[1], c.args[2]
        want = prefix_sum.double() + (pending.double() if pending is not None else 0.0)
        why = _within(c.out, want, U_BF16 * want.abs(), "the tap against the prefix it should have mixed")
        if why:
            return why
    return ""


# ---- K3N-006: TokenSpeed rounds each tap's projection to bf16 -------------------------------------


def _stage_partial_model(c: Call) -> str:
    taps, fc, members = c.args[0], c.args[1], list(c.args[2])
    h = taps.shape[-1]
    want = torch.zeros(taps.shape[1], fc.shape[0], dtype=torch.float64, device=taps.device)
    slack = torch.zeros_like(want)
    absum = torch.zeros_like(want)
    for i in sorted(members):
        a, w = taps[i].double(), fc[:, i * h:(i + 1) * h].double()
        p = a @ w.T  # [N, H_out] the tap's exact projection
        gemm_err = h * U_FP32 * (a.abs() @ w.abs().T)  # the GEMM's float32 accumulation before its rounding
        r = p.to(torch.bfloat16).double()  # project_target_tap: one bf16 rounding per tap
        slack += _ambiguous_ulp(p, gemm_err) + gemm_err
        want += r
        absum += r.abs()
    bound = slack + max(len(members), 1) * U_FP32 * absum  # add_capture: the float32 running sum
    return _within(c.out, want, bound + 1e-300, f"the stage partial of taps {members}")


def _finalize_model(c: Call) -> str:
    from k3num.refmodel.rmsnorm import rms_norm

    partials, norm, eps, order = c.args[0], c.args[1], c.args[2], list(c.args[4])
    s = sum(partials[i].double() for i in order)  # [N, H_out] the float32 partials' exact sum
    sum_err = len(order) * U_FP32 * sum(partials[i].double().abs() for i in order)
    r = s.to(torch.bfloat16).double()  # finalize_target_projection: the sum rounded to bf16 before the norm
    want = rms_norm(r, norm.double(), float(eps))
    # the norm in float32, its output rounded once; an ambiguous pre-norm rounding moves that element by one
    # ulp of r (times its weight over the row's rms)
    rms = (r.square().mean(dim=-1, keepdim=True) + float(eps)).sqrt()
    moved = _ambiguous_ulp(s, sum_err) * norm.double().abs() / rms
    bound = U_BF16 * want.abs() + moved + r.shape[-1] * U_FP32 * want.abs()
    return _within(c.out, want, bound + 1e-300, "the finalized projection")


def tap_projections_rounded_to_bf16(calls: list[Call]) -> str:
    """Every stage partial is sum_i bf16(h_i W_i^T) in float32, and every finalize rounds the float32 sum to
    bf16 before the norm: K3N-006's roundings and no other."""
    relevant = [c for c in calls if c.subject in (base.STAGE_PARTIAL, base.FINALIZE_PROJECTION)]
    if not relevant:
        return "no stage partial or finalize call was made"
    for c in relevant:
        why = _stage_partial_model(c) if c.subject == base.STAGE_PARTIAL else _finalize_model(c)
        if why:
            return why
    return ""


# ---- K3N-007: ROCm's attn_res reads the prefix back after its own in-place store -----------------------

SEGMENT = 32  # the race's granularity: one store/load tile of the prefix (oracles/ledger.py K3N-007's `what`)
ATTN_RES_NAMES = ("prefix", "delta", "blocks", "norm_weight", "qk_weight", "output_norm_weight", "num_blocks",
                  "block_write_idx", "eps", "output_norm_eps")


def _attn_res_args(c: Call) -> dict[str, Any]:
    return {**dict(zip(ATTN_RES_NAMES, c.args)), **{k: v for k, v in c.kwargs.items() if k in ATTN_RES_NAMES}}


EVERY_SUBSET = 8  # up to this many segments (hidden <= 256) the raced set may be any of them: 2^8 oracle calls


def _segment_sets(hidden: int) -> list[tuple[int, ...]]:
    """The prefix segments a raced read can take twice. Any set of them where there are at most EVERY_SUBSET
    (GPU run 80: at hidden 128 with 7 blocks, outputs bitwise equal to three segments raced, (1, 2, 3) and
    (0, 2, 3), beside one and two); beyond that, for cost, none, one, or (up to 16 segments) two."""
    n = -(-hidden // SEGMENT)
    if n <= EVERY_SUBSET:
        return [c for k in range(n + 1) for c in itertools.combinations(range(n), k)]
    sets: list[tuple[int, ...]] = [(), *((i,) for i in range(n))]
    if n <= 16:
        sets += [(i, j) for i in range(n) for j in range(i + 1, n)]
    return sets


def delta_applied_twice(calls: list[Call]) -> str:
    """Every output row equals the mixture in which a set of 32-element segments of the prefix source (_segment_sets)
    are bf16(bf16(p + d) + d) (the prefix read back after the kernel's own store), within the call's budget
    (harness/judges.attn_res_oracle's, the accuracy property's own)."""
    from k3num.harness import judges

    if not calls:
        return "no attn_res call was made"
    seen: set[bytes] = set()
    for c in calls:
        a = _attn_res_args(c)
        if a.get("delta") is None or c.engine is None:
            return "a call without a delta (or its engine) cannot take the delta twice"
        key = bytes(c.out.detach().cpu().contiguous().view(torch.uint8).flatten().tolist()[:4096]) + bytes(
            str(c.out.float().sum().item()), "ascii")
        if key in seen:
            continue
        seen.add(key)
        prefix, delta, blocks = a["prefix"], a["delta"], a["blocks"]
        p = judges.round_storage(c.engine, prefix.float() + delta.float())
        twice = judges.round_storage(c.engine, p.float() + delta.float())
        bank = blocks.clone()
        if int(a["block_write_idx"]) >= 0:
            bank[:, int(a["block_write_idx"])] = p
        best = torch.full((prefix.shape[0],), float("inf"), dtype=torch.float64, device=prefix.device)
        budget = None
        for segs in _segment_sets(prefix.shape[1]):
            raced = p.clone()
            for sgm in segs:
                raced[:, sgm * SEGMENT:(sgm + 1) * SEGMENT] = twice[:, sgm * SEGMENT:(sgm + 1) * SEGMENT]
            want, b = judges.attn_res_oracle(c.engine, raced, None, bank, a["norm_weight"], a["qk_weight"],
                                             a["output_norm_weight"], int(a["num_blocks"]), -1, float(a["eps"]),
                                             float(a["output_norm_eps"]))
            budget = b if not segs else budget
            best = torch.minimum(best, (c.out.double() - want).abs().amax(dim=-1))
        assert budget is not None
        if not bool((best <= budget.value).all()):
            worst = int(torch.argmax(best).item())
            return (f"row {worst} of the output is {best[worst]:.3g} from every delta-twice variant (budget "
                    f"{budget.value:.3g})")
    return ""


@dataclass(frozen=True)
class BugModel:
    subjects: tuple[str, ...]  # the subjects whose calls it reads
    explains: Callable[[list[Call]], str]  # '' explained, else why not
    what: str  # the defective computation, in one line


MODELS: dict[str, BugModel] = {
    "K3N-001": BugModel((base.AUX_CAPTURE,), tap_returns_the_prefix,
                        "the tap returns bf16(prefix_sum + pending) where the next layer's mixture belongs"),
    "K3N-002": BugModel((base.AUX_CAPTURE,), tap_returns_the_prefix,
                        "the tap returns bf16(prefix_sum + pending) where the output mixture belongs"),
    "K3N-007": BugModel((base.ATTN_RES,), delta_applied_twice,
                        "the prefix source read back after the kernel's own store: a set of 32-element segments "
                        "with the delta applied twice"),
    "K3N-006": BugModel((base.STAGE_PARTIAL, base.FINALIZE_PROJECTION), tap_projections_rounded_to_bf16,
                        "each tap's projection rounded to bf16, summed in float32; the sum rounded to bf16 "
                        "before the norm"),
}


def explains(entry_id: str, calls: list[Call]) -> str:
    """'' where the entry's model explains these calls (or the entry has no model: its region decides), else
    why not, naming the entry."""
    model = MODELS.get(entry_id)
    if model is None:
        return ""
    why = model.explains([c for c in calls if c.subject in model.subjects])
    return f"not {entry_id}'s bug ({model.what}): {why}" if why else ""
