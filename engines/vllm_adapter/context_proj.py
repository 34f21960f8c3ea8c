"""vLLM 0.34.0's column-parallel, all-gathered DSpark context projection (path 3's GEMM), one TP rank at a time.

extras["context_proj_tp"]: `make(world, rank, all_gather, dtype, device)` -> the specialized drafter's context
projection as TP rank `rank` of `world` builds it, or None where vLLM keeps the stock replicated one (TP 1, or a TP
size that does not divide the output). Real code, from the hash-checked wheel files:
- `context_proj(backbone, prefix)` (specialized_decode/drafter/model.py, lifted): the TP check and the sizes
  (input target_hidden_size * num_target_layers, output hidden_size, no bias, gathered by the subclass);
- `_gathered_linear()` (the same file, lifted): GatheredColumnParallelLinear, its `forward` the release's (the
  shard through the base's forward, then the drafter's mailbox gather or `tensor_model_parallel_all_gather`);
- `ColumnParallelLinear.forward` and `.weight_loader_v2` (vllm/model_executor/layers/linear.py, lifted) and
  `UnquantizedLinearMethod.create_weights` (the same file): the weight parameter of [H_out / TP, K];
- `ModelWeightParameter` (vllm/model_executor/parameter.py, loaded as a module at that rank):
  `load_column_parallel_weight` narrows the checkpoint's whole `context_proj.weight` [H_out, K] to the rank's rows;
- `set_weight_attrs` and `copy_weight_` (vllm/model_executor/utils.py, lifted).

`layer.weight.weight_loader(layer.weight, full)` is the call vLLM's default loader makes for the checkpoint
tensor; `layer(x)` the forward: x [T, K] -> [T, H_out] on every rank.

Stand-ins (STANDINS): the TP group's rank and size (the arguments), `LinearBase.__init__` (the attributes
ColumnParallelLinear's own `__init__` sets for an unquantized layer: tp_rank, tp_size, the partition sizes,
gather_output, skip_bias_add, return_bias, params_dtype; the weight is made by the real create_weights), the
unquantized GEMM (`quant_method.apply`: F.linear, the GEMM vLLM's default unquantized dispatch runs on CUDA and
on the CPU before its packing step), and `tensor_model_parallel_all_gather` (the caller's `all_gather`: over
torch.distributed, the ranks' shards concatenated along the last dim in rank order, as vLLM's
GroupCoordinator.all_gather returns them). The drafter's own mailbox gather (comm.DrafterComm.gather_context,
Lamport mailboxes on multicast symmetric memory) is not built: `comm` stays None, as wherever they are not.

Shapes: x [T, L * H_target] bf16, weight [H_out, L * H_target] bf16 (the checkpoint's), out [T, H_out].
"""

from __future__ import annotations

import ast
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from k3num.engines import source
from k3num.engines.vllm_adapter import quant_loading

DRAFTER_MODEL_PY = "vllm/models/kimi_k3/nvidia/specialized_decode/drafter/model.py"
MODELS_UTILS_PY = "vllm/model_executor/models/utils.py"
EXECUTOR_UTILS_PY = "vllm/model_executor/utils.py"
STANDINS = ("stand-ins: the TP group's rank and size, LinearBase.__init__'s attributes, the unquantized GEMM "
            "(F.linear) and tensor_model_parallel_all_gather (torch.distributed, rank order, last dim); the "
            "drafter's mailbox gather is not built (comm None)")
ABSENT = "not in this release: the column-parallel context projection is 0.34.0's specialized DSpark drafter's"


def _base_class(root: Path, rank: int, world: int, all_gather: Callable, dtype: torch.dtype,
                device: str) -> tuple[type, dict[str, types.ModuleType]]:
    """(vLLM's ColumnParallelLinear as rank `rank` of `world` builds an unquantized one, the stubs its code imports)."""
    stubs = quant_loading.loader_stubs(root, rank, world)
    params = source.load_module(root / quant_loading.PARAMETER_PY, f"k3num_engine.vllm.parameter_tp{world}_{rank}",
                                stubs)
    linear = root / quant_loading.LINEAR_PY
    platform = types.SimpleNamespace(use_sync_weight_loader=lambda: False)
    set_attrs = source.lift(root / EXECUTOR_UTILS_PY, "set_weight_attrs", {"torch": torch, "Any": Any})
    ns: dict[str, Any] = {"torch": torch, "Parameter": torch.nn.Parameter, "Any": Any,
                          "BasevLLMParameter": params.BasevLLMParameter,
                          "ModelWeightParameter": params.ModelWeightParameter, "set_weight_attrs": set_attrs,
                          "tensor_model_parallel_all_gather": all_gather}
    forward = source.lift(linear, "ColumnParallelLinear.forward", ns)
    loader_v2 = source.lift(linear, "ColumnParallelLinear.weight_loader_v2", ns)
    create = source.lift(linear, "UnquantizedLinearMethod.create_weights", ns)

    _forward, _loader_v2 = forward, loader_v2  # a class body reads enclosing names it does not itself assign

    def apply(layer: Any, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return torch.nn.functional.linear(x, layer.weight, bias)

    class ColumnParallelLinear(torch.nn.Module):
        """LinearBase.__init__ and ColumnParallelLinear.__init__'s attributes for an unquantized layer (a
        stand-in); the weight from the real create_weights, the forward and loader the release's."""

        def __init__(self, input_size: int, output_size: int, bias: bool = True, gather_output: bool = False,
                     skip_bias_add: bool = False, params_dtype: torch.dtype | None = None, quant_config: Any = None,
                     prefix: str = "", *, return_bias: bool = True, disable_tp: bool = False) -> None:
            super().__init__()
            if quant_config is not None:
                raise NotImplementedError("a quantized context_proj is not bound (its quant method's create_weights)")
            if output_size % world:
                raise ValueError(f"{output_size} is not divisible by {world}")  # vLLM's divide() asserts it
            self.tp_rank, self.tp_size = (0, 1) if disable_tp else (rank, world)
            self.input_size, self.output_size, self.prefix = input_size, output_size, prefix
            self.input_size_per_partition = input_size
            self.output_size_per_partition = output_size // self.tp_size
            self.output_partition_sizes = [self.output_size_per_partition]
            self.gather_output, self.skip_bias_add, self.return_bias = gather_output, skip_bias_add, return_bias
            self.params_dtype = params_dtype or dtype
            self.quant_method = types.SimpleNamespace(apply=apply)
            with source.stubbed({**stubs, "vllm.platforms": source.stub("vllm.platforms", current_platform=platform)}):
                create(self.quant_method, self, self.input_size_per_partition, self.output_partition_sizes,
                       input_size, output_size, self.params_dtype, weight_loader=self.weight_loader_v2)
            self.weight.data = self.weight.data.to(device)
            if bias:
                self.bias = torch.nn.Parameter(torch.zeros(self.output_size_per_partition, dtype=self.params_dtype,
                                                           device=device), requires_grad=False)
            else:
                self.register_parameter("bias", None)

        forward = _forward
        weight_loader_v2 = _loader_v2

    return ColumnParallelLinear, stubs


def bind(root: Path) -> Callable[..., Any] | None:
    """extras["context_proj_tp"] (the module docstring), or None where the release has no such drafter."""
    path = root / DRAFTER_MODEL_PY
    if not path.is_file():
        return None
    maybe_prefix = source.lift(root / MODELS_UTILS_PY, "maybe_prefix", {})
    # the two functions are read here, so a release that renames them fails the bind, not a test
    tree = ast.parse(path.read_text(), filename=str(path))
    for name in ("context_proj", "_gathered_linear"):
        source.find_def(tree, name)

    def make(world: int, rank: int, all_gather: Callable[[torch.Tensor], torch.Tensor], *, target_hidden: int,
             target_layers: int, hidden: int, dtype: torch.dtype = torch.bfloat16, device: str = "cpu") -> Any:
        base, stubs = _base_class(root, rank, world, all_gather, dtype, device)
        distributed = source.stub("vllm.distributed", get_tensor_model_parallel_world_size=lambda: world,
                                  get_tensor_model_parallel_rank=lambda: rank,
                                  tensor_model_parallel_all_gather=all_gather)
        linear_mod = source.stub("vllm.model_executor.layers.linear", ColumnParallelLinear=base)
        modules = {**stubs, "vllm.distributed": distributed,
                   "vllm.model_executor.layers": source.stub("vllm.model_executor.layers"),
                   "vllm.model_executor.layers.linear": linear_mod}
        if "vllm.model_executor" not in modules:
            modules["vllm.model_executor"] = source.stub("vllm.model_executor")
        gathered = source.lift(path, "_gathered_linear", {})
        ctor = source.lift(path, "context_proj", {"maybe_prefix": maybe_prefix, "_gathered_linear": gathered})
        backbone = types.SimpleNamespace(
            config=types.SimpleNamespace(target_hidden_size=target_hidden, num_target_layers=target_layers,
                                         hidden_size=hidden), quant_config=None)
        with source.stubbed(modules):
            return ctor(backbone, "model")

    return make
