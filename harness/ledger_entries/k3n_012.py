"""K3N-012: vLLM's merged NVFP4 context-KV loader keeps one per-tensor scale where the layers carry their own
(oracles/ledger.py: the facts)."""

from __future__ import annotations

from k3num.harness import ledger_models
from k3num.harness.ledger_cases import CHECKPOINT_TEST, K3_WIDTH, CheckpointRule, LedgerCase, nvfp4_per_layer_scales
from k3num.harness.ledger_entries import Entry

ENTRY = Entry(
    case=LedgerCase("per-layer scales (not shared) and a second layer to rescale",
                    lambda a: not a["shared"] and a["layers"] >= 2,
                    "test_nvfp4_merged_shards_dequantize_to_the_per_layer_weights",
                    {"layers": 5, "width": K3_WIDTH, "shared": False, "data": None, "seed": 0,
                     "naming": "compressed-tensors"},
                    signature=r"differs from the per-layer weights in \[0, 576, 576, 576, 576\] rows per layer",
                    failures={"test_nvfp4_merged_shards_dequantize_to_the_per_layer_weights":
                              r"^AssertionError: .*: dequantized as the NVFP4 GEMM reads it, the merged weight "
                              r"differs from the per-layer weights in \[[0-9, ]+\] rows per layer",
                              CHECKPOINT_TEST: r"^AssertionError: .*: dequantized as the GEMM reads it, the merged "
                                               r"weight differs from the checkpoint's per-layer weights in \[[0-9, ]+\]"
                                               r" rows per layer"}),
    model=ledger_models.BugModel((ledger_models.NVFP4_MERGE,), ledger_models.one_multiplier_kept,
                                 "one per-tensor multiplier kept, one of the layers' own: the others loaded rescaled"),
    checkpoint=CheckpointRule(CHECKPOINT_TEST, nvfp4_per_layer_scales,
                              "vLLM 0.33.0 would keep one per-tensor scale for this NVFP4 draft's merged context-KV "
                              "weight while its layers carry their own: every layer but one is loaded rescaled"),
)
