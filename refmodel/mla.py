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

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from k3num.refmodel import checks, rmsnorm
from k3num.refmodel import rope as rope_ops
from k3num.refmodel.geometry import RopeSpec


def _norm_rope(
    all_kv: torch.Tensor,
    kv_norm_weight: torch.Tensor,
    positions: torch.Tensor,
    spec: RopeSpec,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """all_kv: [L, N, kv_lora + rope] -> (kv_c [L, N, kv_lora], k_pe [L, N, rope], entries [L, N, kv_lora + rope]).

    Both results are written into one new buffer, `entries` = [kv_c | k_pe] per token (what the cache
    write stores), and returned as views of it: no concatenation pass, the same values."""
    kv_lora = kv_norm_weight.shape[1]
    entries = torch.empty(all_kv.shape, dtype=all_kv.dtype, device=all_kv.device)
    kv_c = rmsnorm.normalize(all_kv[..., :kv_lora], kv_norm_weight.unsqueeze(1), eps, out=entries[..., :kv_lora])
    # [N, L, rope]: positions shared by layers
    k_pe = rope_ops.rotate(all_kv[..., kv_lora:].transpose(0, 1), positions, spec,
                           out=entries[..., kv_lora:].transpose(0, 1)).transpose(0, 1)
    return kv_c, k_pe, entries


def _check_common(
    context_states: torch.Tensor,
    weight: torch.Tensor,
    kv_norm_weight: torch.Tensor,
    positions: torch.Tensor,
    spec: RopeSpec,
    eps: float,
    weight_name: str,
) -> tuple[int, int, int]:
    checks.float64("context_states", context_states, (None, None), finite=False)
    n, h = context_states.shape
    checks.float64(weight_name, weight, (None, None, h), finite=False)
    num_layers = weight.shape[0]
    checks.float64("kv_norm_weight", kv_norm_weight, (num_layers, None), finite=False)
    checks.integer("positions", positions, (n,))
    checks.same_device(
        context_states=context_states, **{weight_name: weight},
        kv_norm_weight=kv_norm_weight, positions=positions,
    )
    checks.positive_float("eps", eps)
    rope_width = weight.shape[1] - kv_norm_weight.shape[1]
    if weight_name == "kv_a_weight" and rope_width < spec.rotary_dim:
        raise ValueError(
            f"kv_a_weight: expected dim 1 >= kv_lora {kv_norm_weight.shape[1]} + rotary_dim "
            f"{spec.rotary_dim}, got {weight.shape[1]}"
        )
    return n, num_layers, kv_norm_weight.shape[1]


def _queue_value_checks(
    context_states: torch.Tensor, weight: torch.Tensor, kv_norm_weight: torch.Tensor, positions: torch.Tensor,
    weight_name: str, entries: torch.Tensor | None = None,
) -> checks.Deferred:
    """Finiteness and position checks, queued AFTER the GEMM is launched so that on a GPU
    their launches overlap it; resolved by deferred.raise_first() before any result returns.

    With `entries` (the path's [L, N, kv_lora + rope] results, N > 0 and H > 0), the inputs' finiteness
    is read off the results: a NaN or Inf in context_states, the weight or kv_norm_weight reaches
    every output of its row or column (IEEE: Inf * 0 and Inf - Inf are NaN, and no product or sum
    turns a NaN or Inf finite; the norm's rsqrt of an Inf mean square is 0, and 0 * Inf is NaN;
    RoPE's products of an Inf are Inf or NaN), so one reduction of the results replaces three over
    the inputs. A non-finite result whose inputs are finite (an overflow) is rechecked on the inputs
    and passes, as before: the verdict and its message are the input check's."""
    deferred = checks.Deferred()
    tensors = {"context_states": context_states, weight_name: weight, "kv_norm_weight": kv_norm_weight}
    if entries is not None and entries.numel() and context_states.shape[1]:
        deferred.suspect(torch.isfinite(entries.sum()), lambda: checks.all_finite(**tensors))
    else:
        deferred.finite(**tensors)
    if positions.numel():
        deferred.require(positions.min() >= 0,
                         lambda: f"positions: expected values >= 0, got min {int(positions.min())}")
    return deferred


def context_kv(
    context_states: torch.Tensor,
    kv_a_weight: torch.Tensor,
    kv_norm_weight: torch.Tensor,
    positions: torch.Tensor,
    rope: RopeSpec,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The fused context-KV path.

    context_states: [N, H]; kv_a_weight: [L, kv_lora + rope, H] (layer l's
    kv_a_proj_with_mqa); kv_norm_weight: [L, kv_lora]; positions: [N] int.
    Returns kv_c [L, N, kv_lora] (normed) and k_pe [L, N, rope] (rotated).
    """
    all_kv = _checked_gemm(context_states, kv_a_weight)
    _check_common(context_states, kv_a_weight, kv_norm_weight, positions, rope, eps, "kv_a_weight")
    kv_c, k_pe, entries = _norm_rope(all_kv, kv_norm_weight, positions, rope, eps)
    _queue_value_checks(context_states, kv_a_weight, kv_norm_weight, positions, "kv_a_weight",
                        entries).raise_first()
    return kv_c, k_pe


def _checked_gemm(context_states: torch.Tensor, kv_a_weight: torch.Tensor) -> torch.Tensor:
    """`_gemm`, queued as soon as its two operands are known good: a GPU would otherwise idle through
    the host's other checks, which follow it (host-only: they raise before any result is returned)."""
    checks.float64("context_states", context_states, (None, None), finite=False)
    checks.float64("kv_a_weight", kv_a_weight, (None, None, context_states.shape[1]), finite=False)
    checks.same_device(context_states=context_states, kv_a_weight=kv_a_weight)
    return _gemm(context_states, kv_a_weight)


def _gemm(context_states: torch.Tensor, kv_a_weight: torch.Tensor) -> torch.Tensor:
    """The one GEMM of the fused path: [N, H] x [L, W, H] -> all_kv [L, N, W] (a layer-major view)."""
    n = context_states.shape[0]
    num_layers, width = kv_a_weight.shape[0], kv_a_weight.shape[1]
    merged = kv_a_weight.reshape(num_layers * width, -1)  # rows [W*l, W*(l+1)) = layer l
    return (context_states @ merged.T).view(n, num_layers, width).transpose(0, 1)  # [L, N, W]


def context_kv_unfused(
    context_states: torch.Tensor,
    fused_qkv_a_weight: torch.Tensor,
    kv_norm_weight: torch.Tensor,
    positions: torch.Tensor,
    rope: RopeSpec,
    eps: float,
    *,
    rope_head_dim: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The unfused path: per layer the full fused_qkv_a_proj, Q columns discarded.

    fused_qkv_a_weight: [L, q_lora + kv_lora + rope, H]; rows [0, q_lora) are Q.
    rope_head_dim defaults to rope.rotary_dim. Same outputs as `context_kv`.
    """
    n, num_layers, kv_lora = _check_common(
        context_states, fused_qkv_a_weight, kv_norm_weight, positions, rope, eps,
        "fused_qkv_a_weight",
    )
    r = rope.rotary_dim if rope_head_dim is None else rope_head_dim
    if r < rope.rotary_dim:
        raise ValueError(f"rope_head_dim: expected >= rotary_dim {rope.rotary_dim}, got {r}")
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
    kv_c, k_pe, _ = _norm_rope(all_kv, kv_norm_weight, positions, rope, eps)
    _queue_value_checks(context_states, fused_qkv_a_weight, kv_norm_weight, positions,
                        "fused_qkv_a_weight").raise_first()
    return kv_c, k_pe


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
    Returns new caches; the input is not modified. Caches are storage, not
    arithmetic input: untouched slots may hold anything (NaN included, as
    torch.empty memory does) and pass through unchanged.
    """
    checks.float64("kv_c", kv_c, (None, None, None), finite=False)
    checks.float64("k_pe", k_pe, (kv_c.shape[0], kv_c.shape[1], None), finite=False)
    slots = _check_write(caches, kv_c.shape[0], kv_c.shape[1], kv_c.shape[2] + k_pe.shape[2], slot_mapping)
    checks.same_device(caches=caches, kv_c=kv_c, k_pe=k_pe, slot_mapping=slot_mapping)
    deferred = checks.Deferred()
    deferred.finite(kv_c=kv_c, k_pe=k_pe)
    out = _write(caches, torch.cat([kv_c, k_pe], dim=-1), slots, deferred)
    deferred.raise_first()
    return out


def precompute_context_kv(
    context_states: torch.Tensor,
    kv_a_weight: torch.Tensor,
    kv_norm_weight: torch.Tensor,
    positions: torch.Tensor,
    rope: RopeSpec,
    eps: float,
    caches: torch.Tensor | None = None,
    slot_mapping: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The whole context-KV path in one call, as `_precompute_fused_context_kv` runs it.

    `context_kv` then, when slot_mapping is given, `write_mla_cache` into
    caches; slot_mapping None computes only (new caches None). Validation is
    resolved with one device sync at the end. Returns (kv_c, k_pe, new_caches).
    """
    all_kv = _checked_gemm(context_states, kv_a_weight)
    n, num_layers, kv_lora = _check_common(
        context_states, kv_a_weight, kv_norm_weight, positions, rope, eps, "kv_a_weight"
    )
    width = kv_a_weight.shape[1]
    if (caches is None) != (slot_mapping is None):
        raise ValueError("slot_mapping: expected caches and slot_mapping both given or both None")
    slots = None
    if caches is not None and slot_mapping is not None:
        slots = _check_write(caches, num_layers, n, width, slot_mapping)
        checks.same_device(context_states=context_states, caches=caches, slot_mapping=slot_mapping)
    kv_c, k_pe, entries = _norm_rope(all_kv, kv_norm_weight, positions, rope, eps)
    deferred = _queue_value_checks(context_states, kv_a_weight, kv_norm_weight, positions, "kv_a_weight", entries)
    new_caches = None if caches is None or slots is None else _write(caches, entries, slots, deferred)
    deferred.raise_first()
    return kv_c, k_pe, new_caches


def _check_write(
    caches: torch.Tensor, num_layers: int, n: int, width: int, slot_mapping: torch.Tensor
) -> torch.Tensor:
    """Shape checks of a cache write; returns the slots as [L, N]."""
    checks.float64("caches", caches, (num_layers, None, None, width), finite=False)
    if slot_mapping.dim() == 1:
        checks.integer("slot_mapping", slot_mapping, (n,))
        return slot_mapping.unsqueeze(0).expand(num_layers, n)
    checks.integer("slot_mapping", slot_mapping, (num_layers, n))
    return slot_mapping


def _write(caches: torch.Tensor, entries: torch.Tensor, slots: torch.Tensor, deferred: checks.Deferred) -> torch.Tensor:
    """New caches with entries [L, N, width] ([kv_c | k_pe] per token) at slots [L, N]; the range and
    repeated-slot checks are queued on `deferred` (no sync)."""
    plan = _write_plan(caches, slots)
    plan.queue(deferred)
    return plan.write(entries)


@dataclass
class _WritePlan:
    """A cache write before its entries exist: the new caches (a copy of the old, plus one spare row
    that absorbs skipped and out-of-range slots, so the write needs no sync), the flat row of every
    (layer, token), and the range and repeated-slot flags."""

    ext: torch.Tensor  # [L * capacity + 1, width]
    out: torch.Tensor  # ext without the spare row, in the caches' shape
    rows: torch.Tensor | None  # [L * N], None when there are no slots
    flags: list[tuple[torch.Tensor, Callable[[], str]]]

    def queue(self, deferred: checks.Deferred) -> None:
        for ok, message in self.flags:
            deferred.require(ok, message)

    def write(self, entries: torch.Tensor) -> torch.Tensor:
        if self.rows is not None:
            self.ext.index_copy_(0, self.rows, entries.reshape(-1, self.ext.shape[1]))  # row l * N + t
        return self.out


def _write_plan(caches: torch.Tensor, slots: torch.Tensor) -> _WritePlan:
    num_layers, num_blocks, block_size, width = caches.shape
    capacity = num_blocks * block_size
    spare = num_layers * capacity
    ext = torch.empty(spare + 1, width, dtype=caches.dtype, device=caches.device)
    ext[:spare].copy_(caches.view(spare, width))
    out = ext[:spare].view(caches.shape)
    if slots.numel() == 0:
        return _WritePlan(ext, out, None, [])
    s64 = slots.to(torch.int64)
    below = s64 < capacity
    # row l * capacity + s of the flat view = layer l, block s // block_size, offset s % block_size
    rows = torch.where((s64 >= 0) & below, s64 + _layer_base(num_layers, capacity, s64.device), spare).flatten()
    # a slot used twice in a layer: its row is hit more than once (the spare row takes every skip)
    hits = torch.zeros(spare + 1, dtype=torch.int32, device=rows.device)
    hits.index_add_(0, rows, _ones_int32(rows.device).expand(rows.numel()))
    return _WritePlan(ext, out, rows, [
        (below.all(), lambda: (
            f"slot_mapping: expected slots < {capacity} (num_blocks * block_size), got {int(s64.max())}")),
        ((hits[:spare] <= 1).all(), lambda: (
            f"slot_mapping: layer {int((hits[:spare] > 1).nonzero()[0, 0]) // capacity} uses a slot more than once")),
    ])


@functools.lru_cache(maxsize=64)
def _layer_base(num_layers: int, capacity: int, device: torch.device) -> torch.Tensor:
    """[L, 1]: the first flat cache row of each layer (cached per shape and device: read-only)."""
    return capacity * torch.arange(num_layers, device=device)[:, None]


@functools.lru_cache(maxsize=8)
def _ones_int32(device: torch.device) -> torch.Tensor:
    return torch.ones(1, dtype=torch.int32, device=device)
