"""Mirror of the PP partial-projection summation and the DFlash draft context K/V.

Following TokenSpeed 0.1.1 `project_target_tap` / `finalize_target_projection`
against `project_target_hidden` (BRIEF §3): each stage projects its own taps'
column blocks in the weight dtype (fp32 accumulation, one rounding); partials
cross stages in the transfer dtype (bf16 or fp32) and are summed there in the
given order; RMSNorm (fp32 math, one rounding) once, after the sum. The
unsharded baseline is one GEMM over the concatenated taps, then the norm.
DFlash: per draft layer K/V GEMMs, per-head K RMSNorm, RoPE on K.
"""

from __future__ import annotations

import torch

from k3num.engines.mirror.context_kv import acc_dtype, rotary, shared_rope_cache
from k3num.refmodel.geometry import RopeSpec


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, out_dtype: torch.dtype) -> torch.Tensor:
    a = acc_dtype(out_dtype)
    xf = x.to(a)
    return (xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps) * weight.to(a)).to(out_dtype)


def stage_partial(taps: torch.Tensor, fc_weight: torch.Tensor, members: list[int]) -> torch.Tensor:
    k, n, h = taps.shape
    if not members:
        return torch.zeros(n, fc_weight.shape[0], dtype=taps.dtype, device=taps.device)
    cols = torch.cat([torch.arange(i * h, (i + 1) * h, device=taps.device) for i in members])
    own = taps[members].permute(1, 0, 2).reshape(n, len(members) * h)  # [N, |stage| * H]
    return own @ fc_weight[:, cols].T  # the stage's column blocks only


def finalize_projection(
    partials: list[torch.Tensor], norm_weight: torch.Tensor, eps: float, transfer_dtype: torch.dtype,
    order: list[int],
) -> torch.Tensor:
    out_dtype = partials[0].dtype
    acc = torch.zeros_like(partials[0], dtype=transfer_dtype)
    for s in order:
        acc = acc + partials[s].to(transfer_dtype)  # one addition per stage, in the transfer dtype
    return rms_norm(acc, norm_weight, eps, out_dtype)


def project_unsharded(
    taps: torch.Tensor, fc_weight: torch.Tensor, norm_weight: torch.Tensor, eps: float
) -> torch.Tensor:
    k, n, h = taps.shape
    y = taps.permute(1, 0, 2).reshape(n, k * h) @ fc_weight.T
    return rms_norm(y, norm_weight, eps, taps.dtype)


def segmented_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., S, H], weight [S, H]: segment s RMS-normed by weight row s, fp32 math, one rounding (as
    TokenSpeed's `_segmented_rmsnorm_kernel`, the per-tap fc_norm of a DSpark draft)."""
    return rms_norm(x, weight, eps, x.dtype)


def project_unsharded_fc_norm(taps: torch.Tensor, fc_weight: torch.Tensor, fc_norm: torch.Tensor | None,
                              norm_weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`project_unsharded` with the draft's fc_norm (fc_norm [K, H], one row per tap; None: without)."""
    if fc_norm is not None:
        taps = segmented_rms_norm(taps.permute(1, 0, 2), fc_norm, eps).permute(1, 0, 2)
    return project_unsharded(taps, fc_weight, norm_weight, eps)


def draft_context_kv(
    ctx: torch.Tensor, k_weight: torch.Tensor, v_weight: torch.Tensor, k_norm_weight: torch.Tensor,
    positions: torch.Tensor, rope: RopeSpec, eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    num_layers, width, _ = k_weight.shape
    d = k_norm_weight.shape[1]
    n = ctx.shape[0]
    max_pos = int(positions.max()) + 1 if positions.numel() else 1
    cache = shared_rope_cache(rope, max_pos, acc_dtype(ctx.dtype), ctx.device)
    ks, vs = [], []
    for layer in range(num_layers):
        k = (ctx @ k_weight[layer].T).view(n, width // d, d)
        v = (ctx @ v_weight[layer].T).view(n, width // d, d)
        e = eps[layer] if isinstance(eps, (list, tuple)) else eps  # one epsilon, or one per layer
        k = rms_norm(k, k_norm_weight[layer], e, ctx.dtype)  # per head, shared [D] weight
        k = rotary(k.reshape(n * (width // d), d), positions.repeat_interleave(width // d), cache, rope.style)
        ks.append(k.view(n, width // d, d))
        vs.append(v)
    return torch.stack(ks), torch.stack(vs)
