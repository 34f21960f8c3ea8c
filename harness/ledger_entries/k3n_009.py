"""K3N-009: vLLM's NVIDIA attn_res wrapper accepts bank indices outside the bank (oracles/ledger.py: the facts)."""

from __future__ import annotations

from k3num.harness import fixes
from k3num.harness.ledger_cases import EVERY_BANK, REFUSAL_NO_MODEL, LedgerCase, every
from k3num.harness.ledger_entries import Entry

ENTRY = Entry(
    case=LedgerCase(EVERY_BANK, every, "test_attn_res_bank_indices_outside_the_bank_are_refused",
                    {"bank": 2, "over": 1, "which": "num_blocks", "seed": 0},
                    signature=r"^Failed: vllm accepted (num_blocks|block_write_idx)=\d+ with a bank of \d+ rows",
                    failures={"test_attn_res_bank_indices_outside_the_bank_are_refused":
                              r"^Failed: vllm accepted (num_blocks|block_write_idx)=\d+ with a bank of \d+ rows"},
                    no_model=REFUSAL_NO_MODEL),
    # both wrappers refuse indices outside the bank (K3N-010 too)
    fix=fixes.Fix("K3N-009/010", "vllm", ((fixes.VLLM_ATTN_RES, fixes.refuse_bank_indices_outside_the_bank),
                                          (fixes.ROCM_ATTN_RES, fixes.refuse_bank_indices_outside_the_bank)),
                  ("vllm", "vllm-rocm"),
                  ("properties/test_off_path_shapes.py::test_attn_res_bank_indices_outside_the_bank_are_refused",)),
)
