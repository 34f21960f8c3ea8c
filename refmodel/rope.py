"""Rotary position embedding in float64: plain and YaRN, GPT-J and NeoX pairing.

Mirrors the numerics of vLLM's `RotaryEmbedding` / `DeepseekScalingRotaryEmbedding`
(cos/sin cache laid out [cos | sin], YaRN inverse frequencies blended by a
linear ramp between the correction dims, cos/sin scaled by the YaRN mscale
ratio) and HF transformers' `_compute_yarn_parameters` (truncated correction
range), but evaluates every angle in float64. The paper: Peng et al. 2023,
"YaRN: Efficient Context Window Extension of Large Language Models".
"""

from __future__ import annotations

import functools
import math

import torch

from k3num.refmodel import checks
from k3num.refmodel.geometry import RopeSpec


def _yarn_mscale(scale: float, mscale: float) -> float:
    return 1.0 if scale <= 1.0 else 0.1 * mscale * math.log(scale) + 1.0


def attention_scaling(spec: RopeSpec) -> float:
    """The factor cos and sin are multiplied by: 1, or the YaRN mscale ratio."""
    y = spec.yarn
    if y is None:
        return 1.0
    return _yarn_mscale(y.factor, y.mscale) / _yarn_mscale(y.factor, y.mscale_all_dim)


def softmax_scale_factor(spec: RopeSpec) -> float:
    """What YaRN multiplies an MLA attention's softmax scale by, as DeepSeek-V2/V3 (and the DSpark drafts built
    on them) do: mscale(factor, mscale_all_dim) squared, where mscale(s, m) = 0.1 m ln s + 1 (1 for s <= 1, and
    for m = 0, a config without `mscale_all_dim`); 1 without YaRN. (GQA models in HF's Qwen convention scale
    cos/sin only: `attention_scaling`.)"""
    y = spec.yarn
    return 1.0 if y is None else _yarn_mscale(y.factor, y.mscale_all_dim) ** 2


def correction_range(spec: RopeSpec) -> tuple[int, int]:
    """YaRN's [low, high] pair-index range over which the ramp blends (truncated)."""
    y = spec.yarn
    if y is None:
        raise ValueError("spec.yarn: expected a YarnScaling, got None")
    d, base = spec.rotary_dim, spec.theta

    def dim_for(rotations: float) -> float:
        # the pair index whose wavelength fits `rotations` turns in the original context
        return d * math.log(y.original_max_position / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low = math.floor(dim_for(y.beta_fast))
    high = math.ceil(dim_for(y.beta_slow))
    return max(low, 0), min(high, d - 1)


def inv_freq(spec: RopeSpec, device: torch.device | str = "cpu") -> torch.Tensor:
    """Inverse frequencies, float64: [rotary_dim / 2].

    Always evaluated on the CPU (so every device sees the same bits) and
    cached per (spec, device): a host-to-device copy inside a GPU call would
    otherwise stall the host behind queued kernels. The result is read-only
    by convention; callers must not modify it.
    """
    return _inv_freq_on(spec, str(torch.device(device)))


@functools.lru_cache(maxsize=128)
def _inv_freq_on(spec: RopeSpec, device: str) -> torch.Tensor:
    return _inv_freq_cpu(spec).to(device)


def _inv_freq_cpu(spec: RopeSpec) -> torch.Tensor:
    d = spec.rotary_dim
    exponents = torch.arange(0, d, 2, dtype=torch.float64) / d
    pos_freqs = torch.pow(torch.tensor(spec.theta, dtype=torch.float64), exponents)
    extrapolation = 1.0 / pos_freqs
    if spec.yarn is None:
        return extrapolation
    interpolation = 1.0 / (spec.yarn.factor * pos_freqs)
    low, high = correction_range(spec)
    hi = high + 0.001 if low == high else float(high)  # YaRN's guard against 0/0
    ramp = ((torch.arange(d // 2, dtype=torch.float64) - low) / (hi - low)).clamp(0, 1)
    keep = 1.0 - ramp  # 1 -> pure extrapolation (high-frequency pairs), 0 -> interpolation
    return interpolation * (1.0 - keep) + extrapolation * keep


def cos_sin(positions: torch.Tensor, spec: RopeSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of every (position, pair) angle, scaled: ([*P, d/2], [*P, d/2])."""
    freqs = inv_freq(spec, positions.device)
    angles = positions.to(torch.float64).unsqueeze(-1) * freqs  # [*P, d/2]
    scale = attention_scaling(spec)
    if scale == 1.0:  # x * 1.0 is x: two passes saved, the same values
        return torch.cos(angles), torch.sin(angles)
    return torch.cos(angles) * scale, torch.sin(angles) * scale


def cos_sin_table(spec: RopeSpec, max_position: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """The rotary cache as vLLM lays it out: [max_position, rotary_dim] = [cos | sin]."""
    if not isinstance(max_position, int) or max_position <= 0:
        raise ValueError(f"max_position: expected a positive int, got {max_position!r}")
    pos = torch.arange(max_position, dtype=torch.int64, device=device)
    c, s = cos_sin(pos, spec)
    return torch.cat([c, s], dim=-1)


def apply_rope(x: torch.Tensor, positions: torch.Tensor, spec: RopeSpec) -> torch.Tensor:
    """Rotate the first `rotary_dim` dims of every head; the rest pass through.

    x: [N, *, head_dim] float64 (head_dim >= rotary_dim); positions: [N] int (>= 0).
    Returns a new tensor of x's shape.
    """
    checks.float64("x", x)
    if x.dim() < 2:
        raise ValueError(f"x: expected shape [N, *, head_dim], got {list(x.shape)}")
    n = x.shape[0]
    checks.integer("positions", positions, (n,))
    checks.same_device(x=x, positions=positions)
    if positions.numel() and int(positions.min()) < 0:
        raise ValueError(f"positions: expected values >= 0, got min {int(positions.min())}")
    d = spec.rotary_dim
    if x.shape[-1] < d:
        raise ValueError(f"x: expected last dim >= rotary_dim {d}, got {x.shape[-1]}")
    return rotate(x, positions, spec)


def rotate(x: torch.Tensor, positions: torch.Tensor, spec: RopeSpec, out: torch.Tensor | None = None) -> torch.Tensor:
    """The unchecked kernel of `apply_rope` (same shapes, no validation). `out` (x's shape, any strides,
    not overlapping x): written and returned instead of a new tensor; the same values."""
    n, d = x.shape[0], spec.rotary_dim
    c, s = cos_sin(positions, spec)  # [N, d/2]
    view = (n,) + (1,) * (x.dim() - 2) + (d // 2,)
    c, s = c.view(view), s.view(view)
    if out is None:
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    rot, rest = x[..., :d], x[..., d:]
    if spec.style == "gptj":
        a, b = rot[..., 0::2], rot[..., 1::2]  # pairs (2i, 2i+1)
        first, second = out[..., 0:d:2], out[..., 1:d:2]
    else:
        a, b = rot[..., : d // 2], rot[..., d // 2 :]  # pairs (i, i + d/2)
        first, second = out[..., : d // 2], out[..., d // 2 : d]
    torch.sub(a * c, b * s, out=first)
    torch.add(b * c, a * s, out=second)
    if rest.shape[-1]:
        out[..., d:].copy_(rest)
    return out
