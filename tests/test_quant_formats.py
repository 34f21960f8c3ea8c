"""Dequantisation of FP8-block and NVFP4 checkpoints: independent cross-checks and exact identities.

What each check covers:
- `unpack_e2m1` against compressed-tensors' `unpack_fp4_from_uint8` on every
  byte value (exact: both are table lookups), and `pack_e2m1` against
  compressed-tensors' `pack_fp4_to_uint8` on grid values.
- FP8-block dequantisation against the closed form fp8 * scale evaluated
  element by element in Python floats (exact contract).
- NVFP4 in both namings: dequantised values equal e2m1 * scale / global (or
  * scale_2) evaluated per element in Python floats; the two namings of one
  quantisation agree to one float64 rounding.
- Merging L quantised shards row-wise then dequantising equals the row-stack
  of the per-shard dequantisations, bitwise, even with per-shard scales.
"""

from __future__ import annotations

import pytest
import torch

from k3num.fixtures.tensors import Draw
from k3num.oracles import budgets
from k3num.oracles.metrics import assert_bitwise_equal, assert_normwise_close
from k3num.refmodel import quant


def test_unpack_e2m1_matches_compressed_tensors_on_every_byte() -> None:
    helpers = pytest.importorskip(
        "compressed_tensors.compressors.nvfp4.helpers", reason="test extra: pip install -e .[test]"
    )
    packed = torch.arange(256, dtype=torch.uint8).view(16, 16)
    theirs = helpers.unpack_fp4_from_uint8(packed, 16, 32, dtype=torch.float64)
    assert_bitwise_equal(quant.unpack_e2m1(packed), theirs, "unpack_e2m1 vs compressed-tensors")


def test_pack_e2m1_matches_compressed_tensors() -> None:
    helpers = pytest.importorskip(
        "compressed_tensors.compressors.nvfp4.helpers", reason="test extra: pip install -e .[test]"
    )
    d = Draw(3)
    grid = torch.tensor(quant.E2M1_VALUES, dtype=torch.float64)
    values = grid[d.integers(1, 8, (8, 32))] * torch.where(d.integers(0, 2, (8, 32)) == 1, -1.0, 1.0)
    theirs = helpers.pack_fp4_to_uint8(values.to(torch.float32))
    assert_bitwise_equal(quant.pack_e2m1(values), theirs, "pack_e2m1 vs compressed-tensors")


@pytest.mark.parametrize("shape", [(128, 128), (200, 300), (1, 129)])
def test_fp8_block_dequant_is_exact_product(shape: tuple[int, int]) -> None:
    w = Draw(sum(shape)).normal(shape, 0.02, outliers=30.0)
    q, s = quant.quantize_fp8_block(w)
    got = quant.dequantize_fp8_block(q, s)
    qf, sf = q.to(torch.float64).tolist(), s.tolist()
    want = torch.tensor(
        [[qf[i][j] * sf[i // 128][j // 128] for j in range(shape[1])] for i in range(shape[0])],
        dtype=torch.float64,
    )
    assert_bitwise_equal(got, want, "fp8 block dequant vs closed form")
    # and the quantiser is a real quantiser: within e4m3's unit roundoff of w, blockwise
    assert_normwise_close(got, w, 2 * budgets.unit_roundoff(torch.float8_e4m3fn), "fp8 round trip")


def test_nvfp4_dequant_is_the_closed_form_in_both_namings() -> None:
    w = Draw(11).normal((8, 64), 0.05, outliers=20.0)
    ct = quant.quantize_nvfp4(w, naming="compressed-tensors")
    mo = quant.quantize_nvfp4(w, naming="modelopt")
    got_ct = quant.dequantize_nvfp4(ct["weight_packed"], ct["weight_scale"], ct["weight_global_scale"])
    got_mo = quant.dequantize_nvfp4_modelopt(mo["weight"], mo["weight_scale"], mo["weight_scale_2"])
    e2m1 = quant.unpack_e2m1(ct["weight_packed"]).tolist()
    sc = ct["weight_scale"].to(torch.float64).tolist()
    g = float(ct["weight_global_scale"])
    want = torch.tensor(
        [[e2m1[i][j] * sc[i][j // 16] / g for j in range(64)] for i in range(8)], dtype=torch.float64
    )
    assert_bitwise_equal(got_ct, want, "compressed-tensors NVFP4 vs closed form")
    # 1/g rounded to fp32 (scale_2) differs from dividing by g by <= one fp32 rounding
    assert_normwise_close(got_mo, got_ct, budgets.U32, "ModelOpt vs compressed-tensors naming")
    # e2m1 keeps 1 mantissa bit: each value within u(e2m1) of w relative to its 16-group's scale
    assert_normwise_close(got_ct, w, 2 * budgets.unit_roundoff("e2m1"), "nvfp4 round trip")


def test_merged_fp8_shards_dequantize_to_row_stack_of_shards() -> None:
    d = Draw(5)
    shards = [d.normal((256, 384), 0.02 * (layer + 1)) for layer in range(3)]
    qs = [quant.quantize_fp8_block(w) for w in shards]
    merged = quant.dequantize_fp8_block(torch.cat([q for q, _ in qs]), torch.cat([s for _, s in qs]))
    stacked = torch.cat([quant.dequantize_fp8_block(q, s) for q, s in qs])
    assert_bitwise_equal(merged, stacked, "merged FP8 shards vs row-stacked per-shard dequant")


def test_merged_nvfp4_shards_need_per_shard_global_scale() -> None:
    d = Draw(6)
    shards = [d.normal((4, 32), 0.01 * 10**layer) for layer in range(3)]
    qs = [quant.quantize_nvfp4(w) for w in shards]
    globals_ = torch.cat([q["weight_global_scale"].expand(4) for q in qs]).unsqueeze(1)  # per row
    merged = quant.unpack_e2m1(torch.cat([q["weight_packed"] for q in qs])) * torch.cat(
        [q["weight_scale"] for q in qs]
    ).to(torch.float64).repeat_interleave(16, dim=1) / globals_.to(torch.float64)
    stacked = torch.cat([
        quant.dequantize_nvfp4(q["weight_packed"], q["weight_scale"], q["weight_global_scale"]) for q in qs
    ])
    assert_bitwise_equal(merged, stacked, "merged NVFP4 with per-row global scales")
    one_global = quant.dequantize_nvfp4(
        torch.cat([q["weight_packed"] for q in qs]), torch.cat([q["weight_scale"] for q in qs]),
        qs[0]["weight_global_scale"],
    )
    assert not torch.equal(one_global, stacked), "a single global scale must not reproduce the shards"
