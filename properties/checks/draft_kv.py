"""Checks shared by properties/test_draft_kv.py and the property modules that reuse them: no test module
imports another, so they live here (moved from test_draft_kv.py with their bodies unchanged; a name
another module uses is public)."""

from __future__ import annotations

import pytest

from k3num.engines import base
from k3num.fixtures.builders import draft_kv_inputs
from k3num.fixtures.strategies import DraftKVCase
from k3num.harness import judges
from k3num.harness.judges import EPS
from k3num.oracles.records import judge
from k3num.properties.support import LOW, report, subject

MATERIALIZE = "draft_kv_materialize"  # SGLang's DFlash writer, FusedKVMaterializeHelper (an engine extra)


def materializer(engine):
    fn = engine.extras.get(MATERIALIZE)
    if fn is None:
        pytest.skip(f"engine {engine.name} {engine.version} has no DFlash draft-KV materializer to check")
    return fn


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
