"""Properties of the DSpark MLA context-KV path (fused and unfused subjects, the cache write)."""

from __future__ import annotations

from hypothesis import given

from k3num.engines import base
from k3num.fixtures.builders import CACHE_LAYOUTS, context_kv_inputs
from k3num.fixtures.strategies import ContextKVCase, context_kv_cases
from k3num.harness import judges
from k3num.harness.judges import EPS
from k3num.oracles.records import judge
from k3num.properties.checks.context_kv import (
    check_cache_slots,
    check_fused_within_budget_of_unfused,
    check_layer_output_depends_only_on_its_rows,
    check_layer_outputs_follow_their_row_block,
    check_no_slot_mapping_writes_nothing,
)
from k3num.properties.support import DEVICE, LOW, report, subject


@given(case=context_kv_cases())
def test_fused_context_kv_within_budget_of_unfused_baseline(engine, case: ContextKVCase) -> None:
    check_fused_within_budget_of_unfused(engine, case, DEVICE)


@given(case=context_kv_cases())
def test_unfused_context_kv_within_rounding_budget_of_oracle(engine, case: ContextKVCase) -> None:
    unfused = subject(engine, base.CONTEXT_KV_UNFUSED)
    inp = context_kv_inputs(case, LOW, DEVICE)
    kv_c, k_pe = unfused(inp.x, inp.fused_qkv_a, inp.norm, inp.positions, case.rope, EPS)
    want = judges.unfused_context_kv(inp.x, inp.fused_qkv_a, inp.norm, inp.positions, case.rope, EPS)
    for name, out in (("kv_c", kv_c), ("k_pe", k_pe)):
        report(judge(property="unfused_within_rounding_budget", engine=engine, subject=base.CONTEXT_KV_UNFUSED,
                     actual=out, reference=want[name].reference, budget=want[name].budget, seed=case.seed,
                     reduction_len=want[name].reduction_len, detail=name))


@given(case=context_kv_cases(min_layers=2))
def test_layer_outputs_follow_their_row_block_of_the_merged_weight(engine, case: ContextKVCase) -> None:
    check_layer_outputs_follow_their_row_block(engine, case, DEVICE)


@given(case=context_kv_cases(min_layers=2))
def test_layer_output_depends_on_nothing_but_its_own_rows(engine, case: ContextKVCase) -> None:
    check_layer_output_depends_only_on_its_rows(engine, case, DEVICE)


@given(case=context_kv_cases())
def test_no_slot_mapping_writes_nothing(engine, case: ContextKVCase) -> None:
    check_no_slot_mapping_writes_nothing(engine, case, DEVICE, CACHE_LAYOUTS[case.seed % 2])


@given(case=context_kv_cases())
def test_cache_slot_lands_at_block_and_offset_and_nothing_else_changes(engine, case: ContextKVCase) -> None:
    check_cache_slots(engine, case, DEVICE, CACHE_LAYOUTS[(case.seed // 2) % 2])


