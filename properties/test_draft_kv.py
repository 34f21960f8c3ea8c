"""Properties of the DFlash draft context K/V (the follow-on of the projected taps)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from k3num.fixtures.strategies import DraftKVCase, draft_kv_cases
from k3num.harness.judges import EPS
from k3num.properties.checks.draft_kv import MATERIALIZE, check_draft_kv_within_rounding_budget, materializer
from k3num.properties.support import DEVICE


@given(case=draft_kv_cases())
def test_draft_context_kv_within_rounding_budget_of_oracle(engine, case: DraftKVCase) -> None:
    check_draft_kv_within_rounding_budget(engine, case, DEVICE)


# each draft layer's k_norm has its own epsilon (FusedKVMaterializeHelper stacks them into eps_values [L]):
# drawn per layer from values far enough apart that a layer normed with another's shows
LAYER_EPS = (1e-6, 1e-2, 0.25)


@given(case=draft_kv_cases(styles=("neox",)), per_layer_eps=st.booleans())
def test_dflash_materialized_kv_within_rounding_budget_of_oracle(engine, case: DraftKVCase,
                                                                  per_layer_eps: bool) -> None:
    """DFlash's materializer (one GEMM over every layer, then per-head K RMSNorm and NeoX RoPE, partial
    rotary included) against the same oracle and budget as the DSpark writer: every layer's K and V, with
    one epsilon for every layer or one per layer."""
    eps = tuple(LAYER_EPS[(case.seed + i) % len(LAYER_EPS)] for i in range(case.num_layers)) if per_layer_eps \
        else EPS
    check_draft_kv_within_rounding_budget(engine, case, DEVICE, materializer(engine), MATERIALIZE, eps)


