"""K3N-005: the write race of K3N-004 in vLLM's ROCm attn_res kernel (oracles/ledger.py: the facts). Its fix is
K3N-004's (one edit, both kernels)."""

from __future__ import annotations

from k3num.engines import base
from k3num.fixtures.strategies import WRITE_IN_THE_MIX_UNIT
from k3num.harness.ledger_cases import RACE_NO_MODEL, LedgerCase, write_race
from k3num.harness.ledger_entries import Entry

ENTRY = Entry(
    case=LedgerCase("a bank write inside [0, num_blocks), no delta (the NVIDIA kernel's race, in the ROCm kernel)",
                    write_race, "test_attn_res_repeated_calls_are_bitwise_identical", {"case": WRITE_IN_THE_MIX_UNIT},
                    call=base.ATTN_RES,
                    signature=r"deterministic_across_calls \[vllm-rocm .*\] attn_res .*distinct of",
                    no_model=RACE_NO_MODEL),
)
