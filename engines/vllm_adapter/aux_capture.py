"""AUX_CAPTURE: `KimiLinearModel._capture_aux_hidden_stream` (nvidia/model.py) and the ROCm tap
(`_maybe_add_hidden_state` of amd/linear.py), lifted and run on stand-in models with real weights."""

from __future__ import annotations

import ast
import types
from pathlib import Path
from typing import Any, cast

import torch

from k3num.engines import source


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


def _mixin_maybe_add_hidden_state(self: Any, aux: list, layer_idx: int, hidden_states: torch.Tensor,
                                  residual: torch.Tensor | None) -> list:
    if layer_idx in self.aux_hidden_state_layers:
        aux.append(hidden_states + residual if residual is not None else hidden_states)
    return aux


def _rocm_layers(weights: Any, num_layers: int, block_size: int, eps: float) -> tuple[list, Any, Any]:
    """Stand-ins for the ROCm model's decoder layers' AttnRes weights, as `KimiDecoderLayer.__init__` names them
    (amd/linear.py: `self_attention_res_norm`, `self_attention_res_proj` of shape [1, H], `prev_valid_blocks`
    = cdiv(i, block size)), and its output mixture's norm and projection: (layers, output norm, output proj)."""
    def norm(w: torch.Tensor) -> Any:
        return types.SimpleNamespace(weight=w, variance_epsilon=eps)

    def proj(w: torch.Tensor) -> Any:
        return types.SimpleNamespace(weight=w.unsqueeze(0))

    if weights is None:
        return [], None, None
    layers = [types.SimpleNamespace(self_attention_res_norm=norm(weights.attn_res_norm[i]),
                                    self_attention_res_proj=proj(weights.attn_res_proj[i]),
                                    prev_valid_blocks=-(-i // block_size)) for i in range(num_layers)]
    return layers, norm(weights.output_res_norm), proj(weights.output_res_proj)


def _bind_rocm_capture(path: Path, module: types.ModuleType | None = None, kernel: Any = None) -> Any:
    """The ROCm tap from amd/linear.py's `_maybe_add_hidden_state`, lifted; its `super()` call goes to
    the Eagle mixin's method: our stand-in in source mode, the real class's in import mode (`module`).

    In source mode the lifted body also gets what a tree that mixes the tap reads (harness/fixes.py's K3N-001/002
    fix, a patch of the same kind): the file's own `_apply_attn_res`, lifted, over `kernel` (ROCm's `attn_res`),
    `envs` with the stream flag as the call gives it, `get_pp_group`, `cdiv`, and the model's layers' AttnRes
    weights. The pinned body reads none of them (it ignores the flag: K3N-001)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    classes = [n for n in tree.body if isinstance(n, ast.ClassDef)
               and any(isinstance(b, ast.FunctionDef) and b.name == "_maybe_add_hidden_state" for b in n.body)]
    if not classes:
        raise source.SourceError("amd/linear.py: no class defines _maybe_add_hidden_state")
    fn = next(b for b in classes[0].body if isinstance(b, ast.FunctionDef) and b.name == "_maybe_add_hidden_state")
    fn.decorator_list = []
    fn = source.route_super(fn)
    mixin: Any = _mixin_maybe_add_hidden_state
    if module is not None:
        cls = getattr(module, classes[0].name)
        mixin = next((c.__dict__["_maybe_add_hidden_state"] for c in cls.__mro__[1:]
                      if "_maybe_add_hidden_state" in c.__dict__), None)
        if mixin is None:
            raise source.SourceError(f"{classes[0].name}: no base class defines _maybe_add_hidden_state")
    flags = types.SimpleNamespace(VLLM_KIMI_K3_AUX_ATTN_RES_STREAM=False, VLLM_BATCH_INVARIANT=False)
    pp = types.SimpleNamespace(is_last_rank=True)
    glb: dict[str, Any] = {**(vars(module) if module is not None else {"torch": torch}),
                           "_super__maybe_add_hidden_state": mixin, "__builtins__": __builtins__}
    body: list[ast.stmt] = [fn]
    if module is None:
        if kernel is None:
            kernel = source.not_bound("ROCm's attn_res kernel did not load", "attn_res")["attn_res"]
        glb.update({"envs": flags, "get_pp_group": lambda: pp, "cdiv": lambda a, b: -(-a // b), "cast": cast,
                    "attn_res": kernel, "kFp8DynamicTokenSym": _NO_QUANT_KEY,
                    **{n: object for n in ("ReplicatedLinear", "RMSNorm", "QuantKey", "QuantizedActivation")}})
        apply = source.find_def(tree, "_apply_attn_res")
        apply.decorator_list = []
        body.append(apply)
    exec(compile(ast.Module(body=body, type_ignores=[]), str(path), "exec"), glb)
    lifted = glb["_maybe_add_hidden_state"]

    def capture(layer_idx, prefix_sum, pending, bank, *, enabled, weights, block_size, end_layer, num_layers,
                is_last_rank, eps, non_final_stage="raise"):
        # KimiLinearModel.forward (ROCm) taps `hidden_states + prefix_delta` after layer i as capture
        # id i + 1; the block bank is passed as `residual`; the pinned body does not consult the env flag
        layers, out_norm, out_proj = _rocm_layers(weights, num_layers, block_size, eps)
        model = types.SimpleNamespace(
            config=types.SimpleNamespace(attn_res_block_size=block_size if weights is not None else None),
            aux_hidden_state_layers={layer_idx + 1}, end_layer=end_layer, layers=layers,
            output_attn_res_norm=out_norm, output_attn_res_proj=out_proj)
        flags.VLLM_KIMI_K3_AUX_ATTN_RES_STREAM = bool(enabled)
        pp.is_last_rank = is_last_rank
        hidden = prefix_sum if pending is None else prefix_sum + pending
        aux: list[torch.Tensor] = []
        lifted(model, aux, layer_idx + 1, hidden, bank if weights is not None else None)
        return aux[-1]

    return capture


# `_apply_attn_res` compares its quant key with this one; the tap passes none, so no fused quantization
_NO_QUANT_KEY = types.SimpleNamespace(dtype=None)
