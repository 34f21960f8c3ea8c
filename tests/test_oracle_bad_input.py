"""Bad input to the oracle: each case raises a ValueError naming the argument and what was expected."""

from __future__ import annotations

import pytest
import torch

from k3num.fixtures.tensors import Draw
from k3num.refmodel import attn_res, geometry, mla, partial_projection, quant, rmsnorm, rope
from k3num.refmodel.geometry import RopeSpec
from k3num.refmodel.transfer_plan import KVLayout, head_aware_plan

SPEC = RopeSpec(8, 50000.0, "gptj", None)
d = Draw(0)
T, NB, H = 3, 4, 16
PREFIX, BLOCKS = d.normal((T, H)), d.normal((T, NB, H))
NW, QK = d.positive((H,)), d.normal((H,))
N, HID, L, KVL = 4, 24, 2, 8
X = d.normal((N, HID))
KVW = d.normal((L, KVL + 8, HID))
KNW = d.positive((L, KVL))
POS = torch.arange(N)


def _attn_res(**kw: object) -> None:
    args: dict[str, object] = dict(
        prefix=PREFIX, delta=None, blocks=BLOCKS, norm_weight=NW, qk_weight=QK, output_norm_weight=None,
        num_blocks=2, block_write_idx=-1, eps=1e-5, output_norm_eps=1e-5,
    )
    args.update(kw)
    attn_res.attn_res(**args)  # type: ignore[arg-type]


def _context_kv(**kw: object) -> None:
    args: dict[str, object] = dict(
        context_states=X, kv_a_weight=KVW, kv_norm_weight=KNW, positions=POS, rope=SPEC, eps=1e-5
    )
    args.update(kw)
    mla.context_kv(**args)  # type: ignore[arg-type]


def test_float32_input_is_rejected_naming_the_dtype() -> None:
    with pytest.raises(ValueError, match=r"context_states: expected dtype torch.float64, got torch.float32"):
        _context_kv(context_states=X.float())


def test_bfloat16_weight_is_rejected() -> None:
    with pytest.raises(ValueError, match=r"kv_a_weight: expected dtype torch.float64"):
        _context_kv(kv_a_weight=KVW.bfloat16())


def test_weight_hidden_mismatch_is_rejected_with_expected_shape() -> None:
    with pytest.raises(ValueError, match=r"kv_a_weight: expected shape \[\*, \*, 24\], got \[2, 16, 20\]"):
        _context_kv(kv_a_weight=KVW[..., :20])


def test_norm_weight_layer_count_mismatch_is_rejected() -> None:
    with pytest.raises(ValueError, match=r"kv_norm_weight: expected shape \[2, \*\]"):
        _context_kv(kv_norm_weight=KNW[:1])


def test_positions_of_wrong_length_are_rejected() -> None:
    with pytest.raises(ValueError, match=r"positions: expected shape \[4\]"):
        _context_kv(positions=torch.arange(5))


def test_float_positions_are_rejected() -> None:
    with pytest.raises(ValueError, match=r"positions: expected dtype torch.int64"):
        _context_kv(positions=POS.double())


def test_negative_positions_are_rejected() -> None:
    with pytest.raises(ValueError, match=r"positions: expected values >= 0"):
        rope.apply_rope(X[:, None, :8].clone(), torch.tensor([0, 1, -2, 3]), SPEC)


def test_nan_input_is_rejected_with_count() -> None:
    bad = X.clone()
    bad[1, 2] = float("nan")
    with pytest.raises(ValueError, match=r"context_states: expected finite values, found 1 NaN/Inf"):
        _context_kv(context_states=bad)


def test_inf_in_bank_is_rejected() -> None:
    bad = BLOCKS.clone()
    bad[0, 0, 0] = float("inf")
    with pytest.raises(ValueError, match=r"blocks: expected finite values, found 1 NaN/Inf"):
        _attn_res(blocks=bad)


def test_device_mismatch_is_rejected() -> None:
    with pytest.raises(ValueError, match=r"qk_weight: expected device cpu \(the device of prefix\), got meta"):
        _attn_res(qk_weight=torch.empty(H, dtype=torch.float64, device="meta"))


def test_negative_num_blocks_is_rejected() -> None:
    with pytest.raises(ValueError, match=r"num_blocks: expected an int in \[0, 4\]"):
        _attn_res(num_blocks=-1)


def test_num_blocks_beyond_the_bank_is_rejected() -> None:
    with pytest.raises(ValueError, match=r"num_blocks: expected an int in \[0, 4\] \(the bank size\), got 5"):
        _attn_res(num_blocks=5)


def test_block_write_idx_below_minus_one_is_rejected() -> None:
    with pytest.raises(ValueError, match=r"block_write_idx: expected an int in \[-1, 4\), got -2"):
        _attn_res(block_write_idx=-2)


def test_block_write_idx_at_bank_size_is_rejected() -> None:
    with pytest.raises(ValueError, match=r"block_write_idx: expected an int in \[-1, 4\), got 4"):
        _attn_res(block_write_idx=4)


def test_delta_shape_mismatch_is_rejected() -> None:
    with pytest.raises(ValueError, match=r"delta: expected shape \[3, 16\], got \[2, 16\]"):
        _attn_res(delta=PREFIX[:2])


def test_nonpositive_eps_is_rejected() -> None:
    with pytest.raises(ValueError, match=r"eps: expected a finite value > 0, got 0.0"):
        _attn_res(eps=0.0)


def test_stages_repeating_a_tap_are_rejected() -> None:
    taps, fc = d.normal((3, 2, 4)), d.normal((5, 12))
    with pytest.raises(ValueError, match=r"stages: expected a partition of tap indices 0..2"):
        partial_projection.stage_partials(taps, fc, [[0, 1], [1, 2]])


def test_stages_missing_a_tap_are_rejected() -> None:
    taps, fc, nw = d.normal((3, 2, 4)), d.normal((5, 12)), d.positive((5,))
    with pytest.raises(ValueError, match=r"stages: expected a partition"):
        partial_projection.project_context(taps, fc, nw, 1e-5, [[0], [], [2]])


def test_stages_with_out_of_range_tap_are_rejected() -> None:
    taps, fc = d.normal((3, 2, 4)), d.normal((5, 12))
    with pytest.raises(ValueError, match=r"stages: expected a partition"):
        partial_projection.stage_partials(taps, fc, [[0, 1, 2, 3]])


def test_fc_weight_width_not_matching_taps_is_rejected() -> None:
    with pytest.raises(ValueError, match=r"fc_weight: expected shape \[\*, 12\], got \[5, 10\]"):
        partial_projection.stage_partials(d.normal((3, 2, 4)), d.normal((5, 10)), [[0, 1, 2]])


def _cache_args() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    caches = torch.zeros(L, 3, 4, KVL + 8, dtype=torch.float64)
    return caches, d.normal((L, N, KVL)), d.normal((L, N, 8))


def test_slot_beyond_the_cache_is_rejected() -> None:
    caches, kv_c, k_pe = _cache_args()
    with pytest.raises(ValueError, match=r"slot_mapping: expected slots < 12 \(num_blocks \* block_size\), got 12"):
        mla.write_mla_cache(caches, kv_c, k_pe, torch.tensor([0, 5, 12, -1]))


def test_duplicate_slot_in_one_layer_is_rejected() -> None:
    caches, kv_c, k_pe = _cache_args()
    with pytest.raises(ValueError, match=r"slot_mapping: layer 1 uses a slot more than once"):
        mla.write_mla_cache(caches, kv_c, k_pe, torch.tensor([[0, 1, 2, 3], [4, 4, -1, -1]]))


def test_slot_mapping_of_wrong_shape_is_rejected() -> None:
    caches, kv_c, k_pe = _cache_args()
    with pytest.raises(ValueError, match=r"slot_mapping: expected shape \[2, 4\], got \[3, 4\]"):
        mla.write_mla_cache(caches, kv_c, k_pe, torch.zeros(3, 4, dtype=torch.int64))


def test_grouped_norm_weight_needs_three_dim_input() -> None:
    with pytest.raises(ValueError, match=r"x: a grouped weight \[G, D\] needs x \[G, N, D\]"):
        rmsnorm.rms_norm(d.normal((4, 8)), d.positive((2, 8)), 1e-5)


def test_unknown_preset_lists_known_names() -> None:
    with pytest.raises(ValueError, match=r"preset: unknown name 'k4'; known: \["):
        geometry.preset("k4")


def test_odd_rotary_dim_is_rejected() -> None:
    with pytest.raises(ValueError, match=r"RopeSpec.rotary_dim: expected a positive even int, got 7"):
        RopeSpec(7, 10000.0)


def test_fp8_scale_of_wrong_shape_is_rejected() -> None:
    q, s = quant.quantize_fp8_block(d.normal((130, 8)))
    with pytest.raises(ValueError, match=r"weight_scale_inv: expected shape \[2, 1\], got \[1, 1\]"):
        quant.dequantize_fp8_block(q, s[:1])


def test_transfer_plan_with_mismatched_page_lists_is_rejected() -> None:
    src = KVLayout(4, 8, 128, 64, 2, (0, 1, 2, 3))
    with pytest.raises(ValueError, match=r"dst_pages: expected as many pages as src_pages \(2\), got 1"):
        head_aware_plan(src, src, [0, 1], [0])


def test_transfer_layout_with_incompatible_tp_is_rejected() -> None:
    with pytest.raises(ValueError, match=r"KVLayout.tp_size: expected a divisor or multiple of total_kv_heads 8"):
        KVLayout(3, 8, 128, 64, 2, (0, 1, 2))


def test_non_final_stage_option_must_be_known() -> None:
    with pytest.raises(ValueError, match=r"non_final_stage: expected 'raise' or 'prefix', got 'zero'"):
        attn_res.capture_aux_stream(
            0, PREFIX, None, BLOCKS, enabled=True, weights=None, block_size=3, end_layer=2, num_layers=4,
            is_last_rank=False, eps=1e-5, non_final_stage="zero",  # type: ignore[arg-type]
        )
