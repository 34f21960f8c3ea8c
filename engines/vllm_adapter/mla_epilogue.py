"""vLLM's fused MLA epilogues (vllm/models/kimi_k3/nvidia/ops/fused_mla_key_concat_kv_cache.py over
csrc/fused_kimi_k3_mla_key_concat_kv_cache_kernel.cu): what `MultiHeadLatentAttention` (nvidia/mla.py), the DSpark
draft's own layers among its users, writes its prefill and decode tokens' latent cache with. The release's three
wrappers (prefill bf16, prefill fp8, decode bf16/fp8) are lifted and called on the ops `k3num build-ops` built from
the release's csrc; without those ops (no CUDA) the capability is absent and its properties skip saying why.

Shapes: engines.standins.MlaEpilogue.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from k3num.engines import source

MLA_EPILOGUE_PY = "vllm/models/kimi_k3/nvidia/ops/fused_mla_key_concat_kv_cache.py"
KERNEL_CU = "csrc/fused_kimi_k3_mla_key_concat_kv_cache_kernel.cu"
BF16_INSERT = "fused_mla_key_concat_kv_cache_insert"
FP8_INSERT = "fused_mla_qkv_quant_kv_cache_fp8_insert"
DECODE_INSERT = "fused_mla_decode_q_concat_kv_cache_insert"
# the wrappers' leading parameters the adapter passes by position (CONTRACT: a re-signed wrapper is named)
SIGNATURES = {
    BF16_INSERT: ["q", "k_nope", "k_pe", "kv_c_normed", "kv_cache", "slot_mapping", "positions", "cos_sin_cache"],
    FP8_INSERT: ["q", "k_nope", "k_pe", "kv_c_normed", "v", "kv_cache", "slot_mapping", "q_scale_inv", "k_scale_inv",
                 "v_scale_inv", "cache_scale_inv", "positions", "cos_sin_cache"],
    DECODE_INSERT: ["ql_nope", "q_pe", "kv_c_normed", "k_pe", "kv_cache", "slot_mapping"],
}


class RealMlaEpilogue:
    """The release's three wrappers under engines.standins.MlaEpilogue's interface."""

    def __init__(self, bf16_insert: Any, fp8_insert: Any, decode_insert: Any) -> None:
        self._bf16, self._fp8, self._decode = bf16_insert, fp8_insert, decode_insert

    def insert(self, q: torch.Tensor, k_nope: torch.Tensor, k_pe: torch.Tensor, kv_c: torch.Tensor,
               cache: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor | None = None,
               cos_sin_cache: torch.Tensor | None = None) -> torch.Tensor:
        return self._bf16(q, k_nope, k_pe, kv_c, cache, slots, positions, cos_sin_cache)

    def insert_fp8(self, q: torch.Tensor, k_nope: torch.Tensor, k_pe: torch.Tensor, kv_c: torch.Tensor,
                   v: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor, q_scale_inv: torch.Tensor,
                   k_scale_inv: torch.Tensor, v_scale_inv: torch.Tensor, cache_scale_inv: torch.Tensor,
                   positions: torch.Tensor | None = None,
                   cos_sin_cache: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        # the layer views its fp8 cache as E4M3 before the call (nvidia/mla.py), as the op's check requires
        fp8_cache = cache if cache.dtype == torch.float8_e4m3fn else cache.view(torch.float8_e4m3fn)
        return self._fp8(q, k_nope, k_pe, kv_c, v, fp8_cache, slots, q_scale_inv, k_scale_inv, v_scale_inv,
                         cache_scale_inv, positions, cos_sin_cache)

    def decode(self, ql_nope: torch.Tensor, q_pe: torch.Tensor, kv_c: torch.Tensor, k_pe: torch.Tensor,
               cache: torch.Tensor, slots: torch.Tensor, q_scale_inv: torch.Tensor | None = None,
               cache_scale_inv: torch.Tensor | None = None, positions: torch.Tensor | None = None,
               cos_sin_cache: torch.Tensor | None = None) -> torch.Tensor:
        # the wrapper picks the fp8 op by q_scale_inv and views the cache as E4M3 itself (ds_mla: not a draft's)
        return self._decode(ql_nope, q_pe, kv_c, k_pe, cache, slots, q_scale_inv=q_scale_inv,
                            cache_scale_inv=cache_scale_inv, positions=positions, cos_sin_cache=cos_sin_cache)


def bind(root: Path) -> RealMlaEpilogue:
    """The wrappers of the tree under `root`, lifted over torch alone (their bodies call torch.ops._C, which
    `k3num build-ops` registered)."""
    path = root / MLA_EPILOGUE_PY
    return RealMlaEpilogue(*(source.lift(path, name, {"torch": torch}) for name in (BF16_INSERT, FP8_INSERT,
                                                                                   DECODE_INSERT)))
