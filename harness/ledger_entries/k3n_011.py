"""K3N-011: vLLM's merged block-FP8 context-KV loader misplaces block scales where a layer's width is not whole
128-row blocks (oracles/ledger.py: the facts)."""

from __future__ import annotations

from k3num.harness import ledger_models
from k3num.harness.ledger_cases import (
    CHECKPOINT_TEST,
    K3_WIDTH,
    CheckpointRule,
    LedgerCase,
    block_fp8_not_whole_blocks,
)
from k3num.harness.ledger_entries import Entry

ENTRY = Entry(
    case=LedgerCase("shards that are not whole blocks (width % 128 != 0) and a second layer to misplace",
                    lambda a: a["width"] % 128 != 0 and a["layers"] >= 2,
                    "test_block_fp8_merged_shards_dequantize_to_the_per_layer_weights",
                    {"layers": 5, "width": K3_WIDTH, "hidden": 256, "data": None, "seed": 0},
                    # the reproducer's rows wrong per layer (its `what`); the model below judges the bytes loaded
                    signature=r"differs from the per-layer weights in \[0, 320, 0, 320, 0\] rows per layer",
                    # the misplaced rows; or, with an even number of layers, the last layer's scale rows placed
                    # at ceil(576 (L-1) / 128) for ceil(576 / 128) rows run past the merged scale's
                    # ceil(576 L / 128) (L = 2: start 5 + length 5 > 9) and the loader's narrow raises
                    failures={"test_block_fp8_merged_shards_dequantize_to_the_per_layer_weights":
                              r"^AssertionError: .*: dequantized as the block GEMM reads it, the merged weight differs "
                              r"from the per-layer weights in \[[0-9, ]+\] rows per layer"
                              r"|^RuntimeError: start \(\d+\) \+ length \(\d+\) exceeds dimension size \(\d+\)\.",
                              CHECKPOINT_TEST: r"^AssertionError: .*: dequantized as the GEMM reads it, the merged "
                                               r"weight differs from the checkpoint's per-layer weights in \[[0-9, ]+\]"
                                               r" rows per layer|^RuntimeError: start \(\d+\) \+ length \(\d+\) "
                                               r"exceeds dimension size \(\d+\)\."}),
    model=ledger_models.BugModel((ledger_models.BLOCK_FP8_MERGE,), ledger_models.scales_placed_by_rounding_up,
                                 "each layer's scale rows placed at ceil(W l / 128) in arrival order (the later "
                                 "layer's in a shared row), or the narrow's error where they run past"),
    checkpoint=CheckpointRule(CHECKPOINT_TEST, block_fp8_not_whole_blocks,
                              "vLLM 0.33.0 would load this block-FP8 draft's merged context-KV weight with block "
                              "scales misplaced (its per-layer width is not a multiple of 128): some layers' context "
                              "KV would come from wrongly scaled rows"),
)
