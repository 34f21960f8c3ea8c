"""The read-only pre-norm AttnRes mixture (SGLang's aggregate_stream family) against the oracle."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from k3num.engines import base
from k3num.fixtures.strategies import seeds
from k3num.fixtures.tensors import Draw
from k3num.harness import judges
from k3num.harness.judges import EPS
from k3num.oracles.records import judge
from k3num.properties.support import DEVICE, LOW, call, report, subject

SUBJECTS = [base.ATTN_RES_MIX, base.ATTN_RES_MIX_TRITON, base.ATTN_RES_MIX_EAGER]


@pytest.mark.parametrize("hidden", [64, 1024])
@pytest.mark.parametrize("name", SUBJECTS)
@given(tokens=st.integers(1, 4), nvb=st.integers(0, 8), seed=seeds)
def test_read_only_mixture_within_rounding_budget_of_oracle(engine, name: str, hidden: int, tokens: int, nvb: int,
                                                            seed: int) -> None:
    check_read_only_mixture(engine, name, tokens, hidden, nvb, seed, DEVICE)


def check_read_only_mixture(engine, name: str, tokens: int, hidden: int, nvb: int, seed: int, device: str) -> None:
    """Mix nvb of 8 bank rows plus the prefix (tokens x hidden, bf16) on `device`; judge against the
    oracle and require the inputs unchanged."""
    fn = subject(engine, name)
    d = Draw.for_device(seed, device)
    prefix, bank = d.normal((tokens, hidden)).to(LOW), d.normal((tokens, 8, hidden)).to(LOW)
    norm, proj = d.positive((hidden,)).to(LOW), d.normal((hidden,), hidden**-0.5).to(LOW)
    before = (prefix.clone(), bank.clone())
    out = call(engine, fn, prefix, bank, nvb, norm, proj, EPS)
    want, budget = judges.read_only_mixture(engine, name, prefix, bank, nvb, norm, proj, EPS)
    report(judge(property="read_only_mixture_within_rounding_budget", engine=engine, subject=name, actual=out,
                 reference=want, budget=budget, seed=seed, reduction_len=hidden, detail=f"nvb={nvb}"))
    assert torch.equal(prefix, before[0]) and torch.equal(bank, before[1]), "a read-only mixture wrote its inputs"
