"""The oracle against HF transformers (an independent public implementation).

What each check covers:
- the MLA KV path of `DeepseekV3Attention.forward` (kv_a_proj_with_mqa split,
  kv_a_layernorm, interleaved RoPE) run as HF runs it, captured at its cache
  write, against `refmodel.mla.context_kv` for one layer. HF's RMSNorm and its
  rotary angles run in fp32, so the bound is fp32's (oracles.budgets); HF fixes
  kv_a_layernorm's eps at 1e-6, which the oracle is given. HF's interleaved
  RoPE returns [rotated evens | rotated odds], a fixed permutation of the GPT-J
  pairs the oracle returns.
- YaRN: HF's `_compute_yarn_parameters` inverse frequencies and attention
  factor against `refmodel.rope.inv_freq` / `attention_scaling`, including a
  non-trivial mscale ratio and the plain (default) RoPE.
Not covered here: NeoX pairing (HF's non-interleaved path is checked in
test_rope_identities against the closed form), the cache write.
"""

from __future__ import annotations

import math

import pytest
import torch

from k3num.fixtures.tensors import Draw
from k3num.oracles import budgets
from k3num.oracles.metrics import assert_normwise_close
from k3num.refmodel import mla, rope
from k3num.refmodel.geometry import RopeSpec, YarnScaling

transformers = pytest.importorskip("transformers", reason="test extra: pip install -e .[test]")
from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf_ds  # noqa: E402

HF_KV_NORM_EPS = 1e-6  # DeepseekV3RMSNorm's default; kv_a_layernorm is built without an eps


def _hf_config(spec: RopeSpec, hidden: int, q_lora: int, kv_lora: int) -> transformers.DeepseekV3Config:
    params: dict[str, object] = {"rope_theta": spec.theta}
    if spec.yarn is None:
        params["rope_type"] = "default"
        max_pos = 4096
    else:
        y = spec.yarn
        params.update(
            rope_type="yarn", factor=y.factor, original_max_position_embeddings=y.original_max_position,
            beta_fast=y.beta_fast, beta_slow=y.beta_slow, mscale=y.mscale, mscale_all_dim=y.mscale_all_dim,
        )
        max_pos = int(y.factor * y.original_max_position)
    return transformers.DeepseekV3Config(
        hidden_size=hidden, num_attention_heads=2, num_key_value_heads=2, q_lora_rank=q_lora,
        kv_lora_rank=kv_lora, qk_rope_head_dim=spec.rotary_dim, qk_nope_head_dim=8, v_head_dim=8,
        rope_interleave=True, rope_parameters=params, max_position_embeddings=max_pos,
        attention_bias=False,
    )


class _Captured(Exception):
    def __init__(self, kv_nope: torch.Tensor, k_rot: torch.Tensor) -> None:
        self.kv_nope, self.k_rot = kv_nope, k_rot


class _CaptureCache:
    """Stands in for HF's Cache: stops the forward at the latent cache write."""

    def update(self, kv_nope: torch.Tensor, k_rot: torch.Tensor, *args: object, **kwargs: object) -> None:
        raise _Captured(kv_nope.detach().clone(), k_rot.detach().clone())


def _gptj_to_hf_interleave(d: int) -> torch.Tensor:
    """HF's interleaved output index j holds GPT-J output perm[j]: evens then odds."""
    return torch.cat([torch.arange(0, d, 2), torch.arange(1, d, 2)])


SPECS = [
    RopeSpec(8, 50000.0, "gptj", YarnScaling(factor=4.0, original_max_position=64)),
    RopeSpec(8, 50000.0, "gptj", YarnScaling(factor=32.0, original_max_position=32768)),
    RopeSpec(16, 10000.0, "gptj", None),
]


@pytest.mark.parametrize("spec", SPECS, ids=["tiny-yarn", "k3-yarn-at-d8", "plain"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_context_kv_matches_hf_deepseek_v3_attention_kv_path(spec: RopeSpec, seed: int) -> None:
    hidden, q_lora, kv_lora, n = 48, 24, 16, 9
    cfg = _hf_config(spec, hidden, q_lora, kv_lora)
    attn = hf_ds.DeepseekV3Attention(cfg, layer_idx=0).to(torch.float64)
    rot = hf_ds.DeepseekV3RotaryEmbedding(cfg)
    d = Draw(seed)
    w = d.normal((kv_lora + spec.rotary_dim, hidden), hidden**-0.5)
    norm_w = d.positive((kv_lora,))
    x = d.normal((n, hidden))
    positions = d.integers(0, 64, (n,))
    with torch.no_grad():
        attn.kv_a_proj_with_mqa.weight.copy_(w)
        attn.kv_a_layernorm.weight.copy_(norm_w)
        cos, sin = rot(x[None], positions[None])
        with pytest.raises(_Captured) as cap:
            attn(x[None], (cos.to(torch.float64), sin.to(torch.float64)), None, cache=_CaptureCache())
    hf_kv_c = cap.value.kv_nope[0, 0]  # [N, kv_lora]
    hf_k_pe = cap.value.k_rot[0, 0]  # [N, rope], interleaved order

    kv_c, k_pe = mla.context_kv(x, w[None], norm_w[None], positions, spec, HF_KV_NORM_EPS)
    assert_normwise_close(
        kv_c[0], hf_kv_c, budgets.identity_rtol(max(hidden, kv_lora), budgets.U32), "kv_c vs HF"
    )
    theta_max = float(positions.max()) * float(rope.inv_freq(spec).max())
    # the projection shared by both sides is float64 on both, so only the fp32 angle error remains
    rtol = budgets.fp32_angle_rope_rtol(theta_max) + budgets.f64_identity_rtol(hidden)
    perm = _gptj_to_hf_interleave(spec.rotary_dim)
    assert_normwise_close(k_pe[0][:, perm], hf_k_pe, rtol, "k_pe vs HF interleaved RoPE")


YARN_CASES = [
    YarnScaling(factor=32.0, original_max_position=32768),
    YarnScaling(factor=4.0, original_max_position=64),
    YarnScaling(factor=40.0, original_max_position=4096, beta_fast=16.0, beta_slow=2.0, mscale=0.707,
                mscale_all_dim=1.0),
]


@pytest.mark.parametrize("yarn", YARN_CASES, ids=["k3", "tiny", "mscale-ratio"])
@pytest.mark.parametrize("rotary_dim", [8, 64])
def test_yarn_inv_freq_and_attention_factor_match_hf(yarn: YarnScaling, rotary_dim: int) -> None:
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    spec = RopeSpec(rotary_dim, 50000.0, "gptj", yarn)
    cfg = _hf_config(spec, 48, 24, 16)
    hf_inv, hf_factor = ROPE_INIT_FUNCTIONS["yarn"](cfg)
    ours = rope.inv_freq(spec)
    # HF evaluates in fp32: pow, reciprocal, ramp blend -> at most 4 fp32 roundings per entry
    assert_normwise_close(hf_inv.to(torch.float64), ours, 4 * budgets.U32, "YaRN inv_freq vs HF")
    rel = torch.abs(hf_inv.to(torch.float64) - ours) / ours
    assert float(rel.max()) <= 4 * budgets.U32, f"entrywise YaRN inv_freq error {float(rel.max()):.3e}"
    # the attention factor is a Python float on both sides, same formula in float64
    assert math.isclose(hf_factor, rope.attention_scaling(spec), rel_tol=4 * budgets.U64, abs_tol=0.0)


def test_plain_inv_freq_matches_hf_default() -> None:
    spec = RopeSpec(64, 50000.0, "gptj", None)
    cfg = _hf_config(spec, 48, 24, 16)
    hf_inv, hf_factor = hf_ds.DeepseekV3RotaryEmbedding.compute_default_rope_parameters(cfg)
    assert hf_factor == 1.0 == rope.attention_scaling(spec)
    rel = torch.abs(hf_inv.to(torch.float64) - rope.inv_freq(spec)) / rope.inv_freq(spec)
    assert float(rel.max()) <= 4 * budgets.U32, f"plain inv_freq error {float(rel.max()):.3e}"
