"""The sharded-projection budget's declared-rounding terms cover what they claim and hide no real error.

TokenSpeed rounds each tap's projection to bf16 before summing (declared in its adapter's
extras["projection_roundings"]). On cancelling taps that rounding is u * |p_i|, far above the one
rounding u * |sum| of the unsharded baseline: the accuracy property, which counts the declared
terms, passes there, while a subject that drops a tap still fails it. (Without the declared terms
the same inputs fail: properties/test_partial_projection.py, ledger K3N-006.)
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from k3num.engines import registry
from k3num.fixtures.builders import ProjectionInputs, cancelling_projection_inputs, projection_inputs
from k3num.fixtures.strategies import ProjectionCase
from k3num.oracles.drift import COLLECTOR
from k3num.properties.checks.partial_projection import check_sharded_within_budget_of_unsharded

LOW = torch.bfloat16
CASE = ProjectionCase(taps=2, tokens=4, hidden=64, hidden_out=32, stages=((0, 1),), order=(0,), seed=3,
                      scale=1.0, outliers=0.0)


@pytest.fixture(scope="module")
def tokenspeed():
    try:
        return registry.get("tokenspeed")
    except registry.EngineUnavailable as e:
        pytest.skip(f"engine tokenspeed unavailable: {e}")


@pytest.fixture(autouse=True)
def _keep_out_of_the_drift_report():
    """These records judge hand-built subjects, not an engine: keep them out of the session's CSV."""
    n = len(COLLECTOR.records)
    yield
    del COLLECTOR.records[n:]


def _cancelling_inputs() -> ProjectionInputs:
    return cancelling_projection_inputs(CASE, LOW, "cpu")


def test_per_tap_rounding_of_tokenspeed_passes_with_its_declared_terms(tokenspeed) -> None:
    check_sharded_within_budget_of_unsharded(tokenspeed, CASE, "fp32", "cpu", _cancelling_inputs())


def test_declared_terms_still_catch_a_dropped_tap(tokenspeed) -> None:
    from k3num.engines import base

    partial = tokenspeed.subject(base.STAGE_PARTIAL)
    dropping = dataclasses.replace(tokenspeed, subjects={**tokenspeed.subjects,
                                                         base.STAGE_PARTIAL: lambda t, f, m: partial(t, f, m[:-1])})
    inp = projection_inputs(CASE, LOW, "cpu")  # no cancellation: a dropped tap is an O(1) error
    with pytest.raises(AssertionError, match="sharded_within_budget_of_unsharded"):
        check_sharded_within_budget_of_unsharded(dropping, CASE, "fp32", "cpu", inp)
