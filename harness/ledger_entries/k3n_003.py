"""K3N-003: at the end of a non-final PP stage vLLM's ROCm tap returns the prefix where the NVIDIA path refuses
(oracles/ledger.py: the facts)."""

from __future__ import annotations

from k3num.fixtures.strategies import TapCase
from k3num.harness.ledger_cases import EVERY_TAP, REFUSAL_NO_MODEL, LedgerCase, every
from k3num.harness.ledger_entries import Entry

ENTRY = Entry(
    case=LedgerCase(EVERY_TAP, every, "test_branch3_non_final_stage_raises_when_configured_to",
                    {"case": TapCase(2, 1, 1, 0, 1, 16, 0)}, signature=r"^Failed: DID NOT RAISE",
                    failures={"test_branch3_non_final_stage_raises_when_configured_to": r"^Failed: DID NOT RAISE"},
                    no_model=REFUSAL_NO_MODEL),
)
