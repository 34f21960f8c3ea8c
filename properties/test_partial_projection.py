"""Properties of the PP partial-projection summation (stage partials, the finalize, the baseline)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st

from k3num.engines import base
from k3num.fixtures.builders import cancelling_projection_inputs, projection_inputs
from k3num.fixtures.strategies import ProjectionCase, projection_cases, seeds
from k3num.harness import judges
from k3num.harness.judges import EPS
from k3num.oracles import budgets
from k3num.oracles.records import judge
from k3num.properties.checks.partial_projection import TRANSFER, check_sharded_within_budget_of_unsharded
from k3num.properties.checks.partial_projection import sharded_call as _sharded
from k3num.properties.support import DEVICE, LOW, assert_bitwise, call, report, subject, up
from k3num.refmodel import rmsnorm


@given(case=projection_cases())
def test_partial_sum_is_exact_in_float64_for_every_stage_partition(engine, case: ProjectionCase) -> None:
    inp = projection_inputs(case, torch.float64, DEVICE)
    _, got = _sharded(engine, inp, case, torch.float64)
    want = judges.projection_oracle(inp.taps, inp.fc, inp.norm, EPS)
    tol = budgets.f64_identity_rtol(case.reduction_len)
    budget = budgets.Budget(tol * want.abs().max().item(), f"f64_identity_rtol({case.reduction_len})*max|ref|")
    report(judge(property="partial_sum_exact_in_float64", engine=engine, subject=base.FINALIZE_PROJECTION,
                 actual=got, reference=want, budget=budget, seed=case.seed, reduction_len=case.reduction_len,
                 detail=f"stages={len(case.stages)}"))


@pytest.mark.parametrize("transfer", sorted(TRANSFER))
@given(case=projection_cases())
def test_sharded_within_budget_of_unsharded_for_every_order_of_stages(engine, transfer: str,
                                                                     case: ProjectionCase) -> None:
    check_sharded_within_budget_of_unsharded(engine, case, transfer, DEVICE)


@pytest.mark.parametrize("transfer", sorted(TRANSFER))
@given(case=projection_cases(min_taps=2))
@example(case=ProjectionCase(taps=2, tokens=1, hidden=16, hidden_out=16, stages=((0, 1),), order=(0,), seed=0,
                             scale=0.01, outliers=0.0))  # K3N-006
def test_sharded_adds_no_rounding_beyond_its_partials_when_taps_cancel(engine, transfer: str,
                                                                      case: ProjectionCase) -> None:
    """Taps 0 and 1 cancel (their sum is ~1% of each): sharding may round each stage's partial and
    the running sum, nothing more. A path that rounds each tap's projection on its own (declared or
    not) loses u * |p_i| against a sum 100x smaller: the budget does not count engine-declared
    roundings here."""
    inp = cancelling_projection_inputs(case, LOW, DEVICE)
    check_sharded_within_budget_of_unsharded(engine, case, transfer, DEVICE, inp, count_declared=False,
                                             prop="sharded_adds_no_rounding_when_taps_cancel")


@given(case=projection_cases(max_taps=5))
def test_each_stage_reads_only_its_own_taps_column_blocks(engine, case: ProjectionCase) -> None:
    partial = subject(engine, base.STAGE_PARTIAL)
    inp = projection_inputs(case, LOW, DEVICE)
    h = case.hidden
    for members in case.stages:
        own = partial(inp.taps, inp.fc, list(members))
        others = [i for i in range(case.taps) if i not in members]
        taps2, fc2 = inp.taps.clone(), inp.fc.clone()
        for i in others:  # scramble every tap and column block this stage does not own
            taps2[i] = (taps2[i] * -7 + 1).to(LOW)
            fc2[:, i * h : (i + 1) * h] = (fc2[:, i * h : (i + 1) * h] * 5 - 2).to(LOW)
        assert_bitwise(partial(taps2, fc2, list(members)), own, f"stage {list(members)} partial")
        if members:  # and it does read its own: changing an owned block changes the partial
            fc3 = inp.fc.clone()
            fc3[:, members[0] * h : (members[0] + 1) * h] = 0
            assert not torch.equal(partial(inp.taps, fc3, list(members)), own), "an owned column block was ignored"


@pytest.mark.parametrize("transfer", sorted(TRANSFER))
@given(case=projection_cases())
def test_empty_stages_contribute_nothing(engine, transfer: str, case: ProjectionCase) -> None:
    partial = subject(engine, base.STAGE_PARTIAL)
    finalize = subject(engine, base.FINALIZE_PROJECTION)
    inp = projection_inputs(case, LOW, DEVICE)
    empty = partial(inp.taps, inp.fc, [])
    zeros = torch.zeros(case.tokens, case.hidden_out, dtype=empty.dtype, device=empty.device)
    assert_bitwise(empty, zeros, "an empty stage's partial")
    nonempty = [list(m) for m in case.stages if m] or [[]]
    plain = call(engine, finalize, [partial(inp.taps, inp.fc, m) for m in nonempty], inp.norm, EPS,
                 TRANSFER[transfer], list(range(len(nonempty))))
    padded_parts = [partial(inp.taps, inp.fc, m) for m in nonempty] + [empty, empty]
    padded = call(engine, finalize, padded_parts, inp.norm, EPS, TRANSFER[transfer], list(range(len(padded_parts))))
    assert_bitwise(padded, plain, "projection with two extra empty stages")


@given(case=projection_cases())
def test_unsharded_projection_within_rounding_budget_of_oracle(engine, case: ProjectionCase) -> None:
    project = subject(engine, base.PROJECT_UNSHARDED)
    inp = projection_inputs(case, LOW, DEVICE)
    got = project(inp.taps, inp.fc, inp.norm, EPS)
    want = judges.unsharded_projection(inp.taps, inp.fc, inp.norm, EPS)
    report(judge(property="unsharded_within_rounding_budget", engine=engine, subject=base.PROJECT_UNSHARDED,
                 actual=got, reference=want.reference, budget=want.budget, seed=case.seed,
                 reduction_len=want.reduction_len))


FC_NORM = "project_unsharded_fc_norm"
SEGMENTED = "segmented_rmsnorm"


@given(seed=seeds, tokens=st.integers(1, 6), segments=st.integers(1, 6), hidden=st.sampled_from([16, 48, 64, 256]))
def test_segmented_rms_norm_segment_s_is_normed_by_weight_row_s_in_fp32_rounded_once(engine, seed, tokens, segments,
                                                                                     hidden):
    """TokenSpeed's `_segmented_rmsnorm_kernel` (the fc_norm of a draft whose config has it): segment s of
    every row [.., S, H] is RMS-normed by weight row s in fp32, rounded once (elementwise, as the grouped
    rms_norm op is judged: oracles.budgets.rounded_once_rtol); permuting segments and weight rows together
    permutes the output bitwise."""
    op = engine.extras.get(SEGMENTED)
    if op is None:
        pytest.skip(f"engine {engine.name} {engine.version} binds no segmented RMSNorm (the fc_norm draft config)")
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(tokens, segments, hidden, generator=gen) * 3).to(LOW).to(DEVICE)
    w = (torch.rand(segments, hidden, generator=gen) * 2 + 0.1).to(LOW).to(DEVICE)
    out = op(x, w, EPS)
    ref = torch.stack([rmsnorm.rms_norm(up(x[:, s]), up(w[s]), EPS) for s in range(segments)], 1)
    eps32 = budgets.gamma(hidden, budgets.U32) / 2 + 4 * budgets.U32  # sum of squares, rsqrt, mean, two products
    scale = ref.abs().clamp_min(torch.finfo(torch.float64).tiny)
    rtol = budgets.rounded_once_rtol(LOW, eps32)
    report(judge(property="segmented_rms_norm_rounded_once", engine=engine, subject=SEGMENTED,
                 actual=up(out) / scale, reference=ref / scale,
                 budget=budgets.Budget(rtol, f"elementwise |out-ref|<=rtol*|ref|, rtol={rtol:.3g} (rounded once)"),
                 seed=seed, reduction_len=hidden, detail=f"S={segments};H={hidden}"))
    perm = torch.randperm(segments, generator=gen).to(DEVICE)
    assert_bitwise(op(x[:, perm].contiguous(), w[perm].contiguous(), EPS), out[:, perm],
                   "segmented rms_norm with the segments and their weight rows permuted together")


@given(case=projection_cases(), fc_norm=st.booleans())
def test_fc_norm_projection_is_the_projection_of_the_segment_normed_taps(engine, case: ProjectionCase,
                                                                         fc_norm: bool) -> None:
    """project_target_hidden on a draft with fc_norm drawn on and off. Off: the unsharded projection's bits.
    On: the projection of the taps each normed by its own fc_norm row (the engine's segmented RMSNorm,
    judged on its own above), bit for bit; and a tap's fc_norm row reaches only that tap's term."""
    project = engine.extras.get(FC_NORM)
    if project is None:
        pytest.skip(f"engine {engine.name} {engine.version} binds no fc_norm projection")
    inp = projection_inputs(case, LOW, DEVICE)
    plain = subject(engine, base.PROJECT_UNSHARDED)
    if not fc_norm:
        assert_bitwise(project(inp.taps, inp.fc, None, inp.norm, EPS), plain(inp.taps, inp.fc, inp.norm, EPS),
                       "fc_norm off against the unsharded projection")
        return
    gen = torch.Generator().manual_seed(case.seed)
    w = (torch.rand(case.taps, case.hidden, generator=gen) * 2 + 0.1).to(LOW).to(DEVICE)
    got = project(inp.taps, inp.fc, w, inp.norm, EPS)
    normed = engine.extras[SEGMENTED](inp.taps.permute(1, 0, 2).contiguous(), w, EPS).permute(1, 0, 2)
    assert_bitwise(got, plain(normed.contiguous(), inp.fc, inp.norm, EPS),
                   "fc_norm projection against the projection of the segment-normed taps")
    if case.taps > 1:  # tap 0's row scaled by 4 changes the output only through tap 0
        w2 = w.clone()
        w2[0] = (w2[0] * 4).to(LOW)
        normed2 = normed.clone()
        normed2[0] = engine.extras[SEGMENTED](inp.taps[0][:, None].contiguous(), w2[:1].contiguous(), EPS)[:, 0]
        assert_bitwise(project(inp.taps, inp.fc, w2, inp.norm, EPS),
                       plain(normed2.contiguous(), inp.fc, inp.norm, EPS), "tap 0's fc_norm row scaled by 4")
