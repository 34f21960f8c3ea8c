"""vLLM 0.33.0's real K3 code as subjects (BRIEF §4).

Import mode (engines.installed: vLLM 0.33.0 installed, CUDA, its compiled ops
registered): the installed modules are bound, the lifted methods run with their
own module's globals (the real `ops`, the real attn_res kernel), and only the
server's runtime state is replaced (the pipeline group, the workspace manager;
the model namespace that carries the test's weights and caches). Source mode
otherwise, bound from the fetched, hash-checked wheel files:
- ATTN_RES: `vllm/models/kimi_k3/nvidia/ops/attn_res.py::attn_res` (Triton). On a CUDA
  machine the file is loaded as a module and Triton compiles the kernel (mode
  source-gpu); elsewhere it runs under TRITON_INTERPRET=1 (source-interpreter).
  Under the interpreter the module is exec'd from its source text without
  registering it for `inspect`, because the interpreter's AST rewrite of a
  file-backed kernel breaks the BLOCK_L tile loop (BRIEF §4, quirk b); the
  interpreter also truncates float -> bf16 conversions (quirk a), which
  `storage_rounding` declares so that exact checks use the mode's rounding.
- AUX_CAPTURE: `KimiLinearModel._capture_aux_hidden_stream` (nvidia/model.py), lifted
  and run on a stand-in model that carries real weights and calls the engine's
  own attn_res kernel above.
- CONTEXT_KV_FUSED: `K3DSparkModel._precompute_fused_context_kv` (nvidia/dspark_mla.py),
  lifted, with the real `_has_uniform_block_layout` / `_get_context_kv_cache_ptrs`;
  the compiled ops it calls (ops.rms_norm with a 2-D weight, ops.rotary_embedding,
  concat_and_cache_mla_grouped, do_kv_cache_update) are stand-ins following the
  documented numerics (fp32 math, one rounding) and are named in `real_ops`.
- The weight-loading contract: `_duplicate_context_kv_weights` and
  `K3DSparkForCausalLM.hf_to_vllm_mapper` (built with the real `WeightsMapper`
  class from vllm/model_executor/models/utils.py), exposed as `weight_loading`.
"""

from __future__ import annotations

import ast
import functools
import logging
import os
import re
import sys
import types
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from engines import base, fetch, installed, source, standins
from engines.mirror.context_kv import rope_cache
from engines.registry import EngineUnavailable
from refmodel.geometry import RopeSpec

PIN = fetch.PINS["vllm"]
ATTN_RES_PY = "vllm/models/kimi_k3/nvidia/ops/attn_res.py"
MODEL_PY = "vllm/models/kimi_k3/nvidia/model.py"
DSPARK_PY = "vllm/models/kimi_k3/nvidia/dspark_mla.py"
UTILS_PY = "vllm/model_executor/models/utils.py"
CUSTOM_OPS_PY = "vllm/_custom_ops.py"
STANDIN_OPS = "stand-in: ops.rms_norm, ops.rotary_embedding, concat_and_cache_mla_grouped, do_kv_cache_update"
# the one op of the path that stays a stand-in in every mode: it is the attention backend's, not vLLM's _custom_ops
PER_LAYER_WRITE_STANDIN = ("stand-in: do_kv_cache_update (the attention backend's per-layer write, taken when a layer "
                           "has no slots)")
IMPORT_OPS = f"real: ops.rms_norm, ops.rotary_embedding, concat_and_cache_mla_grouped; {PER_LAYER_WRITE_STANDIN}"
# what import mode binds, and the compiled ops the bound code calls (vllm/_custom_ops.py)
IMPORT_MODULES = (ATTN_RES_PY, MODEL_PY, DSPARK_PY, UTILS_PY, CUSTOM_OPS_PY)
IMPORT_CUDA_OPS = (("_C", "rms_norm"), ("_C", "rotary_embedding"), ("_C_cache_ops", "concat_and_cache_mla_grouped"))


def require_interpreter() -> None:
    """TRITON_INTERPRET must be set before triton is first imported (triton.language's own
    jit helpers are decorated at import); the root conftest sets it on machines without CUDA."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        if "triton" in sys.modules:
            raise EngineUnavailable(
                "no CUDA device, and triton was imported before TRITON_INTERPRET=1 was set: "
                "set TRITON_INTERPRET=1 in the environment to run the Triton kernels under the interpreter"
            )
        os.environ["TRITON_INTERPRET"] = "1"


def _triton() -> tuple[Any, Any]:
    try:
        import triton
        import triton.language as tl
    except ImportError as e:  # pragma: no cover - depends on the machine
        raise EngineUnavailable(f"vllm: triton is not installed ({e}); pip install triton") from e
    return triton, tl


class _Platform:
    """Stand-in for vllm.platforms.current_platform: no SM100 native op; PDL on Hopper and newer."""

    @staticmethod
    def is_device_capability_family(family: int) -> bool:
        return False

    @staticmethod
    def is_arch_support_pdl() -> bool:
        return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9


def _load_attn_res(path: Path, interpret: bool) -> Any:
    triton, tl = _triton()
    stubs = {
        "vllm": source.stub("vllm"),
        "vllm._custom_ops": source.stub("vllm._custom_ops"),
        "vllm.platforms": source.stub("vllm.platforms", current_platform=_Platform()),
        "vllm.triton_utils": source.stub("vllm.triton_utils", tl=tl, triton=triton),
    }
    return source.load_kernel_module(path, "k3num_engine.vllm.attn_res", stubs, interpret=interpret).attn_res


def truncate_to_bf16(x: torch.Tensor) -> torch.Tensor:
    """float32 -> bfloat16 rounding toward zero (the Triton interpreter's conversion, quirk a)."""
    bits = x.float().contiguous().view(torch.int32) & ~0xFFFF
    return bits.view(torch.float32).to(torch.bfloat16)


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
            path, "_GROUPED_KV_CACHE_DTYPES", {})}
    else:
        impl = real_ops
    workspace = _Workspace()
    ns = {**namespace, "ops": _RecordingOps(impl, captured), "current_workspace_manager": lambda: workspace}
    precompute = source.lift(path, "K3DSparkModel._precompute_fused_context_kv", ns)
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
                                         _k_scale=torch.ones(()))
            layers.append(types.SimpleNamespace(self_attn=attn))
        model = _StandinModel(
            context_kv_proj=lambda h: torch.nn.functional.linear(h, merged), _num_context_layers=num_layers,
            _context_kv_width=width, _context_kv_lora_rank=kv_lora, _context_kv_norm_weights=norm,
            _context_rms_norm_eps=eps, _context_rope_dim=width - kv_lora,
            _max_num_context_tokens=max(x.shape[0], 1), layers=layers,
            # _build_fused_context_kv_metadata: None unless the cache dtype is quantized (fp8); the
            # compiled grouped insert refuses scales for a bf16 cache
            _context_kv_scales=None,
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


def _bind_capture(path: Path, namespace: dict[str, Any]) -> Any:
    """AUX_CAPTURE from `path` with `namespace` (source mode: torch and the loaded attn_res kernel;
    import mode: the module's own globals); the pipeline group is runtime state, replaced in both."""
    got = source.signature_of(path, "KimiLinearModel._capture_aux_hidden_stream")
    if got != ["self", "layer_idx", "prefix_sum", "pending_mlp_out", "block_residual"]:
        raise source.SourceError(f"_capture_aux_hidden_stream signature changed: {got}")
    pp = {"is_last_rank": True}
    ns = {**namespace, "get_pp_group": lambda: types.SimpleNamespace(is_last_rank=pp["is_last_rank"])}
    lifted = source.lift(path, "KimiLinearModel._capture_aux_hidden_stream", ns)

    def capture(layer_idx, prefix_sum, pending, bank, *, enabled, weights, block_size, end_layer, num_layers,
                is_last_rank, eps, non_final_stage="raise"):
        if non_final_stage != "raise":
            raise NotImplementedError("vLLM 0.33.0 raises at a non-final stage end; it has no prefix fallback")

        def norm(w: torch.Tensor) -> Any:
            return types.SimpleNamespace(weight=w, variance_epsilon=eps)

        def proj(w: torch.Tensor) -> Any:
            return types.SimpleNamespace(weight=w.unsqueeze(0))  # [1, H], squeezed by the engine

        layers = []
        if weights is not None:
            for i in range(num_layers):
                layers.append(types.SimpleNamespace(
                    self_attention_res_norm=norm(weights.attn_res_norm[i]),
                    self_attention_res_proj=proj(weights.attn_res_proj[i]),
                    prev_valid_blocks=-(-i // block_size)))
        model = types.SimpleNamespace(
            _aux_attn_res_stream=enabled, use_attn_res=weights is not None, end_layer=end_layer, layers=layers,
            output_attn_res_norm=norm(weights.output_res_norm) if weights is not None else None,
            output_attn_res_proj=proj(weights.output_res_proj) if weights is not None else None,
            num_attn_res_blocks=-(-num_layers // block_size),
        )
        pp["is_last_rank"] = is_last_rank
        return lifted(model, layer_idx, prefix_sum, pending, bank)

    return capture


def _bind_weight_loading(root: Path) -> Any:
    utils = root / UTILS_PY
    logger = logging.getLogger("k3num.vllm")
    logger.warning_once = logger.warning  # type: ignore[attr-defined]
    ns = {"field": field, "dataclass": dataclass, "Mapping": Mapping, "Iterable": Iterable, "re": re,
          "torch": torch, "logger": logger, "ShardIds": Any, "WeightRenaming": Any}
    mapper_cls = source.lift_class(utils, "WeightsMapper", ns)
    mapper = source.lift_value(root / DSPARK_PY, "K3DSparkForCausalLM.hf_to_vllm_mapper",
                               {"WeightsMapper": mapper_cls})
    duplicate = source.lift(root / DSPARK_PY, "_duplicate_context_kv_weights",
                            {"torch": torch, "Iterable": Iterable})
    return types.SimpleNamespace(duplicate=duplicate, mapper=mapper)


def _built_ops(root: Path, interpret: bool) -> tuple[Any | None, str, str]:
    """(ops, real_ops label, note): vLLM's own `_custom_ops` wrappers (lifted from the wheel's
    vllm/_custom_ops.py) over the compiled ops `k3num build-ops` built for this GPU and torch, or
    (None, stand-in label, why not)."""
    if interpret:
        return None, STANDIN_OPS, "no CUDA: the compiled ops cannot run here"
    from engines import cuda_ops

    so, why = cuda_ops.load()
    if so is None:
        return None, STANDIN_OPS, why
    ns = {"torch": torch}
    ops = types.SimpleNamespace(**{name: source.lift(root / CUSTOM_OPS_PY, name, ns) for name in BUILT_OPS})
    return ops, (f"real (built by k3num build-ops from {fetch.SDISTS['vllm'].filename}, sha256 "
                 f"{fetch.SDISTS['vllm'].sha256[:12]}...): {', '.join(BUILT_OPS)}; {PER_LAYER_WRITE_STANDIN}"), ""


# the compiled ops `_precompute_fused_context_kv` calls, by their vllm/_custom_ops.py wrapper names
BUILT_OPS = ("rms_norm", "rotary_embedding", "concat_and_cache_mla_grouped")


def build() -> base.Engine:
    root = fetch.source_dir("vllm")
    inst, note = installed.select("vllm", IMPORT_MODULES, IMPORT_CUDA_OPS)
    if inst is not None:
        return _build_imported(inst)
    if not fetch.verified_manifest("vllm"):
        raise EngineUnavailable(f"vllm {PIN.version} source is not in {root}: run `k3num fetch vllm`")
    interpret = not torch.cuda.is_available()
    mode = "source-interpreter" if interpret else "source-gpu"
    if interpret:
        require_interpreter()
    try:
        ops, real_ops, ops_note = _built_ops(root, interpret)
        attn_res = _load_attn_res(root / ATTN_RES_PY, interpret)
        subjects: dict[str, base.Subject] = {
            base.ATTN_RES: attn_res,
            base.AUX_CAPTURE: _bind_capture(root / MODEL_PY, {"torch": torch, "attn_res": attn_res}),
            base.CONTEXT_KV_FUSED: _bind_precompute(root / DSPARK_PY, None, ops),
        }
        loading = _bind_weight_loading(root)
    except source.SourceError as e:
        raise EngineUnavailable(f"vllm {PIN.version}: {e}") from e
    if ops is not None:
        mode += OPS_SUFFIX
    elif not interpret:  # on a CUDA machine, say how the real ops would be had
        note = "; ".join(filter(None, [note, f"compiled ops are stand-ins: {ops_note}"]))
    m = fetch.verified_manifest("vllm")
    sha = {base.ATTN_RES: m[ATTN_RES_PY], base.AUX_CAPTURE: m[MODEL_PY], base.CONTEXT_KV_FUSED: m[DSPARK_PY]}
    return base.Engine(
        name="vllm", version=fetch.version_label("vllm"), mode=mode, subjects=subjects, real_ops=real_ops,
        source_sha256=sha, missing=MISSING,
        storage_rounding=truncate_to_bf16 if interpret else None,
        rounding="toward_zero" if interpret else "nearest",
        extras={"weight_loading": loading, **({"context_kv_ops": _RealContextKVOps(ops)} if ops is not None else {})},
        mode_note=note,
    )


# the mode label of source-gpu with vLLM's compiled ops built here (engines.cuda_ops)
OPS_SUFFIX = "+ops"


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
                       slot_mapping: torch.Tensor) -> None:
        ptrs = torch.tensor([c.data_ptr() for c in caches], dtype=torch.int64, device=kv_c.device)
        ref = caches[0]
        self._ops.concat_and_cache_mla_grouped(kv_c, k_pe, ptrs, slot_mapping, ref.size(1), ref.stride(0),
                                               ref.stride(1), None, "auto")


MISSING = {
    base.CONTEXT_KV_UNFUSED: "vLLM 0.33.0 has only the fused path (the unfused one was removed)",
    base.STAGE_PARTIAL: "vLLM 0.33.0 has no PP partial projection",
    base.FINALIZE_PROJECTION: "vLLM 0.33.0 has no PP partial projection",
    base.PROJECT_UNSHARDED: "not bound from vLLM",
    base.DRAFT_CONTEXT_KV: "not bound from vLLM",
}


def _build_imported(inst: installed.Installed) -> base.Engine:
    """Import mode: the installed modules, their compiled ops, the server's runtime state replaced."""
    dspark = inst.module(DSPARK_PY)
    try:
        subjects: dict[str, base.Subject] = {
            base.ATTN_RES: inst.module(ATTN_RES_PY).attn_res,
            base.AUX_CAPTURE: _bind_capture(inst.file(MODEL_PY), inst.namespace(MODEL_PY, {})),
            base.CONTEXT_KV_FUSED: _bind_precompute(inst.file(DSPARK_PY), inst.namespace(DSPARK_PY, {}),
                                                    inst.module(CUSTOM_OPS_PY)),
        }
        loading = types.SimpleNamespace(duplicate=dspark._duplicate_context_kv_weights,
                                        mapper=dspark.K3DSparkForCausalLM.hf_to_vllm_mapper)
    except (source.SourceError, AttributeError) as e:
        raise EngineUnavailable(f"vllm {inst.version} (installed): {e}") from e
    sha = {base.ATTN_RES: inst.sha256(ATTN_RES_PY), base.AUX_CAPTURE: inst.sha256(MODEL_PY),
           base.CONTEXT_KV_FUSED: inst.sha256(DSPARK_PY)}
    return base.Engine(
        name="vllm", version=inst.version, mode="import", subjects=subjects, real_ops=IMPORT_OPS,
        source_sha256=sha, missing=MISSING, extras={"weight_loading": loading},
    )


# --- the ROCm path: amd/ops/attn_res.py and the aux tap of amd/linear.py -----------------------

AMD_ATTN_RES_PY = "vllm/models/kimi_k3/amd/ops/attn_res.py"
AMD_LINEAR_PY = "vllm/models/kimi_k3/amd/linear.py"
ROCM_STANDINS = "stand-in: the Eagle mixin's _maybe_add_hidden_state (appends hidden_states [+ residual])"


def _load_amd_attn_res(path: Path, interpret: bool) -> Any:
    triton, tl = _triton()
    quant = "vllm.model_executor.layers.quantization.utils.quant_utils"
    stubs = {name: source.stub(name) for name in (
        "vllm", "vllm.model_executor", "vllm.model_executor.layers", "vllm.model_executor.layers.quantization",
        "vllm.model_executor.layers.quantization.utils")}
    stubs[quant] = source.stub(quant, get_fp8_min_max=lambda *a, **k: (-448.0, 448.0))
    stubs["vllm.triton_utils"] = source.stub("vllm.triton_utils", tl=tl, triton=triton)
    return source.load_kernel_module(path, "k3num_engine.vllm_rocm.attn_res", stubs, interpret=interpret).attn_res


class _SuperToMixin(ast.NodeTransformer):
    """`super().m(args)` -> `_mixin_m(self, args)`: the lifted method has no class to call super() on."""

    def visit_Call(self, node: ast.Call) -> ast.AST:
        self.generic_visit(node)
        f = node.func
        if (isinstance(f, ast.Attribute) and isinstance(f.value, ast.Call) and isinstance(f.value.func, ast.Name)
                and f.value.func.id == "super"):
            return ast.Call(func=ast.Name(id=f"_mixin_{f.attr}", ctx=ast.Load()),
                            args=[ast.Name(id="self", ctx=ast.Load()), *node.args], keywords=node.keywords)
        return node


def _mixin_maybe_add_hidden_state(self: Any, aux: list, layer_idx: int, hidden_states: torch.Tensor,
                                  residual: torch.Tensor | None) -> list:
    if layer_idx in self.aux_hidden_state_layers:
        aux.append(hidden_states + residual if residual is not None else hidden_states)
    return aux


def _bind_rocm_capture(path: Path, module: types.ModuleType | None = None) -> Any:
    """The ROCm tap from amd/linear.py's `_maybe_add_hidden_state`, lifted; its `super()` call goes to
    the Eagle mixin's method: our stand-in in source mode, the real class's in import mode (`module`)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    classes = [n for n in tree.body if isinstance(n, ast.ClassDef)
               and any(isinstance(b, ast.FunctionDef) and b.name == "_maybe_add_hidden_state" for b in n.body)]
    if not classes:
        raise source.SourceError("amd/linear.py: no class defines _maybe_add_hidden_state")
    fn = next(b for b in classes[0].body if isinstance(b, ast.FunctionDef) and b.name == "_maybe_add_hidden_state")
    fn.decorator_list = []
    fn = ast.fix_missing_locations(_SuperToMixin().visit(fn))
    mixin: Any = _mixin_maybe_add_hidden_state
    if module is not None:
        cls = getattr(module, classes[0].name)
        mixin = next((c.__dict__["_maybe_add_hidden_state"] for c in cls.__mro__[1:]
                      if "_maybe_add_hidden_state" in c.__dict__), None)
        if mixin is None:
            raise source.SourceError(f"{classes[0].name}: no base class defines _maybe_add_hidden_state")
    glb: dict[str, Any] = {**(vars(module) if module is not None else {"torch": torch}),
                           "_mixin__maybe_add_hidden_state": mixin, "__builtins__": __builtins__}
    exec(compile(ast.Module(body=[fn], type_ignores=[]), str(path), "exec"), glb)
    lifted = glb["_maybe_add_hidden_state"]

    def capture(layer_idx, prefix_sum, pending, bank, *, enabled, weights, block_size, end_layer, num_layers,
                is_last_rank, eps, non_final_stage="raise"):
        # KimiLinearModel.forward (ROCm) taps `hidden_states + prefix_delta` after layer i as capture
        # id i + 1; the block bank is passed as `residual`; the env flag is not consulted
        model = types.SimpleNamespace(config=types.SimpleNamespace(
            attn_res_block_size=block_size if weights is not None else None), aux_hidden_state_layers={layer_idx + 1})
        hidden = prefix_sum if pending is None else prefix_sum + pending
        aux: list[torch.Tensor] = []
        lifted(model, aux, layer_idx + 1, hidden, bank if weights is not None else None)
        return aux[-1]

    return capture


ROCM_MISSING = {s: "the ROCm path binds only attn_res and the aux tap" for s in base.SUBJECTS
                if s not in (base.ATTN_RES, base.AUX_CAPTURE)}


def build_rocm() -> base.Engine:
    root = fetch.source_dir("vllm")
    # the ROCm kernels are Triton and the tap is Python: no compiled op to require
    inst, note = installed.select("vllm", (AMD_ATTN_RES_PY, AMD_LINEAR_PY), ())
    if inst is not None:
        try:
            subjects = {base.ATTN_RES: inst.module(AMD_ATTN_RES_PY).attn_res,
                        base.AUX_CAPTURE: _bind_rocm_capture(inst.file(AMD_LINEAR_PY), inst.module(AMD_LINEAR_PY))}
        except (source.SourceError, AttributeError) as e:
            raise EngineUnavailable(f"vllm-rocm {inst.version} (installed): {e}") from e
        return base.Engine(
            name="vllm-rocm", version=inst.version, mode="import", subjects=subjects,
            real_ops="real: the Eagle mixin's _maybe_add_hidden_state",
            source_sha256={base.ATTN_RES: inst.sha256(AMD_ATTN_RES_PY), base.AUX_CAPTURE: inst.sha256(AMD_LINEAR_PY)},
            missing=ROCM_MISSING,
        )
    if not fetch.verified_manifest("vllm"):
        raise EngineUnavailable(f"vllm {PIN.version} source is not in {root}: run `k3num fetch vllm`")
    interpret = not torch.cuda.is_available()
    if interpret:
        require_interpreter()
    try:
        subjects = {base.ATTN_RES: _load_amd_attn_res(root / AMD_ATTN_RES_PY, interpret),
                    base.AUX_CAPTURE: _bind_rocm_capture(root / AMD_LINEAR_PY)}
    except source.SourceError as e:
        raise EngineUnavailable(f"vllm-rocm {PIN.version}: {e}") from e
    m = fetch.verified_manifest("vllm")
    return base.Engine(
        name="vllm-rocm", version=fetch.version_label("vllm"), mode="source-interpreter" if interpret else "source-gpu",
        subjects=subjects, real_ops=ROCM_STANDINS,
        source_sha256={base.ATTN_RES: m[AMD_ATTN_RES_PY], base.AUX_CAPTURE: m[AMD_LINEAR_PY]},
        missing=ROCM_MISSING,
        storage_rounding=truncate_to_bf16 if interpret else None, rounding="toward_zero" if interpret else "nearest",
        mode_note=note,
    )
