"""Closed forms and identities the oracle must satisfy (no external implementation needed).

Each test states one identity that holds in real arithmetic; float64 results
are compared exactly where the identity is exact in floating point too, else
within oracles.budgets.f64_identity_rtol of the reduction length involved.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from k3num.fixtures.tensors import Draw
from k3num.oracles import budgets
from k3num.oracles.metrics import assert_bitwise_equal, assert_normwise_close
from k3num.refmodel import attn_res as ar
from k3num.refmodel import geometry, mla, partial_projection, rope
from k3num.refmodel.geometry import RopeSpec, YarnScaling

SPECS = [
    RopeSpec(8, 50000.0, "gptj", None),
    RopeSpec(8, 50000.0, "neox", None),
    RopeSpec(16, 10000.0, "gptj", YarnScaling(4.0, 64)),
    RopeSpec(16, 10000.0, "neox", YarnScaling(40.0, 4096, 16.0, 2.0, 0.707, 1.0)),
]
seeds = st.integers(0, 2**32 - 1)


def _pairs(x: torch.Tensor, style: str, d: int) -> tuple[torch.Tensor, torch.Tensor]:
    if style == "gptj":
        return x[..., 0:d:2], x[..., 1:d:2]
    return x[..., : d // 2], x[..., d // 2 : d]


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: f"{s.style}-{'yarn' if s.yarn else 'plain'}")
@given(seed=seeds)
def test_rope_scales_every_pair_norm_by_attention_scaling(spec: RopeSpec, seed: int) -> None:
    d = Draw(seed)
    x = d.normal((6, 2, spec.rotary_dim + 4))
    pos = d.integers(0, 10_000, (6,))
    y = rope.apply_rope(x, pos, spec)
    a, b = _pairs(x, spec.style, spec.rotary_dim)
    ya, yb = _pairs(y, spec.style, spec.rotary_dim)
    m = rope.attention_scaling(spec)
    assert_normwise_close(torch.hypot(ya, yb), m * torch.hypot(a, b), budgets.f64_identity_rtol(2), "pair norm")
    assert_bitwise_equal(y[..., spec.rotary_dim :], x[..., spec.rotary_dim :], "dims past rotary_dim")


@pytest.mark.parametrize("spec", [s for s in SPECS if rope.attention_scaling(s) == 1.0],
                         ids=lambda s: f"{s.style}-{'yarn' if s.yarn else 'plain'}")
@given(seed=seeds)
def test_rope_composes_additively_in_position(spec: RopeSpec, seed: int) -> None:
    d = Draw(seed)
    x = d.normal((5, spec.rotary_dim))
    p1, p2 = d.integers(0, 3000, (5,)), d.integers(0, 3000, (5,))
    twice = rope.apply_rope(rope.apply_rope(x, p1, spec), p2, spec)
    once = rope.apply_rope(x, p1 + p2, spec)
    # angles up to 6000 rad: cos/sin of a float64 angle carry |theta| u64 absolute error each
    theta = 6000.0 * float(rope.inv_freq(spec).max())
    assert_normwise_close(twice, once, budgets.f64_identity_rtol(2) + 4 * theta * budgets.U64, "R(p2)R(p1)=R(p1+p2)")


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: f"{s.style}-{'yarn' if s.yarn else 'plain'}")
def test_cos_sin_table_rows_are_cos_then_sin_of_position_times_inv_freq(spec: RopeSpec) -> None:
    table = rope.cos_sin_table(spec, 37)
    ang = torch.arange(37, dtype=torch.float64)[:, None] * rope.inv_freq(spec)
    m = rope.attention_scaling(spec)
    assert table.shape == (37, spec.rotary_dim)
    assert_bitwise_equal(table, torch.cat([torch.cos(ang) * m, torch.sin(ang) * m], -1), "[cos | sin]")


def test_neox_rope_equals_hf_rotate_half_given_the_same_cos_sin() -> None:
    hf = pytest.importorskip("transformers.models.deepseek_v3.modeling_deepseek_v3")
    spec = SPECS[1]
    d = Draw(7)
    x = d.normal((4, 3, spec.rotary_dim))  # [N, heads, d]
    pos = d.integers(0, 500, (4,))
    c, s = rope.cos_sin(pos, spec)
    cos, sin = torch.cat([c, c], -1), torch.cat([s, s], -1)  # HF's emb = cat(freqs, freqs)
    q, _ = hf.apply_rotary_pos_emb(x, x, cos, sin, unsqueeze_dim=1)
    assert_normwise_close(rope.apply_rope(x, pos, spec), q, budgets.f64_identity_rtol(2), "NeoX vs rotate_half")


def test_yarn_k3_correction_range_and_mscale() -> None:
    spec = geometry.PRESETS["k3-dspark"].rope  # type: ignore[union-attr]
    low, high = rope.correction_range(spec)
    # d log(L / (2 pi beta)) / (2 log theta) with d=64, L=32768, theta=50000: floor(15.06), ceil(25.31)
    assert (low, high) == (15, 26)
    assert rope.attention_scaling(spec) == 1.0  # mscale == mscale_all_dim
    f = rope.inv_freq(spec)
    plain = rope.inv_freq(RopeSpec(64, 50000.0, "gptj", None))
    assert torch.equal(f[:low], plain[:low]), "pairs below the ramp are extrapolated (unchanged)"
    assert_normwise_close(f[high:], plain[high:] / 32.0, budgets.f64_identity_rtol(1), "interpolated pairs")


@given(seed=seeds, n=st.integers(1, 12), preset=st.sampled_from(["tiny-dspark", "tiny-dspark-plain-rope"]))
def test_fused_context_kv_equals_unfused_with_q_discarded(seed: int, n: int, preset: str) -> None:
    g = geometry.PRESETS[preset]
    assert isinstance(g, geometry.MLADraftGeometry)
    d = Draw(seed)
    x = d.normal((n, g.hidden))
    w = d.normal((g.num_layers, g.fused_qkv_a_width, g.hidden), g.hidden**-0.5)
    nw = d.positive((g.num_layers, g.kv_lora_rank))
    pos = d.integers(0, 4 * 64, (n,))
    fused = mla.context_kv(x, w[:, g.q_lora_rank :], nw, pos, g.rope, g.eps)
    unfused = mla.context_kv_unfused(x, w, nw, pos, g.rope, g.eps)
    for a, b, what in zip(fused, unfused, ("kv_c", "k_pe")):
        assert_normwise_close(a, b, budgets.f64_identity_rtol(g.hidden), what)


def test_attn_res_with_zero_blocks_returns_the_prefix_bitwise() -> None:
    d = Draw(1)
    t, nb, h = 5, 3, 16
    prefix, blocks = d.normal((t, h)), d.normal((t, nb, h))
    out, new_prefix, new_blocks = ar.attn_res(
        prefix, None, blocks, d.positive((h,)), d.normal((h,)), None, 0, -1, 1e-5, 0.0
    )
    assert_bitwise_equal(out, prefix, "output")
    assert_bitwise_equal(new_prefix, prefix, "new_prefix")
    assert_bitwise_equal(new_blocks, blocks, "new_blocks")


@given(seed=seeds, nb=st.integers(1, 8))
def test_attn_res_with_equal_logits_is_the_mean_of_the_sources(seed: int, nb: int) -> None:
    d = Draw(seed)
    t, h = 4, 32
    prefix, blocks = d.normal((t, h)), d.normal((t, nb, h))
    zeros = torch.zeros(h, dtype=torch.float64)  # q = 0: every logit is 0
    out, _, _ = ar.attn_res(prefix, None, blocks, d.positive((h,)), zeros, None, nb, -1, 1e-5, 0.0)
    mean = torch.cat([blocks, prefix[:, None]], 1).mean(1)
    assert_normwise_close(out, mean, budgets.f64_identity_rtol(nb + 1), "equal-logit mixture")


def _all_partitions(k: int, num_stages: int) -> list[list[list[int]]]:
    parts = []
    for assign in itertools.product(range(num_stages), repeat=k):
        parts.append([[i for i in range(k) if assign[i] == s] for s in range(num_stages)])
    return parts


@pytest.mark.parametrize("num_stages", [1, 2, 3, 5])
def test_stage_partial_sum_equals_concatenated_projection_for_every_partition(num_stages: int) -> None:
    d = Draw(num_stages)
    k, n, h, h_out = 4, 3, 8, 12
    taps, fc = d.normal((k, n, h)), d.normal((h_out, k * h))
    norm_w = d.positive((h_out,))
    full = partial_projection.project_context(taps, fc, norm_w, 1e-5)
    for stages in _all_partitions(k, num_stages):
        got = partial_projection.project_context(taps, fc, norm_w, 1e-5, stages)
        assert_normwise_close(got, full, budgets.f64_identity_rtol(k * h), f"stages {stages}")


@given(seed=seeds, layer=st.integers(0, 8), flag=st.booleans(), with_pending=st.booleans())
def test_stream_tap_with_flag_off_equals_prefix_plus_pending(seed: int, layer: int, flag: bool,
                                                            with_pending: bool) -> None:
    d = Draw(seed)
    t, h, nb = 3, 16, 4
    prefix, pending, bank = d.normal((t, h)), d.normal((t, h)), d.normal((t, nb, h))
    w = _weights(d, 10, h)
    tap = ar.capture_aux_stream(
        layer, prefix, pending if with_pending else None, bank, enabled=flag, weights=None if flag else w,
        block_size=3, end_layer=10, num_layers=10, is_last_rank=True, eps=1e-5,
    )
    assert_bitwise_equal(tap, prefix + pending if with_pending else prefix, "disabled tap")


def _weights(d: Draw, num_layers: int, h: int) -> ar.AttnResWeights:
    def per_layer() -> torch.Tensor:
        return d.normal((num_layers, h), 0.5)

    return ar.AttnResWeights(
        per_layer(), per_layer(), d.positive((num_layers, h)), per_layer(), per_layer(),
        d.positive((num_layers, h)), d.normal((h,), 0.5), d.normal((h,), 0.5),
    )


@given(seed=seeds)
def test_capture_tap_equals_the_consumer_mixture_of_the_stream(seed: int) -> None:
    g = geometry.PRESETS["tiny-attnres"]
    assert isinstance(g, geometry.AttnResGeometry)
    d = Draw(seed)
    t, L, h = 3, g.num_layers, g.hidden
    w = _weights(d, L, h)
    mlp_outputs = d.normal((L, t, h))
    s = ar.attn_res_stream(d.normal((t, h)), d.normal((L, t, h)), mlp_outputs, w, g.block_size, g.eps)
    for i in range(L):
        tap = ar.capture_aux_stream(
            i, s.prefixes[i], mlp_outputs[i], s.banks[i], enabled=True, weights=w, block_size=g.block_size,
            end_layer=L, num_layers=L, is_last_rank=True, eps=g.eps,
        )
        # the same float64 operations on the same values: exact
        assert_bitwise_equal(tap, s.taps[i], f"tap after layer {i}")
