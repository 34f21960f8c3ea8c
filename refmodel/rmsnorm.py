"""RMSNorm in float64, plain and grouped (one weight row per group).

Mirrors vLLM's `ops.rms_norm` contract including its 2-D weight form used by
the DSpark fused context-KV path: `x: [G, N, D]` with `weight: [G, D]`
normalises group g with row g. Zhang & Sennrich 2019, "Root Mean Square Layer
Normalization": y = x * rsqrt(mean(x^2) + eps) * w.
"""

from __future__ import annotations

import torch

from k3num.refmodel import checks


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMS-normalise the last dim of x.

    x: [..., D] with weight [D]; or x: [G, N, D] with weight [G, D] (grouped).
    Returns a new float64 tensor of x's shape.
    """
    checks.float64("x", x)
    checks.float64("weight", weight)
    checks.same_device(x=x, weight=weight)
    eps = checks.nonnegative_float("eps", eps)
    if x.dim() == 0:
        raise ValueError("x: expected at least 1 dim, got a scalar")
    d = x.shape[-1]
    if weight.dim() == 1:
        checks.float64("weight", weight, (d,))
        w = weight
    elif weight.dim() == 2:
        if x.dim() != 3:
            raise ValueError(f"x: a grouped weight [G, D] needs x [G, N, D], got {list(x.shape)}")
        checks.float64("weight", weight, (x.shape[0], d))
        w = weight.unsqueeze(1)  # [G, 1, D]
    else:
        raise ValueError(f"weight: expected shape [D] or [G, D], got {list(weight.shape)}")
    return normalize(x, w, eps)


def normalize(x: torch.Tensor, weight: torch.Tensor, eps: float | torch.Tensor,
              out: torch.Tensor | None = None) -> torch.Tensor:
    """The unchecked kernel: weight (and a tensor eps) already broadcastable to x ([D] or [G, 1, D]).
    `out` (x's shape, any strides): written and returned instead of a new tensor; the same values."""
    d = x.shape[-1]
    ms = torch.linalg.vector_norm(x, dim=-1, keepdim=True).square_().div_(d)  # mean(x^2), one read of x
    return torch.mul(x, ms.add_(eps).rsqrt_(), out=out).mul_(weight)
