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
                                    32-element segments bf16(bf16(p + d) + d) (amd/ops/attn_res.py; any set,
                                    every one tried up to hidden 256, else found by a per-segment search)
    K3N-006    stage_partial        each tap's projection rounded to bf16 (project_target_tap), the taps
                                    summed in float32 (add_capture): sum_i bf16(h_i W_i^T)
               finalize_projection  the float32 sum of the partials rounded to bf16 before the norm
                                    (finalize_target_projection), then the norm in float32, rounded once
    K3N-014    fp8_insert           every byte of the layer's slots x / scale saturated, computed by cases from the
                                    insert's inputs (its compiled op runs behind a capability no recorder wraps:
                                    the property observes the call, harness/ledger_run.observe)
    K3N-011    block_fp8_merged_load each layer's scale rows at ceil(W l / 128), in arrival order (a shared row holds
                                    the later layer's), or the narrow's RuntimeError where a layer's rows run past
    K3N-012    nvfp4_merged_load    one per-tensor multiplier kept, one of the layers' own, over each layer's own
                                    values and group scales (the other layers loaded rescaled)
    K3N-013    kv_transfer_plan     the flat plan (refmodel.transfer_plan.flat_plan): pages copied whole at the
                                    source's page size, from the served rank's sender
    K3N-008    attn_res_residual    the pre-norm mixture's columns at and past (H // 1024) * 1024 never written:
                                    the call made again with the allocations filled with 1 shows the fill through
                                    the output norm; each row before them the mixture or NaN (whole 1024-element
                                    chunks read past the row: srt/layers/attn_residual.py _score_kernel, _mix_fused)

Where a rounding's input lies within the float32 accumulation error of a rounding boundary, the model
cannot say which neighbour the engine takes: both are allowed there (`_ambiguous_ulp`), so an exact
contract holds on real code and one more bf16 rounding anywhere else is outside it. The model functions
are here, each named by what it computes; an entry binds its own in its module (harness/ledger_entries), and
an entry without one says why there (`no_model`); its region rule alone decides.

Shapes: as engines/base.py's subject signatures.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
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
    """The tap's output is the prefix it would mix, bf16(prefix_sum + pending): one rounding of the sum, so within
    half a bf16 ulp of the exact sum (doubled by MARGIN: one ulp; two ulps off is not this bug)."""
    if not calls:
        return "no aux_capture call was made"
    for c in calls:
        prefix_sum, pending = c.args[1], c.args[2]
        want = prefix_sum.double() + (pending.double() if pending is not None else 0.0)
        why = _within(c.out, want, _ulp_bf16(want) / 2, "the tap against the prefix it should have mixed")
        if why:
            return why
    return ""


# ---- K3N-006: TokenSpeed rounds each tap's projection to bf16 -------------------------------------


def _outside(out: torch.Tensor, want: torch.Tensor, bound: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The elements (rows, cols) of a 2-D output where |out - want| > MARGIN * bound (NaN included); none found
    by one reduction where the output is within the bound everywhere (the common case)."""
    inside = (out.double() - want).abs() <= MARGIN * bound
    if bool(inside.all()):
        return want.new_empty(0, dtype=torch.long), want.new_empty(0, dtype=torch.long)
    rows, cols = torch.nonzero(~inside, as_tuple=True)
    return rows, cols


def _stage_partial_model(c: Call) -> str:
    """The stage partial against sum_i bf16(h_i W_i^T) summed in float32. The GEMMs' float32 accumulation
    error (h * u * |h_i| |W_i|^T per element, and the one bf16 ulp allowed where it reaches a rounding
    midpoint) only widens the bound, so it is computed only at the elements the float32 sum's bound alone
    does not explain, and the taps are projected in one batched GEMM (bench/model_cost.py: the model's cost
    against the example's)."""
    taps, fc, members = c.args[0], c.args[1], sorted(c.args[2])
    h, h_out = taps.shape[-1], fc.shape[0]
    every = members == list(range(taps.shape[0]))  # the common case: no gather
    a = (taps if every else taps[members]).double()  # [K, N, H]
    w = fc.double().view(h_out, -1, h).permute(1, 2, 0)  # [K_all, H, H_out]
    w = w if every else w[members]
    p = torch.bmm(a, w)  # [K, N, H_out] each tap's exact projection
    r = p.to(torch.bfloat16).double()  # project_target_tap: one bf16 rounding per tap
    want = r.sum(dim=0)  # exact: a few bf16 values in float64
    bound = max(len(members), 1) * U_FP32 * r.abs().sum(dim=0)  # add_capture: the float32 running sum
    rows, cols = _outside(c.out, want, bound)
    if not rows.numel():
        return ""
    # there alone, the GEMMs' float32 accumulation slack, tap by tap in the order the sum took them
    slack = torch.zeros(rows.numel(), dtype=torch.float64, device=want.device)
    for k in range(len(members)):
        gemm_err = h * U_FP32 * (a[k, rows].abs() * w[k, :, cols].T.abs()).sum(dim=-1)
        slack += _ambiguous_ulp(p[k, rows, cols], gemm_err) + gemm_err
    bound = bound.index_put((rows, cols), slack + bound[rows, cols])
    return _within(c.out, want, bound + 1e-300, f"the stage partial of taps {members}")


def _finalize_model(c: Call) -> str:
    """The finalized projection against norm(bf16(sum of the float32 partials)), the norm in float32 and its
    output rounded once; where the pre-norm rounding's input lies within the sum's float32 error of a
    midpoint (computed only where the rest of the bound does not explain the output), one ulp of it more."""
    partials, norm, eps, order = c.args[0], c.args[1], float(c.args[2]), list(c.args[4])
    stacked = torch.stack([partials[i] for i in order]).double()  # [S, N, H_out]
    s = stacked.sum(dim=0)  # the float32 partials' exact sum
    r = s.to(torch.bfloat16).double()  # finalize_target_projection: the sum rounded to bf16 before the norm
    rms = (r.square().mean(dim=-1, keepdim=True) + eps).sqrt()  # [N, 1]
    g = norm.double()
    want = r / rms * g  # y = x rsqrt(mean(x^2) + eps) w (refmodel.rmsnorm)
    bound = (U_BF16 + r.shape[-1] * U_FP32) * want.abs()
    rows, cols = _outside(c.out, want, bound)
    if not rows.numel():
        return ""
    # an ambiguous pre-norm rounding moves that element by one ulp of r (times its weight over the row's rms)
    sum_err = len(order) * U_FP32 * stacked[:, rows, cols].abs().sum(dim=0)
    moved = _ambiguous_ulp(s[rows, cols], sum_err) * g[cols].abs() / rms[rows, 0]
    bound = bound.index_put((rows, cols), bound[rows, cols] + moved)
    return _within(c.out, want, bound + 1e-300, "the finalized projection")


def _bf16_np(x: np.ndarray) -> np.ndarray:
    """float64 -> the bf16 value torch's `.to(torch.bfloat16)` gives (through float32, nearest even both times),
    as float64; finite inputs only (the caller checks)."""
    u = x.astype(np.float32).view(np.uint32)
    u = (u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) & ~np.uint32(0xFFFF)  # the low half cleared
    return u.view(np.float32).astype(np.float64)


def _np64(t: torch.Tensor) -> np.ndarray:
    """A CPU tensor's values as float64 numpy, read without a torch operation (bf16: its bits are the high half of
    the float32 of the same value)."""
    if t.dtype == torch.bfloat16:
        return (t.view(torch.int16).numpy().astype(np.int32) << 16).view(np.float32).astype(np.float64)
    return (t if t.dtype in (torch.float32, torch.float64) else t.float()).numpy().astype(np.float64)


def _finalize_at_once(c: Call) -> bool:
    """`_finalize_model`'s bound without its midpoint term, in numpy on the CPU: True where it alone explains the
    finalized projection (the common case), False sends the call to `_finalize_model` (bench/model_cost.py)."""
    partials, norm, eps, order = c.args[0], c.args[1], float(c.args[2]), list(c.args[4])
    if c.out.device.type != "cpu":
        return False
    s = np.sum([_np64(partials[i]) for i in order], axis=0)  # [N, H_out] the float32 partials' exact sum
    if not np.isfinite(s).all():
        return False
    r = _bf16_np(s)  # the sum rounded to bf16 before the norm
    want = r / np.sqrt(np.mean(r * r, axis=-1, keepdims=True) + eps) * _np64(norm)
    bound = (U_BF16 + r.shape[-1] * U_FP32) * np.abs(want)
    return bool((np.abs(_np64(c.out) - want) <= MARGIN * bound).all())


def _stage_partials_at_once(cs: list[Call]) -> bool:
    """Whether every stage partial of `cs` is explained by the float32 running sum's bound alone, judged for all
    of them at once where they share their taps [K,N,H] and fc weight [H_out,K*H] (the PP stages of one
    projection do): every tap projected once, each stage's sum taken through a membership matrix, one
    comparison. On the CPU this runs in numpy: a small example's model is otherwise torch's per-operation
    overhead (bench/model_cost.py; docs/performance.md). False (calls that do not share them, or any element
    the bound alone does not explain) sends each call to `_stage_partial_model`, which adds the GEMMs'
    accumulation slack where it is needed."""
    taps, fc = cs[0].args[0], cs[0].args[1]
    if any(not torch.equal(c.args[0], taps) or not torch.equal(c.args[1], fc) for c in cs[1:]):
        return False
    k, h, h_out = taps.shape[0], taps.shape[-1], fc.shape[0]
    member = np.zeros((len(cs), k))  # [S, K]: which taps each stage owns
    for j, c in enumerate(cs):
        member[j, list(c.args[2])] = 1.0
    count = member.sum(axis=1, keepdims=True).clip(min=1.0)  # [S, 1] the float32 sum's terms
    if taps.device.type == "cpu":
        a, w = _np64(taps), _np64(fc).reshape(h_out, k, h).transpose(1, 2, 0)
        p = np.matmul(a, w)  # [K, N, H_out] each tap's exact projection
        if not np.isfinite(p).all():
            return False
        r = _bf16_np(p).reshape(k, -1)  # project_target_tap: one bf16 rounding per tap
        want, bound = member @ r, count * U_FP32 * (member @ np.abs(r))  # [S, N*H_out] add_capture's sum
        out = np.stack([_np64(c.out).reshape(-1) for c in cs])
        return bool((np.abs(out - want) <= MARGIN * bound).all())
    m = torch.from_numpy(member).to(taps.device)
    p = torch.bmm(taps.double(), fc.double().view(h_out, k, h).permute(1, 2, 0))  # [K, N, H_out]
    r = p.to(torch.bfloat16).double().reshape(k, -1)
    want, bound = m @ r, torch.from_numpy(count).to(taps.device) * U_FP32 * (m @ r.abs())
    out = torch.stack([c.out.reshape(-1) for c in cs]).double()
    return bool(((out - want).abs() <= MARGIN * bound).all())


def tap_projections_rounded_to_bf16(calls: list[Call]) -> str:
    """Every stage partial is sum_i bf16(h_i W_i^T) in float32, and every finalize rounds the float32 sum to
    bf16 before the norm: K3N-006's roundings and no other."""
    relevant = [c for c in calls if c.subject in (base.STAGE_PARTIAL, base.FINALIZE_PROJECTION)]
    if not relevant:
        return "no stage partial or finalize call was made"
    stages = [c for c in relevant if c.subject == base.STAGE_PARTIAL]
    if stages and _stage_partials_at_once(stages):
        relevant = [c for c in relevant if c.subject != base.STAGE_PARTIAL]  # every stage call explained
    for c in relevant:
        if c.subject == base.FINALIZE_PROJECTION and _finalize_at_once(c):
            continue
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
SWEEPS = 6  # beyond that, rounds of the per-segment search (_searched_sets) before it gives up
CHUNK_ELEMENTS = 2**27  # float64 elements of one batched oracle call in that search (about 1 GiB)


def _segment_sets(hidden: int) -> list[tuple[int, ...]]:
    """Every set of the prefix's 32-element segments a raced read can take twice, where there are at most
    EVERY_SUBSET of them (GPU run 80: at hidden 128 with 7 blocks, outputs bitwise equal to three segments
    raced, (1, 2, 3) and (0, 2, 3), beside one and two). Beyond that `_searched_sets` finds the set."""
    n = -(-hidden // SEGMENT)
    return [c for k in range(n + 1) for c in itertools.combinations(range(n), k)]


def _mixture(c: Call, a: dict[str, Any], prefix: torch.Tensor, bank: torch.Tensor) -> tuple[torch.Tensor, Any]:
    """(the oracle's mixture [T,H] of `prefix` [T,H] over `bank` [T,N,H], its budget): the call's weights,
    no delta, no bank write (the caller has applied both)."""
    from k3num.harness import judges

    return judges.attn_res_oracle(c.engine, prefix, None, bank, a["norm_weight"], a["qk_weight"],
                                  a["output_norm_weight"], int(a["num_blocks"]), -1, float(a["eps"]),
                                  float(a["output_norm_eps"]))


def _segment_max(err: torch.Tensor, n: int) -> torch.Tensor:
    """[..., n] the largest element of `err` [..., H] in each 32-element segment (the last one may be short)."""
    pad = n * SEGMENT - err.shape[-1]
    if pad:
        err = torch.nn.functional.pad(err, (0, pad))
    return err.reshape(*err.shape[:-1], n, SEGMENT).amax(dim=-1)


def _searched_sets(c: Call, a: dict[str, Any], once: torch.Tensor, twice: torch.Tensor, bank: torch.Tensor,
                   out: torch.Tensor) -> torch.Tensor:
    """Where the prefix has more segments than EVERY_SUBSET (K3's 224): per row, the set of segments whose
    delta-twice variant best explains `out` [T,H], found by rounds of single flips. Each round computes, for
    every row and segment, the exact mixture with that one segment flipped from the current set (one batched
    oracle call over rows x segments), and flips each segment whose own elements come closer to `out`. It
    stops when nothing flips. Returns the best mixture found [T,H] (float64); the caller judges it against
    the budget, so a set the search fails to find makes the output unexplained, never explained wrongly."""
    t, h = once.shape
    n = -(-h // SEGMENT)
    seg_of = torch.arange(h, device=once.device) // SEGMENT  # [H]
    swap = seg_of[None, :] == torch.arange(n, device=once.device)[:, None]  # [n, H] segment s's elements
    raced = torch.zeros(t, n, dtype=torch.bool, device=once.device)  # [T, n] the current set per row
    target = out.double()
    best, best_err = None, None
    rows = max(1, CHUNK_ELEMENTS // max(1, n * h * (bank.shape[1] + 2)))
    for _ in range(SWEEPS):
        cur = torch.where(raced[:, seg_of], twice, once)  # [T, H]
        want, _ = _mixture(c, a, cur, bank)
        err_now = (target - want).abs()
        row_err = err_now.amax(dim=-1)
        if best is None:
            best, best_err = want.clone(), row_err.clone()
        else:
            better = row_err < best_err
            best[better], best_err[better] = want[better], row_err[better]
        other = torch.where(raced[:, seg_of], once, twice)  # [T, H] every segment's other variant
        closer = torch.zeros_like(raced)
        for r0 in range(0, t, rows):
            r = slice(r0, min(t, r0 + rows))
            k = r.stop - r.start
            pref = torch.where(swap[None], other[r, None, :], cur[r, None, :]).reshape(k * n, h)
            flipped, _ = _mixture(c, a, pref, bank[r].repeat_interleave(n, dim=0))
            err_flip = (target[r, None, :] - flipped.reshape(k, n, h)).abs()  # [k, n, H]
            own = torch.where(swap[None], err_flip, torch.zeros_like(err_flip)).amax(dim=-1)  # [k, n]
            closer[r] = own < _segment_max(err_now[r], n)
        if not bool(closer.any()):
            break
        raced ^= closer
    cur = torch.where(raced[:, seg_of], twice, once)
    want, _ = _mixture(c, a, cur, bank)
    row_err = (target - want).abs().amax(dim=-1)
    assert best is not None and best_err is not None
    better = row_err < best_err
    best[better] = want[better]
    return best


def delta_applied_twice(calls: list[Call]) -> str:
    """Every output row is either the mixture with no segment raced (the race did not fire there) or, strictly
    closer than that, the mixture in which a non-empty set of 32-element segments of the prefix source (any set up
    to EVERY_SUBSET segments, else the one `_searched_sets` finds) are bf16(bf16(p + d) + d) (the prefix read back
    after the kernel's own store), each within the call's budget (harness/judges.attn_res_oracle's); and at least
    one row of one call is raced. A correct output (no row raced) or a near miss that no raced set explains
    better than the correct mixture does is not this bug. Every distinct output is judged (compared whole)."""
    from k3num.harness import judges

    if not calls:
        return "no attn_res call was made"
    seen: set[bytes] = set()
    raced_rows = 0
    for c in calls:
        a = _attn_res_args(c)
        if a.get("delta") is None or c.engine is None:
            return "a call without a delta (or its engine) cannot take the delta twice"
        key = c.out.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()
        if key in seen:
            continue
        seen.add(key)
        prefix, delta, blocks = a["prefix"], a["delta"], a["blocks"]
        p = judges.round_storage(c.engine, prefix.float() + delta.float())
        twice = judges.round_storage(c.engine, p.float() + delta.float())
        bank = blocks.clone()
        if int(a["block_write_idx"]) >= 0:
            bank[:, int(a["block_write_idx"])] = p
        clean, budget = _mixture(c, a, p, bank)
        none = (c.out.double() - clean).abs().amax(dim=-1)  # [T] each row's distance from the unraced mixture
        if -(-prefix.shape[1] // SEGMENT) > EVERY_SUBSET:
            best = (c.out.double() - _searched_sets(c, a, p, twice, bank, c.out)).abs().amax(dim=-1)
        else:
            best = torch.full((prefix.shape[0],), float("inf"), dtype=torch.float64, device=prefix.device)
            for segs in _segment_sets(prefix.shape[1])[1:]:  # every non-empty set (the empty one is `clean`)
                raced = p.clone()
                for sgm in segs:
                    raced[:, sgm * SEGMENT:(sgm + 1) * SEGMENT] = twice[:, sgm * SEGMENT:(sgm + 1) * SEGMENT]
                want, _ = _mixture(c, a, raced, bank)
                best = torch.minimum(best, (c.out.double() - want).abs().amax(dim=-1))
        raced_row = (best <= budget.value) & (best < none)
        ok = raced_row | (none <= budget.value)
        if not bool(ok.all()):
            worst = int(torch.argmax(torch.where(ok, 0.0, torch.minimum(best, none))).item())
            return (f"row {worst} of the output is {min(best[worst], none[worst]):.3g} from the unraced mixture and "
                    f"every delta-twice variant (budget {budget.value:.3g})")
        raced_rows += int(raced_row.sum())
    if not raced_rows:
        return ("no output shows the race: every row of every call is the unraced mixture, which no raced set "
                "explains better (a correct output, or another bug)")
    return ""


# ---- K3N-008: SGLang's model aggregation leaves the columns past the 1024 grid unwritten -----------------

GRID = 1024  # _mix_fused's column block and _score_kernel's unmasked chunk (oracles/ledger.py K3N-008's `what`)


def _refilled(c: Call, fill: float) -> torch.Tensor:
    """The call made again on its recorded inputs with every uninitialised allocation filled with the finite
    `fill` instead of NaN (oracles/hunt.PoisonAllocations): what the kernel never writes is then `fill`, which the
    output norm carries through (a read past the row still meets the inputs' own NaN rows)."""
    from k3num.oracles import hunt

    fn = c.engine.subjects[base.ATTN_RES_RESIDUAL]
    with hunt.poisoned_allocations(lambda t: t.fill_(fill)), np.errstate(over="ignore", invalid="ignore"):
        return fn(*[a.clone() if isinstance(a, torch.Tensor) else a for a in c.args], **c.kwargs)


def unwritten_past_the_grid(calls: list[Call]) -> str:
    """Every attn_res_residual(prefix [T,H], bank [T,R,H], nvb, norm, proj, out_norm, eps) output [T,H] is the
    output norm of a pre-norm mixture whose columns at and past (H // 1024) * 1024 were never written, so they
    hold what the allocation held. Judged by making the call again with the allocations filled with 1 instead of
    the property's NaN: below 1024 (no column written) each row is then exactly the norm of a row of ones,
    out_norm / sqrt(1 + eps), and the recorded output all NaN (the NaN allocation through the norm); past 1024
    each row is either not finite (its score read whole 1024-element chunks past the row, into the inputs' NaN
    rows or, made again on a GPU, whatever memory follows the recorded copies) or its unwritten columns are
    out_norm times one constant (the fill over the row's rms), and the written columns
    before them within the property's budget of the oracle or NaN. A finite output below 1024, a row that is
    not the fill where nothing was written, or a written tail, is not this bug."""
    from k3num.harness import judges

    if not calls:
        return "no attn_res_residual call was made"
    for c in calls:
        if len(c.args) < 7 or c.engine is None:
            return "a call not made with its seven positional arguments and its engine: it cannot be made again"
        prefix, bank, nvb, norm, proj, out_norm, eps = c.args[:7]
        h = prefix.shape[-1]
        cut = h // GRID * GRID
        if not cut and not bool(torch.isnan(c.out).all()):  # the recorded output first: no remake needed
            return (f"{int((~torch.isnan(c.out)).sum())} of {c.out.numel()} elements are not NaN, where no "
                    "column is written and the allocation held NaN")
        if cut and not bool(torch.isnan(c.out[:, cut:]).all()):
            return f"columns {cut}-{h - 1} were written: not every element there is NaN, where the allocation held NaN"
        refilled = _refilled(c, 1.0).double()
        g = out_norm.double()
        if not cut:  # nothing written: the refilled output the norm of the ones
            want = (g / (1.0 + float(eps)) ** 0.5).expand_as(refilled)
            why = _within(refilled, want, (U_BF16 + h * U_FP32) * want.abs(),
                          "made again with the allocations filled with 1, the output against the norm of a row of ones")
            if why:
                return why
            continue
        tail = refilled[:, cut:] / g[cut:]  # per row: the fill over the row's rms, where the head was finite
        finite = torch.isfinite(refilled).all(-1)
        spread = (tail - tail[:, :1]).abs() <= MARGIN * (U_BF16 + h * U_FP32) * tail[:, :1].abs()
        rows = ~finite | spread.all(-1)  # a row the reads past it made non-finite says nothing of its tail
        if not bool(rows.all()):
            r = int((~rows).nonzero()[0, 0])
            return (f"made again with the allocations filled with 1, row {r}'s columns {cut}-{h - 1} are not out_norm "
                    "times one constant (the unwritten fill through the norm), and the row is finite")
        want, budget = judges.residual_mixture(c.engine, prefix, bank.nan_to_num(0.0), int(nvb), norm, proj,
                                               out_norm, float(eps))
        head = c.out[:, :cut].double()
        within = ((head - want[:, :cut]).abs() <= torch.as_tensor(budget.value, dtype=torch.float64)).all(-1)
        rows = torch.isnan(head).all(-1) | within
        if not bool(rows.all()):
            r = int((~rows).nonzero()[0, 0])
            return (f"row {r}'s columns 0-{cut - 1} are neither the mixture within its budget nor NaN (a read "
                    "past the row)")
    return ""


# ---- K3N-013: SGLang's KV transfer plans a flat copy where the heads per rank differ ------------------------

KV_TRANSFER = "kv_transfer_plan"  # the plan the transfer property observes (harness/ledger_run.observe): (case,)


def flat_copy_planned(calls: list[Call]) -> str:
    """Every observed transfer plan is the flat plan (refmodel.transfer_plan.flat_plan: each page copied whole at
    the source's page size, its destination offset taken with the source's page size too), for the stage's
    layers, from the served decode rank's sender to it: the same (src, dst) chunks, no more, no fewer. A plan
    with another wrong chunk, or the head-aware plan, is not this bug."""
    from k3num.harness import judges
    from k3num.refmodel.transfer_plan import flat_plan

    if not calls:
        return "no KV transfer plan was observed"
    for c in calls:
        (case,), blocks = c.args, c.out
        want = judges.transfer_oracle(case, flat_plan)  # the property's restriction, over the flat plan
        src, _ = judges.transfer_layouts(case, case.stage[0])
        got = judges.transfer_items(list(blocks), src.item_bytes)
        if got != want:
            extra, missed = sorted((got or set()) - want)[:2], sorted(want - (got or set()))[:2]
            return (f"the plan is not the flat plan: {len(got or ())} chunks against its {len(want)} (first not in it "
                    f"{extra}, first of it missing {missed})")
    return ""


# ---- K3N-011: vLLM's merged block-FP8 loader places each layer's scale rows by rounding up -----------------

BLOCK_FP8_MERGE = "block_fp8_merged_load"  # the load the block-FP8 properties observe: (((weight, scale) per
# layer, in layer order), arrival order, block rows) -> (the merged weight, the merged scale), or what it raised


def _misplaced(layers: list[tuple[torch.Tensor, torch.Tensor]], order: list[int], block: int
               ) -> tuple[torch.Tensor, torch.Tensor] | str:
    """What adjust_block_scale_shard's placement loads: each layer's weight at row W l of the merged weight, its
    ceil(W / block) scale rows at ceil(W l / block) of the merged scale's ceil(W L / block), written in arrival
    order (a later layer's rows overwrite an earlier one's); NaN where no layer's row lands. Where a layer's rows
    run past the merged scale, the RuntimeError message the loader's narrow raises (a str). layers: L x ([W, H]
    fp8, [ceil(W / block), ceil(H / block)] float32); returns ([W L, H], [ceil(W L / block), ceil(H / block)])."""
    width = layers[0][0].shape[0]
    n_total, n_len = -(-width * len(layers) // block), -(-width // block)
    scale = torch.full((n_total, layers[0][1].shape[1]), float("nan"), dtype=layers[0][1].dtype)
    for layer in order:
        start = -(-width * layer // block)
        if start + n_len > n_total:
            return f"start ({start}) + length ({n_len}) exceeds dimension size ({n_total})."
        scale[start:start + n_len] = layers[layer][1].detach().cpu()
    return torch.cat([w.detach().cpu() for w, _ in layers]), scale


def scales_placed_by_rounding_up(calls: list[Call]) -> str:
    """Every observed merged block-FP8 load is, bit for bit, what the rounded-up placement loads
    (`_misplaced`): each layer's weight rows where they belong and its scale rows at ceil(W l / 128), the later
    arrival winning a shared row; or, where that placement runs a layer past the merged scale, the loader's
    RuntimeError with those very numbers. And the placement is wrong there (shards of whole blocks load right,
    which is not this bug). Any other bytes, order of overwrites, exception or message is not this bug."""
    from k3num.refmodel import quant

    if not calls:
        return "no merged block-FP8 load was observed"
    for c in calls:
        layers, order, block = c.args
        layers = [(w.detach().cpu(), s.detach().cpu()) for w, s in layers]
        want = _misplaced(layers, list(order), int(block))
        if isinstance(c.out, BaseException):
            said = f"{type(c.out).__name__}: {c.out}"
            if isinstance(want, str):
                if isinstance(c.out, RuntimeError) and str(c.out).strip() == want:
                    continue
                return f"the load raised {said[:160]!r}, where the placement raises 'RuntimeError: {want}'"
            return f"the load raised {said[:160]!r}, where the placement loads without an error"
        if isinstance(want, str):
            return f"the load returned, where the placement raises 'RuntimeError: {want}'"
        weight, scale = (t.detach().cpu() for t in c.out)
        if bool(want[1].isnan().any()):
            return "the placement leaves scale rows unwritten, whose content the model cannot say"
        right = torch.cat([quant.dequantize_fp8_block(w, s) for w, s in layers])
        if torch.equal(quant.dequantize_fp8_block(*want), right):
            return "the placement loads these shards right (whole blocks, or scales that agree): not this bug"
        for name, got, exp in (("weight", weight, want[0]), ("scale", scale, want[1])):
            if got.shape != exp.shape or not torch.equal(got.view(torch.uint8), exp.view(torch.uint8)):
                bad = (int((got.view(torch.uint8) != exp.view(torch.uint8)).any(-1).sum())
                       if got.shape == exp.shape else f"shape {tuple(got.shape)} against {tuple(exp.shape)}:")
                return f"{bad} rows of the merged {name} are not where the rounded-up placement puts them"
    return ""


# ---- K3N-012: vLLM's merged NVFP4 loader keeps one per-tensor multiplier ------------------------------------

NVFP4_MERGE = "nvfp4_merged_load"  # the load the NVFP4 property observes: (per-layer (packed, group scale,
# multiplier), ...) -> (the merged weight, its group scales, the one multiplier kept)


def one_multiplier_kept(calls: list[Call]) -> str:
    """Every observed merged NVFP4 load holds each layer's own e2m1 values and group scales, in layer order, and
    one float32 per-tensor multiplier that is one of the layers' own (so the layers quantized with another are
    loaded rescaled): the merged weight dequantized with it is, bit for bit, each layer's values and group scales
    dequantized with that one multiplier; and some layer's own multiplier differs from it (else the load is
    right). Values, group scales or a multiplier of another kind are not this bug."""
    from k3num.refmodel import quant

    if not calls:
        return "no merged NVFP4 load was observed"
    for c in calls:
        layers, (weight, scale, kept) = c.args, c.out
        kept = kept.detach().cpu().reshape(-1)
        own = [m.detach().cpu().reshape(-1) for _, _, m in layers]
        if kept.numel() != 1 or not any(torch.equal(kept, m) for m in own):
            return f"the kept multiplier {kept.tolist()[:4]} is not one of the layers' own {[m.item() for m in own]}"
        if all(torch.equal(kept, m) for m in own):
            return "every layer's multiplier is the kept one: the load is right, not rescaled"
        want = torch.cat([quant.dequantize_nvfp4_modelopt(p, g, kept) for p, g, _ in layers])
        got = quant.dequantize_nvfp4_modelopt(weight, scale, kept)
        if got.shape != want.shape or not bool(torch.equal(got, want)):
            bad = int((got != want).any(-1).sum()) if got.shape == want.shape else got.shape[0]
            return (f"{bad} rows of the merged weight are not the layers' own values and group scales under the one "
                    "kept multiplier")
    return ""


# ---- K3N-014: vLLM's FP8 cache insert takes a zero or infinite scale and saturates -----------------------

FP8_INSERT = "fp8_insert"  # the call the insert property observes (harness/ledger_run.observe): (x, scale, fmt)


def _saturated_bytes(x: torch.Tensor, scale: float, fmt: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(the bytes a saturating conversion of x / scale writes, where they are NaN) for a zero or infinite scale,
    by cases, no division made: the quotient's sign is x's sign bit xor the scale's; a zero scale gives the
    format's +-max, and NaN for a zero or NaN element; an infinite one gives +-0, and NaN for an infinite or
    NaN element. x: any shape; both results x's shape (uint8, bool), on the CPU."""
    x = x.detach().cpu().double()
    big = torch.finfo(fmt).max
    negative = torch.signbit(x) ^ bool(torch.signbit(torch.tensor(scale)))
    if scale == 0.0:
        nan = (x == 0.0) | torch.isnan(x)
        value = torch.where(negative, -big, big)
    else:
        nan = torch.isinf(x) | torch.isnan(x)
        value = torch.where(negative, -0.0, 0.0).double()
    return value.to(fmt).view(torch.uint8), nan


def quotient_saturated(calls: list[Call]) -> str:
    """Every observed FP8 insert with a zero or infinite scale wrote, in every mapped slot of the layer, the
    bytes of a saturating conversion of x / scale (`_saturated_bytes`: +-max for a zero scale, +-0 for an
    infinite one, a NaN where the quotient is 0 / 0 or inf / inf), every byte. The expected bytes come from the
    call's inputs, not from the property's message; NaN bytes where a finite value belongs (the correct,
    visibly poisoned output), one byte off, or bytes of another scale are not this bug."""
    from k3num.refmodel import quant

    if not calls:
        return "no FP8 insert call was observed"
    for c in calls:
        x, scale, fmt = c.args
        fp8 = quant.FP8_KV_FORMATS[fmt]
        if not (scale == 0.0 or abs(scale) == float("inf")):
            return f"the observed insert's scale {scale} is neither zero nor infinite"
        want, nan = _saturated_bytes(x, float(scale), fp8)
        got = c.out.detach().cpu().reshape(want.shape)
        got_nan = torch.isnan(got.view(fp8).float())
        same = torch.where(nan, got_nan, got == want)
        if not bool(same.all()):
            return (f"{int((~same).sum())} of {same.numel()} bytes are not x / {scale} saturated (e.g. "
                    f"{got[~same].flatten()[:4].tolist()} where {want[~same].flatten()[:4].tolist()} belongs)")
    return ""


@dataclass(frozen=True)
class BugModel:
    subjects: tuple[str, ...]  # the subjects whose calls it reads
    explains: Callable[[list[Call]], str]  # '' explained, else why not, over the calls of `subjects`
    what: str  # the defective computation, in one line


def __getattr__(name: str) -> Any:
    """`MODELS` (entry id -> BugModel): read from the entries' own modules (harness/ledger_entries), lazily."""
    if name == "MODELS":
        return models()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def models() -> dict[str, BugModel]:
    """Every entry's bug model, by entry id (an entry without one says why in its case rule's `no_model`)."""
    from k3num.harness import ledger_entries

    return ledger_entries.models()


TRUNCATED = "(calls past the recorder's limit)"  # harness/ledger_run.record_calls's mark: outputs not kept


def explains(entry_id: str, calls: list[Call]) -> str:
    """'' where the entry's model explains these calls (an entry without a model: its signature and region
    decide), else why not, naming the entry. Where the recorder dropped calls (TRUNCATED), not explained: the
    model never saw every output."""
    model = models().get(entry_id)
    if model is None:
        return ""
    if any(c.subject == TRUNCATED for c in calls):
        return (f"not {entry_id}'s bug as far as can be told: more than {len(calls) - 1} calls with distinct "
                "inputs or outputs, and the model judges only the ones recorded (harness/ledger_run.DISTINCT)")
    why = model.explains([c for c in calls if c.subject in model.subjects])
    return f"not {entry_id}'s bug ({model.what}): {why}" if why else ""
