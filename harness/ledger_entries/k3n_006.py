"""K3N-006: TokenSpeed rounds every tap's projection to bf16 before the fp32 stage sum, and the sum to bf16 before
the norm (oracles/ledger.py: the facts)."""

from __future__ import annotations

from k3num.engines import base
from k3num.fixtures.strategies import ProjectionCase
from k3num.harness import ledger_models
from k3num.harness.ledger_cases import LedgerCase, every
from k3num.harness.ledger_entries import Entry

ENTRY = Entry(
    case=LedgerCase("every case: the test's taps cancel by construction, and every tap's projection is rounded to "
                    "bf16", every, "test_sharded_adds_no_rounding_beyond_its_partials_when_taps_cancel",
                    {"case": ProjectionCase(taps=2, tokens=1, hidden=16, hidden_out=16, stages=((0, 1),), order=(0,),
                                            seed=0, scale=0.01, outliers=0.0),
                     "transfer": "fp32"},
                    signature=r"AssertionError: sharded_adds_no_rounding_when_taps_cancel \[tokenspeed "),
    model=ledger_models.BugModel((base.STAGE_PARTIAL, base.FINALIZE_PROJECTION),
                                 ledger_models.tap_projections_rounded_to_bf16,
                                 "each tap's projection rounded to bf16, summed in float32; the sum rounded to bf16 "
                                 "before the norm"),
)
