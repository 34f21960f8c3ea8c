"""Mirror of the DSpark context-KV path in low precision, step by step as vLLM 0.33.0 runs it.

`K3DSparkModel._precompute_fused_context_kv` (BRIEF §1): one KV-only GEMM in
the weight dtype (fp32 accumulation, one rounding), a layer-major view,
grouped RMSNorm with fp32 math and one rounding, RoPE from an fp32 [cos | sin]
cache built like vLLM's (fp32 angles) with positions repeated per layer, fp32
math and one rounding, then the paged cache write (in place). The unfused
baseline runs each layer's full fused_qkv_a GEMM and discards the Q columns.
Works on any device and any float dtype (float64 inputs compute in float64).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch

from k3num.refmodel import rope as ref_rope
from k3num.refmodel.geometry import RopeSpec


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """The math dtype: fp32 for 16-bit storage, else the storage dtype itself."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def rope_cache(spec: RopeSpec, max_position: int, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """vLLM-style cache [P, rotary_dim] = [cos | sin], angles t * inv_freq evaluated in `dtype` (on the CPU, so
    every device holds the same bits). A new tensor each call: it may be handed to an engine's kernel."""
    if not _keeps(spec, max_position):
        return _table(spec, max_position, dtype, str(torch.device(device)))  # built for this call alone
    return _kept_table(spec, max_position, dtype, str(torch.device(device))).clone()


# tables up to this many elements are kept per (spec, P, dtype, device): 4-8 MB each, 16 of them at most
_SHARED_MAX_ELEMENTS = 1 << 20


def shared_rope_cache(spec: RopeSpec, max_position: int, dtype: torch.dtype,
                      device: torch.device | str) -> torch.Tensor:
    """`rope_cache`'s table, the same tensor for the same arguments: read-only, for the mirror's own reads
    (indexing it makes new tensors). Building a table costs host-side cos/sin and a host-to-device copy that
    waits for the device's queue; a draft step reads one table about 2L times."""
    if not _keeps(spec, max_position):
        return _table(spec, max_position, dtype, str(torch.device(device)))
    return _kept_table(spec, max_position, dtype, str(torch.device(device)))


def _keeps(spec: RopeSpec, max_position: int) -> bool:
    return max_position * spec.rotary_dim <= _SHARED_MAX_ELEMENTS


def _table(spec: RopeSpec, max_position: int, dtype: torch.dtype, device: str) -> torch.Tensor:
    inv = ref_rope.inv_freq(spec).to(dtype)
    t = torch.arange(max_position, dtype=dtype)
    freqs = torch.outer(t, inv)
    m = ref_rope.attention_scaling(spec)
    return torch.cat([freqs.cos() * m, freqs.sin() * m], dim=-1).to(device)


_kept_table = functools.lru_cache(maxsize=16)(_table)


def drop_kept_tables() -> None:
    """Forget the kept tables: a kernel under test that stored outside its buffers may have written into
    them in device memory, as into the oracle's constants (harness/isolation.release_failure calls both)."""
    _kept_table.cache_clear()


def grouped_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [L, N, D], weight [L, D]: fp32 math, one rounding to x's dtype."""
    a = acc_dtype(x.dtype)
    xf = x.to(a)
    y = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps) * weight.to(a)[:, None, :]
    return y.to(x.dtype)


def rotary(x: torch.Tensor, positions: torch.Tensor, cache: torch.Tensor, style: str) -> torch.Tensor:
    """x [M, R] with positions [M]: rotate the first cache-width dims; fp32 math, one rounding."""
    a = acc_dtype(x.dtype)
    d = cache.shape[-1]
    cos, sin = cache[positions, : d // 2].to(a), cache[positions, d // 2 :].to(a)
    xf = x.to(a)
    rot, rest = xf[..., :d], xf[..., d:]
    if style == "gptj":
        u, v = rot[..., 0::2], rot[..., 1::2]
        out = torch.stack([u * cos - v * sin, v * cos + u * sin], dim=-1).flatten(-2)
    else:
        u, v = rot[..., : d // 2], rot[..., d // 2 :]
        out = torch.cat([u * cos - v * sin, v * cos + u * sin], dim=-1)
    return torch.cat([out, rest], dim=-1).to(x.dtype)


def repeat_positions(positions: torch.Tensor, num_layers: int) -> torch.Tensor:
    """vLLM's `repeated.view(L, N).copy_(positions)`: layer-major, [L * N]."""
    return positions.unsqueeze(0).expand(num_layers, -1).reshape(-1)


def norm_rope(
    all_kv: torch.Tensor, kv_norm_weight: torch.Tensor, positions: torch.Tensor, spec: RopeSpec, eps: float,
    *, repeat: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """all_kv [L, N, W] (rounded GEMM output) -> (kv_c [L, N, kv_lora], k_pe [L, N, W - kv_lora])."""
    num_layers, n, width = all_kv.shape
    kv_lora = kv_norm_weight.shape[1]
    kv_c = grouped_rms_norm(all_kv[..., :kv_lora].contiguous(), kv_norm_weight, eps)
    k_pe = all_kv[..., kv_lora:].contiguous().view(num_layers * n, width - kv_lora)
    pos = repeat_positions(positions, num_layers) if repeat else positions
    max_pos = int(positions.max()) + 1 if positions.numel() else 1
    cache = shared_rope_cache(spec, max_pos, torch.float32 if all_kv.dtype != torch.float64 else torch.float64,
                              all_kv.device)
    k_pe = rotary(k_pe, pos, cache, spec.style).view(num_layers, n, width - kv_lora)
    return kv_c, k_pe


def write_cache(caches: torch.Tensor | Sequence[torch.Tensor], kv_c: torch.Tensor, k_pe: torch.Tensor,
                slot_mapping: torch.Tensor) -> None:
    """In place: slot s of layer l -> caches[l][s // bs, s % bs] = [kv_c | k_pe]; s < 0 skipped.

    caches: [L, NB, BS, W], or L per-layer caches [NB, BS, W] with any strides and placement."""
    num_layers, block_size = len(caches), caches[0].shape[1]
    n = kv_c.shape[1]
    slots = slot_mapping if slot_mapping.dim() == 2 else slot_mapping.unsqueeze(0).expand(num_layers, n)
    entries = torch.cat([kv_c, k_pe], dim=-1).to(caches[0].dtype)
    for layer in range(num_layers):
        s = slots[layer].to(torch.int64)
        keep = s >= 0
        caches[layer][s[keep] // block_size, s[keep] % block_size] = entries[layer, keep]


def context_kv_fused(
    context_states: torch.Tensor,
    kv_a_weight: torch.Tensor,
    kv_norm_weight: torch.Tensor,
    positions: torch.Tensor,
    rope: RopeSpec,
    eps: float,
    caches: torch.Tensor | None = None,
    slot_mapping: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    num_layers, width, hidden = kv_a_weight.shape
    n = context_states.shape[0]
    merged = kv_a_weight.reshape(num_layers * width, hidden)  # MergedColumnParallelLinear rows
    all_kv = (context_states @ merged.T).view(n, num_layers, width).permute(1, 0, 2)  # [L, N, W]
    kv_c, k_pe = norm_rope(all_kv, kv_norm_weight, positions, rope, eps)
    if caches is not None and slot_mapping is not None:
        write_cache(caches, kv_c, k_pe, slot_mapping)
    return kv_c, k_pe


def context_kv_unfused(
    context_states: torch.Tensor,
    fused_qkv_a_weight: torch.Tensor,
    kv_norm_weight: torch.Tensor,
    positions: torch.Tensor,
    rope: RopeSpec,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    kv_lora = kv_norm_weight.shape[1]
    q_lora = fused_qkv_a_weight.shape[1] - kv_lora - rope.rotary_dim
    per_layer = [context_states @ w.T for w in fused_qkv_a_weight]  # [N, Q + W] each
    all_kv = torch.stack([full[:, q_lora:] for full in per_layer])  # Q discarded
    return norm_rope(all_kv, kv_norm_weight, positions, rope, eps)
