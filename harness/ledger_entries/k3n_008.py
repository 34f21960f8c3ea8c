"""K3N-008: SGLang's model-level aggregation takes its fused path at every hidden size; off the 1024 grid it reads
whole chunks past each row and leaves the columns past the grid unwritten (oracles/ledger.py: the facts)."""

from __future__ import annotations

from k3num.engines import base
from k3num.harness import fixes, ledger_models
from k3num.harness.ledger_cases import LedgerCase
from k3num.harness.ledger_entries import Entry

ENTRY = Entry(
    case=LedgerCase("a hidden size off the 1024 grid (hidden % 1024 != 0)",
                    lambda a: a["hidden"] % ledger_models.GRID != 0,
                    "test_model_aggregation_off_grid_hidden_within_budget_or_refused",
                    {"tokens": 1, "hidden": 96, "nvb": 1, "seed": 0},
                    signature=r"off_path_shape_within_budget \[sglang .*\] attn_res_residual .*elements over budget"),
    model=ledger_models.BugModel((base.ATTN_RES_RESIDUAL,), ledger_models.unwritten_past_the_grid,
                                 "the columns at and past (H // 1024) * 1024 never written, the ones before read over "
                                 "whole 1024-element chunks past the row"),
    # the model's aggregation through the public dispatch (the eager fallback off the grid)
    fix=fixes.Fix("K3N-008", "sglang", ((fixes.SGLANG_ATTN, fixes.aggregate_fused_through_dispatch),), ("sglang",),
                  ("properties/test_off_path_shapes.py::test_model_aggregation_off_grid_hidden_within_budget_or_refused",
                   )),
)
