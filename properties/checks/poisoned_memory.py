"""Checks shared by properties/test_poisoned_memory.py and the property modules that reuse them: no test module
imports another, so they live here (moved from test_poisoned_memory.py with their bodies unchanged; a name
another module uses is public)."""

from __future__ import annotations

import numpy as np
import torch

from k3num.engines import base
from k3num.fixtures.builders import attn_res_inputs
from k3num.fixtures.strategies import AttnResCase
from k3num.fixtures.tensors import Draw
from k3num.harness import judges
from k3num.harness.judges import EPS, OUT_EPS, attn_res_oracle
from k3num.oracles import hunt
from k3num.oracles.records import judge
from k3num.properties.support import DEVICE, LOW, assert_bitwise, call, report, subject


def nonfinite(t: torch.Tensor) -> str:
    bad = int((~torch.isfinite(t.float())).sum())
    return f"{bad} of {t.numel()} output elements not finite" if bad else ""


def check_poisoned_attn_res(engine, case: AttnResCase, prop: str = "poisoned_output_fully_written") -> None:
    fn = subject(engine, base.ATTN_RES)
    write = case.block_write_idx
    inp = attn_res_inputs(case, LOW, DEVICE)
    idle = [r for r in range(case.bank) if r >= case.num_blocks and r != write]
    blocks = inp.blocks.clone()
    blocks[:, idle] = float("nan")
    g = {"prefix": hunt.guarded(inp.prefix), "bank": hunt.guarded(blocks)}
    if inp.delta is not None:
        g["delta"] = hunt.guarded(inp.delta)
    clean = blocks.clone()
    clean[:, idle] = 0.0  # never read by the oracle either
    want, budget = attn_res_oracle(engine, inp.prefix, inp.delta, clean, inp.norm, inp.qk, inp.out_norm,
                                   case.num_blocks, write)
    with hunt.poisoned_allocations():
        out = fn(g["prefix"].view, g["delta"].view if inp.delta is not None else None, g["bank"].view, inp.norm,
                 inp.qk, inp.out_norm, case.num_blocks, write, EPS, OUT_EPS)
    report(judge(property=prop, engine=engine, subject=base.ATTN_RES, actual=out,
                 reference=want, budget=budget, seed=case.seed, reduction_len=case.hidden * (case.num_blocks + 1),
                 detail=";".join(filter(None, [f"H={case.hidden};T={case.tokens};nb={case.num_blocks};write={write};"
                                               f"idle_rows={idle}", nonfinite(out)]))), climb=False)
    assert_bitwise(g["bank"].view[:, idle], blocks[:, idle], f"bank rows {idle} (neither mixed nor written)")
    for name, gb in g.items():
        assert gb.guards_intact(), f"{name}: {gb.guard_damage()}"


def check_poisoned_mixture(engine, name: str, tokens: int, hidden: int, nvb: int, seed: int, bank_rows: int,
                           prop: str = "poisoned_mixture_fully_written") -> None:
    fn = subject(engine, name)
    d = Draw.for_device(seed, DEVICE)
    prefix, bank = d.normal((tokens, hidden)).to(LOW), d.normal((tokens, bank_rows, hidden)).to(LOW)
    norm, proj = d.positive((hidden,)).to(LOW), d.normal((hidden,), hidden**-0.5).to(LOW)
    out_norm = d.positive((hidden,)).to(LOW)
    bank[:, nvb:] = float("nan")
    gp, gb = hunt.guarded(prefix), hunt.guarded(bank)
    residual = name == base.ATTN_RES_RESIDUAL
    args = [gp.view, gb.view, nvb, norm, proj] + ([out_norm] if residual else []) + [EPS]
    # a kernel that reads past its rows (K3N-008: SGLang's unmasked 1024-wide loads) reads the NaN rows and the
    # guard bands' sentinels; under Triton's CPU interpreter numpy then warns of overflow and invalid values on
    # those reads. The output is what is judged (below), so numpy's warnings are off for this call alone
    with hunt.poisoned_allocations(), np.errstate(over="ignore", invalid="ignore"):
        out = call(engine, fn, *args)
    clean = bank.nan_to_num(0.0)  # the rows past nvb are never read: the oracle sees zeros
    if residual:  # the mixture, rounded to storage, then the output norm (fp32, one rounding)
        want, budget = judges.residual_mixture(engine, prefix, clean, nvb, norm, proj, out_norm, EPS)
    else:
        want, budget = judges.read_only_mixture(engine, name, prefix, clean, nvb, norm, proj, EPS)
    report(judge(property=prop, engine=engine, subject=name, actual=out, reference=want, budget=budget, seed=seed,
                 reduction_len=hidden, detail=";".join(filter(None, [f"H={hidden};nvb={nvb};T={tokens}",
                                                                     nonfinite(out)]))), climb=False)
    assert_bitwise(gp.view, prefix, "prefix after a read-only mixture")
    assert_bitwise(gb.view, bank, "bank (rows past nvb poisoned) after a read-only mixture")
    for label, g in (("prefix", gp), ("bank", gb)):
        assert g.guards_intact(), f"{label}: {g.guard_damage()}"
