"""The fused MLA epilogue's oracle (refmodel/mla_epilogue.py) and the two exact helpers its property leans on
(oracles.budgets.half_spacing, refmodel.quant.fp8_e4m3_times), each against closed forms or an independent path:

- the rotation by a table's rows is refmodel.rope.rotate's GPT-J rotation (which tests/test_oracle_vs_transformers.py
  checks against HF's interleaved RoPE) when the table is rope.cos_sin_table's; angle 0 is the identity; every pair
  keeps its norm; the rotation by -theta undoes it;
- the epilogue copies what it does not rotate, and every head's key carries the cache entry's rotated k_pe;
- half_spacing is half the format's spacing at powers of two and in the subnormals, bounds torch's own
  round-to-nearest conversions, and a second rounding through bf16 exceeds it for some fp8 values;
- fp8_e4m3_times rounds to nearest even (ties to the even mantissa), clamps to +-448 and multiplies in fp32.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from k3num.oracles.budgets import half_spacing
from k3num.refmodel import geometry, mla_epilogue, quant, rope

SPEC = dataclasses.replace(geometry.preset("k3-dspark-plain-rope").rope, style="gptj")


def _x(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def test_rotating_by_the_tables_rows_is_ropes_gptj_rotation() -> None:
    pos = torch.tensor([0, 1, 7, 4095, 31000])
    rows = rope.cos_sin_table(SPEC, 32768)[pos]
    x = _x(5, 3, 64)
    assert torch.equal(mla_epilogue.rotate_pairs(x, rows), rope.rotate(x, pos, SPEC))


def test_angle_zero_is_the_identity_and_every_pair_keeps_its_norm() -> None:
    x = _x(4, 64, seed=1)
    zero = torch.cat([torch.ones(4, 32), torch.zeros(4, 32)], -1).double()
    assert torch.equal(mla_epilogue.rotate_pairs(x, zero), x)
    rows = rope.cos_sin_table(SPEC, 100)[torch.tensor([3, 17, 50, 99])]
    y = mla_epilogue.rotate_pairs(x, rows)
    norm = lambda t: (t[..., 0::2] ** 2 + t[..., 1::2] ** 2).sqrt()  # noqa: E731
    torch.testing.assert_close(norm(y), norm(x), rtol=1e-14, atol=0)


def test_rotating_back_by_the_negated_angle_returns_the_input() -> None:
    x = _x(6, 2, 64, seed=2)
    rows = rope.cos_sin_table(SPEC, 4096)[torch.tensor([1, 2, 3, 100, 1000, 4095])]
    back = torch.cat([rows[:, :32], -rows[:, 32:]], -1)
    torch.testing.assert_close(mla_epilogue.rotate_pairs(mla_epilogue.rotate_pairs(x, rows), back), x,
                               rtol=0, atol=1e-14)


@pytest.mark.parametrize("with_table", [False, True])
def test_the_epilogue_copies_what_it_does_not_rotate(with_table: bool) -> None:
    t, h, p, r, c = 5, 3, 128, 64, 512
    q, k_nope, k_pe, kv_c = _x(t, h, p + r, seed=3), _x(t, h, p, seed=4), _x(t, r, seed=5), _x(t, c, seed=6)
    rows = rope.cos_sin_table(SPEC, 64)[torch.tensor([0, 5, 9, 33, 63])] if with_table else None
    q_out, k, entry = mla_epilogue.prefill_epilogue(q, k_nope, k_pe, kv_c, rows)
    assert torch.equal(q_out[..., :p], q[..., :p]) and torch.equal(k[..., :p], k_nope)
    assert torch.equal(entry[:, :c], kv_c)
    for head in range(h):
        assert torch.equal(k[:, head, p:], entry[:, c:])
    if with_table:
        assert torch.equal(entry[:, c:], mla_epilogue.rotate_pairs(k_pe, rows))
        assert torch.equal(q_out[..., p:], mla_epilogue.rotate_pairs(q[..., p:], rows))
    else:
        assert torch.equal(q_out, q) and torch.equal(entry[:, c:], k_pe)


def test_the_epilogue_refuses_shapes_that_disagree() -> None:
    with pytest.raises(ValueError, match="shapes disagree"):
        mla_epilogue.prefill_epilogue(_x(2, 1, 100), _x(2, 1, 128), _x(2, 64), _x(2, 512))
    with pytest.raises(ValueError, match="cos_sin: expected shape"):
        mla_epilogue.rotate_pairs(_x(2, 64), _x(3, 64))


def test_half_spacing_at_powers_of_two_and_in_the_subnormals() -> None:
    v = torch.tensor([1.0, 1.9, 2.0, 448.0, 2.0 ** -6, 2.0 ** -9, 0.0], dtype=torch.float64)
    assert half_spacing(v, torch.float8_e4m3fn).tolist() == [2.0 ** -4, 2.0 ** -4, 2.0 ** -3, 16.0, 2.0 ** -10,
                                                             2.0 ** -10, 2.0 ** -10]
    assert half_spacing(v[:3], torch.bfloat16).tolist() == [2.0 ** -8, 2.0 ** -8, 2.0 ** -7]


@pytest.mark.parametrize("fmt", [torch.bfloat16, torch.float8_e4m3fn])
def test_half_spacing_bounds_round_to_nearest_and_a_second_rounding_exceeds_it(fmt: torch.dtype) -> None:
    v = (_x(200_000, seed=7) * 4).float().double()  # float32 values: torch rounds float32 -> fmt once
    v = v.clamp(-400, 400)
    once = v.float().to(fmt).double()
    assert bool(((once - v).abs() <= half_spacing(v, fmt)).all())
    if fmt == torch.float8_e4m3fn:
        twice = v.float().to(torch.bfloat16).to(fmt).double()
        assert bool(((twice - v).abs() > half_spacing(v, fmt)).any())


def test_fp8_e4m3_times_rounds_ties_to_even_clamps_and_multiplies_in_fp32() -> None:
    # 1 + 1/16 lies midway between 1 and 1.125 (even: 1); 1 + 3/16 midway between 1.125 and 1.25 (even: 1.25)
    x = torch.tensor([1.0, 1.0 + 1 / 16, 1.0 + 3 / 16, 500.0, -1000.0, 0.0], dtype=torch.bfloat16)
    got = quant.fp8_e4m3_times(x, 1.0).view(torch.float8_e4m3fn).float().tolist()
    assert got == [1.0, 1.0, 1.25, 448.0, -448.0, 0.0]
    # the product is rounded to fp32 first: x * s for s = 1/3 (fp32), against the float64 product
    x3 = torch.tensor([3.0], dtype=torch.bfloat16)
    s = float(torch.tensor(1 / 3, dtype=torch.float32))
    want = (torch.tensor([3.0], dtype=torch.float32) * torch.tensor(s, dtype=torch.float32)).to(torch.float8_e4m3fn)
    assert torch.equal(quant.fp8_e4m3_times(x3, s), want.view(torch.uint8))
    with pytest.raises(ValueError, match="scale_inv"):
        quant.fp8_e4m3_times(x3, 0.0)


@pytest.mark.parametrize("with_table", [False, True])
def test_the_decode_epilogue_concats_the_latent_query_and_writes_the_prefill_entry(with_table: bool) -> None:
    t, h, p, r, c = 4, 3, 128, 64, 512
    ql, q_pe, kv_c, k_pe = _x(t, h, c, seed=8), _x(t, h, r, seed=9), _x(t, c, seed=10), _x(t, r, seed=11)
    rows = rope.cos_sin_table(SPEC, 64)[torch.tensor([0, 7, 31, 63])] if with_table else None
    mqa, entry = mla_epilogue.decode_epilogue(ql, q_pe, kv_c, k_pe, rows)
    assert torch.equal(mqa[..., :c], ql)
    assert torch.equal(mqa[..., c:], q_pe if rows is None else mla_epilogue.rotate_pairs(q_pe, rows))
    _, _, prefill_entry = mla_epilogue.prefill_epilogue(_x(t, 1, p + r), _x(t, 1, p), k_pe, kv_c, rows)
    assert torch.equal(entry, prefill_entry)
    with pytest.raises(ValueError, match="shapes disagree"):
        mla_epilogue.decode_epilogue(ql, q_pe[:, :2], kv_c, k_pe, rows)
