"""Properties of the DFlash draft context K/V (the follow-on of the projected taps)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from k3num.engines import base
from k3num.fixtures.builders import draft_kv_inputs
from k3num.fixtures.strategies import DraftKVCase, draft_kv_cases
from k3num.harness import judges
from k3num.harness.judges import EPS
from k3num.oracles.records import judge
from k3num.properties.support import DEVICE, LOW, report, subject


@given(case=draft_kv_cases())
def test_draft_context_kv_within_rounding_budget_of_oracle(engine, case: DraftKVCase) -> None:
    check_draft_kv_within_rounding_budget(engine, case, DEVICE)


MATERIALIZE = "draft_kv_materialize"  # SGLang's DFlash writer, FusedKVMaterializeHelper (an engine extra)


def materializer(engine):
    fn = engine.extras.get(MATERIALIZE)
    if fn is None:
        pytest.skip(f"engine {engine.name} {engine.version} has no DFlash draft-KV materializer to check")
    return fn


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


def check_draft_kv_within_rounding_budget(engine, case: DraftKVCase, device: str, draft=None,
                                          name: str = base.DRAFT_CONTEXT_KV, eps: float | tuple = EPS) -> None:
    """Draft context K (norm + rope) and V of every layer against the oracle, each within its budget."""
    draft = draft if draft is not None else subject(engine, base.DRAFT_CONTEXT_KV)
    inp = draft_kv_inputs(case, LOW, device)
    k, v = draft(inp.ctx, inp.k_weight, inp.v_weight, inp.k_norm, inp.positions, case.rope, eps)
    want = judges.draft_context_kv(inp.ctx, inp.k_weight, inp.v_weight, inp.k_norm, inp.positions, case.rope, eps)
    for name, out in (("k", k), ("v", v)):
        report(judge(property="draft_kv_within_rounding_budget", engine=engine, subject=name,
                     actual=out, reference=want[name].reference, budget=want[name].budget, seed=case.seed,
                     reduction_len=want[name].reduction_len, detail=name))
