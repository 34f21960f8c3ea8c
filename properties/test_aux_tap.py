"""Properties of the aux-state tap (`_capture_aux_hidden_stream`) and its PP branches (BRIEF §2)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st

from k3num.engines import base
from k3num.fixtures.builders import TapInputs, tap_inputs, upcast_weights
from k3num.fixtures.strategies import TapCase, tap_cases
from k3num.harness import oracle
from k3num.harness.judges import mixture_budget
from k3num.oracles import budgets
from k3num.oracles.drift import COLLECTOR
from k3num.oracles.records import INFO, judge
from k3num.properties.support import DEVICE, LOW, assert_bitwise, raised_deliberately, report, subject, up
from k3num.refmodel import attn_res as ref

EPS = 1e-5


def _owner_stage(engine) -> bool:
    """The engine takes an AttnRes tap on the stage that owns its consumer (TokenSpeed's
    _context_tap_owner_layer), not on the stage that produced the stream: a stage-end tap on a
    non-final stage is the next stage's, and the last stage always ends at the last layer."""
    return bool(engine.extras.get("aux_capture_owner_stage"))


OWNER_STAGE_SKIP = ("takes this tap on the next stage (the tap owner rule), which mixes it with layer i + 1's weights: "
                    "judged by test_a_stage_end_tap_taken_by_the_next_stage_mixes_with_its_weights")


def _tap(engine, case: TapCase, inp: TapInputs, *, enabled: bool = True, weights: bool = True,
         is_last_rank: bool = True, non_final_stage: str = "raise", pending: bool = True) -> torch.Tensor:
    """The engine's tap; an error that no `raise` of the code made (a torch operator's, a subscript's) is an
    AssertionError: neither a refusal (the RuntimeError branch 2 expects) nor a mode it lacks (a skip)."""
    try:
        return subject(engine, base.AUX_CAPTURE)(
            case.layer_idx, inp.prefix_sum, inp.pending if pending else None, inp.bank, enabled=enabled,
            weights=inp.weights if weights else None, block_size=case.block_size, end_layer=case.stage_end,
            num_layers=case.num_layers, is_last_rank=is_last_rank, eps=EPS, non_final_stage=non_final_stage,
        )
    except RuntimeError as e:  # NotImplementedError is one
        if raised_deliberately(e):
            raise
        raise AssertionError(f"{engine.name} {engine.version}: the tap crashed, no check of its own refused: "
                             f"{type(e).__name__}: {e}") from e


def _oracle(case: TapCase, inp: TapInputs, *, end_layer: int, is_last_rank: bool = True) -> torch.Tensor:
    """The oracle tap on the prefix the subject mixes: prefix_sum + pending rounded to storage."""
    prefix = up(inp.prefix_sum + inp.pending)
    return oracle.current().capture_aux_stream(
        case.layer_idx, prefix, None, up(inp.bank), enabled=True, weights=upcast_weights(inp.weights),
        block_size=case.block_size, end_layer=end_layer, num_layers=case.num_layers, is_last_rank=is_last_rank,
        eps=EPS,
    )


def _budget(case: TapCase, inp: TapInputs, want: torch.Tensor, norm: torch.Tensor, proj: torch.Tensor,
            nbl: int, rounding: str) -> budgets.Budget:
    sources = torch.cat([up(inp.bank[:, :nbl]), up(inp.prefix_sum + inp.pending)[:, None]], 1)
    return mixture_budget(want, sources, up(norm) * up(proj), case.hidden, rounding)


@given(case=tap_cases(position="inner"), flag_off=st.booleans(), pending=st.booleans())
def test_disabled_tap_returns_prefix_plus_pending_bitwise(engine, case: TapCase, flag_off: bool,
                                                         pending: bool) -> None:
    inp = tap_inputs(case, LOW, DEVICE)
    want = inp.prefix_sum + inp.pending if pending else inp.prefix_sum.clone()
    got = _tap(engine, case, inp, enabled=not flag_off, weights=flag_off, pending=pending)
    assert_bitwise(got, want, "disabled tap (flag off)" if flag_off else "disabled tap (no AttnRes)")


@given(case=tap_cases(position="inner"))
@example(case=TapCase(num_layers=2, block_size=1, stage_end=2, layer_idx=0, tokens=1, hidden=16, seed=0))  # K3N-001
def test_branch1_tap_mixes_with_the_next_layers_weights_and_blocks(engine, case: TapCase) -> None:
    inp = tap_inputs(case, LOW, DEVICE)
    got = _tap(engine, case, inp)
    want = _oracle(case, inp, end_layer=case.stage_end)
    nxt = case.layer_idx + 1
    budget = _budget(case, inp, want, inp.weights.attn_res_norm[nxt], inp.weights.attn_res_proj[nxt],
                     ref.LayerWiring(nxt, case.block_size).prev_valid_blocks, engine.rounding)
    report(judge(property="branch1_next_layer_mixture", engine=engine, subject=base.AUX_CAPTURE, actual=got,
                 reference=want, budget=budget, seed=case.seed, reduction_len=case.hidden,
                 detail=f"layer={case.layer_idx};S={case.block_size};end={case.stage_end}"))


@given(case=tap_cases(position="stage_end"))
@example(case=TapCase(num_layers=2, block_size=1, stage_end=1, layer_idx=0, tokens=1, hidden=16, seed=0))  # K3N-002
def test_branch2_tap_on_the_last_rank_mixes_with_the_output_weights(engine, case: TapCase) -> None:
    if _owner_stage(engine):  # its last stage ends at the last layer (pp_layer_window)
        case = TapCase(case.num_layers, case.block_size, case.num_layers, case.num_layers - 1, case.tokens,
                       case.hidden, case.seed)
    inp = tap_inputs(case, LOW, DEVICE)
    got = _tap(engine, case, inp, is_last_rank=True)
    want = _oracle(case, inp, end_layer=case.stage_end, is_last_rank=True)
    nbl = -(-case.num_layers // case.block_size)
    budget = _budget(case, inp, want, inp.weights.output_res_norm, inp.weights.output_res_proj, nbl,
                     engine.rounding)
    report(judge(property="branch2_output_mixture", engine=engine, subject=base.AUX_CAPTURE, actual=got,
                 reference=want, budget=budget, seed=case.seed, reduction_len=case.hidden,
                 detail=f"layer={case.layer_idx};S={case.block_size};L={case.num_layers}"))


@given(case=tap_cases(position="stage_end"))
@example(case=TapCase(num_layers=2, block_size=1, stage_end=1, layer_idx=0, tokens=1, hidden=16, seed=0))  # K3N-003
def test_branch3_non_final_stage_raises_when_configured_to(engine, case: TapCase) -> None:
    if _owner_stage(engine):
        pytest.skip(f"{engine.name} {engine.version} {OWNER_STAGE_SKIP}")
    inp = tap_inputs(case, LOW, DEVICE)
    # a deliberate refusal (RuntimeError, as vLLM 0.33.0 raises), not an accident such as an IndexError
    with pytest.raises(RuntimeError):
        _tap(engine, case, inp, is_last_rank=False, non_final_stage="raise")


@given(case=tap_cases(position="stage_end"))
def test_branch3_prefix_fallback_returns_the_prefix_and_reports_its_cosine(engine, case: TapCase) -> None:
    if _owner_stage(engine):
        pytest.skip(f"{engine.name} {engine.version} {OWNER_STAGE_SKIP}")
    inp = tap_inputs(case, LOW, DEVICE)
    try:
        got = _tap(engine, case, inp, is_last_rank=False, non_final_stage="prefix")
    except NotImplementedError as e:
        pytest.skip(f"{engine.name} {engine.version}: {e}")
    assert_bitwise(got, inp.prefix_sum + inp.pending, "branch-3 fallback (the prefix)")
    if case.layer_idx + 1 < case.num_layers:
        # how far the fallback is from the mixture the consumer (on the next stage) reads
        true_mix = _oracle(case, inp, end_layer=case.num_layers)
        COLLECTOR.add(judge(property="branch3_fallback_cosine", engine=engine, subject=base.AUX_CAPTURE,
                            actual=got, reference=true_mix, budget=budgets.Budget(float("inf"), "reported only"),
                            seed=case.seed, reduction_len=case.hidden, verdict=INFO,
                            detail=f"layer={case.layer_idx};S={case.block_size};L={case.num_layers}"))


@given(case=tap_cases(position="stage_end"))
def test_a_stage_end_tap_taken_by_the_next_stage_mixes_with_its_weights(engine, case: TapCase) -> None:
    """The tap after a non-final stage's last layer i (i + 1 < L), taken on the stage that holds layer
    i + 1, is the mixture of layer i + 1 (its weights, its prev_valid_blocks) from the bank and prefix that
    stage was handed, as a one-stage run computes it. An engine that takes a tap on its consumer's stage
    (TokenSpeed) is called as the producing stage's end (it must move the tap itself); one that takes it
    on the producing stage (vLLM, the mirror) is called on a stage that holds i + 1 (branch 1 there)."""
    if case.layer_idx + 1 >= case.num_layers:
        case = TapCase(case.num_layers + 1, case.block_size, case.stage_end, case.layer_idx, case.tokens,
                       case.hidden, case.seed)
    inp = tap_inputs(case, LOW, DEVICE)
    if not _owner_stage(engine):
        case = TapCase(case.num_layers, case.block_size, case.num_layers, case.layer_idx, case.tokens, case.hidden,
                       case.seed)
    got = _tap(engine, case, inp, is_last_rank=not _owner_stage(engine), non_final_stage="raise")
    want = _oracle(case, inp, end_layer=case.num_layers)
    nxt = case.layer_idx + 1
    budget = _budget(case, inp, want, inp.weights.attn_res_norm[nxt], inp.weights.attn_res_proj[nxt],
                     ref.LayerWiring(nxt, case.block_size).prev_valid_blocks, engine.rounding)
    report(judge(property="stage_end_tap_on_the_next_stage", engine=engine, subject=base.AUX_CAPTURE, actual=got,
                 reference=want, budget=budget, seed=case.seed, reduction_len=case.hidden,
                 detail=f"layer={case.layer_idx};S={case.block_size};L={case.num_layers}"))


@given(case=tap_cases(position="inner"), flag_off=st.booleans())
def test_a_tap_handed_on_keeps_its_value_when_the_next_layers_change_their_buffers_in_place(
        engine, case: TapCase, flag_off: bool) -> None:
    """The tap is the draft's input from the moment it is taken, while the target goes on: taken as the engine's
    model takes it (with the pending MLP output, or, where the engine declares so, of the running prefix sum
    alone: extras["aux_capture_takes_pending"]), then the prefix sum, the pending output and the bank are changed
    in place as the next layers' residual adds change them, and the next tap is taken: the first tap keeps its
    value bit for bit. A tap that is the running prefix itself, or a view of the bank, or a workspace the next
    call reuses, moves."""
    inp = tap_inputs(case, LOW, DEVICE)
    pending = engine.extras.get("aux_capture_takes_pending", True)
    got = _tap(engine, case, inp, enabled=not flag_off, pending=pending)
    kept = got.clone()
    for t in (inp.prefix_sum, inp.pending, inp.bank):  # the next layers' in-place residual adds
        t.add_(1.0)
    _tap(engine, case, inp, enabled=not flag_off, pending=pending)  # the next tap
    assert_bitwise(got, kept, "a tap after the next layers changed the prefix sum, the pending output and the bank "
                              "in place and took the next tap")


@given(case=tap_cases(position="inner"), position=st.sampled_from(["inner", "last", "non_final"]))
def test_capture_leaves_the_callers_tensors_untouched(engine, case: TapCase, position: str) -> None:
    inp = tap_inputs(case, LOW, DEVICE)
    if position != "inner":
        case = TapCase(case.num_layers, case.block_size, case.stage_end, case.stage_end - 1, case.tokens,
                       case.hidden, case.seed)
    saved = [t.clone() for t in (inp.prefix_sum, inp.pending, inp.bank)]
    try:
        _tap(engine, case, inp, is_last_rank=position != "non_final", non_final_stage="raise")
    except RuntimeError:
        assert position == "non_final", "only a non-final stage end may refuse"
    for name, t, s in zip(("prefix_sum", "pending_mlp_out", "bank"), (inp.prefix_sum, inp.pending, inp.bank), saved):
        assert_bitwise(t, s, f"caller's {name} after the tap")
