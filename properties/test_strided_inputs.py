"""AttnRes on inputs that are not contiguous: computed right, or refused by the engine's own check.

The kernels take raw pointers and assume a unit stride along the hidden dimension (vLLM's wrapper asserts
`stride(-1) == 1` for every tensor it is given); a caller can still hand them a view: a weight expanded from one
value (stride 0), every other element of a wider buffer (stride 2). Read as if contiguous, such a view gives the
neighbouring memory's values, and a write-back through it lands on elements that are not the view's. The
contract: the call either refuses the layout by a check of its own (an `assert` or a `raise`), or it computes
what the contiguous copy of the same values gives: the output within the accuracy budget of the float64 oracle,
the in-place write-back of the prefix and the bank row bit for bit the contiguous call's, and every element of the
wider buffer outside the view left as it was.
"""

from __future__ import annotations

import dataclasses

import torch
from hypothesis import given
from hypothesis import strategies as st

from k3num.engines import base
from k3num.fixtures.builders import AttnResInputs, attn_res_inputs
from k3num.fixtures.strategies import AttnResCase, attn_res_cases
from k3num.harness.judges import EPS, OUT_EPS, attn_res_oracle
from k3num.oracles.records import judge
from k3num.properties.checks.attn_res import as_admitted
from k3num.properties.support import DEVICE, LOW, raised_deliberately, report, subject

# the argument given as a view, and the views each can be: weights (1-D) stride 0 or 2, row tensors stride 2
WEIGHTS = ("norm", "qk", "out_norm")
ROWS = ("prefix", "delta", "blocks")


def _every_other(x: torch.Tensor, fill: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(a view of x's values with stride 2 along the last dimension, the buffer it lives in: x's values at the even
    places, `fill` at the odd ones)."""
    buf = torch.full((*x.shape[:-1], 2 * x.shape[-1]), fill, dtype=x.dtype, device=x.device)
    buf[..., ::2] = x
    return buf[..., ::2], buf


def _broadcast(w: torch.Tensor, fill: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(a stride-0 view [H] of w's first value, its buffer [2H]: that value, then `fill`)."""
    buf = torch.full((2 * w.shape[0],), fill, dtype=w.dtype, device=w.device)
    buf[0] = w[0]
    return buf.as_strided(w.shape, (0,)), buf


@given(case=attn_res_cases(num_blocks=lambda bank: st.integers(1, bank), with_delta=st.just(True),
                           with_output_norm=st.just(True)),
       which=st.sampled_from(WEIGHTS + ROWS), layout=st.sampled_from(["every_other", "broadcast"]))
def test_attn_res_on_a_strided_input_computes_the_contiguous_call_or_refuses(engine, case: AttnResCase, which: str,
                                                                           layout: str) -> None:
    """One argument (a weight, the prefix, the delta or the bank) given as a strided view of the same values: the
    call refuses it by its own check, or its output is within the accuracy budget of the oracle on the contiguous
    values, its write-backs are the contiguous call's bit for bit, and the buffer outside the view is unchanged."""
    if layout == "broadcast" and which not in WEIGHTS:
        layout = "every_other"  # a row tensor's stride-0 view would make every token's row one: not a layout slip
    if 0 <= case.block_write_idx < case.num_blocks:
        case = dataclasses.replace(case, block_write_idx=case.num_blocks if case.num_blocks < case.bank else -1)
    case = as_admitted(engine, case)
    fn = subject(engine, base.ATTN_RES)
    inp = attn_res_inputs(case, LOW, DEVICE)
    view, buf = (_broadcast if layout == "broadcast" else _every_other)(getattr(inp, which), 7.0)
    # the contiguous call on the same values: the reference for the write-backs, and the oracle's inputs
    flat = dataclasses.replace(inp, **{which: view.contiguous()})
    ref = _clone(flat)
    want, budget = attn_res_oracle(engine, ref.prefix, ref.delta, ref.blocks, ref.norm, ref.qk, ref.out_norm,
                                   case.num_blocks, case.block_write_idx)
    fn(ref.prefix, ref.delta, ref.blocks, ref.norm, ref.qk, ref.out_norm, case.num_blocks,
                    case.block_write_idx, EPS, OUT_EPS)
    strided = _clone(flat)
    strided = dataclasses.replace(strided, **{which: view})
    outside = buf.clone()
    try:
        out = fn(strided.prefix, strided.delta, strided.blocks, strided.norm, strided.qk, strided.out_norm,
                 case.num_blocks, case.block_write_idx, EPS, OUT_EPS)
    except (AssertionError, ValueError, RuntimeError, NotImplementedError) as e:
        if raised_deliberately(e):
            return  # refused by the engine's own check: the contract's other branch
        raise AssertionError(f"{engine.name} {engine.version}: a {layout} {which} crashed the call, no check of its "
                             f"own refused it: {type(e).__name__}: {e}") from e
    report(judge(property="strided_input_within_budget", engine=engine, subject=base.ATTN_RES, actual=out,
                 reference=want, budget=budget, seed=case.seed, reduction_len=case.hidden * (case.num_blocks + 1),
                 detail=f"{which}={layout};nb={case.num_blocks};write={case.block_write_idx}"))
    assert torch.equal(strided.prefix, ref.prefix), f"the prefix written back through a {layout} {which} differs"
    assert torch.equal(strided.blocks, ref.blocks), f"the bank written through a {layout} {which} differs"
    gaps = torch.ones_like(buf, dtype=torch.bool)
    if layout == "broadcast":
        gaps[0] = False
    else:
        gaps[..., ::2] = False
    assert torch.equal(buf[gaps], outside[gaps]), f"the call wrote outside the {layout} view of {which}"


def _clone(inp: AttnResInputs) -> AttnResInputs:
    """Fresh copies of every tensor (the calls write the prefix and the bank in place)."""
    return AttnResInputs(**{f.name: None if (t := getattr(inp, f.name)) is None else t.clone()
                            for f in dataclasses.fields(inp)})
