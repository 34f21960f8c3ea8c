"""Which PP stage produces a target tap (TokenSpeed `_context_tap_owner_layer`), against the wiring
of the aux tap: an AttnRes tap after layer i mixes with layer i + 1's attention-side weights
(branch 1), or with the output pair after the last layer (branch 2, on the last stage)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st


def _owner(engine):
    fn = engine.extras.get("tap_owner")
    if fn is None:
        pytest.skip(f"engine {engine.name} {engine.version} has no tap-ownership rule to check")
    return fn


@st.composite
def stage_windows(draw: st.DrawFn) -> tuple[int, list[tuple[int, int]]]:
    """A layer count and a partition of its layers into consecutive non-empty PP stage windows."""
    num_layers = draw(st.integers(1, 93))
    cuts = sorted(draw(st.sets(st.integers(1, num_layers - 1), max_size=min(7, num_layers - 1)))) \
        if num_layers > 1 else []
    bounds = [0, *cuts, num_layers]
    return num_layers, list(zip(bounds, bounds[1:]))


@given(windows=stage_windows(), data=st.data())
def test_attn_res_tap_is_produced_by_the_stage_holding_its_mixing_weights(engine, windows, data) -> None:
    owner = _owner(engine)
    num_layers, stages = windows
    # the final tap (branch 2: the output pair on the last stage) half the time: 1 in num_layers is too rare
    layer = data.draw(st.one_of(st.just(num_layers - 1), st.integers(0, num_layers - 1)))
    consumer = layer + 1 if layer + 1 < num_layers else num_layers - 1  # branch 1, else the output pair
    stage_of = next(s for s, (lo, hi) in enumerate(stages) if lo <= consumer < hi)
    got = owner(layer, num_layers, "attn_res")
    lo, hi = stages[stage_of]
    assert lo <= got < hi, (
        f"tap after layer {layer}: owner layer {got} is not on the stage holding layer {consumer}'s weights")
    if layer + 1 == num_layers:
        assert stages[stage_of][1] == num_layers, "the final tap must come from the last stage"


@given(num_layers=st.integers(1, 93), data=st.data())
def test_prefix_tap_is_produced_by_its_own_layer(engine, num_layers, data) -> None:
    owner = _owner(engine)
    layer = data.draw(st.integers(0, num_layers - 1))
    assert owner(layer, num_layers, "prefix") == layer


STREAMS = ("prefix", "attn_res")
# names beside the two streams on both sides of them in string order (a `>=` for an `==` on "prefix" passes
# every name below it) and arbitrary text
unknown_streams = st.one_of(st.sampled_from(["post_norm", "residual", "prefix_sum", "attn", "Prefix", "", "z"]),
                            st.text(max_size=12)).filter(lambda s: s not in STREAMS)


@given(stream=unknown_streams)
def test_unknown_stream_is_refused(engine, stream: str) -> None:
    owner = _owner(engine)
    with pytest.raises(ValueError):
        owner(3, 10, stream)
