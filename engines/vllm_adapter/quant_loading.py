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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from k3num.engines import source

PARAMETER_PY = "vllm/model_executor/parameter.py"
LINEAR_PY = "vllm/model_executor/layers/linear.py"
CT_NVFP4_PY = "vllm/model_executor/layers/quantization/compressed_tensors/schemes/compressed_tensors_w4a4_nvfp4.py"
MODELOPT_PY = "vllm/model_executor/layers/quantization/modelopt.py"


def copy_weight(root: Path) -> Any:
    """vLLM's `copy_weight_` (vllm/model_executor/utils.py, 0.34.0: the weight loaders' copy, parameter.py
    imports it), lifted, off an integrated GPU as every machine here is; None where the release has none."""
    import functools
    import mmap

    path = root / "vllm/model_executor/utils.py"
    platform = types.SimpleNamespace(is_integrated_gpu=lambda index: False)
    try:
        integrated = source.lift(path, "_is_integrated_gpu", {"torch": torch, "current_platform": platform})
        return source.lift(path, "copy_weight_", {"torch": torch, "mmap": mmap,
                                                  "_is_integrated_gpu": functools.cache(integrated)})
    except source.SourceError:
        return None


def release_helpers(root: Path) -> dict[str, Any]:
    """The parameter helpers a release's quantization schemes read (vllm/model_executor/utils.py, 0.34.0:
    `move_parameter`, `retire_parameter`), lifted; the ones the release does not define are left out (the
    lift's check then names what a scheme reads and nothing provides)."""
    path = root / "vllm/model_executor/utils.py"
    out = {}
    for name in ("move_parameter", "retire_parameter"):
        try:
            out[name] = source.lift(path, name, {"torch": torch})
        except source.SourceError:
            continue
    return out


def loader_stubs(root: Path | None = None, rank: int = 0, world: int = 1) -> dict[str, types.ModuleType]:
    """The modules vLLM's loading code imports: one tensor-parallel rank (`rank` of `world`), no synced loader,
    and the release's own `copy_weight_` where it has one (`root` given)."""
    copy = copy_weight(root) if root is not None else None
    return {
        "vllm": source.stub("vllm"),
        "vllm.distributed": source.stub("vllm.distributed", get_tensor_model_parallel_rank=lambda: rank,
                                        get_tensor_model_parallel_world_size=lambda: world),
        **({"vllm.model_executor": source.stub("vllm.model_executor"),
            "vllm.model_executor.utils": source.stub("vllm.model_executor.utils", copy_weight_=copy)}
           if copy is not None else {}),
        "vllm.logger": source.stub("vllm.logger", init_logger=lambda name: types.SimpleNamespace(
            debug=lambda *a, **k: None, warning=lambda *a, **k: None, info=lambda *a, **k: None)),
        "vllm.platforms": source.stub("vllm.platforms", current_platform=types.SimpleNamespace(
            use_sync_weight_loader=lambda: False)),
    }


@dataclass(frozen=True)
class _Merged:
    """vLLM's parameter classes (parameter.py, loaded once) and its merged-layer loader (lifted)."""

    params: types.ModuleType
    loader: Callable
    validate: Callable

    update_tp: Callable | None = None  # LinearBase.update_param_tp_status: the layer's rank into its parameters

    def load(self, params_by_name: dict[str, Any], tensors: list[tuple[str, torch.Tensor]], widths: list[int],
             what: str, world: int = 1, rank: int = 0, **layer_attrs: Any) -> None:
        """Each (name, tensor) into its parameter through `weight_loader_v2`, by its `.shard_id`, on TP rank
        `rank` of `world` (the layer's parameters given the layer's rank as vLLM's LinearBase does)."""
        # 0.34.0's StackedColumnParallelLinear records the shards each parameter received (shard_ids,
        # loaded_shard_ids, named_parameters)
        owner = types.SimpleNamespace(output_sizes=widths, tp_size=world, tp_rank=rank,
                                      shard_ids=tuple(range(len(widths))), loaded_shard_ids={},
                                      named_parameters=lambda: iter(params_by_name.items()),
                                      parameters=lambda: iter(params_by_name.values()), **layer_attrs)
        owner.validate_shard_id = types.MethodType(self.validate, owner)
        if (world, rank) != (1, 0):
            if self.update_tp is None:
                raise NotImplementedError(f"{what}: this release's linear.py has no "
                                          f"LinearBase.update_param_tp_status to give the parameters a rank")
            self.update_tp(owner)
        for name, tensor in tensors:
            param = params_by_name.get(name)
            if param is None:
                raise ValueError(f"{what}: no parameter {name!r} in the merged layer")
            self.loader(owner, param, tensor, tensor.shard_id)


def _merged(root: Path) -> _Merged:
    params = source.load_module(root / PARAMETER_PY, "k3num_engine.vllm.parameter", loader_stubs(root))
    linear = root / LINEAR_PY
    ns: dict[str, Any] = {n: getattr(params, n) for n in (
        "BasevLLMParameter", "RowvLLMParameter", "PerTensorScaleParameter", "BlockQuantScaleParameter")}
    ns.update(Any=Any, TypeIs=Any, adjust_block_scale_shard=source.lift(linear, "adjust_block_scale_shard", {}))
    try:  # 0.34.0: the merged layer's check calls its base's (StackedColumnParallelLinear), which records shards
        ns["_super_validate_shard_id"] = source.lift(linear, "StackedColumnParallelLinear.validate_shard_id", ns)
    except source.SourceError:
        pass
    try:
        update_tp = source.lift(linear, "LinearBase.update_param_tp_status",
                                {"BasevLLMParameter": params.BasevLLMParameter})
    except source.SourceError:
        update_tp = None
    return _Merged(params, source.lift(linear, "MergedColumnParallelLinear.weight_loader_v2", ns),
                   source.lift_method(linear, "MergedColumnParallelLinear.validate_shard_id", ns), update_tp)


def _warnings_logger(into: list[str]) -> Any:
    def log(msg: str, *a: Any) -> None:
        into.append(msg % a if a else msg)
    return types.SimpleNamespace(warning_once=log, warning=log)


def bind(root: Path) -> Callable:
    """The block-FP8 loader (extras["block_fp8_loading"])."""
    m = _merged(root)

    def load(tensors: list[tuple[str, torch.Tensor]], num_layers: int, block: tuple[int, int]
             ) -> tuple[torch.Tensor, torch.Tensor]:
        width, hidden = next(t for name, t in tensors if name == "weight").shape
        bn, bk = block
        with source.stubbed(loader_stubs()):
            weight = m.params.ModelWeightParameter(
                data=torch.empty(num_layers * width, hidden, dtype=torch.float8_e4m3fn), input_dim=1, output_dim=0,
                weight_loader=lambda *a: None)
            scale = m.params.BlockQuantScaleParameter(
                data=torch.full((-(-num_layers * width // bn), -(-hidden // bk)), float("nan"), dtype=torch.float32),
                input_dim=1, output_dim=0, weight_loader=lambda *a: None)
        m.load({"weight": weight, "weight_scale_inv": scale}, tensors, [width] * num_layers, "block_fp8_loading",
               weight_block_size=[bn, bk])
        return weight.data, scale.data

    return load


def bind_tp(root: Path) -> Callable:
    """extras["merged_loading_tp"]: (tensors: ("weight", [W, H] with .shard_id) per layer in arrival order;
    num_layers; world; rank) -> the merged weight [L * W / world, H] as TP rank `rank` of `world` loads it:
    vLLM's `ModelWeightParameter` (its `load_merged_column_weight` narrows each shard to the rank's rows) through
    `MergedColumnParallelLinear.weight_loader_v2`, the parameter given the layer's rank by
    `LinearBase.update_param_tp_status`. Unwritten rows stay NaN. A width the ranks cannot split evenly is
    refused (ValueError), as vLLM's divide() asserts. The K3 draft's own merged context-KV layer is built
    with disable_tp (rank 0 of 1); the target's merged layers (gate_up_proj, in_proj_qkvgfab) load this way."""
    m = _merged(root)

    def load(tensors: list[tuple[str, torch.Tensor]], num_layers: int, world: int, rank: int) -> torch.Tensor:
        width, hidden = next(t for name, t in tensors if name == "weight").shape
        if width % world:
            raise ValueError(f"{width} is not divisible by {world}")
        with source.stubbed(loader_stubs()):
            weight = m.params.ModelWeightParameter(
                data=torch.full((num_layers * width // world, hidden), float("nan"), dtype=tensors[0][1].dtype),
                input_dim=1, output_dim=0, weight_loader=lambda *a: None)
        m.load({"weight": weight}, tensors, [width] * num_layers, "merged_loading_tp", world=world, rank=rank)
        return weight.data

    return load


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
    m = _merged(root)
    warnings: list[str] = []
    ns = {"torch": torch, "ModelWeightParameter": m.params.ModelWeightParameter,
          "PerTensorScaleParameter": m.params.PerTensorScaleParameter,
          "GroupQuantScaleParameter": m.params.GroupQuantScaleParameter, "Callable": Callable,
          "expose_input_quant_key": lambda layer, kernel: None, "logger": _warnings_logger(warnings),
          "replace_parameter": _replace_parameter, **release_helpers(root)}
    create = source.lift(root / CT_NVFP4_PY, "CompressedTensorsW4A4Fp4.create_weights", ns)
    process = source.lift(root / CT_NVFP4_PY, "CompressedTensorsW4A4Fp4.process_weights_after_loading", ns)

    def load(tensors: list[tuple[str, torch.Tensor]], num_layers: int) -> dict[str, Any]:
        width, half = next(t for name, t in tensors if name == "weight_packed").shape
        scheme = types.SimpleNamespace(use_a16=False, group_size=16,
                                       kernel=types.SimpleNamespace(process_weights_after_loading=lambda layer: None))
        layer = torch.nn.Module()
        warnings.clear()
        with source.stubbed(loader_stubs()):
            create(scheme, layer, [width] * num_layers, 2 * half, torch.bfloat16, lambda *a: None)
        m.load(dict(layer.named_parameters()), tensors, [width] * num_layers, "nvfp4_loading")
        process(scheme, layer)
        return _processed(layer, warnings)

    return load


def bind_nvfp4_modelopt(root: Path) -> Callable:
    """extras["nvfp4_modelopt_loading"]: ModelOpt NVFP4 shards through vLLM's own code: the weight
    scheme `KNvfp4Static` of modelopt.py (`create_weights` with `QuantKeyScheme.register_params`, and
    `process`), the merged loader, W4A16 (no activation scheme: the weight's handling is the same).
    (tensors: weight [W, H/2] uint8, weight_scale [W, H/16] float8_e4m3fn, weight_scale_2 [1] per
    layer, with .shard_id, in arrival order; num_layers) -> the dict of bind_nvfp4 (the multiplier is
    the `weight_global_scale` the scheme keeps: ModelOpt's scale_2 is a multiplier already)."""
    m = _merged(root)
    path = root / MODELOPT_PY
    warnings: list[str] = []
    register = source.lift(path, "QuantKeyScheme.register_params", {"torch": torch})
    shapes_cls = source.lift_class(path, "Shapes", {"dataclass": dataclass, "torch": torch})
    weight_role = object()
    ns = {"torch": torch, "ModelWeightParameter": m.params.ModelWeightParameter,
          "PerTensorScaleParameter": m.params.PerTensorScaleParameter, "WEIGHT": weight_role,
          "logger": _warnings_logger(warnings), "replace_parameter": _replace_parameter, **release_helpers(root)}
    create = source.lift(path, "KNvfp4Static.create_weights", ns)
    process = source.lift(path, "KNvfp4Static.process", ns)

    def load(tensors: list[tuple[str, torch.Tensor]], num_layers: int) -> dict[str, Any]:
        width, half = next(t for name, t in tensors if name == "weight").shape
        scheme = types.SimpleNamespace(reject=lambda role: None, register_params=register)
        layer = torch.nn.Module()
        warnings.clear()
        with source.stubbed(loader_stubs()):
            create(scheme, layer, weight_role, types.SimpleNamespace(group_size=16),
                   shapes_cls([width] * num_layers, 2 * half, torch.bfloat16), lambda *a: None)
        m.load(dict(layer.named_parameters()), tensors, [width] * num_layers, "nvfp4_modelopt_loading")
        process(scheme, layer, weight_role)
        return _processed(layer, warnings)

    return load


def _processed(layer: torch.nn.Module, warnings: list[str]) -> dict[str, Any]:
    """An NVFP4 merged layer after its scheme's processing, as the GEMM reads it."""
    return {"weight": layer.weight.data, "weight_scale": layer.weight_scale.data,
            "weight_multiplier": layer.weight_global_scale.data.reshape(1).to(torch.float32),
            "warnings": list(warnings)}


def _replace_parameter(layer: torch.nn.Module, name: str, value: torch.Tensor) -> None:
    """Stand-in for vllm.model_executor.utils.replace_parameter: the attribute becomes a plain
    parameter holding `value`."""
    if name in layer._parameters:
        del layer._parameters[name]
    layer.register_parameter(name, torch.nn.Parameter(torch.as_tensor(value), requires_grad=False))
