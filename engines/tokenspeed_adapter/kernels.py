"""The K3 kernels TokenSpeed 0.1.1 calls on an H200, from the pinned tokenspeed-kernel 0.1.4 files.

Loaded from the hash-checked tree (`supply.fetch`, the tokenspeed pin and its companion wheel):
- `torch_attn_res_fwd` (ops/residual/torch.py): what `attn_res_fwd` selects on an H200 (the CUDA
  `attn_res.so` is Blackwell-only). Lifted as it is, plain torch.
- `apply_k_rope` and `apply_rope` (ops/embedding/__init__.py), lifted with the registry's selection
  reduced to the two kernels it registers for `embedding.rope` on NVIDIA: the CUDA `rope.so`
  (`cuda_embedding_rope`, Priority.PERFORMANT; head_size in {64, 128, 256, 512}, rotary_dim a multiple
  of 32 up to 512) when it loads, else `triton_embedding_rope` (Priority.PORTABLE). The higher band
  wins among the kernels whose traits admit the call, as `select_kernel` does.
- `set_mla_kv_buffer_triton` (ops/kvcache/triton.py): the MLA pool's latent write.
- `_segmented_rmsnorm_kernel` (tokenspeed/runtime/layers/segmented_rmsnorm.py): the per-tap norm of
  `project_target_hidden` when the draft config has `fc_norm`; on CUDA through the file's own
  `segmented_rmsnorm`, under the interpreter through `segmented_rmsnorm_interpreted` (the same
  launch; the wrapper refuses CPU tensors).
Declared adaptations (in the mode note): tokenspeed_kernel._triton, which imports TokenSpeed's fork
`tokenspeed_triton`, resolves to the stock triton installed here; PDL (programmatic dependent launch)
is off (`pdl_enabled` -> False): a launch-overlap switch, no arithmetic changes with it. The CUDA
RoPE needs `tvm_ffi` (apache-tvm-ffi) and the pinned `rope.so` (`k3num fetch tokenspeed-bin`); where
either is missing, or there is no CUDA, the Triton kernel is the one selected, and the note says why.
"""

from __future__ import annotations

import contextlib
import types
import typing
from pathlib import Path
from typing import Any

import torch

from k3num.engines import source, triton_support
from k3num.supply import fetch

RESIDUAL_TORCH_PY = "tokenspeed_kernel/ops/residual/torch.py"
EMBED_INIT_PY = "tokenspeed_kernel/ops/embedding/__init__.py"
EMBED_TRITON_PY = "tokenspeed_kernel/ops/embedding/triton.py"
ROPE_PY = "tokenspeed_kernel/thirdparty/cuda/rope.py"
KVCACHE_TRITON_PY = "tokenspeed_kernel/ops/kvcache/triton.py"
SEGMENTED_PY = "tokenspeed/runtime/layers/segmented_rmsnorm.py"
ADAPTATIONS = ("tokenspeed_kernel._triton -> the stock triton installed here (TokenSpeed's fork tokenspeed_triton "
               "is not installed); PDL off")
CUDA_ROPE_HEADS = frozenset({64, 128, 256, 512})
CUDA_ROPE_ROTARY = frozenset(range(32, 513, 32))


def _stubs(triton: Any, tl: Any) -> dict[str, types.ModuleType]:
    """The tokenspeed_kernel / tokenspeed modules the kernel files import at load time."""
    is_cuda = torch.cuda.is_available()
    platform = types.SimpleNamespace(is_nvidia=is_cuda, is_amd=False, is_hopper_plus=is_cuda)
    return {
        "tokenspeed_kernel": source.stub("tokenspeed_kernel"),
        "tokenspeed_kernel._triton": source.stub("tokenspeed_kernel._triton", triton=triton, tl=tl),
        "tokenspeed_kernel.platform": source.stub(
            "tokenspeed_kernel.platform", current_platform=lambda: platform, pdl_enabled=lambda *a: False,
            CapabilityRequirement=lambda **k: None),
        "tokenspeed_kernel.registry": source.stub(
            "tokenspeed_kernel.registry", register_kernel=lambda *a, **k: (lambda f: f),
            Priority=types.SimpleNamespace(PORTABLE=0, PERFORMANT=1)),
        "tokenspeed_kernel.signature": source.stub(
            "tokenspeed_kernel.signature", format_signatures=lambda *a, **k: None,
            format_signature=lambda *a, **k: None, dense_tensor_format=lambda *a, **k: None),
        "tokenspeed": source.stub("tokenspeed"), "tokenspeed.runtime": source.stub("tokenspeed.runtime"),
        "tokenspeed.runtime.utils": source.stub("tokenspeed.runtime.utils"),
        "tokenspeed.runtime.utils.triton": source.stub("tokenspeed.runtime.utils.triton", triton=triton, tl=tl),
    }


def cuda_rope(root: Path) -> tuple[Any, str]:
    """(apply_rope_with_cos_sin_cache_inplace bound to the pinned rope.so, "") or (None, why not)."""
    if not torch.cuda.is_available():
        return None, "CUDA rope.so: no CUDA device (the Triton RoPE is selected)"
    try:
        import tvm_ffi  # noqa: PLC0415  (a GPU-only dependency of tokenspeed-kernel)
    except ImportError:
        return None, "CUDA rope.so: tvm_ffi (apache-tvm-ffi) is not installed (the Triton RoPE is selected)"
    try:
        so = fetch.binary("tokenspeed:rope", extract=True)
    except fetch.FetchError as e:
        return None, f"CUDA rope.so: {e} (the Triton RoPE is selected)"
    try:
        module = tvm_ffi.load_module(str(so))
    except Exception as e:  # noqa: BLE001  (the loader's own error, reported)
        return None, f"CUDA rope.so does not load against torch {torch.__version__}: {e} (the Triton RoPE is selected)"
    fn = source.lift(root / ROPE_PY, "apply_rope_with_cos_sin_cache_inplace",
                     {"torch": torch, "Optional": typing.Optional, "Any": Any, "_load_rope_module": lambda: module})
    return fn, ""


class Kernels(types.SimpleNamespace):
    """attn_res_fwd, apply_k_rope, apply_rope, rope_kernel (its name), set_mla_kv_buffer, segmented_rmsnorm,
    note."""


def load(root: Path, interpret: bool, *, want_cuda_rope: bool = True) -> Kernels:
    """The kernels from the tree at `root` (the cache or a local --engine-src tree)."""
    triton, tl = triton_support.triton_modules("tokenspeed")
    stubs = _stubs(triton, tl)
    attn_res_fwd = source.lift(root / RESIDUAL_TORCH_PY, "torch_attn_res_fwd", {"torch": torch})
    embed = source.load_kernel_module(root / EMBED_TRITON_PY, "k3num_engine.tokenspeed.embedding_triton", stubs,
                                      interpret=interpret)
    kv = source.load_kernel_module(root / KVCACHE_TRITON_PY, "k3num_engine.tokenspeed.kvcache_triton", stubs,
                                   interpret=interpret)
    seg = source.load_kernel_module(root / SEGMENTED_PY, "k3num_engine.tokenspeed.segmented_rmsnorm", stubs,
                                    interpret=interpret)
    rope_cuda, why = cuda_rope(root) if want_cuda_rope else (None, "CUDA rope.so: not asked for")

    def cuda_embedding_rope(*, positions, q, k, head_size, cos_sin_cache, is_neox=True, fused_set_kv_buffer_arg=None,
                            q_rope_out=None, k_rope_out=None, enable_pdl=False):
        # embedding/cuda.py registers exactly this pass-through (defined under `if platform.is_nvidia`)
        rope_cuda(positions=positions, query=q, key=k, head_size=head_size, cos_sin_cache=cos_sin_cache,
                  is_neox=is_neox, fused_set_kv_buffer_arg=fused_set_kv_buffer_arg, output_q_rope=q_rope_out,
                  output_k_rope=k_rope_out, enable_pdl=enable_pdl)

    cuda_embedding_rope.name = "cuda_embedding_rope"  # type: ignore[attr-defined]
    embed.triton_embedding_rope.name = "triton_embedding_rope"
    chosen: set[str] = set()  # the kernels the selection has taken (a set: one entry per kernel, not per call)

    def select_kernel(family, op, signature, *, traits, solution=None, override=None):  # noqa: ANN001
        if (family, op) != ("embedding", "rope") or solution or override:
            raise NotImplementedError(f"k3num binds embedding.rope only, without solution/override ({family}.{op})")
        if (rope_cuda is not None and traits["head_size"] in CUDA_ROPE_HEADS
                and traits["rotary_dim"] in CUDA_ROPE_ROTARY):
            kernel = cuda_embedding_rope
        elif traits["has_fused_kv"]:
            raise ValueError("Triton RoPE does not support fused KV writes")
        else:
            kernel = embed.triton_embedding_rope
        chosen.add(kernel.name)
        return kernel

    init_ns = {"torch": torch, "select_kernel": select_kernel, "format_signature": lambda **k: None,
               "dense_tensor_format": lambda *a: None, "pdl_enabled": lambda *a: False,
               "ShapeCapture": types.SimpleNamespace(get=lambda: types.SimpleNamespace(record=lambda *a, **k: None)),
               "kernel_scope": lambda *a, **k: contextlib.nullcontext()}
    apply_rope = source.lift(root / EMBED_INIT_PY, "apply_rope", init_ns)
    apply_k_rope = source.lift(root / EMBED_INIT_PY, "apply_k_rope", {**init_ns, "apply_rope": apply_rope})

    def segmented_interpreted(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """segmented_rmsnorm's launch (grid (rows, segments), BLOCK next power of two) without its CUDA
        check, for the interpreter: x [..., S, H], weight [S, H] -> out like x."""
        out = torch.empty_like(x)
        if x.numel() == 0:
            return out
        s, h = weight.shape
        seg._segmented_rmsnorm_kernel[(x.numel() // (s * h), s)](x, weight, out, s, h, eps,
                                                                  BLOCK=triton.next_power_of_2(h))
        return out

    rope_note = why or "real: CUDA rope.so (tvm_ffi) where its traits admit the call"
    return Kernels(attn_res_fwd=attn_res_fwd, apply_k_rope=apply_k_rope, apply_rope=apply_rope, rope_chosen=chosen,
                   rope_cuda_loaded=rope_cuda is not None, set_mla_kv_buffer=kv.set_mla_kv_buffer_triton,
                   segmented_rmsnorm=segmented_interpreted if interpret else seg.segmented_rmsnorm,
                   note=f"{ADAPTATIONS}; {rope_note}")
