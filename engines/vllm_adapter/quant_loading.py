"""Block-FP8 shards of the fused context-KV projection through vLLM's own loading code.

extras["block_fp8_loading"]: (tensors: the (param name, tensor with .shard_id) pairs
`_duplicate_context_kv_weights` yields for the merged layer, in arrival order: "weight" [W,H]
float8_e4m3fn and "weight_scale_inv" [cdiv(W,bn), cdiv(H,bk)] float32 per layer; num_layers;
block (bn, bk)) -> (merged weight [L*W, H], merged weight_scale_inv), the parameters as the
block-FP8 GEMM reads them (weight row r uses scale row r // bn: vLLM's w8a8 block kernels);
raises where the engine refuses.

Real code, from the hash-checked wheel files: the parameter classes of
vllm/model_executor/parameter.py (loaded as a module: `ModelWeightParameter`,
`BlockQuantScaleParameter`, and the `load_merged_column_weight` they inherit), and
`MergedColumnParallelLinear.weight_loader_v2` / `validate_shard_id` with `adjust_block_scale_shard`
from vllm/model_executor/layers/linear.py (lifted). Stand-ins: the tensor-parallel group (one
rank), the platform (no synced loader), the layer object, which carries what `create_weights`
gives a merged block-FP8 layer: `output_sizes` [W] * L, `weight_block_size`, and parameters of shape
[L*W, H] and [cdiv(L*W, bn), cdiv(H, bk)] (Fp8LinearMethod.create_weights, from the same release,
read, not run: it builds these shapes from the merged output size). The `allow_fp8_block_shape_
mismatch` flag a merged layer sets when a shard is not a multiple of bn (linear.py) lets
`validate_fp8_block_shape` pass: the accepted load is what runs here.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from engines import source

PARAMETER_PY = "vllm/model_executor/parameter.py"
LINEAR_PY = "vllm/model_executor/layers/linear.py"
CT_NVFP4_PY = "vllm/model_executor/layers/quantization/compressed_tensors/schemes/compressed_tensors_w4a4_nvfp4.py"
MODELOPT_PY = "vllm/model_executor/layers/quantization/modelopt.py"


def _stubs() -> dict[str, types.ModuleType]:
    return {
        "vllm": source.stub("vllm"),
        "vllm.distributed": source.stub("vllm.distributed", get_tensor_model_parallel_rank=lambda: 0,
                                        get_tensor_model_parallel_world_size=lambda: 1),
        "vllm.logger": source.stub("vllm.logger", init_logger=lambda name: types.SimpleNamespace(
            debug=lambda *a, **k: None, warning=lambda *a, **k: None, info=lambda *a, **k: None)),
        "vllm.platforms": source.stub("vllm.platforms", current_platform=types.SimpleNamespace(
            use_sync_weight_loader=lambda: False)),
    }


def bind(root: Path) -> Callable:
    """The block-FP8 loader (extras["block_fp8_loading"])."""
    return _bind(root)[0]


def bind_nvfp4(root: Path) -> Callable:
    """extras["nvfp4_loading"]: compressed-tensors NVFP4 shards through vLLM's own code:
    `CompressedTensorsW4A4Fp4.create_weights` (the merged layer's parameters),
    `MergedColumnParallelLinear.weight_loader_v2` (each shard by its shard id) and the scheme's
    `process_weights_after_loading` up to the GEMM kernel's own layout step (a stand-in: it only
    re-lays the tensors out for the GPU kernel). (tensors: (param name, tensor with .shard_id) in
    arrival order: weight_packed [W, H/2] uint8, weight_scale [W, H/16] float8_e4m3fn,
    weight_global_scale [1], input_global_scale [1], per layer; num_layers) -> (weight [L*W, H/2],
    weight_scale, the per-tensor multiplier the GEMM applies to the weight (1 / the global scale the
    scheme keeps), warnings the scheme logged)."""
    return _bind(root)[1]


def bind_nvfp4_modelopt(root: Path) -> Callable:
    """extras["nvfp4_modelopt_loading"]: ModelOpt NVFP4 shards through vLLM's own code: the weight
    scheme `KNvfp4Static` of modelopt.py (`create_weights` with `QuantKeyScheme.register_params`, and
    `process`), the merged loader, W4A16 (no activation scheme: the weight's handling is the same).
    (tensors: weight [W, H/2] uint8, weight_scale [W, H/16] float8_e4m3fn, weight_scale_2 [1] per
    layer, with .shard_id, in arrival order; num_layers) -> the dict of bind_nvfp4 (the multiplier is
    the `weight_global_scale` the scheme keeps: ModelOpt's scale_2 is a multiplier already)."""
    params = source.load_module(root / PARAMETER_PY, "k3num_engine.vllm.parameter", _stubs())
    path = root / MODELOPT_PY
    warnings: list[str] = []
    logger = types.SimpleNamespace(warning_once=lambda msg, *a: warnings.append(msg % a if a else msg))
    register = source.lift(path, "QuantKeyScheme.register_params", {"torch": torch})
    shapes_cls = source.lift_class(path, "Shapes", {"dataclass": __import__("dataclasses").dataclass,
                                                    "torch": torch})
    weight_role = object()
    ns = {"torch": torch, "ModelWeightParameter": params.ModelWeightParameter,
          "PerTensorScaleParameter": params.PerTensorScaleParameter, "WEIGHT": weight_role, "logger": logger,
          "replace_parameter": _replace_parameter}
    create = source.lift(path, "KNvfp4Static.create_weights", ns)
    process = source.lift(path, "KNvfp4Static.process", ns)
    linear = root / LINEAR_PY
    lns: dict[str, Any] = {n: getattr(params, n) for n in (
        "BasevLLMParameter", "RowvLLMParameter", "PerTensorScaleParameter", "BlockQuantScaleParameter")}
    lns.update(Any=Any, TypeIs=Any, adjust_block_scale_shard=source.lift(linear, "adjust_block_scale_shard", {}))
    loader = source.lift(linear, "MergedColumnParallelLinear.weight_loader_v2", lns)
    validate = source.lift(linear, "MergedColumnParallelLinear.validate_shard_id", lns)

    def load(tensors: list[tuple[str, torch.Tensor]], num_layers: int) -> dict[str, Any]:
        width, half = next(t for name, t in tensors if name == "weight").shape
        scheme = types.SimpleNamespace(reject=lambda role: None, register_params=register)
        layer = torch.nn.Module()
        warnings.clear()
        with source.stubbed(_stubs()):
            create(scheme, layer, weight_role, types.SimpleNamespace(group_size=16),
                   shapes_cls([width] * num_layers, 2 * half, torch.bfloat16), lambda *a: None)
        owner = types.SimpleNamespace(output_sizes=[width] * num_layers, tp_size=1, tp_rank=0)
        owner.validate_shard_id = types.MethodType(validate, owner)
        for name, tensor in tensors:
            param = getattr(layer, name, None)
            if param is None:
                raise ValueError(f"nvfp4_modelopt_loading: no parameter {name!r} in a ModelOpt NVFP4 merged layer")
            loader(owner, param, tensor, tensor.shard_id)
        process(scheme, layer, weight_role)
        return {"weight": layer.weight.data, "weight_scale": layer.weight_scale.data,
                "weight_multiplier": layer.weight_global_scale.data.reshape(1).to(torch.float32),
                "warnings": list(warnings)}

    return load


def _bind(root: Path) -> tuple[Callable, Callable]:
    params = source.load_module(root / PARAMETER_PY, "k3num_engine.vllm.parameter", _stubs())
    linear = root / LINEAR_PY
    ns: dict[str, Any] = {n: getattr(params, n) for n in (
        "BasevLLMParameter", "RowvLLMParameter", "PerTensorScaleParameter", "BlockQuantScaleParameter")}
    ns["Any"] = Any
    ns["TypeIs"] = Any
    adjust = source.lift(linear, "adjust_block_scale_shard", {})
    ns["adjust_block_scale_shard"] = adjust
    loader = source.lift(linear, "MergedColumnParallelLinear.weight_loader_v2", ns)
    validate = source.lift(linear, "MergedColumnParallelLinear.validate_shard_id", ns)

    def load(tensors: list[tuple[str, torch.Tensor]], num_layers: int, block: tuple[int, int]
             ) -> tuple[torch.Tensor, torch.Tensor]:
        width, hidden = next(t for name, t in tensors if name == "weight").shape
        n = num_layers
        bn, bk = block
        with source.stubbed(_stubs()):
            weight = params.ModelWeightParameter(
                data=torch.empty(n * width, hidden, dtype=torch.float8_e4m3fn), input_dim=1, output_dim=0,
                weight_loader=lambda *a: None)
            scale = params.BlockQuantScaleParameter(
                data=torch.full((-(-n * width // bn), -(-hidden // bk)), float("nan"), dtype=torch.float32),
                input_dim=1, output_dim=0, weight_loader=lambda *a: None)
        layer = types.SimpleNamespace(output_sizes=[width] * n, tp_size=1, tp_rank=0, weight_block_size=[bn, bk])
        layer.validate_shard_id = types.MethodType(validate, layer)
        targets = {"weight": weight, "weight_scale_inv": scale}
        for name, tensor in tensors:
            if name not in targets:
                raise ValueError(f"block_fp8_loading: no parameter {name!r} in a block-FP8 merged layer")
            loader(layer, targets[name], tensor, tensor.shard_id)
        return weight.data, scale.data

    warnings: list[str] = []
    scheme_ns = {
        "torch": torch, "ModelWeightParameter": params.ModelWeightParameter,
        "PerTensorScaleParameter": params.PerTensorScaleParameter,
        "GroupQuantScaleParameter": params.GroupQuantScaleParameter, "Callable": Callable,
        "expose_input_quant_key": lambda layer, kernel: None,
        "logger": types.SimpleNamespace(warning_once=lambda msg, *a: warnings.append(msg % a if a else msg),
                                        warning=lambda msg, *a: warnings.append(msg % a if a else msg)),
        "replace_parameter": _replace_parameter,
    }
    create = source.lift(root / CT_NVFP4_PY, "CompressedTensorsW4A4Fp4.create_weights", scheme_ns)
    process = source.lift(root / CT_NVFP4_PY, "CompressedTensorsW4A4Fp4.process_weights_after_loading", scheme_ns)

    def load_nvfp4(tensors: list[tuple[str, torch.Tensor]], num_layers: int) -> dict[str, Any]:
        width, half = next(t for name, t in tensors if name == "weight_packed").shape
        scheme = types.SimpleNamespace(use_a16=False, group_size=16,
                                       kernel=types.SimpleNamespace(process_weights_after_loading=lambda layer: None))
        layer = torch.nn.Module()
        warnings.clear()
        with source.stubbed(_stubs()):
            create(scheme, layer, [width] * num_layers, 2 * half, torch.bfloat16, lambda *a: None)
        owner = types.SimpleNamespace(output_sizes=[width] * num_layers, tp_size=1, tp_rank=0)
        owner.validate_shard_id = types.MethodType(validate, owner)
        for name, tensor in tensors:
            param = getattr(layer, name, None)
            if param is None:
                raise ValueError(f"nvfp4_loading: no parameter {name!r} in a compressed-tensors NVFP4 merged layer")
            loader(owner, param, tensor, tensor.shard_id)
        process(scheme, layer)
        return {"weight": layer.weight.data, "weight_scale": layer.weight_scale.data,
                "weight_multiplier": layer.weight_global_scale.data.reshape(1).to(torch.float32),
                "warnings": list(warnings)}

    return load, load_nvfp4


def _replace_parameter(layer: torch.nn.Module, name: str, value: torch.Tensor) -> None:
    """Stand-in for vllm.model_executor.utils.replace_parameter: the attribute becomes a plain
    parameter holding `value`."""
    if name in layer._parameters:
        del layer._parameters[name]
    layer.register_parameter(name, torch.nn.Parameter(torch.as_tensor(value), requires_grad=False))
