"""The aux taps across pipeline-parallel stages: vLLM's own forward loops and Eagle slot layout.

PP_TAPS (extras["pp_taps"]): (plan: PPTapPlan, embeddings [T,H], weights: AttnResWeights,
layer_scale [L,H]) -> the taps the last stage hands the draft, in order (a list of [T,H]).

Each stage runs the real code, lifted from the hash-checked wheel files:
- NVIDIA: `KimiLinearModel.forward` (nvidia/model.py) with its `_set_aux_hidden_state_layers`
  override and `_capture_aux_hidden_stream` (the real attn_res kernel in aux-stream mode);
- ROCm: `KimiLinearModel.forward` and `_maybe_add_hidden_state` (amd/linear.py);
- both: `EagleModelMixin` from vllm/model_executor/models/interfaces.py (the slot layout
  `_cache_aux_pp_layout`, `pack_local_aux_hidden_states`, `collect_remote_aux_hidden_states`, the
  mixin's `_maybe_add_hidden_state` and `_set_aux_hidden_state_layers`);
- the worker between stages: `aux_hidden_state_relay_keys` (v1/worker/gpu/spec_decode/eagle/
  eagle3_utils.py) and `PPHandler.relay_aux_hidden_states` (v1/worker/gpu/pp_utils.py), which carry
  the upstream taps through a middle stage.
Stand-ins (runtime state and the layers' own math): the pipeline group (rank, world size), the
IntermediateTensors container, and the decoder layers. A stand-in layer keeps the real layer's
AttnRes state flow (the prefix add, the bank write at a block's first layer, the prefix restart
after it; nvidia/model.py KimiDecoderLayer) with the mirror's attn_res and an elementwise tanh for
attention and MLP, so a one-stage run and a split run compute the same bits wherever the tap
plumbing is right. The ROCm layer is the same function under the ROCm loop's state names.
"""

from __future__ import annotations

import types
import typing
from bisect import bisect_right
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from k3num.engines import source
from k3num.engines.base import PPTapPlan, StageRefused
from k3num.engines.mirror.pp import standin_layer

MODEL_PY = "vllm/models/kimi_k3/nvidia/model.py"
AMD_LINEAR_PY = "vllm/models/kimi_k3/amd/linear.py"
INTERFACES_PY = "vllm/model_executor/models/interfaces.py"
EAGLE3_UTILS_PY = "vllm/v1/worker/gpu/spec_decode/eagle/eagle3_utils.py"
PP_UTILS_PY = "vllm/v1/worker/gpu/pp_utils.py"
MIXIN_METHODS = ("_set_aux_hidden_state_layers", "_cache_aux_pp_layout", "_maybe_add_hidden_state",
                 "pack_local_aux_hidden_states", "collect_remote_aux_hidden_states")
STANDINS = ("stand-in: the pipeline group, IntermediateTensors, the decoder layers (the real layer's AttnRes state "
            "flow with the mirror's attn_res; tanh for attention and MLP)")


class IntermediateTensors:
    """Stand-in for vllm.sequence.IntermediateTensors: a dict of named tensors."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.tensors = dict(tensors)

    def __getitem__(self, key: str) -> torch.Tensor:
        return self.tensors[key]

    def __setitem__(self, key: str, value: torch.Tensor) -> None:
        self.tensors[key] = value


class _Group:
    """Stand-in for the pipeline-parallel group of one stage."""

    def __init__(self, rank: int, world: int) -> None:
        self.rank_in_group, self.world_size = rank, world
        self.is_first_rank, self.is_last_rank = rank == 0, rank == world - 1


@contextmanager
def _parallel_state(group: _Group):
    """The modules the lifted methods import at call time, answering for `group`."""
    ps = source.stub("vllm.distributed.parallel_state", get_pp_group=lambda: group,
                     model_parallel_is_initialized=lambda: True)
    with source.stubbed({"vllm": source.stub("vllm"), "vllm.distributed": source.stub("vllm.distributed"),
                         "vllm.distributed.parallel_state": ps}):
        yield


def _rocm_layer(nv: Callable) -> Callable:
    """The same layer under the ROCm loop's names: (positions, hidden_states = prefix, residual = bank,
    prefix_delta) -> (prefix, bank, delta)."""

    def layer(positions, hidden_states, residual, prefix_delta):
        delta, prefix, bank = nv(positions, prefix_delta, residual, hidden_states)
        return prefix, bank, delta

    return layer


def bind(root: Path, attn_res: Callable, platform: str, mutate: dict[str, Callable] | None = None) -> Callable:
    """PP_TAPS for `platform` ("nvidia" or "rocm") from the files under `root`. `mutate` (the mutant
    self-test only: tests/mutants.py) maps a mixin method name or "relay" to a function that takes
    the real one and returns its broken replacement."""
    mutate = mutate or {}
    interfaces = root / INTERFACES_PY
    mixin_ns = {"torch": torch, "bisect_right": bisect_right}
    mixin = {m: source.lift(interfaces, f"EagleModelMixin.{m}", mixin_ns) for m in MIXIN_METHODS}
    mixin = {m: mutate[m](f) if m in mutate else f for m, f in mixin.items()}
    key = source.lift_value(interfaces, "EagleModelMixin.AUX_HIDDEN_STATE_KEY", {"ClassVar": Any})
    relay_keys = source.lift(root / EAGLE3_UTILS_PY, "aux_hidden_state_relay_keys",
                             {"_inner_decoder": lambda model: model.model, "torch": torch})
    relay = source.lift(root / PP_UTILS_PY, "PPHandler.relay_aux_hidden_states",
                        {"IntermediateTensors": IntermediateTensors})
    relay = mutate["relay"](relay) if "relay" in mutate else relay
    # the V2 model runner (the only one that runs DSpark) checks at load, under PP, that the model
    # declares supports_aux_hidden_states_over_pp (the mixin's default is False)
    verify = source.lift(root / EAGLE3_UTILS_PY, "verify_supports_aux_hidden_states_over_pp",
                         {"_inner_decoder": lambda model: model.model, "nn": Any})
    default_over_pp = source.lift_value(interfaces, "EagleModelMixin.supports_aux_hidden_states_over_pp",
                                        {"ClassVar": Any})
    envs = types.SimpleNamespace(VLLM_MOE_SKIP_PADDING=False)
    group_box: dict[str, _Group] = {}
    common = {"torch": torch, "IntermediateTensors": IntermediateTensors, "envs": envs, "attn_res": attn_res,
              "get_pp_group": lambda: group_box["g"], "cdiv": lambda a, b: -(-a // b)}
    if platform == "nvidia":
        path = root / MODEL_PY
        over_pp = _class_value(path, "KimiLinearModel", "supports_aux_hidden_states_over_pp", default_over_pp)
        # its sequence-parallel branch reads names the harness does not bind (use_sequence_parallel is False
        # on the models it builds): declared so, each raising if it is ever reached
        forward = source.lift_method(path, "KimiLinearModel.forward", {**common, **source.not_bound(
            "sequence parallelism (the harness builds use_sequence_parallel=False)",
            "get_forward_context", "is_forward_context_available", "sp_all_gather", "sp_padding_mask", "sp_shard")})
        capture = source.lift_method(path, "KimiLinearModel._capture_aux_hidden_stream", common)
        set_layers = source.lift_method(path, "KimiLinearModel._set_aux_hidden_state_layers", {
            **common, "logger": types.SimpleNamespace(info=lambda *a, **k: None, info_once=lambda *a, **k: None),
            "_super__set_aux_hidden_state_layers": mixin["_set_aux_hidden_state_layers"]})
        add_hidden = mixin["_maybe_add_hidden_state"]
    elif platform == "rocm":
        path = root / AMD_LINEAR_PY
        over_pp = _class_value(path, "KimiLinearModel", "supports_aux_hidden_states_over_pp", default_over_pp)
        envs.VLLM_BATCH_INVARIANT = False
        common["_apply_attn_res"] = source.lift(path, "_apply_attn_res", {
            **common, "cast": typing.cast, "kFp8DynamicTokenSym": types.SimpleNamespace(dtype=None),
            **{n: Any for n in ("ReplicatedLinear", "RMSNorm", "QuantKey", "QuantizedActivation")}})
        forward = source.lift_method(path, "KimiLinearModel.forward", common)
        capture = None
        set_layers = mixin["_set_aux_hidden_state_layers"]
        add_hidden = source.lift_method(path, "KimiLinearModel._maybe_add_hidden_state", {
            **common, "_super__maybe_add_hidden_state": mixin["_maybe_add_hidden_state"]})
    else:
        raise ValueError(f"platform: expected 'nvidia' or 'rocm', got {platform!r}")

    def stage_model(plan: PPTapPlan, start: int, end: int, weights: Any, scale: torch.Tensor, eps: float) -> Any:
        layers: list[Any] = [None] * plan.num_layers
        for i in range(start, end):
            nv = standin_layer(i, plan.block_size, weights, scale, eps)
            if platform == "nvidia":
                layers[i] = types.SimpleNamespace(
                    __call__=nv, self_attention_res_norm=types.SimpleNamespace(weight=weights.attn_res_norm[i],
                                                                               variance_epsilon=eps),
                    self_attention_res_proj=types.SimpleNamespace(weight=weights.attn_res_proj[i].unsqueeze(0)),
                    prev_valid_blocks=-(-i // plan.block_size))
            else:
                layers[i] = _rocm_layer(nv)
        m = types.SimpleNamespace(
            start_layer=start, end_layer=end, layers=_Layers(layers), use_attn_res=True, use_sequence_parallel=False,
            attn_res_block_size=plan.block_size, num_attn_res_blocks=-(-end // plan.block_size),
            _aux_attn_res_stream=plan.aux_stream, supports_aux_hidden_states_over_pp=over_pp,
            AUX_HIDDEN_STATE_KEY=key, aux_hidden_state_layers=(),
            _aux_slot_base_cached=0, _aux_upstream_total_cached=0,
            config=types.SimpleNamespace(attn_res_block_size=plan.block_size, hidden_size=scale.shape[1]),
            output_attn_res_norm=types.SimpleNamespace(weight=weights.output_res_norm, variance_epsilon=eps),
            output_attn_res_proj=types.SimpleNamespace(weight=weights.output_res_proj.unsqueeze(0)))
        for name in ("_cache_aux_pp_layout", "pack_local_aux_hidden_states", "collect_remote_aux_hidden_states"):
            setattr(m, name, types.MethodType(mixin[name], m))
        m._maybe_add_hidden_state = types.MethodType(add_hidden, m)
        if capture is not None:
            m._capture_aux_hidden_stream = types.MethodType(capture, m)
        return m

    def pp_taps(plan: PPTapPlan, embeddings: torch.Tensor, weights: Any, scale: torch.Tensor,
                eps: float = 1e-5, *, runner_check: bool = True, link: Any = None) -> list[torch.Tensor]:
        """runner_check False skips the V2 runner's load-time check (to see what the model's own loop
        would hand on if the runner let the plan through). `link` (harness/pp_ranks.py): run only stage
        link.rank, receiving what the previous stage hands on with link.recv() and sending this stage's
        with link.send(); None runs every stage in this process."""
        stages = plan.stages()
        positions = torch.arange(embeddings.shape[0], device=embeddings.device)
        carried: IntermediateTensors | None = None
        out: Any = None
        for rank, (start, end) in enumerate(stages):
            if link is not None and rank != link.rank:
                continue
            if link is not None and rank > 0:
                carried = link.recv()
            group_box["g"] = _Group(rank, len(stages))
            m = stage_model(plan, start, end, weights, scale, eps)
            with _parallel_state(group_box["g"]):
                try:
                    set_layers(m, plan.taps)
                    if len(stages) > 1 and runner_check:
                        verify(KimiLinearForCausalLM(m), "dspark")
                except (RuntimeError, ValueError) as e:
                    raise StageRefused(f"stage {rank} [{start}, {end}): {e}") from e
                keys = relay_keys(types.SimpleNamespace(model=m))
            out = forward(m, None, positions, carried, inputs_embeds=embeddings.clone() if rank == 0 else None)
            if rank < len(stages) - 1:  # the worker hands the stage's tensors on, relaying upstream taps
                carried = relay(types.SimpleNamespace(aux_hidden_state_relay_keys=keys), carried, out)
                if link is not None:
                    link.send(carried)
        if isinstance(out, tuple):
            return list(out[1])
        return []

    return pp_taps


class KimiLinearForCausalLM:
    """The runner's model object (named as vLLM's, for the refusal's message): the decoder is its
    `.model` (eagle3_utils._inner_decoder)."""

    def __init__(self, model: Any) -> None:
        self.model = model


def _class_value(path: Path, cls: str, attr: str, default: Any) -> Any:
    """A class attribute assigned in `cls`'s body in `path`, else `default` (the base class's)."""
    try:
        return source.lift_value(path, f"{cls}.{attr}", {"ClassVar": Any})
    except source.SourceError:
        return default


class _Layers(list):
    """The model's layer list: the lifted forward slices it and calls each entry."""

    def __getitem__(self, item):  # noqa: ANN001
        got = super().__getitem__(item)
        if isinstance(item, slice):
            return [g.__call__ if isinstance(g, types.SimpleNamespace) else g for g in got]
        return got
