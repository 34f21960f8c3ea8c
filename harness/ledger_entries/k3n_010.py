"""K3N-010: vLLM's ROCm attn_res wrapper accepts bank indices outside the bank, as K3N-009's NVIDIA one does
(oracles/ledger.py: the facts). Its fix is K3N-009's."""

from __future__ import annotations

from k3num.harness.ledger_cases import EVERY_BANK, REFUSAL_NO_MODEL, LedgerCase, every
from k3num.harness.ledger_entries import Entry

ENTRY = Entry(
    case=LedgerCase(EVERY_BANK, every, "test_attn_res_bank_indices_outside_the_bank_are_refused",
                    {"bank": 2, "over": 1, "which": "num_blocks", "seed": 0},
                    signature=r"^Failed: vllm-rocm accepted (num_blocks|block_write_idx)=\d+ with a bank of \d+ rows",
                    failures={"test_attn_res_bank_indices_outside_the_bank_are_refused":
                              r"^Failed: vllm-rocm accepted (num_blocks|block_write_idx)=\d+ with a bank of \d+ rows"},
                    no_model=REFUSAL_NO_MODEL),
)
