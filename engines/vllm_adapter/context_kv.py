"""CONTEXT_KV_FUSED: `K3DSparkModel._precompute_fused_context_kv` (nvidia/dspark_mla.py), lifted, on the
metadata vLLM's own `_build_fused_context_kv_metadata` builds from the draft layers (lifted too), with
stand-in compiled ops or vLLM's own `_custom_ops` wrappers over the ops `k3num build-ops` built."""

from __future__ import annotations

import ast
import functools
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from k3num.engines import source, standins
from k3num.engines.mirror.context_kv import rope_cache
from k3num.engines.vllm_adapter.common import CUSTOM_OPS_PY, PER_LAYER_WRITE_STANDIN, STANDIN_OPS
from k3num.refmodel.geometry import RopeSpec
from k3num.supply import fetch

# --- stand-ins for the compiled ops (engines.standins: fp32 math, one rounding) -----------------


def _rotary_embedding(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor | None, head_size: int,
                      cos_sin_cache: torch.Tensor, is_neox: bool) -> None:
    """vLLM's ops.rotary_embedding: query (and key) [M, 1, R] rotated in place."""
    for t in (query, key):
        if t is not None:
            t.copy_(standins.rotate_heads(positions, t, cos_sin_cache, is_neox))


@dataclass
class _StandinModel:
    """The attributes `_precompute_fused_context_kv` reads, with real weights and caches."""

    context_kv_proj: Any
    _num_context_layers: int
    _context_kv_width: int
    _context_kv_lora_rank: int
    _context_kv_norm_weights: torch.Tensor
    _context_rms_norm_eps: float
    _context_rope_dim: int
    _max_num_context_tokens: int
    layers: list[Any]
    _context_kv_scales: torch.Tensor | None
    captured: dict[str, torch.Tensor] = field(default_factory=dict)


class _CpuSafeTorch:
    """`torch` for lifted code on a CPU-only build: torch.cuda.is_current_stream_capturing() raises
    there instead of answering False; everything else is torch itself."""

    class _Cuda:
        def __getattr__(self, name: str) -> Any:
            return getattr(torch.cuda, name)

        @staticmethod
        def is_current_stream_capturing() -> bool:
            return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()

    cuda = _Cuda()

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)


class _Workspace:
    """Stand-in for vLLM's workspace manager (runtime state): fresh buffers on the call's device."""

    device: torch.device | str = "cpu"

    def get_simultaneous(self, *specs: tuple[tuple[int, ...], torch.dtype]) -> tuple[torch.Tensor, ...]:
        return tuple(torch.empty(shape, dtype=dtype, device=self.device) for shape, dtype in specs)


class _RecordingOps:
    """The `ops` the lifted method sees: `impl`'s ops (the real module, or stand-ins), recording the
    outputs the subject returns (the normed kv_c, the rotated k_pe)."""

    def __init__(self, impl: Any, captured: dict[str, torch.Tensor]) -> None:
        self._impl, self._captured = impl, captured

    def __getattr__(self, name: str) -> Any:
        return getattr(self._impl, name)

    def rms_norm(self, out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
        self._impl.rms_norm(out, x, weight, eps)
        self._captured["kv_c"] = out

    def rotary_embedding(self, positions, query, key, head_size, cos_sin_cache, is_neox) -> None:
        self._impl.rotary_embedding(positions, query, key, head_size, cos_sin_cache, is_neox)
        self._captured["k_pe"] = query


# helpers a release added to vllm/model_executor/utils.py that the bound methods read (0.34.0's metadata build
# sets its derived tensors through refill_derived), lifted from the tree when it defines them
MEXEC_UTILS_PY = "vllm/model_executor/utils.py"
RELEASE_HELPERS = ("refill_derived",)


def release_helpers(root: Path) -> dict[str, Any]:
    """{name: the tree's own function} for each of RELEASE_HELPERS that `root`'s utils file defines."""
    path = root / MEXEC_UTILS_PY
    if not path.is_file():
        return {}
    tree = ast.parse(path.read_text(), filename=str(path))
    defined = {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}
    return {name: source.lift(path, name, {"torch": torch}) for name in RELEASE_HELPERS if name in defined}


def _bind_precompute(path: Path, namespace: dict[str, Any] | None, real_ops: Any | None) -> Any:
    """CONTEXT_KV_FUSED from `path`: in source mode (namespace None) with stand-in ops, or with `real_ops`
    (the compiled ops built by `k3num build-ops`, behind vLLM's own wrappers); in import mode with the
    module's own globals and its compiled `real_ops`."""
    captured: dict[str, torch.Tensor] = {}
    caches_by_ptr: dict[int, torch.Tensor] = {}
    rope_caches: dict[Any, torch.Tensor] = {}

    def grouped_standin(kv_c, k_pe, cache_ptrs, slot_mapping, block_size, s0, s1, scales, dtype):
        for layer, ptr in enumerate(cache_ptrs.tolist()):
            standins.write_slots(caches_by_ptr[ptr], kv_c[layer], k_pe[layer], slot_mapping[layer])

    if namespace is None:
        impl: Any = real_ops or types.SimpleNamespace(
            rms_norm=standins.rms_norm_into, rotary_embedding=_rotary_embedding,
            concat_and_cache_mla_grouped=grouped_standin)
        namespace = {"torch": _CpuSafeTorch(), "_GROUPED_KV_CACHE_DTYPES": source.lift_value(
            path, "_GROUPED_KV_CACHE_DTYPES", {}),
            # vllm/v1/kv_cache_interface.py (not pinned): a quantized mode for the fp8 cache dtypes, none for "auto"
            "is_quantized_kv_cache": lambda dtype: dtype != "auto" and "fp8" in str(dtype)}
    else:
        impl = real_ops
    workspace = _Workspace()
    ns = {**namespace, "ops": _RecordingOps(impl, captured), "current_workspace_manager": lambda: workspace,
          **{k: f for k, f in release_helpers(path.parents[4]).items() if k not in namespace}}
    precompute = source.lift(path, "K3DSparkModel._precompute_fused_context_kv", ns)
    # the metadata the fused path reads (the per-layer kv_a_layernorm weights stacked, the geometry, the fp8
    # scales) is built by vLLM's own _build_fused_context_kv_metadata from the draft layers' attentions
    build_metadata = source.lift(path, "K3DSparkModel._build_fused_context_kv_metadata", ns)
    uniform = source.lift(path, "K3DSparkModel._has_uniform_block_layout", ns)
    ptrs = source.lift(path, "K3DSparkModel._get_context_kv_cache_ptrs", ns)
    got = source.signature_of(path, "K3DSparkModel._precompute_fused_context_kv")
    if got != ["self", "context_states", "context_positions", "context_slot_mapping"]:
        raise source.SourceError(f"_precompute_fused_context_kv signature changed: {got}")

    def fused(x: torch.Tensor, kv_a: torch.Tensor, norm: torch.Tensor, positions: torch.Tensor, rope: RopeSpec,
              eps: float, caches: torch.Tensor | None = None, slot_mapping: torch.Tensor | None = None):
        num_layers, width, hidden = kv_a.shape
        kv_lora = norm.shape[1]
        merged = kv_a.reshape(num_layers * width, hidden)
        max_pos = int(positions.max()) + 1 if positions.numel() else 1
        key = (rope, max_pos, x.device)
        if key not in rope_caches:  # vLLM builds its cache once, in fp32
            rope_caches.clear()
            rope_caches[key] = rope_cache(rope, max_pos, torch.float32, x.device)
        cache = rope_caches[key]
        rotary = types.SimpleNamespace(head_size=width - kv_lora, cos_sin_cache=cache,
                                       is_neox_style=rope.style == "neox")
        layers = []
        caches_by_ptr.clear()
        for layer in range(num_layers):
            kv_cache = caches[layer] if caches is not None else torch.empty(1, 1, width, dtype=x.dtype)
            caches_by_ptr[kv_cache.data_ptr()] = kv_cache

            def update(kv_c, k_pe, kv_cache, slots, dtype, k_scale):
                standins.write_slots(kv_cache, kv_c, k_pe, slots)

            attn = types.SimpleNamespace(rotary_emb=rotary, kv_cache_dtype="auto", kv_cache=kv_cache,
                                         impl=types.SimpleNamespace(do_kv_cache_update=update),
                                         _k_scale=torch.ones(()), q_lora_rank=0, kv_lora_rank=kv_lora,
                                         qk_rope_head_dim=width - kv_lora,
                                         kv_a_layernorm=types.SimpleNamespace(weight=norm[layer], variance_epsilon=eps))
            layers.append(types.SimpleNamespace(self_attn=attn))
        meta: Any = types.SimpleNamespace(layers=layers)
        build_metadata(meta)  # vLLM's: _context_kv_norm_weights, the geometry, the scales (None: a bf16 cache)
        model = _StandinModel(
            context_kv_proj=lambda h: torch.nn.functional.linear(h, merged),
            _num_context_layers=meta._num_context_layers,
            _context_kv_width=meta._context_kv_width, _context_kv_lora_rank=meta._context_kv_lora_rank,
            _context_kv_norm_weights=meta._context_kv_norm_weights, _context_rms_norm_eps=meta._context_rms_norm_eps,
            _context_rope_dim=meta._context_rope_dim, _max_num_context_tokens=max(x.shape[0], 1), layers=layers,
            _context_kv_scales=meta._context_kv_scales,
        )
        self_ns: Any = types.SimpleNamespace(**model.__dict__)
        self_ns._has_uniform_block_layout = functools.partial(uniform, self_ns)
        self_ns._get_context_kv_cache_ptrs = functools.partial(ptrs, self_ns)
        mapping: Any = None
        if caches is not None and slot_mapping is not None:
            if slot_mapping.dim() == 1:
                mapping = slot_mapping
            else:  # per-layer: a layer whose slots are all skipped is passed as None
                mapping = [None if bool((row < 0).all()) else row for row in slot_mapping]
        captured.clear()
        workspace.device = x.device
        precompute(self_ns, x, positions, mapping)
        kv_c = captured["kv_c"]
        k_pe = captured["k_pe"].view(num_layers, x.shape[0], width - kv_lora)
        return kv_c, k_pe

    return fused


def _built_ops(src: fetch.Source, interpret: bool) -> tuple[Any | None, str, str]:
    """(ops, real_ops label, note): vLLM's own `_custom_ops` wrappers (lifted from the wheel's
    vllm/_custom_ops.py) over the compiled ops `k3num build-ops` built for this GPU and torch, or
    (None, stand-in label, why not)."""
    if interpret:
        return None, STANDIN_OPS, "no CUDA: the compiled ops cannot run here"
    from k3num.supply import cuda_ops

    try:  # a checkout with its own csrc runs the ops built from it (`k3num build-ops --engine-src vllm=PATH`)
        csrc = cuda_ops.sources_of(src)
    except cuda_ops.BuildError as e:
        return None, STANDIN_OPS, str(e)
    so, why = cuda_ops.load(csrc)
    if so is None:
        return None, STANDIN_OPS, why
    # stand-in: the platform (CUDA: concat_and_cache_mla's wrapper asks whether it runs on XPU)
    ns = {"torch": torch, "current_platform": types.SimpleNamespace(is_xpu=lambda: False)}
    ops = types.SimpleNamespace(**{name: source.lift(src.root / CUSTOM_OPS_PY, name, ns) for name in BUILT_OPS})
    label = f"real (built by k3num build-ops from {csrc.origin}): {', '.join(BUILT_OPS)}; {PER_LAYER_WRITE_STANDIN}"
    return ops, label, ""


# the compiled ops `_precompute_fused_context_kv` calls, by their vllm/_custom_ops.py wrapper names
BUILT_OPS = ("rms_norm", "rotary_embedding", "concat_and_cache_mla_grouped", "concat_and_cache_mla")


class _RealContextKVOps:
    """vLLM's compiled ops behind their `_custom_ops` wrappers, under the per-op interface of
    engines.standins.ContextKVOps (the insert builds the pointer array in the caches' given order,
    as `_get_context_kv_cache_ptrs` does)."""

    def __init__(self, ops: Any) -> None:
        self._ops = ops

    def rms_norm_grouped(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        out = torch.empty_like(x)
        self._ops.rms_norm(out, x, weight, eps)
        return out

    def rotary(self, positions: torch.Tensor, x: torch.Tensor, cos_sin_cache: torch.Tensor,
               is_neox: bool) -> torch.Tensor:
        out = x.clone()
        self._ops.rotary_embedding(positions, out, None, x.shape[-1], cos_sin_cache, is_neox)
        return out

    def insert_grouped(self, kv_c: torch.Tensor, k_pe: torch.Tensor, caches: list[torch.Tensor],
                       slot_mapping: torch.Tensor, kv_cache_dtype: str = "auto",
                       kv_scales: torch.Tensor | None = None) -> None:
        ptrs = torch.tensor([c.data_ptr() for c in caches], dtype=torch.int64, device=kv_c.device)
        ref = caches[0]
        self._ops.concat_and_cache_mla_grouped(kv_c, k_pe, ptrs, slot_mapping, ref.size(1), ref.stride(0),
                                               ref.stride(1), kv_scales, kv_cache_dtype)

    def insert_per_layer(self, kv_c: torch.Tensor, k_pe: torch.Tensor, cache: torch.Tensor,
                         slots: torch.Tensor, kv_cache_dtype: str = "auto", scale: torch.Tensor | None = None) -> None:
        # a bf16 cache ("auto"): the scale is read only by the fp8 branches (cache_kernels.cu)
        scale = scale if scale is not None else torch.ones(1, dtype=torch.float32, device=kv_c.device)
        self._ops.concat_and_cache_mla(kv_c, k_pe, cache, slots, kv_cache_dtype, scale)


