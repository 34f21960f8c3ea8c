"""Shapes the engines' entry points accept off the model's path: a result within budget, or a clear
refusal (an exception raised before any kernel runs), never garbage.

Drawn: hidden sizes that are neither powers of two nor multiples of 1024, odd token counts (and, on
the GPU, token counts either side of vLLM's 256-token tile switch), bank sizes and bank indices.
Every call runs with poisoned allocations, NaN bank rows past the mixed ones and NaN guard bands
around the inputs (oracles.hunt), so a tile read past a row or an output element left unwritten
shows as a non-finite output, and a write past a buffer as a damaged guard.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st

from k3num.engines import base
from k3num.fixtures.builders import attn_res_inputs
from k3num.fixtures.strategies import AttnResCase, seeds
from k3num.harness.judges import EPS, OUT_EPS
from k3num.oracles import hunt
from k3num.oracles.drift import COLLECTOR
from k3num.oracles.records import INFO, Record
from k3num.properties.checks.poisoned_memory import check_poisoned_attn_res, check_poisoned_mixture
from k3num.properties.support import DEVICE, LOW, raised_deliberately, subject

OFF_GRID_HIDDEN = [24, 40, 96, 100, 200, 1000, 1536]
ODD_TOKENS = [1, 3, 5, 7] + ([255, 257] if torch.device(DEVICE).type == "cuda" else [])
# the widest unmasked tile among the bound kernels (SGLang's _BLOCK_H); a bank is drawn with enough
# rows past nvb that a tile read past the last mixed row stays inside the bank (and reads NaN)
TILE = 1024
# exceptions that are a wrapper's refusal (raised by its own checks, before a kernel runs)
REFUSALS = (ValueError, AssertionError, NotImplementedError, TypeError, IndexError, RuntimeError)


@st.composite
def off_path_attn_res_cases(draw: st.DrawFn) -> AttnResCase:
    bank = draw(st.integers(1, 8))
    nb = draw(st.integers(0, bank))
    return AttnResCase(tokens=draw(st.sampled_from(ODD_TOKENS)), hidden=draw(st.sampled_from(OFF_GRID_HIDDEN)),
                       bank=bank, num_blocks=nb, block_write_idx=nb if nb < bank and draw(st.booleans()) else -1,
                       with_delta=draw(st.booleans()), with_output_norm=draw(st.booleans()), seed=draw(seeds),
                       scale=1.0, outliers=0.0)


def _is_refusal(e: BaseException) -> bool:
    """A wrapper's own check, not a kernel or device failure: raised by a `raise` or `assert` statement
    (support.raised_deliberately: not a torch operator's error, nor a subscript's), with a message, no CUDA or
    Triton error."""
    text = f"{type(e).__module__}.{type(e).__name__}: {e}"
    return bool(str(e)) and raised_deliberately(e) and not any(
        k in text for k in ("CUDA", "cuda", "triton", "Triton", "illegal memory"))


def _refused(engine, name: str, e: BaseException, detail: str) -> None:
    """A refusal is a result: it goes into the drift CSV (verdict info) with its message. Anything
    that is not a clear refusal (a device error, an empty assertion) is re-raised: a failure."""
    if not _is_refusal(e):
        raise e
    COLLECTOR.add(Record(
        property="off_path_shape_refused", engine=engine.name, engine_version=engine.version, mode=engine.mode,
        real_ops=engine.real_ops, source_sha256=engine.source_sha256.get(name, ""), subject=name, device=DEVICE,
        dtype="", shape="", reduction_len=0, seed=0, max_abs=math.nan, rel_fro=math.nan, max_ulp=math.nan,
        cosine=math.nan, nonfinite_mismatch=0, worst="", baseline_err=math.nan, budget=math.nan,
        budget_rule="a refusal", ratio=0.0, verdict=INFO, detail=f"{detail};{type(e).__name__}: {e}"[:400]))


@given(case=off_path_attn_res_cases())
def test_attn_res_off_path_shapes_within_budget_or_refused(engine, case: AttnResCase) -> None:
    try:
        check_poisoned_attn_res(engine, case, prop="off_path_shape_within_budget")
    except REFUSALS as e:
        if isinstance(e, AssertionError) and str(e).startswith(("poisoned", "off_path", "bank", "prefix", "delta")):
            raise  # the property's own verdict, not the wrapper's refusal
        _refused(engine, base.ATTN_RES, e, f"H={case.hidden};T={case.tokens};nb={case.num_blocks}")


@given(bank=st.integers(1, 6), over=st.integers(1, 3), which=st.sampled_from(["num_blocks", "block_write_idx"]),
       seed=seeds)
@example(bank=2, over=1, which="num_blocks", seed=0)  # K3N-009 (vllm, vllm-rocm: read past the bank)
@example(bank=2, over=1, which="block_write_idx", seed=0)  # K3N-009 (vllm, vllm-rocm: write past the bank)
def test_attn_res_bank_indices_outside_the_bank_are_refused(engine, bank: int, over: int, which: str,
                                                            seed: int) -> None:
    """num_blocks > the bank's rows, or block_write_idx >= them: no result is defined (the oracle
    refuses), so only a refusal is right. An accepted call reads or writes another token's rows or
    past the buffer; the guards and the poisoned rows say which."""
    fn = subject(engine, base.ATTN_RES)
    nb, write = (bank + over, -1) if which == "num_blocks" else (bank, bank - 1 + over)
    case = AttnResCase(tokens=3, hidden=32, bank=bank, num_blocks=nb, block_write_idx=write, with_delta=False,
                       with_output_norm=False, seed=seed, scale=1.0, outliers=0.0)
    inp = attn_res_inputs(case, LOW, DEVICE)
    gp, gb = hunt.guarded(inp.prefix), hunt.guarded(inp.blocks)
    try:
        with hunt.poisoned_allocations():
            out = fn(gp.view, None, gb.view, inp.norm, inp.qk, None, nb, write, EPS, OUT_EPS)
    except REFUSALS as e:
        _refused(engine, base.ATTN_RES, e, f"bank={bank};num_blocks={nb};write={write}")
        return
    if torch.device(DEVICE).type == "cuda":
        torch.cuda.synchronize()
    found = [f"{int((~torch.isfinite(out.float())).sum())} of {out.numel()} outputs not finite"]
    found += [f"{n}: {g.guard_damage()}" for n, g in (("prefix", gp), ("bank", gb)) if not g.guards_intact()]
    pytest.fail(f"{engine.name} accepted {which}={nb if which == 'num_blocks' else write} with a bank of {bank} "
                f"rows (no defined result): {'; '.join(found)}")


@pytest.mark.parametrize("name", [base.ATTN_RES_MIX, base.ATTN_RES_MIX_EAGER])
@given(tokens=st.sampled_from(ODD_TOKENS[:4]), hidden=st.sampled_from([64, 96, 1536, 2560]), nvb=st.integers(0, 6),
       seed=seeds)
def test_public_mixture_off_grid_hidden_within_budget_or_refused(engine, name: str, tokens: int, hidden: int,
                                                                 nvb: int, seed: int) -> None:
    """The public read-only mixtures at hidden sizes off the 1024 grid (SGLang's aggregate_stream
    takes its eager path there)."""
    _mixture_or_refusal(engine, name, tokens, hidden, nvb, seed)


@given(tokens=st.sampled_from(ODD_TOKENS[:4]), hidden=st.sampled_from([64, 96, 1536, 2560, 1024, 2048]),
       nvb=st.integers(0, 6), seed=seeds)
@example(tokens=1, hidden=1536, nvb=2, seed=0)  # K3N-008 (SGLang: half the output never written)
@example(tokens=1, hidden=96, nvb=1, seed=0)  # K3N-008 (SGLang: no output element written)
def test_model_aggregation_off_grid_hidden_within_budget_or_refused(engine, tokens: int, hidden: int, nvb: int,
                                                                    seed: int) -> None:
    """The model-level aggregation point (SGLang's AttnResidual.forward -> _aggregate -> _mix_fused)
    at any hidden size the class accepts."""
    _mixture_or_refusal(engine, base.ATTN_RES_RESIDUAL, tokens, hidden, nvb, seed)


def _mixture_or_refusal(engine, name: str, tokens: int, hidden: int, nvb: int, seed: int) -> None:
    subject(engine, name)
    rows = nvb + -(-TILE // hidden) + 1
    try:
        check_poisoned_mixture(engine, name, tokens, hidden, nvb, seed, bank_rows=rows,
                               prop="off_path_shape_within_budget")
    except REFUSALS as e:
        if isinstance(e, AssertionError):
            raise  # the property's verdict
        _refused(engine, name, e, f"H={hidden};T={tokens};nvb={nvb}")
