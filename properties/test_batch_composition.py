"""Batch composition: a row computed alone is the same row computed inside its batch.

An AttnRes call's rows are independent in exact arithmetic (each token mixes its own sources), and every bound
kernel assigns one program (or one torch row) per token at these sizes, so the claim is exact: a row alone, the
row inside its batch, and the row at another position of the batch (the batch reversed) are equal bit for bit.
A kernel that picks its tiling or its split count from the row count (vLLM's attn_res switches BLOCK_L at 256
tokens; tokenspeed#904's MLA decode picks its KV split count from it) gives low-bit differences there, which is
what caps greedy target equivalence between a verify batch and decode. Each comparison is a `batch_invariance`
record in the drift CSV (budget 0: bitwise), so a class of differences is measured, not only failed.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from k3num.engines import base
from k3num.fixtures.builders import AttnResInputs, attn_res_inputs
from k3num.fixtures.strategies import (
    AttnResCase,
    attn_res_cases,
    context_kv_cases,
    draft_kv_cases,
    projection_cases,
    seeds,
    tap_cases,
)
from k3num.harness.judges import attn_res_oracle
from k3num.oracles.budgets import Budget
from k3num.oracles.records import judge
from k3num.properties.checks.attn_res import as_admitted, call_attn_res
from k3num.properties.checks.batch_rows import ROW_CALLS, check_rows_batch_invariant
from k3num.properties.support import DEVICE, LOW, report, subject, up

# batches of 2-6 rows on the CPU: one tiling on every bound kernel (a 256-row call under the interpreter costs
# seconds). On cuda the batches also sit on both sides of vLLM's switch at 256 tokens (extras["attn_res_tiling"]):
# 255 and 256 take the two tilings, 257 and 300 the larger one beside a smaller row alone
TOKENS = (st.integers(2, 6) if torch.device(DEVICE).type != "cuda"
          else st.one_of(st.integers(2, 6), st.sampled_from([255, 256, 257, 300])))


def _rows(inp: AttnResInputs, index: torch.Tensor) -> AttnResInputs:
    """The inputs of the rows `index` (fresh tensors: the kernel writes the prefix and the bank in place)."""
    pick = lambda t: None if t is None else t[index].clone()  # noqa: E731
    return dataclasses.replace(inp, prefix=pick(inp.prefix), delta=pick(inp.delta), blocks=pick(inp.blocks),
                               norm=inp.norm.clone(), qk=inp.qk.clone(),
                               out_norm=None if inp.out_norm is None else inp.out_norm.clone())


def _bound(engine, case: AttnResCase, tokens: int, inp: AttnResInputs) -> Budget:
    """Bitwise where the engine takes the same tiling for a batch of `tokens` and for the batch of the case (none
    declared: every call one program per row, extras["attn_res_tiling"]); else twice the accuracy property's
    budget (each of the two outputs is within it of the same oracle), the difference recorded."""
    tiling = engine.extras.get("attn_res_tiling")
    if tiling is None or tiling(tokens, case.num_blocks) == tiling(case.tokens, case.num_blocks):
        return Budget(0.0, "bitwise: the row alone, in its batch and at another position (rows independent)")
    _, budget = attn_res_oracle(engine, inp.prefix, inp.delta, inp.blocks, inp.norm, inp.qk, inp.out_norm,
                                case.num_blocks, case.block_write_idx)
    return Budget(2.0 * budget.value, f"2 x ({budget.rule}): another tiling ({tiling(tokens, case.num_blocks)} "
                                      f"against {tiling(case.tokens, case.num_blocks)})")


@given(case=attn_res_cases(tokens=TOKENS))
def test_attn_res_row_alone_is_the_row_in_its_batch_and_at_another_position_bitwise(engine, case: AttnResCase) -> None:
    """Each row of a batch computed alone and at another position (the batch reversed) equals the row in the batch:
    bit for bit, or within the stated bound where the engine declares another tiling for the other call (vLLM
    below and from 256 tokens; the mirror's torch matmul, by the batch's size)."""
    if 0 <= case.block_write_idx < case.num_blocks:  # the model's calls (the accuracy property's)
        case = dataclasses.replace(case, block_write_idx=case.num_blocks if case.num_blocks < case.bank else -1)
    case = as_admitted(engine, case)
    inp = attn_res_inputs(case, LOW, DEVICE)
    t = case.tokens
    batched = call_attn_res(engine, _rows(inp, torch.arange(t)), case)
    reverse = torch.arange(t - 1, -1, -1)
    reversed_out = call_attn_res(engine, _rows(inp, reverse), case)[reverse]
    report(judge(property="batch_invariance", engine=engine, subject=base.ATTN_RES, actual=reversed_out,
                 reference=up(batched), budget=_bound(engine, case, t, inp), seed=case.seed, reduction_len=case.hidden,
                 detail=f"each row at another position of the batch of {t}"))
    rows = range(t) if t <= 6 else (0, t - 1)  # a larger batch: its first and last row
    alone = torch.cat([call_attn_res(engine, _rows(inp, torch.tensor([r])), dataclasses.replace(case, tokens=1))
                       for r in rows])
    report(judge(property="batch_invariance", engine=engine, subject=base.ATTN_RES, actual=alone,
                 reference=up(batched[list(rows)]), budget=_bound(engine, case, 1, inp), seed=case.seed,
                 reduction_len=case.hidden, detail=f"rows {list(rows)[:6]} alone against the batch of {t}"))


# the row-independent subjects besides attn_res, each with its cases: batches of 2-6 rows (one code path on every
# bound kernel at these sizes, so the claim is bitwise unless the engine declares otherwise)
_ROWS = st.integers(2, 6)
_MIX = st.tuples(_ROWS, st.sampled_from([64, 1024]), st.integers(0, 8), seeds)
ROW_CASES: dict[str, st.SearchStrategy] = {
    base.CONTEXT_KV_FUSED: context_kv_cases(tokens=_ROWS),
    base.CONTEXT_KV_UNFUSED: context_kv_cases(tokens=_ROWS),
    base.DRAFT_CONTEXT_KV: draft_kv_cases(tokens=_ROWS),
    base.STAGE_PARTIAL: projection_cases(tokens=_ROWS),
    base.FINALIZE_PROJECTION: projection_cases(tokens=_ROWS),
    base.PROJECT_UNSHARDED: projection_cases(tokens=_ROWS),
    base.ATTN_RES_MIX: _MIX,
    base.ATTN_RES_MIX_TRITON: st.tuples(_ROWS, st.just(1024), st.integers(0, 8), seeds),
    base.ATTN_RES_MIX_EAGER: _MIX,
    base.ATTN_RES_RESIDUAL: st.tuples(_ROWS, st.just(1024), st.integers(0, 7), seeds),
    base.AUX_CAPTURE: tap_cases(position="inner", tokens=_ROWS),
}


@pytest.mark.parametrize("name", sorted(ROW_CASES))
@given(data=st.data())
def test_a_row_alone_is_the_row_in_its_batch_and_at_another_position_for_every_row_independent_subject(
        engine, name: str, data: st.DataObject) -> None:
    """Each row-independent subject (its rows depend only on their own token's inputs in exact arithmetic): every
    output row of a batch computed with the batch reversed, and its first and last row alone, equal the rows in
    the batch, bit for bit,
    or within twice the accuracy budget where the engine declares the subject batch-variant
    (extras["batch_variant"]), the difference recorded (`batch_invariance`)."""
    fn = subject(engine, name)
    case = data.draw(ROW_CASES[name], label="case")
    check_rows_batch_invariant(engine, name, ROW_CALLS[name](engine, fn, case, DEVICE))
