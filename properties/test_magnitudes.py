"""Magnitudes the field reports: massive activations, rows whose norm an eps dominates, sources of mixed scale.

The other properties draw sources near N(0, 1) with about 1% of entries x30 or x100. K3's residual stream, like
every large LLM's, carries massive activations: a few fixed feature dimensions on a few tokens, "e.g., 100,000
times larger" than the rest (Sun et al., "Massive Activations in Large Language Models", COLM 2024,
arXiv:2402.17762). AttnRes mixes those rows with their RMS-normed scores, and an RMSNorm's eps decides a row whose
mean square is below it. Each profile reshapes the drawn sources, in float64, before the one rounding to storage:

- massive: two fixed channels of every source row (the prefix, the delta, each bank row) times 1e3, 1e4 or 1e5;
- tiny: some sources' rows times 1e-4 (mean square about 1e-8, three decades below eps = 1e-5, so the score is
  eps's and not the row's), among rows at full scale;
- mixed: each source its own scale, from 1e-3, 1 and 1e3 (the bank's old blocks against a fresh prefix).

The oracle stays float64 and the budgets are the accuracy properties' own, derived from the same inputs, so they
follow the magnitudes; nothing is widened here.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from k3num.engines import base
from k3num.fixtures.builders import AttnResInputs, attn_res_inputs
from k3num.fixtures.strategies import AttnResCase, attn_res_cases, seeds
from k3num.fixtures.tensors import Draw
from k3num.harness import judges
from k3num.harness.judges import EPS, attn_res_oracle
from k3num.oracles.records import judge
from k3num.properties.checks.attn_res import as_admitted, call_attn_res
from k3num.properties.checks.attn_res_mix import SUBJECTS
from k3num.properties.support import DEVICE, LOW, call, report, subject

PROFILES = ("massive", "tiny", "mixed")
MASSIVE = (1e3, 1e4, 1e5)
TINY = 1e-4
MIXED = (1e-3, 1.0, 1e3)


def _scales(profile: str, tokens: int, sources: int, hidden: int, seed: int) -> torch.Tensor:
    """[T, S, H] float64 factors for the sources (bank rows 0..S-2, then the prefix) under `profile`."""
    g = torch.Generator().manual_seed(seed)
    f = torch.ones(tokens, sources, hidden, dtype=torch.float64)
    if profile == "massive":
        channels = torch.randperm(hidden, generator=g)[:2]
        f[:, :, channels] = MASSIVE[int(torch.randint(len(MASSIVE), (1,), generator=g))]
    elif profile == "tiny":
        tiny = torch.rand(tokens, sources, generator=g) < 0.5
        f[tiny] = TINY
    elif profile == "mixed":
        pick = torch.randint(len(MIXED), (sources,), generator=g)
        f *= torch.tensor(MIXED, dtype=torch.float64)[pick][None, :, None]
    else:
        raise ValueError(f"profile: expected one of {PROFILES}, got {profile!r}")
    return f


def _shape(x: torch.Tensor, f: torch.Tensor) -> torch.Tensor:
    return (x.double() * f.to(x.device)).to(x.dtype)


@given(case=attn_res_cases(num_blocks=lambda bank: st.integers(1, bank)), profile=st.sampled_from(PROFILES))
def test_attn_res_within_budget_at_massive_tiny_and_mixed_magnitudes(engine, case: AttnResCase, profile: str) -> None:
    """The model's calls (no write inside the mix), at least one block beside the prefix, their sources reshaped by
    `profile`: within the accuracy property's budget of the float64 oracle."""
    if 0 <= case.block_write_idx < case.num_blocks:
        case = dataclasses.replace(case, block_write_idx=case.num_blocks if case.num_blocks < case.bank else -1)
    case = as_admitted(engine, case)
    inp = attn_res_inputs(case, LOW, DEVICE)
    f = _scales(profile, case.tokens, case.bank + 1, case.hidden, case.seed)
    inp = dataclasses.replace(inp, blocks=_shape(inp.blocks, f[:, :-1]), prefix=_shape(inp.prefix, f[:, -1]),
                              delta=None if inp.delta is None else _shape(inp.delta, f[:, -1]))
    _judge_attn_res(engine, case, inp, profile)


def _judge_attn_res(engine, case: AttnResCase, inp: AttnResInputs, profile: str) -> None:
    want, budget = attn_res_oracle(engine, inp.prefix, inp.delta, inp.blocks, inp.norm, inp.qk, inp.out_norm,
                                   case.num_blocks, case.block_write_idx)
    out = call_attn_res(engine, inp, case)
    report(judge(property="attn_res_within_budget_at_magnitudes", engine=engine, subject=base.ATTN_RES, actual=out,
                 reference=want, budget=budget, seed=case.seed, reduction_len=case.hidden * (case.num_blocks + 1),
                 detail=f"profile={profile};nb={case.num_blocks};write={case.block_write_idx};"
                        f"delta={case.with_delta};onorm={case.with_output_norm}"))


@pytest.mark.parametrize("name", SUBJECTS)
@given(hidden=st.sampled_from([64, 1024]), profile=st.sampled_from(PROFILES), tokens=st.integers(1, 4),
       nvb=st.integers(1, 8), seed=seeds)
def test_read_only_mixture_within_budget_at_massive_tiny_and_mixed_magnitudes(engine, name: str, hidden: int,
                                                                            profile: str, tokens: int, nvb: int,
                                                                            seed: int) -> None:
    """The read-only mixture of nvb of 8 bank rows and the prefix, the sources reshaped by `profile`: within the
    accuracy property's budget of the float64 oracle, the inputs untouched."""
    fn = subject(engine, name)
    d = Draw.for_device(seed, DEVICE)
    prefix, bank = d.normal((tokens, hidden)).to(LOW), d.normal((tokens, 8, hidden)).to(LOW)
    norm, proj = d.positive((hidden,)).to(LOW), d.normal((hidden,), hidden**-0.5).to(LOW)
    f = _scales(profile, tokens, 9, hidden, seed)
    prefix, bank = _shape(prefix, f[:, -1]), _shape(bank, f[:, :-1])
    before = (prefix.clone(), bank.clone())
    out = call(engine, fn, prefix, bank, nvb, norm, proj, EPS)
    want, budget = judges.read_only_mixture(engine, name, prefix, bank, nvb, norm, proj, EPS)
    report(judge(property="read_only_mixture_within_budget_at_magnitudes", engine=engine, subject=name, actual=out,
                 reference=want, budget=budget, seed=seed, reduction_len=hidden,
                 detail=f"profile={profile};nvb={nvb};hidden={hidden}"))
    assert torch.equal(prefix, before[0]) and torch.equal(bank, before[1]), "a read-only mixture wrote its inputs"
