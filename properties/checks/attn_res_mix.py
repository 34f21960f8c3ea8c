"""Checks shared by properties/test_attn_res_mix.py and the property modules that reuse them: no test module
imports another, so they live here (moved from test_attn_res_mix.py with their bodies unchanged; a name
another module uses is public)."""

from __future__ import annotations

import torch

from k3num.engines import base
from k3num.fixtures.tensors import Draw
from k3num.harness import judges
from k3num.harness.judges import EPS
from k3num.oracles.records import judge
from k3num.properties.support import LOW, call, report, subject

SUBJECTS = [base.ATTN_RES_MIX, base.ATTN_RES_MIX_TRITON, base.ATTN_RES_MIX_EAGER]


def check_read_only_mixture(engine, name: str, tokens: int, hidden: int, nvb: int, seed: int, device: str,
                            proj_scale: float = 1.0, prop: str = "read_only_mixture_within_rounding_budget") -> None:
    """Mix nvb of 8 bank rows plus the prefix (tokens x hidden, bf16) on `device`; judge against the
    oracle and require the inputs unchanged. `proj_scale` multiplies the drawn score projection (the
    softmax's scores scale with it)."""
    fn = subject(engine, name)
    d = Draw.for_device(seed, device)
    prefix, bank = d.normal((tokens, hidden)).to(LOW), d.normal((tokens, 8, hidden)).to(LOW)
    norm, proj = d.positive((hidden,)).to(LOW), d.normal((hidden,), hidden**-0.5).to(LOW)
    if proj_scale != 1.0:
        proj = (proj.double() * proj_scale).to(LOW)
    before = (prefix.clone(), bank.clone())
    out = call(engine, fn, prefix, bank, nvb, norm, proj, EPS)
    want, budget = judges.read_only_mixture(engine, name, prefix, bank, nvb, norm, proj, EPS)
    report(judge(property=prop, engine=engine, subject=name, actual=out,
                 reference=want, budget=budget, seed=seed, reduction_len=hidden,
                 detail=f"nvb={nvb}" + (f";proj_scale={proj_scale:g}" if proj_scale != 1.0 else "")))
    assert torch.equal(prefix, before[0]) and torch.equal(bank, before[1]), "a read-only mixture wrote its inputs"
