"""K3N-001: vLLM's ROCm aux tap returns the prefix sum, whatever the stream flag, where branch 1 (a tap taken on
the stage that holds the next layer) mixes with that layer's weights (oracles/ledger.py: the facts)."""

from __future__ import annotations

from k3num.engines import base
from k3num.fixtures.strategies import TapCase
from k3num.harness import fixes, ledger_models
from k3num.harness.ledger_cases import EVERY_TAP, LedgerCase, every
from k3num.harness.ledger_entries import Entry

ENTRY = Entry(
    case=LedgerCase(EVERY_TAP, every, "test_branch1_tap_mixes_with_the_next_layers_weights_and_blocks",
                    {"case": TapCase(2, 1, 2, 0, 1, 16, 0)},
                    signature=r"AssertionError: branch1_next_layer_mixture \[vllm-rocm .*\] aux_capture "),
    model=ledger_models.BugModel((base.AUX_CAPTURE,), ledger_models.tap_returns_the_prefix,
                                 "the tap returns bf16(prefix_sum + pending) where the next layer's mixture belongs"),
    # the tap mixes on ROCm as on NVIDIA (K3N-002 too: one edit); the token properties run around it
    fix=fixes.Fix("K3N-001/002", "vllm", ((fixes.ROCM_LINEAR, fixes.rocm_tap_mixes_the_next_layer),), ("vllm-rocm",),
                  ("properties/test_aux_tap.py::test_branch1_tap_mixes_with_the_next_layers_weights_and_blocks",
                   "properties/test_aux_tap.py::test_branch2_tap_on_the_last_rank_mixes_with_the_output_weights"),
                  around=("test_a_decided_token_never_flips", "test_a_block_without_a_near_tie_is_accepted_whole")),
    # a second bug on vllm-rocm, where this entry owns the token properties: judged around its fix
    plants=(fixes.Fix("rocm-score-unnormalized", "vllm", ((fixes.ROCM_ATTN_RES, fixes.score_without_source_rms),),
                      ("vllm-rocm+fix-K3N-001",), ("properties/test_draft_tokens.py",)),),
)
