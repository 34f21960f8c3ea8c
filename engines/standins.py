"""Stand-ins for engine layers and compiled ops that exist only in an installed engine.

Each follows the op's documented numerics (BRIEF §4): fp32 math on the storage values, one rounding
back to the storage dtype. They are the mirror's own kernels (engines.mirror), so every adapter's
stand-ins compute the same thing and are named in the CSV's `real_ops`.
"""

from __future__ import annotations

import torch

from k3num.engines.mirror import context_kv as mirror_ckv
from k3num.engines.mirror import projection as mirror_proj


class RMSNorm:
    """An RMSNorm layer (`.weight`, `.variance_epsilon`): fp32 math, one rounding to the input dtype."""

    def __init__(self, weight: torch.Tensor, eps: float) -> None:
        self.weight, self.variance_epsilon = weight, eps

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return mirror_proj.rms_norm(x, self.weight, self.variance_epsilon, x.dtype)


class Linear:
    """An unquantized replicated linear layer returning (output, bias) like the engines' linear layers."""

    def __init__(self, weight: torch.Tensor) -> None:
        self.weight = weight

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, None]:
        return torch.nn.functional.linear(x, self.weight), None


def rms_norm_into(out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    """vLLM's ops.rms_norm: weight [D], or [L, D] against x [L, N, D] (row l normalises group l)."""
    if weight.dim() == 2:
        out.copy_(mirror_ckv.grouped_rms_norm(x, weight, eps))
    else:
        out.copy_(mirror_proj.rms_norm(x, weight, eps, out.dtype))


def rotate_heads(positions: torch.Tensor, x: torch.Tensor, cos_sin_cache: torch.Tensor, is_neox: bool
                 ) -> torch.Tensor:
    """x [M, 1, R] rotated with cache rows [cos | sin] at positions [M] (dims past the cache width pass)."""
    m, _, r = x.shape
    style = "neox" if is_neox else "gptj"
    return mirror_ckv.rotary(x.reshape(m, r), positions, cos_sin_cache, style).view(m, 1, r)


def write_slots(cache: torch.Tensor, kv_c: torch.Tensor, k_pe: torch.Tensor, slots: torch.Tensor) -> None:
    """One layer's paged write, in place: cache [NB, BS, W], kv_c [N, kv_lora], k_pe [N, (1,) R]."""
    mirror_ckv.write_cache(cache[None], kv_c[None], k_pe.reshape(k_pe.shape[0], -1)[None], slots)


def _write_rows(cache: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor) -> None:
    """rows [T, W] into cache [NB, BS, W] at slots [T] (< 0 skipped)."""
    keep = slots >= 0
    s = slots[keep].to(torch.int64)
    cache[s // cache.shape[1], s % cache.shape[1]] = rows[keep]


def write_fp8_unchecked(kv_c: torch.Tensor, k_pe: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor,
                        kv_cache_dtype: str, scale: torch.Tensor) -> None:
    """sat-RNE(fl32(x / scale)) into the uint8 cache at the slots (< 0 skipped), the scale taken as it is."""
    fmt = {"fp8_e4m3": torch.float8_e4m3fn, "fp8": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}[kv_cache_dtype]
    q = torch.cat([kv_c, k_pe], -1).float() / scale.float()
    big = torch.finfo(fmt).max
    _write_rows(cache, torch.where(torch.isnan(q), q, q.clamp(-big, big)).to(fmt).view(torch.uint8), slots)


def _check_scales(scales: torch.Tensor | None) -> None:
    """The reference's answer to a zero or non-finite FP8 scale: refuse (x / scale would saturate)."""
    if scales is None:
        raise ValueError("an FP8 KV cache needs its scales")
    bad = ~(torch.isfinite(scales) & (scales > 0))
    if bool(bad.any()):
        raise ValueError(f"FP8 KV scales must be finite and > 0; got {scales.tolist()}")


class ContextKVOps:
    """The three compiled ops of vLLM's fused context-KV path, as per-op subjects (the mirror's own
    kernels here; engines with the real ops bind theirs under the same interface):

    - rms_norm_grouped(x [L, N, D], weight [L, D], eps) -> out [L, N, D]: row l of the weight
      normalises group l; fp32 math, one rounding.
    - rotary(positions [M], x [M, 1, R], cos_sin_cache [P, R], is_neox) -> rotated copy of x.
    - insert_grouped(kv_c [L, N, C], k_pe [L, N, R], caches: L tensors [NB, BS, C + R] sharing one
      block layout, slot_mapping [L, N]) -> None: slot s of layer l lands at caches[l][s // BS, s % BS];
      s < 0 skipped; nothing else written.
    - insert_per_layer(kv_c [N, C], k_pe [N, R], cache [NB, BS, C + R], slots [N]) -> None: one layer's
      insert (vLLM's `concat_and_cache_mla`, what `do_kv_cache_update` calls), the same placement.
    Both take `kv_cache_dtype` ("auto", or "fp8_e4m3" / "fp8_e5m2" for a uint8 cache) and the scales
    (grouped: kv_scales [L] float32; per layer: scale [1]): an FP8 cache holds sat-RNE(fl32(x / scale)); a
    zero or non-finite scale is refused (ValueError) before anything is written.
    """

    @staticmethod
    def rms_norm_grouped(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return mirror_ckv.grouped_rms_norm(x, weight, eps)

    @staticmethod
    def rotary(positions: torch.Tensor, x: torch.Tensor, cos_sin_cache: torch.Tensor, is_neox: bool) -> torch.Tensor:
        return rotate_heads(positions, x, cos_sin_cache, is_neox)

    @staticmethod
    def insert_grouped(kv_c: torch.Tensor, k_pe: torch.Tensor, caches: list[torch.Tensor],
                       slot_mapping: torch.Tensor, kv_cache_dtype: str = "auto",
                       kv_scales: torch.Tensor | None = None) -> None:
        if kv_cache_dtype != "auto":
            _check_scales(kv_scales)  # every layer's, before any is written
        if kv_cache_dtype == "auto":
            mirror_ckv.write_cache(caches, kv_c, k_pe, slot_mapping)
            return
        for layer, cache in enumerate(caches):
            ContextKVOps.insert_per_layer(kv_c[layer], k_pe[layer], cache, slot_mapping[layer], kv_cache_dtype,
                                          kv_scales[layer:layer + 1])

    @staticmethod
    def insert_per_layer(kv_c: torch.Tensor, k_pe: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor,
                         kv_cache_dtype: str = "auto", scale: torch.Tensor | None = None) -> None:
        if kv_cache_dtype == "auto":
            mirror_ckv.write_cache([cache], kv_c[None], k_pe[None], slots[None])
            return
        _check_scales(scale)
        write_fp8_unchecked(kv_c, k_pe, cache, slots, kv_cache_dtype, scale)


def _rotate32(x: torch.Tensor, positions: torch.Tensor | None, table: torch.Tensor | None) -> torch.Tensor:
    """x [T, *, R] as fp32, its pairs (2i, 2i+1) rotated by table rows [cos | sin] at positions [T] in fp32, not
    rounded back (the mirror's GPT-J rotary on fp32 values; no table: x as fp32, unrotated)."""
    xf = x.float()
    if table is None or positions is None:
        return xf
    rows_per_token = xf[0].numel() // xf.shape[-1]
    flat = mirror_ckv.rotary(xf.reshape(-1, xf.shape[-1]), positions.repeat_interleave(rows_per_token), table, "gptj")
    return flat.view(xf.shape)


def _e4m3(x32: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    """fp32 values times a reciprocal scale, clamped to E4M3's largest finite value, rounded to nearest even."""
    fmt = torch.float8_e4m3fn
    big = torch.finfo(fmt).max
    return (x32 * scale_inv.float().reshape(())).clamp(-big, big).to(fmt)


class MlaEpilogue:
    """The MLA layer's fused prefill epilogue (vLLM's fused_mla_key_concat_kv_cache ops, what the draft's own
    MLA layers write their cache with; refmodel/mla_epilogue.py states it in float64), the mirror's own: fp32
    math on the storage values, one rounding per output element.

    - insert(q [T, H, P + R] (its rope dims rotated in place), k_nope [T, H, P], k_pe [T, R], kv_c [T, C],
      cache [NB, BS, C + R] (q's dtype; written), slots [T], positions [T] | None, cos_sin_cache [M, R] fp32
      | None) -> k [T, H, P + R]: [k_nope | rot(k_pe)] per head; slot t gets [kv_c | rot(k_pe)], t < 0 skipped.
    - insert_fp8(q, k_nope, k_pe, kv_c, v [T, H, V], cache [NB, BS, C + R] uint8, slots, q_scale_inv,
      k_scale_inv, v_scale_inv, cache_scale_inv (fp32 [1] each), positions, cos_sin_cache) ->
      (q8 [T, H, P + R], k8 [T, H, P + R], v8 [T, H, V]) E4M3: each output times its own reciprocal scale,
      clamped, rounded once (the cache with cache_scale_inv); q is not written.
    - decode(ql_nope [T, H, C], q_pe [T, H, R], kv_c [T, C], k_pe [T, R], cache [NB, BS, C + R], slots [T],
      q_scale_inv=None, cache_scale_inv=None (fp32 [1] each: both or neither; an fp8 query and a uint8 cache),
      positions=None, cos_sin_cache=None) -> mqa_q [T, H, C + R] = [ql_nope | rot(q_pe)] (bf16, or E4M3 times
      q_scale_inv); slot t gets [kv_c | rot(k_pe)] as the prefill inserts write it.
    """

    @staticmethod
    def insert(q: torch.Tensor, k_nope: torch.Tensor, k_pe: torch.Tensor, kv_c: torch.Tensor, cache: torch.Tensor,
               slots: torch.Tensor, positions: torch.Tensor | None = None,
               cos_sin_cache: torch.Tensor | None = None) -> torch.Tensor:
        t, h, p = k_nope.shape
        pe = _rotate32(k_pe, positions, cos_sin_cache).to(k_nope.dtype)
        if cos_sin_cache is not None:
            q[..., p:] = _rotate32(q[..., p:], positions, cos_sin_cache).to(q.dtype)
        _write_rows(cache, torch.cat([kv_c, pe], -1), slots)
        return torch.cat([k_nope, pe[:, None, :].expand(t, h, pe.shape[-1])], -1)

    @staticmethod
    def insert_fp8(q: torch.Tensor, k_nope: torch.Tensor, k_pe: torch.Tensor, kv_c: torch.Tensor, v: torch.Tensor,
                   cache: torch.Tensor, slots: torch.Tensor, q_scale_inv: torch.Tensor, k_scale_inv: torch.Tensor,
                   v_scale_inv: torch.Tensor, cache_scale_inv: torch.Tensor, positions: torch.Tensor | None = None,
                   cos_sin_cache: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        t, h, p = k_nope.shape
        pe = _rotate32(k_pe, positions, cos_sin_cache)
        q32 = torch.cat([q[..., :p].float(), _rotate32(q[..., p:], positions, cos_sin_cache)], -1)
        k32 = torch.cat([k_nope.float(), pe[:, None, :].expand(t, h, pe.shape[-1])], -1)
        _write_rows(cache, _e4m3(torch.cat([kv_c.float(), pe], -1), cache_scale_inv).view(torch.uint8), slots)
        return _e4m3(q32, q_scale_inv), _e4m3(k32, k_scale_inv), _e4m3(v.float(), v_scale_inv)

    @staticmethod
    def decode(ql_nope: torch.Tensor, q_pe: torch.Tensor, kv_c: torch.Tensor, k_pe: torch.Tensor,
               cache: torch.Tensor, slots: torch.Tensor, q_scale_inv: torch.Tensor | None = None,
               cache_scale_inv: torch.Tensor | None = None, positions: torch.Tensor | None = None,
               cos_sin_cache: torch.Tensor | None = None) -> torch.Tensor:
        q32 = torch.cat([ql_nope.float(), _rotate32(q_pe, positions, cos_sin_cache)], -1)
        entry32 = torch.cat([kv_c.float(), _rotate32(k_pe, positions, cos_sin_cache)], -1)
        if q_scale_inv is None:
            _write_rows(cache, entry32.to(kv_c.dtype), slots)
            return q32.to(ql_nope.dtype)
        _write_rows(cache, _e4m3(entry32, cache_scale_inv).view(torch.uint8), slots)
        return _e4m3(q32, q_scale_inv)
