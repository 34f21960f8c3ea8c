"""The aux taps across pipeline-parallel stages: what the last stage hands the draft.

A PP plan draws the number of layers, the tap layers and the stage boundaries (some of them on tap
layers). The engine's `pp_taps` (engines.base.PPTapPlan) runs its real forward loop stage by stage
(capture, pack into IntermediateTensors slots, the worker's relay, collect on the last rank). The
taps the last stage hands the draft must equal a one-stage run's, bitwise and in the same order;
an engine may instead refuse the plan while setting it up (its own check, with its message: a
result, recorded in the CSV). In prefix-tap mode the one-stage taps must also equal the mirror's
reference loop (engines/mirror/pp.py) bit for bit, so a loop that drops or shifts a tap even on one
stage is caught. Where the engine also hands on its last hidden state (and TokenSpeed its DSpark projection
sum), those must equal the one-stage run's bitwise as well. A plan the engine refuses whole (TokenSpeed cannot
name tap 0, the embeddings) must be refused with the same plan split into stages.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from k3num.engines import mirror
from k3num.engines.base import PPTapPlan, StageRefused
from k3num.fixtures.builders import attn_res_weights
from k3num.fixtures.strategies import seeds
from k3num.fixtures.tensors import Draw
from k3num.oracles.drift import COLLECTOR
from k3num.oracles.records import INFO, Record
from k3num.properties.support import DEVICE, LOW, assert_bitwise

EPS = 1e-5


@st.composite
def pp_plans(draw: st.DrawFn) -> PPTapPlan:
    layers = draw(st.integers(2, 8))
    taps = tuple(sorted(set(draw(st.lists(st.integers(0, layers), min_size=1, max_size=4)))))
    ends = set(draw(st.lists(st.integers(1, layers - 1), max_size=3)))
    on_taps = [t for t in taps if 1 <= t < layers]
    if on_taps and draw(st.booleans()):  # a boundary on a tap layer
        ends.add(draw(st.sampled_from(on_taps)))
    return PPTapPlan(layers, taps, tuple(sorted(ends)), draw(st.integers(1, 3)), draw(st.booleans()))


def _kw(hidden: bool) -> dict[str, bool]:
    """An engine that declares extras["pp_taps_hidden"] also returns what its last stage hands on besides the
    taps (a dict of tensors: the model's last hidden state, the projection sum), judged bitwise too."""
    return {"with_hidden": True} if hidden else {}


def _refused(engine, plan: PPTapPlan, e: BaseException) -> None:
    COLLECTOR.add(Record(
        property="pp_plan_refused", engine=engine.name, engine_version=engine.version, mode=engine.mode,
        real_ops=engine.extras.get("pp_taps_standins", ""), source_sha256="", subject="pp_taps", device=DEVICE,
        dtype="", shape="", reduction_len=0, seed=0, max_abs=math.nan, rel_fro=math.nan, max_ulp=math.nan,
        cosine=math.nan, nonfinite_mismatch=0, worst="", baseline_err=math.nan, budget=math.nan,
        budget_rule="a refusal", ratio=0.0, verdict=INFO, detail=f"{plan};{e}"[:400]))


@given(plan=pp_plans(), tokens=st.integers(1, 3), hidden=st.sampled_from([16, 32]), seed=seeds)
@example(plan=PPTapPlan(6, (0, 2, 4, 6), (3,), 2, False), tokens=1, hidden=16, seed=0)  # lead 1
@example(plan=PPTapPlan(6, (0, 2, 4, 6), (2, 4), 2, False), tokens=1, hidden=16, seed=0)  # boundaries on taps
@example(plan=PPTapPlan(6, (2, 4, 6), (2, 4), 2, True), tokens=2, hidden=16, seed=0)  # AttnRes taps, no tap 0
def test_pp_stages_hand_the_draft_the_one_stage_taps_in_order(engine, plan: PPTapPlan, tokens: int, hidden: int,
                                                              seed: int) -> None:
    pp_taps = engine.extras.get("pp_taps")
    if pp_taps is None:
        pytest.skip(f"engine {engine.name} {engine.version} binds no PP forward loop (extras['pp_taps'])")
    d = Draw.for_device(seed, DEVICE)
    weights = attn_res_weights(d, plan.num_layers, hidden, LOW, DEVICE)
    emb = d.normal((tokens, hidden)).to(LOW).to(DEVICE)
    scale = d.normal((plan.num_layers, hidden)).to(LOW).to(DEVICE)
    hidden = bool(engine.extras.get("pp_taps_hidden"))
    try:
        one = pp_taps(dataclasses.replace(plan, stage_ends=()), emb, weights, scale, EPS, **_kw(hidden))
    except StageRefused as e:  # the plan itself (a tap the engine cannot name): the split must refuse it too
        _refused(engine, plan, e)
        with pytest.raises(StageRefused):
            pp_taps(plan, emb, weights, scale, EPS)
        return
    one, one_state = one if hidden else (one, None)
    assert len(one) == len(plan.taps), f"a one-stage run handed {len(one)} taps for tap layers {plan.taps}"
    if not plan.aux_stream:
        ref = mirror.pp.pp_taps(plan, emb, weights, scale, EPS)
        for k, (got, want) in enumerate(zip(one, ref)):
            assert_bitwise(got, want, f"one-stage tap {plan.taps[k]} (slot {k}) against the mirror's loop")
    try:
        split = pp_taps(plan, emb, weights, scale, EPS, **_kw(hidden))
    except StageRefused as e:
        _refused(engine, plan, e)
        return
    split, split_state = split if hidden else (split, None)
    stages = plan.stages()
    for name in (one_state or {}):  # what else the last stage hands on (the model's last hidden state, ...)
        assert_bitwise(split_state[name], one_state[name], f"{name} after {len(stages)} stages {stages}")
    assert len(split) == len(one), (f"{len(stages)} stages {stages} handed the draft {len(split)} taps; one stage "
                                    f"hands {len(one)} (tap layers {plan.taps})")
    for k, (got, want) in enumerate(zip(split, one)):
        assert_bitwise(got, want, f"tap {plan.taps[k]} (slot {k}) after {len(stages)} stages {stages}")


@given(layers=st.integers(1, 93), block=st.integers(1, 12), stream=st.sampled_from(["prefix", "attn_res"]),
       data=st.data())
def test_exactly_the_consumers_of_captured_attn_res_taps_run_split(engine, layers: int, block: int, stream: str,
                                                                  data) -> None:
    """A tap of the AttnRes stream after layer c is the mixture layer c + 1's attention computes (its mixing
    weights), so layer c + 1 must run its AttnRes split, not through a fused graph that hands out no mixture;
    no other layer needs to, and the prefix stream needs none. The engine names the layers it splits
    (extras["capture_split"]: TokenSpeed's per-layer fallback flag, which only steers CUDA's fused graph)."""
    split_layers = engine.extras.get("capture_split")
    if split_layers is None:
        pytest.skip(f"engine {engine.name} {engine.version} declares no per-layer split for captured taps")
    captured = sorted(data.draw(st.sets(st.integers(0, layers - 1), max_size=min(layers, 8)), label="captured"))
    got = split_layers(layers, block, captured, stream)
    want = [stream == "attn_res" and layer - 1 in captured for layer in range(layers)]
    assert got == want, (f"captured layers {captured} ({stream}): the layers run split are "
                         f"{[i for i, f in enumerate(got) if f]}, the consumers of the taps are "
                         f"{[i for i, f in enumerate(want) if f]}")
