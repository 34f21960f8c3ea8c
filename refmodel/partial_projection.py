"""Partial-projection summation under pipeline parallel, and the DFlash follow-on, in float64.

Mirrors TokenSpeed 0.1.1 `K3DSparkModel.project_target_tap` /
`finalize_target_projection` against `project_target_hidden`, and SGLang's
DFlash `project_target_hidden` / `kv_proj_only` (BRIEF §3): ctx =
RMSNorm(fc(concat_i h_i)) = RMSNorm(sum_stages sum_{i in stage} h_i W_i^T),
W_i the column block [i*H, (i+1)*H) of fc. The norm is applied once, after the
sum. Then per draft layer K/V projections, per-head K norm, NeoX RoPE on K.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

import torch

from k3num.refmodel import checks, rmsnorm
from k3num.refmodel import rope as rope_ops
from k3num.refmodel.geometry import RopeSpec

Stages = Sequence[Sequence[int]]


def check_partition(stages: Stages, num_taps: int) -> list[list[int]]:
    """Check that `stages` partitions range(num_taps) (empty stages allowed)."""
    flat: list[int] = []
    out: list[list[int]] = []
    for s in stages:
        members = [int(i) for i in s]
        out.append(members)
        flat.extend(members)
    if sorted(flat) != list(range(num_taps)):
        raise ValueError(
            f"stages: expected a partition of tap indices 0..{num_taps - 1} "
            f"(each exactly once), got {[list(s) for s in stages]}"
        )
    return out


def _check_taps(taps: torch.Tensor, fc_weight: torch.Tensor) -> tuple[int, int, int]:
    """Dtypes, shapes and the device; the caller checks finiteness with its other tensors (one sync)."""
    checks.float64("taps", taps, (None, None, None), finite=False)
    k, n, h = taps.shape
    checks.float64("fc_weight", fc_weight, (None, k * h), finite=False)
    checks.same_device(taps=taps, fc_weight=fc_weight)
    return k, n, h


def stage_partials(taps: torch.Tensor, fc_weight: torch.Tensor, stages: Stages) -> torch.Tensor:
    """Each stage's partial projection of its own taps.

    taps: [K, N, H]; fc_weight: [H_out, K*H]; stages partition range(K).
    Returns [num_stages, N, H_out]; an empty stage's partial is zeros.
    """
    k, n, h = _check_taps(taps, fc_weight)
    checks.all_finite(taps=taps, fc_weight=fc_weight)
    parts = check_partition(stages, k)
    h_out = fc_weight.shape[0]
    out = torch.zeros(len(parts), n, h_out, dtype=torch.float64, device=taps.device)
    for s, members in enumerate(parts):
        for i in members:
            out[s] += taps[i] @ fc_weight[:, i * h : (i + 1) * h].T  # tap i's column block
    return out


def project_context(
    taps: torch.Tensor,
    fc_weight: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    stages: Stages | None = None,
) -> torch.Tensor:
    """ctx = RMSNorm(sum of stage partials), the norm applied once after the sum.

    taps: [K, N, H]; fc_weight: [H_out, K*H]; norm_weight: [H_out]. With
    stages None the projection is the unsharded concat(taps) @ fc^T. Returns [N, H_out].
    """
    k, n, h = _check_taps(taps, fc_weight)
    checks.float64("norm_weight", norm_weight, (fc_weight.shape[0],), finite=False)
    checks.same_device(taps=taps, norm_weight=norm_weight)
    eps = checks.positive_float("eps", eps)
    if stages is None:
        checks.all_finite(taps=taps, fc_weight=fc_weight, norm_weight=norm_weight)
        concat = taps.permute(1, 0, 2).reshape(n, k * h)  # [N, K*H] = concat_i h_i
        summed = concat @ fc_weight.T
    else:
        checks.all_finite(norm_weight=norm_weight)  # taps and fc_weight: stage_partials checks them
        summed = stage_partials(taps, fc_weight, stages).sum(dim=0)
    return rmsnorm.normalize(summed, norm_weight, eps)


def draft_context_kv(
    ctx: torch.Tensor,
    k_weight: torch.Tensor,
    v_weight: torch.Tensor,
    k_norm_weight: torch.Tensor,
    positions: torch.Tensor,
    rope: RopeSpec,
    eps: float | Sequence[float],
) -> tuple[torch.Tensor, torch.Tensor]:
    """The DFlash draft's context K/V for every draft layer (eps: one value, or one per layer).

    ctx: [N, H]; k_weight, v_weight: [L, KVH*D, H]; k_norm_weight: [L, D];
    positions: [N] int. K is RMS-normed per head with layer l's [D] weight and
    rotated (the spec's style, NeoX for K3-DFlash). Returns k, v: [L, N, KVH, D].
    """
    checks.float64("ctx", ctx, (None, None), finite=False)
    n, h = ctx.shape
    checks.float64("k_weight", k_weight, (None, None, h), finite=False)
    num_layers, width = k_weight.shape[0], k_weight.shape[1]
    checks.float64("v_weight", v_weight, (num_layers, width, h), finite=False)
    checks.float64("k_norm_weight", k_norm_weight, (num_layers, None), finite=False)
    d = k_norm_weight.shape[1]
    if d == 0 or width % d:
        raise ValueError(f"k_weight: expected dim 1 a multiple of head_dim {d}, got {width}")
    checks.integer("positions", positions, (n,))
    checks.same_device(ctx=ctx, k_weight=k_weight, v_weight=v_weight, k_norm_weight=k_norm_weight,
                       positions=positions)
    if isinstance(eps, (list, tuple)):  # one epsilon per draft layer (each layer's k_norm has its own)
        if len(eps) != num_layers:
            raise ValueError(f"eps: expected one value per layer ({num_layers}), got {len(eps)}")
        eps_t: float | torch.Tensor = torch.tensor([checks.positive_float(f"eps[{i}]", e) for i, e in enumerate(eps)],
                                                   dtype=torch.float64, device=ctx.device).view(num_layers, 1, 1, 1)
    else:
        eps_t = checks.positive_float("eps", cast(float, eps))
    deferred = checks.Deferred()  # finiteness and the positions' sign with one sync
    deferred.finite(ctx=ctx, k_weight=k_weight, v_weight=v_weight, k_norm_weight=k_norm_weight)
    if positions.numel():
        deferred.require(positions.min() >= 0,
                         lambda: f"positions: expected values >= 0, got min {int(positions.min())}")
    deferred.raise_first()
    if d < rope.rotary_dim:
        raise ValueError(f"k_norm_weight: head_dim {d} is smaller than rotary_dim {rope.rotary_dim}")
    kvh = width // d
    k = torch.einsum("nh,lwh->lnw", ctx, k_weight).reshape(num_layers, n, kvh, d)
    v = torch.einsum("nh,lwh->lnw", ctx, v_weight).reshape(num_layers, n, kvh, d)
    k = rmsnorm.normalize(k, k_norm_weight.view(num_layers, 1, 1, d), eps_t)  # per head
    k = rope_ops.rotate(k.transpose(0, 1), positions, rope).transpose(0, 1)  # [N, L, KVH, D] view
    return k, v
