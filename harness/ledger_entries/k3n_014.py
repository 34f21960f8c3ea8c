"""K3N-014: vLLM's FP8 context-KV cache insert takes a zero or infinite layer scale and writes saturated bytes
without a refusal (oracles/ledger.py: the facts)."""

from __future__ import annotations

import math

from k3num.harness import ledger_models
from k3num.harness.ledger_cases import LedgerCase
from k3num.harness.ledger_entries import Entry

ENTRY = Entry(
    case=LedgerCase("the bad scale is 0 or infinite (a NaN scale poisons every byte, visibly)",
                    lambda a: a["bad"] == 0.0 or math.isinf(a["bad"]),
                    "test_fp8_insert_with_a_zero_or_nonfinite_scale_refuses_or_poisons_visibly",
                    {"seed": 0, "layers": 1, "tokens": 1, "fmt": "fp8_e4m3", "bad": 0.0, "grouped": False},
                    signature=r"scale 0\.0 was taken: \d+ of \d+ bytes in its slots are not NaN",
                    failures={"test_fp8_insert_with_a_zero_or_nonfinite_scale_refuses_or_poisons_visibly":
                              r"^Failed: layer \d+'s scale \S+ was taken: \d+ of \d+ bytes in its slots are not NaN"}),
    model=ledger_models.BugModel((ledger_models.FP8_INSERT,), ledger_models.quotient_saturated,
                                 "every byte of the layer's slots x / scale saturated (+-max for a zero scale, +-0 for "
                                 "an infinite one)"),
)
