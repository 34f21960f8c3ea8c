"""The non-finite contracts: NaN and +-inf among finite rows.

A float64 reference propagates a NaN or an infinity through the row that holds it and no further: the mixtures'
rows are independent (each token's sources are its own prefix row and bank rows). So with some rows poisoned
(a NaN or an infinity in one element of the prefix row or of a mixed bank row), among finite rows:
- each finite row's output is bit for bit the output of the same call with every row finite (a poisoned row
  reaches no other: no shared maximum, no shared sum, no tile that mixes rows);
- each poisoned row is non-finite throughout, as the reference's (IEEE float64) row is: a source with a NaN or an
  infinity has a NaN score, so every softmax weight of its row is NaN (never a finite value made up for it);
- the inputs are unchanged (the mixtures are read-only).
Where a pinned engine breaks its contract it is a ledger entry with its reproducer; the Markov steps' contract
(every draft token in range, the finite rows untouched) is in properties/test_markov.py.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from k3num.engines import base
from k3num.fixtures.builders import attn_res_inputs
from k3num.fixtures.strategies import AttnResCase, attn_res_cases, seeds
from k3num.fixtures.tensors import Draw
from k3num.harness.judges import EPS
from k3num.properties.checks.attn_res import as_admitted, call_attn_res
from k3num.properties.checks.attn_res_mix import SUBJECTS
from k3num.properties.support import DEVICE, LOW, assert_bitwise, call, subject

POISONS = {"nan": float("nan"), "+inf": float("inf"), "-inf": float("-inf")}
# a poisoned row's arithmetic under Triton's interpreter (numpy) warns on inf * 0, inf - inf and a max of NaNs:
# expected there,
# so filtered for the interpreter's module only; on a GPU nothing warns. The properties judge every value.
pytestmark = pytest.mark.filterwarnings(
    "ignore:invalid value encountered in:RuntimeWarning:triton.runtime.interpreter",
    "ignore:overflow encountered in:RuntimeWarning:triton.runtime.interpreter",
    "ignore:All-NaN slice encountered:RuntimeWarning:triton.runtime.interpreter")


@pytest.mark.parametrize("hidden", [64, 1024])
@pytest.mark.parametrize("name", SUBJECTS)
@given(tokens=st.integers(2, 6), nvb=st.integers(1, 8), seed=seeds, data=st.data())
def test_read_only_mixture_keeps_non_finite_rows_to_themselves(engine, name: str, hidden: int, tokens: int,
                                                               nvb: int, seed: int, data) -> None:
    fn = subject(engine, name)
    d = Draw.for_device(seed, DEVICE)
    prefix, bank = d.normal((tokens, hidden)).to(LOW), d.normal((tokens, 8, hidden)).to(LOW)
    norm, proj = d.positive((hidden,)).to(LOW), d.normal((hidden,), hidden**-0.5).to(LOW)
    clean = call(engine, fn, prefix, bank, nvb, norm, proj, EPS)
    poisoned = sorted(data.draw(st.sets(st.integers(0, tokens - 1), min_size=1, max_size=tokens - 1),
                                label="poisoned rows"))
    bad_prefix, bad_bank = prefix.clone(), bank.clone()
    for r in poisoned:
        value = POISONS[data.draw(st.sampled_from(sorted(POISONS)), label=f"row {r}")]
        col = data.draw(st.integers(0, hidden - 1), label=f"row {r} element")
        source = data.draw(st.integers(-1, nvb - 1), label=f"row {r} source (-1: the prefix)")
        if source < 0:
            bad_prefix[r, col] = value
        else:
            bad_bank[r, source, col] = value
    before = (bad_prefix.clone(), bad_bank.clone())
    out = call(engine, fn, bad_prefix, bad_bank, nvb, norm, proj, EPS)
    assert_bitwise(bad_prefix, before[0], "the prefix (a read-only mixture wrote it)")
    assert_bitwise(bad_bank, before[1], "the bank (a read-only mixture wrote it)")
    _check_rows(name, out, clean, poisoned)


def _check_rows(name: str, out: torch.Tensor, clean: torch.Tensor, poisoned: list[int]) -> None:
    """The finite rows of `out` bit for bit `clean`'s; each poisoned row non-finite throughout."""
    finite = [r for r in range(out.shape[0]) if r not in poisoned]
    assert_bitwise(out[finite], clean[finite], f"the finite rows {finite} beside the non-finite rows {poisoned}")
    # the reference's row: a source with a NaN or an infinity has a NaN score (its rms is NaN or infinite, and
    # inf * rsqrt(inf) = inf * 0), so every softmax weight of the row is NaN and so is every output element
    bad = ~torch.isfinite(out[poisoned]).cpu()
    if not bool(bad.all()):
        r, c = (int(i) for i in (~bad).nonzero()[0])
        raise AssertionError(
            f"{name}: poisoned row {poisoned[r]} (a non-finite source) is finite at {int((~bad).sum())} of "
            f"{bad.numel()} elements, first {c} ({float(out[poisoned[r], c])!r}): the reference's row is NaN "
            "throughout (a made-up value where NaN must propagate)")

@given(case=attn_res_cases(tokens=st.integers(2, 6), num_blocks=lambda bank: st.integers(1, bank),
                           block_write_idx=lambda bank: st.just(-1), with_delta=st.just(False)),
       data=st.data())
def test_attn_res_keeps_non_finite_rows_to_themselves(engine, case: AttnResCase, data) -> None:
    """The model's read-only AttnRes call (at least one block beside the prefix, no delta, no write), the output
    norm or not: the finite rows bit for bit the all-finite call's, each poisoned row non-finite throughout (the
    output norm of a NaN row is NaN), the inputs unchanged."""
    case = as_admitted(engine, case)
    inp = attn_res_inputs(case, LOW, DEVICE)
    clean = call_attn_res(engine, inp, case)
    poisoned = sorted(data.draw(st.sets(st.integers(0, case.tokens - 1), min_size=1, max_size=case.tokens - 1),
                                label="poisoned rows"))
    prefix, blocks = inp.prefix.clone(), inp.blocks.clone()
    for r in poisoned:
        value = POISONS[data.draw(st.sampled_from(sorted(POISONS)), label=f"row {r}")]
        col = data.draw(st.integers(0, case.hidden - 1), label=f"row {r} element")
        source = data.draw(st.integers(-1, case.num_blocks - 1), label=f"row {r} source (-1: the prefix)")
        if source < 0:
            prefix[r, col] = value
        else:
            blocks[r, source, col] = value
    bad = dataclasses.replace(inp, prefix=prefix, blocks=blocks)
    before = (prefix.clone(), blocks.clone())
    out = call_attn_res(engine, bad, case)
    assert_bitwise(prefix, before[0], "the prefix after a read-only call with non-finite rows")
    assert_bitwise(blocks, before[1], "the bank after a read-only call with non-finite rows")
    _check_rows(base.ATTN_RES, out, clean, poisoned)
