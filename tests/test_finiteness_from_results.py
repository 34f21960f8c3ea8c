"""The oracle reads its inputs' finiteness off its own results (refmodel/mla.py, refmodel/attn_res.py): a NaN
or Inf anywhere in any input still raises the ValueError that names that input (the first bad one in
argument order), and finite inputs whose arithmetic overflows still raise nothing, exactly as the direct
check of every input did. The unwritten bank comes back as the input itself, and no input is written."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from k3num.fixtures.tensors import Draw
from k3num.refmodel import attn_res, mla
from k3num.refmodel.geometry import RopeSpec

SPEC = RopeSpec(8, 50000.0, "neox", None)
N, HID, L, KVL = 5, 24, 3, 8
T, NB, H = 4, 5, 16
BAD = st.sampled_from([float("nan"), float("inf"), float("-inf")])


def _ckv_inputs(seed: int) -> dict[str, torch.Tensor]:
    d = Draw(seed)
    return {"context_states": d.normal((N, HID)), "kv_a_weight": d.normal((L, KVL + 8, HID), HID**-0.5),
            "kv_norm_weight": d.positive((L, KVL))}


def _plant(t: torch.Tensor, flat: int, value: float) -> None:
    t.view(-1)[flat % t.numel()] = value


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**16), names=st.lists(st.sampled_from(["context_states", "kv_a_weight", "kv_norm_weight"]),
                                                  min_size=1, max_size=3, unique=True),
       flat=st.integers(0, 10**6), value=BAD, cache=st.booleans())
def test_a_nonfinite_context_kv_input_raises_naming_the_first_bad_one(seed: int, names: list[str], flat: int,
                                                                      value: float, cache: bool) -> None:
    inp = _ckv_inputs(seed)
    for name in names:
        _plant(inp[name], flat, value)
    first = next(n for n in inp if n in names)
    pos = torch.arange(N)
    with pytest.raises(ValueError, match=rf"^{first}: expected finite values, found \d+ NaN/Inf"):
        if cache:
            caches = torch.zeros(L, 2, 4, KVL + 8, dtype=torch.float64)
            mla.precompute_context_kv(*inp.values(), pos, SPEC, 1e-5, caches, torch.arange(N))
        else:
            mla.context_kv(*inp.values(), pos, SPEC, 1e-5)


def test_finite_context_kv_inputs_that_overflow_raise_nothing() -> None:
    inp = _ckv_inputs(1)
    inp["context_states"].fill_(1e200)
    inp["kv_a_weight"].fill_(1e200)  # every product overflows to inf: the results are not finite
    kv_c, k_pe = mla.context_kv(*inp.values(), torch.arange(N), SPEC, 1e-5)
    assert not torch.isfinite(kv_c).all() and not torch.isfinite(k_pe).all()
    caches = torch.zeros(L, 2, 4, KVL + 8, dtype=torch.float64)
    _, _, new = mla.precompute_context_kv(*inp.values(), torch.arange(N), SPEC, 1e-5, caches, torch.arange(N))
    assert new is not None and not torch.isfinite(new).all()


ATTN = ["prefix", "delta", "blocks", "norm_weight", "qk_weight", "output_norm_weight"]


def _attn_inputs(seed: int) -> dict[str, torch.Tensor]:
    d = Draw(seed)
    return {"prefix": d.normal((T, H)), "delta": d.normal((T, H)), "blocks": d.normal((T, NB, H)),
            "norm_weight": d.positive((H,)), "qk_weight": d.normal((H,)), "output_norm_weight": d.positive((H,))}


@settings(max_examples=100, deadline=None)
@given(seed=st.integers(0, 2**16), names=st.lists(st.sampled_from(ATTN), min_size=1, max_size=3, unique=True),
       flat=st.integers(0, 10**6), value=BAD, num_blocks=st.integers(0, NB), write=st.integers(-1, NB - 1),
       bank_row=st.integers(0, NB - 1))
def test_a_nonfinite_attn_res_input_raises_naming_the_first_bad_one(seed: int, names: list[str], flat: int,
                                                                   value: float, num_blocks: int, write: int,
                                                                   bank_row: int) -> None:
    """Every bank row counts, mixed or not, and the row a write replaces too."""
    inp = _attn_inputs(seed)
    for name in names:
        if name == "blocks":  # one element of a chosen row: past num_blocks, the written one, or mixed
            inp["blocks"][flat % T, bank_row, flat % H] = value
        else:
            _plant(inp[name], flat, value)
    first = next(n for n in ATTN if n in names)
    with pytest.raises(ValueError, match=rf"^{first}: expected finite values, found \d+ NaN/Inf"):
        attn_res.attn_res(*inp.values(), num_blocks, write, 1e-5, 1e-6)


def test_finite_attn_res_inputs_whose_mean_square_overflows_raise_nothing() -> None:
    inp = _attn_inputs(2)
    inp["prefix"].fill_(1e200)  # mean(v^2) = inf for the prefix source: rechecked on the inputs, all finite
    out, _, _ = attn_res.attn_res(*inp.values(), 3, -1, 1e-5, 1e-6)
    assert out.shape == (T, H)


@given(seed=st.integers(0, 2**16), num_blocks=st.integers(0, NB), write=st.integers(-1, NB - 1),
       delta=st.booleans())
@settings(max_examples=40, deadline=None)
def test_attn_res_writes_no_input_and_returns_an_unwritten_bank_itself(seed: int, num_blocks: int, write: int,
                                                                       delta: bool) -> None:
    inp = _attn_inputs(seed)
    if not delta:
        inp["delta"] = None  # type: ignore[assignment]
    before = {k: None if v is None else v.clone() for k, v in inp.items()}
    out, new_prefix, new_blocks = attn_res.attn_res(*inp.values(), num_blocks, write, 1e-5, 1e-6)
    for k, v in inp.items():
        assert v is None or torch.equal(v, before[k]), f"{k} was written"
    assert (new_blocks is inp["blocks"]) == (write == -1)
    assert new_prefix is not inp["prefix"] and new_prefix.data_ptr() != inp["prefix"].data_ptr()
