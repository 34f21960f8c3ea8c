"""K3N-002: vLLM's ROCm tap after the last layer returns the prefix sum where the output mixture belongs (the
cause of K3N-001; oracles/ledger.py: the facts). Its fix is K3N-001's (one edit fixes both)."""

from __future__ import annotations

from k3num.engines import base
from k3num.fixtures.strategies import TapCase
from k3num.harness import ledger_models
from k3num.harness.ledger_cases import EVERY_TAP, LedgerCase, every
from k3num.harness.ledger_entries import Entry

ENTRY = Entry(
    case=LedgerCase(EVERY_TAP, every, "test_branch2_tap_on_the_last_rank_mixes_with_the_output_weights",
                    {"case": TapCase(2, 1, 1, 0, 1, 16, 0)},
                    signature=r"AssertionError: branch2_output_mixture \[vllm-rocm .*\] aux_capture "),
    model=ledger_models.BugModel((base.AUX_CAPTURE,), ledger_models.tap_returns_the_prefix,
                                 "the tap returns bf16(prefix_sum + pending) where the output mixture belongs"),
)
