"""K3N-007: vLLM's ROCm attn_res kernel reads the prefix back after its own in-place store of prefix + delta
(oracles/ledger.py: the facts). A race on the GPU; its model explains every raced output."""

from __future__ import annotations

from k3num.engines import base
from k3num.fixtures.strategies import DELTA_OVER_FOUR_SOURCES
from k3num.harness import fixes, ledger_models
from k3num.harness.ledger_cases import LedgerCase, delta_race
from k3num.harness.ledger_entries import Entry

ENTRY = Entry(
    case=LedgerCase("a delta with the 4-source tile: num_blocks >= 2, fewer than 256 tokens", delta_race,
                    "test_attn_res_repeated_calls_are_bitwise_identical", {"case": DELTA_OVER_FOUR_SOURCES},
                    call=base.ATTN_RES,
                    signature=r"deterministic_across_calls \[vllm-rocm .*\] attn_res .*distinct of"),
    model=ledger_models.BugModel((base.ATTN_RES,), ledger_models.delta_applied_twice,
                                 "the prefix source read back after the kernel's own store: a set of 32-element "
                                 "segments with the delta applied twice"),
    # a barrier before the in-place store of prefix + delta
    fix=fixes.Fix("K3N-007", "vllm", ((fixes.ROCM_ATTN_RES, fixes.barrier_before_prefix_store),), ("vllm-rocm",),
                  ("properties/test_attn_res.py::test_attn_res_within_rounding_budget_of_oracle",
                   "properties/test_determinism.py::test_attn_res_in_place_prefix_rewrite_is_deterministic"),
                  gpu=True),
)
