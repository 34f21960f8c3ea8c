"""K3N-013: SGLang's disaggregated KV transfer plans a flat copy where the prefill's and the decode's heads per
rank differ and the decode's item lengths are not published (oracles/ledger.py: the facts)."""

from __future__ import annotations

from k3num.fixtures.strategies import SEED_003_TRANSFER
from k3num.harness import ledger_models
from k3num.harness.ledger_cases import LedgerCase, heads_differ
from k3num.harness.ledger_entries import Entry

ENTRY = Entry(
    case=LedgerCase("the prefill's and the decode's KV heads per rank differ and the decode's item lengths are not "
                    "published to the sender (the worker's send_kvcache path)",
                    lambda a: heads_differ(a["case"]) and not a["case"].publish_lens,
                    "test_kv_transfer_copies_exactly_the_head_aware_plan_or_is_refused",
                    {"case": SEED_003_TRANSFER},
                    # the flat plan's first entry (src, dst, length): seed 003's numbers
                    signature=r"planned \[\(1000000, 2065536, 32768\)",
                    failures={"test_kv_transfer_copies_exactly_the_head_aware_plan_or_is_refused":
                              r"^AssertionError: .*: (not refused and )?planned \[\(\d+, \d+, \d+\)"}),
    model=ledger_models.BugModel((ledger_models.KV_TRANSFER,), ledger_models.flat_copy_planned,
                                 "the flat plan: each page copied whole at the source's page size"),
)
