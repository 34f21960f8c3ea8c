"""Exact dequantisation of the K3 checkpoint formats, and quantisers to build fixtures.

Formats (BRIEF §1, read in compressed-tensors and DeepSeek's code):
- FP8 block (DeepSeek): float8_e4m3fn weight [M, N] with `weight_scale_inv`
  fp32 [cdiv(M,128), cdiv(N,128)]; w[i, j] = fp8[i, j] * s[i // 128, j // 128].
  Exact in float64 (4-bit x 24-bit significands fit in 53 bits).
- NVFP4, compressed-tensors: `weight_packed` uint8 [out, in/2], low nibble =
  even column, nibble bit 3 = sign, bits 0-2 index E2M1; `weight_scale`
  float8_e4m3fn [out, in/16]; `weight_global_scale` fp32 [1];
  w = e2m1 * fp32(scale) / global_scale (the product is exact; the division
  is one float64 rounding).
- NVFP4, ModelOpt: `weight` (packed as above), `weight_scale`, `weight_scale_2`;
  w = e2m1 * scale * scale_2, exact in float64.
These functions take storage dtypes (uint8, float8, float32), not float64:
they are the boundary where quantised tensors enter the float64 oracle.
"""

from __future__ import annotations

import math

import torch

FP8_BLOCK = 128
NVFP4_GROUP = 16
E4M3_MAX = 448.0
E2M1_MAX = 6.0
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def _require(name: str, t: object, dtype: torch.dtype, dims: int) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dtype != dtype:
        raise ValueError(f"{name}: expected dtype {dtype}, got {t.dtype}")
    if t.dim() != dims:
        raise ValueError(f"{name}: expected {dims} dims, got shape {list(t.shape)}")
    return t


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def dequantize_fp8_block(weight: torch.Tensor, weight_scale_inv: torch.Tensor) -> torch.Tensor:
    """weight: [M, N] float8_e4m3fn; weight_scale_inv: [cdiv(M,128), cdiv(N,128)] fp32 -> [M, N] float64."""
    _require("weight", weight, torch.float8_e4m3fn, 2)
    _require("weight_scale_inv", weight_scale_inv, torch.float32, 2)
    m, n = weight.shape
    want = (_cdiv(m, FP8_BLOCK), _cdiv(n, FP8_BLOCK))
    if tuple(weight_scale_inv.shape) != want:
        raise ValueError(f"weight_scale_inv: expected shape {list(want)}, got {list(weight_scale_inv.shape)}")
    s = weight_scale_inv.to(torch.float64)
    s = s.repeat_interleave(FP8_BLOCK, 0)[:m].repeat_interleave(FP8_BLOCK, 1)[:, :n]
    return weight.to(torch.float64) * s


def quantize_fp8_block(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w: [M, N] float64 -> (float8_e4m3fn [M, N], weight_scale_inv fp32 [cdiv(M,128), cdiv(N,128)])."""
    _require("w", w, torch.float64, 2)
    m, n = w.shape
    bm, bn = _cdiv(m, FP8_BLOCK), _cdiv(n, FP8_BLOCK)
    padded = torch.zeros(bm * FP8_BLOCK, bn * FP8_BLOCK, dtype=torch.float64, device=w.device)
    padded[:m, :n] = w
    amax = padded.view(bm, FP8_BLOCK, bn, FP8_BLOCK).abs().amax(dim=(1, 3))  # [bm, bn]
    scale = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax)).to(torch.float32)
    s = scale.to(torch.float64).repeat_interleave(FP8_BLOCK, 0)[:m].repeat_interleave(FP8_BLOCK, 1)[:, :n]
    q = (w / s).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q, scale


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """packed: [R, C/2] uint8 (low nibble = even column) -> [R, C] float64 E2M1 values."""
    _require("packed", packed, torch.uint8, 2)
    lut = torch.tensor(E2M1_VALUES, dtype=torch.float64, device=packed.device)
    nibbles = torch.stack([packed & 0x0F, packed >> 4], dim=-1).flatten(-2).to(torch.int64)  # [R, C]
    sign = torch.where((nibbles & 0x8) != 0, -1.0, 1.0).to(torch.float64)
    return sign * lut[nibbles & 0x7]


def pack_e2m1(values: torch.Tensor) -> torch.Tensor:
    """values: [R, C] float64 already on the E2M1 grid -> [R, C/2] uint8."""
    _require("values", values, torch.float64, 2)
    if values.shape[1] % 2:
        raise ValueError(f"values: expected an even number of columns, got {values.shape[1]}")
    lut = torch.tensor(E2M1_VALUES, dtype=torch.float64, device=values.device)
    idx = (values.abs().unsqueeze(-1) - lut).abs().argmin(dim=-1)
    if not torch.equal(lut[idx], values.abs()):
        raise ValueError("values: expected every value on the E2M1 grid")
    nib = (idx | (torch.signbit(values).to(torch.int64) << 3)).to(torch.uint8)
    return nib[:, 0::2] | (nib[:, 1::2] << 4)


def _round_e2m1(x: torch.Tensor) -> torch.Tensor:
    lut = torch.tensor(E2M1_VALUES, dtype=torch.float64, device=x.device)
    idx = (x.abs().clamp(max=E2M1_MAX).unsqueeze(-1) - lut).abs().argmin(dim=-1)
    return torch.where(x < 0, -lut[idx], lut[idx])


def _group_scales(w: torch.Tensor) -> torch.Tensor:
    rows, cols = w.shape
    if cols % NVFP4_GROUP:
        raise ValueError(f"w: expected columns a multiple of {NVFP4_GROUP}, got {cols}")
    return w.view(rows, cols // NVFP4_GROUP, NVFP4_GROUP).abs().amax(dim=-1)  # [R, C/16]


def quantize_nvfp4(w: torch.Tensor, *, naming: str = "compressed-tensors") -> dict[str, torch.Tensor]:
    """w: [R, C] float64 -> the checkpoint tensors of one NVFP4 linear.

    naming "compressed-tensors": weight_packed, weight_scale, weight_global_scale;
    "modelopt": weight, weight_scale, weight_scale_2.
    """
    _require("w", w, torch.float64, 2)
    if naming not in ("compressed-tensors", "modelopt"):
        raise ValueError(f"naming: expected 'compressed-tensors' or 'modelopt', got {naming!r}")
    amax = float(w.abs().max()) if w.numel() else 0.0
    global_scale = torch.tensor([E4M3_MAX * E2M1_MAX / amax if amax > 0 else 1.0], dtype=torch.float32)
    g = float(global_scale)
    scale = (_group_scales(w) / E2M1_MAX * g).clamp(max=E4M3_MAX).to(torch.float8_e4m3fn)
    s = scale.to(torch.float64).repeat_interleave(NVFP4_GROUP, dim=1)
    q = _round_e2m1(torch.where(s > 0, w * g / torch.where(s > 0, s, 1.0), 0.0))
    packed = pack_e2m1(q)
    if naming == "compressed-tensors":
        return {"weight_packed": packed, "weight_scale": scale, "weight_global_scale": global_scale}
    return {"weight": packed, "weight_scale": scale, "weight_scale_2": (1.0 / global_scale).to(torch.float32)}


def _nvfp4_parts(packed: torch.Tensor, weight_scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    values = unpack_e2m1(packed)
    _require("weight_scale", weight_scale, torch.float8_e4m3fn, 2)
    want = (values.shape[0], values.shape[1] // NVFP4_GROUP)
    if tuple(weight_scale.shape) != want:
        raise ValueError(f"weight_scale: expected shape {list(want)}, got {list(weight_scale.shape)}")
    return values, weight_scale.to(torch.float64).repeat_interleave(NVFP4_GROUP, dim=1)


def dequantize_nvfp4(
    weight_packed: torch.Tensor, weight_scale: torch.Tensor, weight_global_scale: torch.Tensor
) -> torch.Tensor:
    """compressed-tensors NVFP4 -> [out, in] float64: e2m1 * scale / global_scale."""
    values, s = _nvfp4_parts(weight_packed, weight_scale)
    _require("weight_global_scale", weight_global_scale, torch.float32, 1)
    return values * s / weight_global_scale.to(torch.float64)


def dequantize_nvfp4_modelopt(
    weight: torch.Tensor, weight_scale: torch.Tensor, weight_scale_2: torch.Tensor
) -> torch.Tensor:
    """ModelOpt NVFP4 -> [out, in] float64: e2m1 * scale * scale_2."""
    values, s = _nvfp4_parts(weight, weight_scale)
    _require("weight_scale_2", weight_scale_2, torch.float32, 1)
    return values * s * weight_scale_2.to(torch.float64)


FP8_KV_FORMATS = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


def fp8_kv_entry(x: torch.Tensor, scale: float, kv_cache_dtype: str) -> torch.Tensor:
    """The bytes an FP8 KV cache holds for `x` at `scale` (vLLM 0.33.0's `fp8::scaled_convert`,
    csrc/quantization/w8a8/fp8/nvidia/quant_utils.cuh: `__nv_cvt_float_to_fp8(float(x) / scale,
    __NV_SATFINITE, E4M3 | E5M2)`): the fp32 quotient, correctly rounded, saturated to the format's
    largest finite value (NaN stays NaN), rounded to nearest even in the format.

    x: any shape, a float dtype (bf16 in the cache path); scale: finite and > 0 (ValueError otherwise:
    what the engine does then is a property's finding, not this model's); returns uint8, x's shape.
    This is an exact contract (a format conversion), not a float64 reference: it is stated in fp32
    because the kernel divides in fp32.
    """
    if kv_cache_dtype not in FP8_KV_FORMATS:
        raise ValueError(f"kv_cache_dtype: expected one of {sorted(FP8_KV_FORMATS)}, got {kv_cache_dtype!r}")
    if not x.is_floating_point():
        raise ValueError(f"x: expected a floating dtype, got {x.dtype}")
    if not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"scale: expected finite and > 0, got {scale}")
    return fp8_quotient_bytes(x, scale, kv_cache_dtype)


def fp8_quotient_bytes(x: torch.Tensor, scale: float, kv_cache_dtype: str) -> torch.Tensor:
    """`fp8_kv_entry`'s formula for any scale, 0 and non-finite ones included: the fp32 quotient x / scale
    (+-inf for a zero scale, +-0 for an infinite one, NaN for 0 / 0), saturated to the format's largest finite
    value (NaN stays NaN), rounded to nearest even. These are the bytes a saturating conversion writes when it
    is handed a bad scale (oracles/ledger.py K3N-014); uint8, x's shape."""
    fmt = FP8_KV_FORMATS[kv_cache_dtype]
    big = torch.finfo(fmt).max
    q = x.detach().to(torch.float32).cpu() / torch.tensor(scale, dtype=torch.float32)
    q = torch.where(torch.isnan(q), q, q.clamp(-big, big))  # __NV_SATFINITE
    return q.to(fmt).view(torch.uint8).to(x.device)


def fp8_e4m3_times(x: torch.Tensor, scale_inv: float) -> torch.Tensor:
    """The E4M3 bytes of x times a reciprocal scale, as vLLM's fused MLA epilogue writes them (csrc/
    fused_kimi_k3_mla_key_concat_kv_cache_kernel.cu `copyChunk8`: `fminf(fmaxf(float(x) * scale_inv, -max), max)`
    then `__nv_cvt_float2_to_fp8x2(..., __NV_SATFINITE, __NV_E4M3)`): the fp32 product, correctly rounded,
    clamped to the format's largest finite value, rounded to nearest even.

    x: any shape, a float dtype, finite (the clamp's treatment of NaN is the kernel's finding, not this model's);
    scale_inv: finite and > 0; returns uint8, x's shape. An exact contract, stated in fp32 because the kernel
    multiplies in fp32 (where the epilogue also rotates, its rope dims are judged against the float64 rotation
    instead: properties/test_mla_epilogue.py)."""
    if not x.is_floating_point():
        raise ValueError(f"x: expected a floating dtype, got {x.dtype}")
    if not (math.isfinite(scale_inv) and scale_inv > 0):
        raise ValueError(f"scale_inv: expected finite and > 0, got {scale_inv}")
    fmt = FP8_KV_FORMATS["fp8_e4m3"]
    big = torch.finfo(fmt).max
    q = x.detach().to(torch.float32).cpu() * torch.tensor(scale_inv, dtype=torch.float32)
    return q.clamp(-big, big).to(fmt).view(torch.uint8).to(x.device)
