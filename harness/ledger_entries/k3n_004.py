"""K3N-004: vLLM's NVIDIA attn_res kernel races when it writes a bank row inside the mixed rows without a delta
(oracles/ledger.py: the facts). A race: a repeat of the same call tells it from a one-off, so the reproducer is
the repeat property (152 calls on the GPU), where it fails 7 calls in 200."""

from __future__ import annotations

from k3num.engines import base
from k3num.fixtures.strategies import WRITE_IN_THE_MIX
from k3num.harness import fixes
from k3num.harness.ledger_cases import RACE_NO_MODEL, LedgerCase, write_race
from k3num.harness.ledger_entries import Entry

ENTRY = Entry(
    case=LedgerCase("a bank write inside [0, num_blocks), no delta (the barrier is emitted under HAS_DELTA only)",
                    write_race, "test_attn_res_repeated_calls_are_bitwise_identical", {"case": WRITE_IN_THE_MIX},
                    call=base.ATTN_RES, signature=r"deterministic_across_calls \[vllm .*\] attn_res .*distinct of",
                    # the rounding contract's own message (properties/test_rounding_contracts.py); the other
                    # tests fail as judged properties (ledger_cases.JUDGED)
                    failures={"test_attn_res_rounds_only_where_its_code_says":
                              r"^AssertionError: vllm \S+ AttnResCase\(.*\): attn_res rounds where its code does not "
                              r"say it does: "},
                    no_model=RACE_NO_MODEL),
    # the barrier under HAS_DELTA or WRITE_BLOCK, in both kernels (K3N-005 too)
    fix=fixes.Fix("K3N-004/005", "vllm", ((fixes.VLLM_ATTN_RES, fixes.barrier_under_write_block),
                                          (fixes.ROCM_ATTN_RES, fixes.barrier_under_write_block)),
                  ("vllm", "vllm-rocm"),
                  ("properties/test_attn_res.py::test_a_block_written_in_the_call_is_mixed_with_its_written_value",),
                  gpu=True),
)
