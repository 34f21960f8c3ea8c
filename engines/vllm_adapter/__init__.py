"""vLLM 0.33.0's real K3 code as subjects (BRIEF §4): one module per bound subject.

Import mode (supply.installed: vLLM 0.33.0 installed, CUDA, its compiled ops
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
  interpreter would also truncate float -> bf16 conversions (quirk a), so it is
  patched to round to nearest even as the GPU does (engines.triton_support,
  declared in the mode note; tests/test_interpreter_rounding.py checks every bf16
  store against the H200's on stored inputs).
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
- PP taps (extras["pp_taps"], both platforms): the real forward loops, Eagle slot layout and the
  worker's relay between stages (engines/vllm_adapter/pp_forward.py).

The contract each subject binds (files, names, signatures) is `CONTRACT` below. A tree that breaks
it (a renamed or re-signed function, an import the stubs do not provide) leaves that subject
missing with "contract changed: <file>: <what>"; the rest of the engine still binds.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from k3num.engines import base, source, triton_support
from k3num.engines.registry import EngineUnavailable
from k3num.engines.triton_support import (
    NEAREST_EVEN_ADAPTATION,
    require_interpreter,
    round_bf16_to_nearest_even,
)
from k3num.engines.vllm_adapter import context_proj, draft_config, markov, mla_epilogue, pp_forward, quant_loading
from k3num.engines.vllm_adapter.attn_res import _load_amd_attn_res, _load_attn_res
from k3num.engines.vllm_adapter.aux_capture import _bind_capture, _bind_rocm_capture
from k3num.engines.vllm_adapter.common import (
    AMD_ATTN_RES_PY,
    AMD_LINEAR_PY,
    ATTN_RES_PY,
    CUSTOM_OPS_PY,
    DSPARK_PY,
    IMPORT_CUDA_OPS,
    IMPORT_MODULES,
    IMPORT_OPS,
    MISSING,
    MODEL_PY,
    OPS_SUFFIX,
    PIN,
    ROCM_MISSING,
    ROCM_STANDINS,
    UTILS_PY,
    attn_res_tiling,
)
from k3num.engines.vllm_adapter.context_kv import BUILT_OPS, _bind_precompute, _built_ops, _RealContextKVOps
from k3num.engines.vllm_adapter.weight_loading import _bind_weight_loading
from k3num.supply import cuda_ops, fetch, installed

__all__ = ["build", "build_rocm", "CONTRACT", "BOUND_BESIDES_CONTRACT", "coverage_rows", "contract_problems",
           "require_interpreter", "ATTN_RES_PY", "AMD_ATTN_RES_PY", "MODEL_PY", "DSPARK_PY", "IMPORT_OPS", "BUILT_OPS",
           "OPS_SUFFIX"]

ATTN_RES_SIGNATURE = ["prefix", "delta", "blocks", "norm_weight", "qk_weight", "output_norm_weight", "num_blocks",
                      "block_write_idx", "eps", "output_norm_eps"]
# what each bound subject needs: file -> {qualified name: its positional parameters (None: only that it exists)}
CONTRACT: dict[str, dict[str, dict[str, list[str] | None]]] = {
    base.ATTN_RES: {ATTN_RES_PY: {"attn_res": ATTN_RES_SIGNATURE, "_attn_res_kernel": None}},
    "rocm:" + base.ATTN_RES: {AMD_ATTN_RES_PY: {"attn_res": ATTN_RES_SIGNATURE, "_attn_res_kernel": None}},
    base.AUX_CAPTURE: {MODEL_PY: {"KimiLinearModel._capture_aux_hidden_stream":
                                  ["self", "layer_idx", "prefix_sum", "pending_mlp_out", "block_residual"]}},
    "rocm:" + base.AUX_CAPTURE: {AMD_LINEAR_PY: {"KimiLinearModel._maybe_add_hidden_state":
                                                 ["self", "aux_hidden_states", "layer_idx", "hidden_states",
                                                  "residual"]}},
    base.CONTEXT_KV_FUSED: {DSPARK_PY: {
        "K3DSparkModel._precompute_fused_context_kv":
            ["self", "context_states", "context_positions", "context_slot_mapping"],
        "K3DSparkModel._has_uniform_block_layout": None, "K3DSparkModel._get_context_kv_cache_ptrs": None,
        "K3DSparkModel._build_fused_context_kv_metadata": ["self"]}},
    "weight_loading": {DSPARK_PY: {"_duplicate_context_kv_weights": None}, UTILS_PY: {}},
    "block_fp8_loading": {quant_loading.LINEAR_PY: {
        "adjust_block_scale_shard": ["weight_block_size", "shard_size", "shard_offset"],
        "MergedColumnParallelLinear.weight_loader_v2": ["self", "param", "loaded_weight", "loaded_shard_id"],
        "MergedColumnParallelLinear.validate_shard_id": None},
        quant_loading.PARAMETER_PY: {"_ColumnvLLMParameter.load_merged_column_weight": None}},
    "merged_loading_tp": {quant_loading.LINEAR_PY: {
        "MergedColumnParallelLinear.weight_loader_v2": None, "MergedColumnParallelLinear.validate_shard_id": None,
        "LinearBase.update_param_tp_status": ["self"]},
        quant_loading.PARAMETER_PY: {"_ColumnvLLMParameter.load_merged_column_weight": None}},
    "nvfp4_loading": {quant_loading.CT_NVFP4_PY: {
        "CompressedTensorsW4A4Fp4.create_weights":
            ["self", "layer", "output_partition_sizes", "input_size_per_partition", "params_dtype", "weight_loader"],
        "CompressedTensorsW4A4Fp4.process_weights_after_loading": ["self", "layer"]},
        quant_loading.LINEAR_PY: {"MergedColumnParallelLinear.weight_loader_v2": None},
        quant_loading.PARAMETER_PY: {"PerTensorScaleParameter._load_into_shard_id": None}},
    "nvfp4_modelopt_loading": {quant_loading.MODELOPT_PY: {
        "KNvfp4Static.create_weights": ["self", "layer", "role", "ctx", "shapes", "wl"],
        "KNvfp4Static.process": ["self", "layer", "role"], "QuantKeyScheme.register_params": None},
        quant_loading.LINEAR_PY: {"MergedColumnParallelLinear.weight_loader_v2": None}},
    "context_proj_tp": {context_proj.DRAFTER_MODEL_PY: {"context_proj": ["backbone", "prefix"],
                                                        "_gathered_linear": None},
                        quant_loading.LINEAR_PY: {"ColumnParallelLinear.forward": ["self", "input_"],
                                                  "ColumnParallelLinear.weight_loader_v2":
                                                      ["self", "param", "loaded_weight"],
                                                  "UnquantizedLinearMethod.create_weights": None},
                        quant_loading.PARAMETER_PY: {"_ColumnvLLMParameter.load_column_parallel_weight": None},
                        context_proj.EXECUTOR_UTILS_PY: {"set_weight_attrs": None}},
    "mla_epilogue": {mla_epilogue.MLA_EPILOGUE_PY: dict(mla_epilogue.SIGNATURES)},
    "draft_config": {path: dict(names) for path, names in draft_config.SIGNATURES.items()},
    "markov_steps": {path: dict(names) for path, names in markov.SIGNATURES.items()},
    "pp_taps": {MODEL_PY: {"KimiLinearModel.forward": None, "KimiLinearModel._set_aux_hidden_state_layers": None},
                pp_forward.INTERFACES_PY: {f"EagleModelMixin.{m}": None for m in pp_forward.MIXIN_METHODS},
                pp_forward.EAGLE3_UTILS_PY: {"aux_hidden_state_relay_keys": None},
                pp_forward.PP_UTILS_PY: {"PPHandler.relay_aux_hidden_states": None}},
    "rocm:pp_taps": {AMD_LINEAR_PY: {"KimiLinearModel.forward": None},
                     pp_forward.INTERFACES_PY: {f"EagleModelMixin.{m}": None for m in pp_forward.MIXIN_METHODS},
                     pp_forward.EAGLE3_UTILS_PY: {"aux_hidden_state_relay_keys": None},
                     pp_forward.PP_UTILS_PY: {"PPHandler.relay_aux_hidden_states": None}},
}

# bound besides CONTRACT's names, for `k3num coverage`: (file, function) -> (language, K3 path, subject or contract)
BOUND_BESIDES_CONTRACT = {
    (UTILS_PY, "WeightsMapper"): ("python", "1", "weight_loading"),
    # 0.34.0's metadata build reads it (context_kv.RELEASE_HELPERS); 0.33.0's file does not define it
    ("vllm/model_executor/utils.py", "refill_derived"): ("python", "1", base.CONTEXT_KV_FUSED),
    (DSPARK_PY, "K3DSparkForCausalLM.hf_to_vllm_mapper"): ("python", "1", "weight_loading"),
    **{(CUSTOM_OPS_PY, name): ("python", "1", "context_kv_ops") for name in BUILT_OPS},
    ("csrc/layernorm_kernels.cu", "rms_norm (built by k3num build-ops; a stand-in without CUDA)"):
        ("cuda", "1", "context_kv_ops"),
    ("csrc/pos_encoding_kernels.cu", "rotary_embedding (built by k3num build-ops; a stand-in without CUDA)"):
        ("cuda", "1", "context_kv_ops"),
    ("csrc/cache_kernels.cu", "concat_and_cache_mla_grouped (built by k3num build-ops; a stand-in without CUDA)"):
        ("cuda", "1", "context_kv_ops"),
    ("csrc/cache_kernels.cu", "concat_and_cache_mla (the per-layer insert do_kv_cache_update calls; built by k3num "
                              "build-ops; a stand-in without CUDA)"): ("cuda", "1", "context_kv_ops"),
    (markov.DRAFT_LOGITS_PY, "draft_logits_row"): ("triton", "3", "markov_steps"),
    (mla_epilogue.KERNEL_CU, "fused_kimi_k3_mla_key_concat_kv_cache_insert (built by k3num build-ops; absent "
                             "without CUDA)"): ("cuda", "1", "mla_epilogue"),
    (mla_epilogue.KERNEL_CU, "fused_kimi_k3_mla_qkv_quant_kv_cache_fp8_insert (built by k3num build-ops; absent "
                             "without CUDA)"): ("cuda", "1", "mla_epilogue"),
    (mla_epilogue.KERNEL_CU, "fused_kimi_k3_mla_decode_q_concat_kv_cache_insert (built by k3num build-ops; absent "
                             "without CUDA)"): ("cuda", "1", "mla_epilogue"),
    (mla_epilogue.KERNEL_CU, "fused_kimi_k3_mla_decode_q_concat_kv_cache_fp8_insert (built by k3num build-ops; "
                             "absent without CUDA)"): ("cuda", "1", "mla_epilogue"),
}


def coverage_rows() -> list[tuple[str, str, str, str, str, str]]:
    """What this adapter binds, in the one format every adapter declares for `k3num coverage`: (engine, file,
    function, language, K3 path, subject or contract) per bound function (CONTRACT's names, by language: a
    Triton kernel's name says so, then BOUND_BESIDES_CONTRACT)."""
    from k3num.engines.subjects import PATH_OF

    rows = []
    for subject, files in CONTRACT.items():
        engine, name = ("vllm-rocm", subject[len("rocm:"):]) if subject.startswith("rocm:") else ("vllm", subject)
        for file, functions in files.items():
            for function in functions or {}:
                language = "triton" if "kernel" in function.lower() or "_mix_fused" in function else "python"
                rows.append((engine, file, function, language, PATH_OF.get(name, "?"), name))
    rows += [("vllm", file, function, *row) for (file, function), row in BOUND_BESIDES_CONTRACT.items()]
    return rows


def contract_problems(root: Path, subject: str) -> list[str]:
    """What in the tree under `root` breaks the contract of `subject` ([] when it holds)."""
    problems = []
    for rel, names in CONTRACT[subject].items():
        path = root / rel
        if not path.is_file():
            problems.append(f"contract changed: {rel}: file missing")
            continue
        for qual, want in names.items():
            try:
                got = source.signature_of(path, qual)
            except source.SourceError as e:
                problems.append(f"contract changed: {rel}: {e}")
                continue
            except SyntaxError as e:
                problems.append(f"contract changed: {rel}: does not parse ({e})")
                break
            if want is not None and got[: len(want)] != want:
                problems.append(f"contract changed: {rel}: {qual} takes {got}, the adapter binds {want}")
    return problems


def _bind(subject: str, root: Path, make: Callable[[], Any], bound: dict[str, Any], missing: dict[str, str]) -> None:
    """bound[subject] = make(), or missing[subject] = why not (the contract, or what binding raised)."""
    problems = contract_problems(root, subject)
    if problems:
        missing[subject.split(":")[-1]] = "; ".join(problems)
        return
    try:
        bound[subject.split(":")[-1]] = make()
    except ImportError as e:
        rel = next(iter(CONTRACT[subject]))
        missing[subject.split(":")[-1]] = (f"contract changed: {rel}: imports a module the adapter's stubs do not "
                                           f"provide ({e})")
    except (source.SourceError, AttributeError, KeyError, SyntaxError) as e:
        rel = next(iter(CONTRACT[subject]))
        missing[subject.split(":")[-1]] = f"contract changed: {rel}: {type(e).__name__}: {e}"


def _unavailable(name: str, missing: dict[str, str], wanted: tuple[str, ...]) -> EngineUnavailable:
    return EngineUnavailable(f"{name} {PIN.version}: no subject could be bound: "
                             + "; ".join(f"{s}: {missing[s]}" for s in wanted if s in missing))


def build(src: fetch.Source, mode: str) -> base.Engine:
    """vLLM's NVIDIA subjects, read from `src` (the pinned cache or a local tree) in `mode` (--engine-mode)."""
    root = src.root
    inst, note = installed.select(src, mode, IMPORT_MODULES, IMPORT_CUDA_OPS)
    if inst is not None:
        return _build_imported(inst)
    if not fetch.verified_manifest(src):
        raise EngineUnavailable(f"vllm {src.pin.version} source is not in {root}: run `k3num fetch {src.spec}`")
    interpret = not torch.cuda.is_available()
    run_mode = "source-interpreter" if interpret else "source-gpu"
    if interpret:
        require_interpreter()
        round_bf16_to_nearest_even()
    triton_support.triton_modules("vllm")
    ops, real_ops, ops_note = _built_ops(src, interpret)
    bound: dict[str, Any] = {}
    missing: dict[str, str] = {}
    _bind(base.ATTN_RES, root, lambda: _load_attn_res(root / ATTN_RES_PY, interpret), bound, missing)
    kernel = bound.get(base.ATTN_RES)
    if kernel is not None:
        _bind(base.AUX_CAPTURE, root, lambda: _bind_capture(root / MODEL_PY, {"torch": torch, "attn_res": kernel}),
              bound, missing)
        _bind("pp_taps", root, lambda: pp_forward.bind(root, kernel, "nvidia"), bound, missing)
    else:
        for s in (base.AUX_CAPTURE, "pp_taps"):
            missing[s] = f"needs attn_res: {missing[base.ATTN_RES]}"
    _bind(base.CONTEXT_KV_FUSED, root, lambda: _bind_precompute(root / DSPARK_PY, None, ops), bound, missing)
    _bind("weight_loading", root, lambda: _bind_weight_loading(root), bound, missing)
    _bind("block_fp8_loading", root, lambda: quant_loading.bind(root), bound, missing)
    _bind("merged_loading_tp", root, lambda: quant_loading.bind_tp(root), bound, missing)
    _bind("nvfp4_loading", root, lambda: quant_loading.bind_nvfp4(root), bound, missing)
    _bind("nvfp4_modelopt_loading", root, lambda: quant_loading.bind_nvfp4_modelopt(root), bound, missing)
    if (root / context_proj.DRAFTER_MODEL_PY).is_file():
        _bind("context_proj_tp", root, lambda: context_proj.bind(root), bound, missing)
    else:
        missing["context_proj_tp"] = context_proj.ABSENT
    if (root / draft_config.DENSE_DRAFT_PY).is_file():
        _bind("draft_config", root, lambda: draft_config.bind(root), bound, missing)
    else:
        missing["draft_config"] = draft_config.ABSENT
    if (root / markov.MARKOV_PY).is_file():
        _bind("markov_steps", root, lambda: markov.bind(root, interpret), bound, missing)
    else:
        missing["markov_steps"] = markov.ABSENT
    if ops is not None:  # the epilogue's wrappers call compiled ops that exist only where they were built
        _bind("mla_epilogue", root, lambda: mla_epilogue.bind(root), bound, missing)
    else:
        missing["mla_epilogue"] = f"vLLM's compiled ops are not built here ({ops_note})"
    subjects = {s: f for s, f in bound.items() if s in base.SUBJECTS}
    if not subjects:
        raise _unavailable("vllm", missing, (base.ATTN_RES, base.AUX_CAPTURE, base.CONTEXT_KV_FUSED))
    if ops is not None:
        run_mode += OPS_SUFFIX
    elif not interpret:  # on a CUDA machine, say how the real ops would be had
        note = "; ".join(filter(None, [note, f"compiled ops are stand-ins: {ops_note}"]))
    m = fetch.verified_manifest(src) or fetch.manifest(src)
    files = {base.ATTN_RES: ATTN_RES_PY, base.AUX_CAPTURE: MODEL_PY, base.CONTEXT_KV_FUSED: DSPARK_PY}
    extras: dict[str, Any] = {k: bound[k] for k in ("weight_loading", "pp_taps", "block_fp8_loading",
                                                    "merged_loading_tp", "nvfp4_loading",
                                                    "nvfp4_modelopt_loading", "context_proj_tp", "mla_epilogue",
                                                    "draft_config", "markov_steps")
                                 if k in bound}
    if base.ATTN_RES in bound:
        extras["attn_res_tiling"] = attn_res_tiling
    if ops is not None and base.CONTEXT_KV_FUSED in bound:
        extras["context_kv_ops"] = _RealContextKVOps(ops)
    if "pp_taps" in bound:
        extras["pp_taps_standins"] = pp_forward.STANDINS
    return base.Engine(
        name="vllm", version=src.version, mode=run_mode, subjects=subjects, real_ops=real_ops,
        source_sha256={s: m.get(f, "") for s, f in files.items() if s in subjects}, missing={**MISSING, **missing},
        extras=extras, mode_note="; ".join(filter(None, [note, NEAREST_EVEN_ADAPTATION if interpret else "",
                                                         *(markov.ADAPTATIONS if interpret and "markov_steps" in bound
                                                           else ()),
                                                         cuda_ops.native_attn_res_note()])),
    )


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



def build_rocm(src: fetch.Source, mode: str) -> base.Engine:
    """vLLM's ROCm subjects (run on this machine's GPU or interpreter), read from `src` in `mode`."""
    root = src.root
    # the ROCm kernels are Triton and the tap is Python: no compiled op to require
    inst, note = installed.select(src, mode, (AMD_ATTN_RES_PY, AMD_LINEAR_PY), ())
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
    if not fetch.verified_manifest(src):
        raise EngineUnavailable(f"vllm {src.pin.version} source is not in {root}: run `k3num fetch {src.spec}`")
    interpret = not torch.cuda.is_available()
    if interpret:
        require_interpreter()
        round_bf16_to_nearest_even()
    triton_support.triton_modules("vllm-rocm")
    bound: dict[str, Any] = {}
    missing: dict[str, str] = {}
    _bind("rocm:" + base.ATTN_RES, root, lambda: _load_amd_attn_res(root / AMD_ATTN_RES_PY, interpret), bound,
          missing)
    kernel = bound.get(base.ATTN_RES)
    _bind("rocm:" + base.AUX_CAPTURE, root, lambda: _bind_rocm_capture(root / AMD_LINEAR_PY, kernel=kernel), bound,
          missing)
    _bind("rocm:pp_taps", root, lambda: pp_forward.bind(root, kernel, "rocm"), bound, missing)
    subjects = {s: f for s, f in bound.items() if s in base.SUBJECTS}
    if not subjects:
        raise _unavailable("vllm-rocm", missing, (base.ATTN_RES, base.AUX_CAPTURE))
    m = fetch.verified_manifest(src) or fetch.manifest(src)
    files = {base.ATTN_RES: AMD_ATTN_RES_PY, base.AUX_CAPTURE: AMD_LINEAR_PY}
    extras: dict[str, Any] = {}
    if "pp_taps" in bound:
        extras = {"pp_taps": bound["pp_taps"], "pp_taps_standins": pp_forward.STANDINS}
    if base.ATTN_RES in bound:
        extras["attn_res_tiling"] = attn_res_tiling  # the same switch as the NVIDIA file's
    return base.Engine(
        name="vllm-rocm", version=src.version, mode="source-interpreter" if interpret else "source-gpu",
        subjects=subjects, real_ops=ROCM_STANDINS,
        source_sha256={s: m.get(f, "") for s, f in files.items() if s in subjects},
        missing={**ROCM_MISSING, **missing},
        extras=extras, mode_note="; ".join(filter(None, [note, NEAREST_EVEN_ADAPTATION if interpret else ""])),
    )
