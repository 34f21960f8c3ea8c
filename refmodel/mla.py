"""The DSpark MLA context-KV path in float64: projection, grouped norm, RoPE, cache write.

Mirrors vLLM 0.33.0 `vllm/models/kimi_k3/nvidia/dspark_mla.py`
(`K3DSparkModel._precompute_fused_context_kv`, BRIEF §1): one GEMM with the L
layers' kv_a_proj_with_mqa weights stacked as rows [W*l, W*(l+1)), a
layer-major view, RMSNorm of kv_c with row l of a [L, kv_lora] weight, RoPE on
k_pe with the context positions repeated per layer, and a paged cache write
slot -> (slot // block_size, slot % block_size). The unfused path (before the
PR) runs each layer's full fused_qkv_a_proj and discards the Q columns.
"""

from __future__ import annotations

import torch

from refmodel import checks, rmsnorm, rope
from refmodel.geometry import RopeSpec


def _norm_rope(
    all_kv: torch.Tensor,
    kv_norm_weight: torch.Tensor,
    positions: torch.Tensor,
    spec: RopeSpec,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """all_kv: [L, N, kv_lora + rope] -> (kv_c [L, N, kv_lora], k_pe [L, N, rope])."""
    kv_lora = kv_norm_weight.shape[1]
    kv_c = rmsnorm.normalize(all_kv[..., :kv_lora], kv_norm_weight.unsqueeze(1), eps)
    k_pe = all_kv[..., kv_lora:].transpose(0, 1)  # [N, L, rope]: positions shared by layers
    k_pe = rope.rotate(k_pe, positions, spec).transpose(0, 1)  # [L, N, rope]
    return kv_c, k_pe


def _check_common(
    context_states: torch.Tensor,
    weight: torch.Tensor,
    kv_norm_weight: torch.Tensor,
    positions: torch.Tensor,
    spec: RopeSpec,
    eps: float,
    weight_name: str,
) -> tuple[int, int, int]:
    checks.float64("context_states", context_states, (None, None))
    n, h = context_states.shape
    checks.float64(weight_name, weight, (None, None, h))
    num_layers = weight.shape[0]
    checks.float64("kv_norm_weight", kv_norm_weight, (num_layers, None))
    checks.integer("positions", positions, (n,))
    checks.same_device(
        context_states=context_states, **{weight_name: weight},
        kv_norm_weight=kv_norm_weight, positions=positions,
    )
    checks.positive_float("eps", eps)
    if positions.numel() and int(positions.min()) < 0:
        raise ValueError(f"positions: expected values >= 0, got min {int(positions.min())}")
    return n, num_layers, kv_norm_weight.shape[1]


def context_kv(
    context_states: torch.Tensor,
    kv_a_weight: torch.Tensor,
    kv_norm_weight: torch.Tensor,
    positions: torch.Tensor,
    rope_spec: RopeSpec,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The fused context-KV path.

    context_states: [N, H]; kv_a_weight: [L, kv_lora + rope, H] (layer l's
    kv_a_proj_with_mqa); kv_norm_weight: [L, kv_lora]; positions: [N] int.
    Returns kv_c [L, N, kv_lora] (normed) and k_pe [L, N, rope] (rotated).
    """
    n, num_layers, kv_lora = _check_common(
        context_states, kv_a_weight, kv_norm_weight, positions, rope_spec, eps, "kv_a_weight"
    )
    width = kv_a_weight.shape[1]
    if width - kv_lora < rope_spec.rotary_dim:
        raise ValueError(
            f"kv_a_weight: expected dim 1 >= kv_lora {kv_lora} + rotary_dim "
            f"{rope_spec.rotary_dim}, got {width}"
        )
    merged = kv_a_weight.reshape(num_layers * width, -1)  # rows [W*l, W*(l+1)) = layer l
    all_kv = (context_states @ merged.T).view(n, num_layers, width).transpose(0, 1)  # [L, N, W]
    return _norm_rope(all_kv, kv_norm_weight, positions, rope_spec, eps)


def context_kv_unfused(
    context_states: torch.Tensor,
    fused_qkv_a_weight: torch.Tensor,
    kv_norm_weight: torch.Tensor,
    positions: torch.Tensor,
    rope_spec: RopeSpec,
    eps: float,
    *,
    rope_head_dim: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The unfused path: per layer the full fused_qkv_a_proj, Q columns discarded.

    fused_qkv_a_weight: [L, q_lora + kv_lora + rope, H]; rows [0, q_lora) are Q.
    rope_head_dim defaults to rope_spec.rotary_dim. Same outputs as `context_kv`.
    """
    n, num_layers, kv_lora = _check_common(
        context_states, fused_qkv_a_weight, kv_norm_weight, positions, rope_spec, eps,
        "fused_qkv_a_weight",
    )
    r = rope_spec.rotary_dim if rope_head_dim is None else rope_head_dim
    if r < rope_spec.rotary_dim:
        raise ValueError(f"rope_head_dim: expected >= rotary_dim {rope_spec.rotary_dim}, got {r}")
    q_lora = fused_qkv_a_weight.shape[1] - kv_lora - r
    if q_lora < 0:
        raise ValueError(
            f"fused_qkv_a_weight: expected dim 1 >= kv_lora {kv_lora} + rope {r}, "
            f"got {fused_qkv_a_weight.shape[1]}"
        )
    per_layer = []
    for layer in range(num_layers):
        full = context_states @ fused_qkv_a_weight[layer].T  # [N, q_lora + kv_lora + rope]
        per_layer.append(full[:, q_lora:])  # Q computed, then discarded
    all_kv = torch.stack(per_layer)  # [L, N, kv_lora + rope]
    return _norm_rope(all_kv, kv_norm_weight, positions, rope_spec, eps)


def write_mla_cache(
    caches: torch.Tensor,
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> torch.Tensor:
    """Write [kv_c | k_pe] of each layer's tokens into its paged cache.

    caches: [L, num_blocks, block_size, kv_lora + rope]; kv_c: [L, N, kv_lora];
    k_pe: [L, N, rope]; slot_mapping: [N] (shared by layers) or [L, N], int.
    Slot s lands at (s // block_size, s % block_size); s < 0 is skipped; a slot
    beyond the cache, or a slot used twice in one layer, is an error.
    Returns new caches; the input is not modified.
    """
    checks.float64("caches", caches, (None, None, None, None))
    num_layers, num_blocks, block_size, width = caches.shape
    checks.float64("kv_c", kv_c, (num_layers, None, None))
    n, kv_lora = kv_c.shape[1], kv_c.shape[2]
    checks.float64("k_pe", k_pe, (num_layers, n, width - kv_lora))
    if slot_mapping.dim() == 1:
        checks.integer("slot_mapping", slot_mapping, (n,))
        slots = slot_mapping.unsqueeze(0).expand(num_layers, n)
    else:
        checks.integer("slot_mapping", slot_mapping, (num_layers, n))
        slots = slot_mapping
    checks.same_device(caches=caches, kv_c=kv_c, k_pe=k_pe, slot_mapping=slot_mapping)
    capacity = num_blocks * block_size
    if slots.numel() and int(slots.max()) >= capacity:
        raise ValueError(
            f"slot_mapping: expected slots < {capacity} (num_blocks * block_size), "
            f"got {int(slots.max())}"
        )
    out = caches.clone()
    flat = out.view(num_layers, capacity, width)  # slot s = row s of the layer's pages
    entries = torch.cat([kv_c, k_pe], dim=-1)  # [L, N, width]
    for layer in range(num_layers):
        s = slots[layer].to(torch.int64)
        keep = s >= 0
        used = s[keep]
        if used.numel() != used.unique().numel():
            raise ValueError(f"slot_mapping: layer {layer} uses a slot more than once")
        flat[layer, used] = entries[layer, keep]
    return out
