"""TokenSpeed 0.1.1's AttnRes stack (path 2) as subjects: the kernel, the aux tap, the PP forward loop.

Lifted from the hash-checked files (tokenspeed/runtime/models/kimi_k3.py and tokenspeed-kernel 0.1.4's
ops/residual/), with the kernels of engines/tokenspeed_adapter/kernels.py:
- ATTN_RES: `attn_res_fwd` with its `select_attn_res_fwd_kernel` (the public entry point: it checks
  num_valid_blocks and that a block write appends, `block_write_idx == num_valid_blocks`, and refuses
  otherwise with ValueError before anything is written), selecting `torch_attn_res_fwd` on an H200 and on
  the CPU (its only other NVIDIA kernel, `cuda_attn_res_fwd`, needs SM100). TokenSpeed's bank is
  block-major [NB, T, H]; the subject hands it `blocks.permute(1, 0, 2)`, a view, so the kernel's writes
  land in the caller's [T, NB, H] bank. Its output norm takes its statistics over the bf16-rounded mix
  (declared in extras["attn_res_roundings"], a term of the budget: harness.judges.attn_res_oracle).
- AUX_CAPTURE: `KimiLinearModel._dspark_capture_stream` -> `KimiLinearDecoderLayer.capture_attnres` ->
  `_apply_attn_res`. TokenSpeed's layers return the summed stream, so a pending MLP output is added to
  the prefix first (one bf16 add, as the layer's `prefix_sum + self.mlp(h)`). TokenSpeed takes an AttnRes
  tap on the stage that owns its consumer (`_context_tap_owner_layer`): a tap after a non-final stage's
  last layer is taken by the next stage with layer i + 1's weights from the bank it was handed
  (extras["aux_capture_owner_stage"]), never refused nor replaced by the prefix.
- extras["pp_taps"]: `KimiLinearModel.forward` run stage by stage with `set_dflash_layers_to_capture`
  and `set_dflash_aux_hidden_stream` (KimiLinearForCausalLM), the stage's `PPStageState` (prefix,
  `block_residual[:ceil(end / block)]`, the fp32 projection sum) copied to the next stage, which
  seeds its own `new_empty` bank with it. Under PP a stage's taps leave it through the DSpark context
  producer (`DSparkContextProducer.begin_stage` / `add_capture`, real, from dspark_context.py): the
  taps are the ones it is handed, in order; with_hidden also gives the model's last hidden state and
  the projection sum the last stage writes (`write_context`'s argument). The forward's own
  `aux_hidden_states` list is per stage (a non-final stage returns None for it), so it is not what
  crosses stages. Stand-ins: the decoder layers (the real layer's AttnRes state flow, the mirror's
  attn_res, tanh for attention and MLP: engines/mirror/pp.py's layer under TokenSpeed's state names),
  the forward context (no DSpark producer: the taps are returned), the stage's mapping and
  PPStageState. The model's final norm weight is the output-mix norm's (a stand-in value).
"""

from __future__ import annotations

import types
import typing
from pathlib import Path
from typing import Any

import torch

from k3num.engines import source
from k3num.engines.base import PPTapPlan, StageRefused
from k3num.engines.mirror import attn_res as mirror

MODEL_PY = "tokenspeed/runtime/models/kimi_k3.py"
CONTEXT_PY = "tokenspeed/runtime/execution/dspark_context.py"
RESIDUAL_INIT_PY = "tokenspeed_kernel/ops/residual/__init__.py"
STANDINS = ("stand-in: the decoder layers (the real layer's AttnRes state flow with the mirror's attn_res; tanh for "
            "attention and MLP), the forward context, the stage mapping, PPStageState, the draft's per-tap "
            "projection (an fp32 scale)")


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


class PPStageState:
    """Stand-in for tokenspeed.runtime.distributed.pp_stage.PPStageState (the boundary bundle)."""

    def __init__(self, hidden_states: torch.Tensor, block_residual: torch.Tensor,
                 projected_context: torch.Tensor | None = None) -> None:
        self.hidden_states, self.block_residual, self.projected_context = hidden_states, block_residual, \
            projected_context

    def sent(self) -> PPStageState:
        """What the next stage receives: a copy of each tensor (the wire)."""
        return PPStageState(self.hidden_states.clone(), self.block_residual.clone(),
                            None if self.projected_context is None else self.projected_context.clone())


def _norm(weight: torch.Tensor, eps: float) -> Any:
    return types.SimpleNamespace(weight=weight, variance_epsilon=eps)


def _proj(weight: torch.Tensor) -> Any:
    return types.SimpleNamespace(weight=weight.unsqueeze(0))  # ReplicatedLinear(H, 1): weight [1, H]


def bind(root: Path, torch_attn_res_fwd: Any, mutate: dict[str, Any] | None = None) -> types.SimpleNamespace:
    """attn_res (ATTN_RES), aux_capture (AUX_CAPTURE), pp_taps, from the files under `root`. `mutate` (the
    mutant self-test only: tests/mutants.py): "sent" -> a function of the PPStageState a stage hands on,
    returning what the next stage receives instead; "begin_stage" -> a function taking the real one and
    returning its broken replacement."""
    mutate = mutate or {}
    platform = types.SimpleNamespace(is_cdna4=False, is_cdna5=False)

    def select_kernel(family, op, signature, *, traits, solution=None):  # noqa: ANN001
        # on SM90 and the CPU the registry admits one attn_res_fwd kernel, torch_attn_res_fwd
        # (cuda_attn_res_fwd: min arch 10.0; the gluon kernels: gfx950 / gfx1250)
        return torch_attn_res_fwd

    res_ns = {"_torch": torch, "math": __import__("math"), "Platform": types.SimpleNamespace(get=lambda: platform),
              "select_kernel": select_kernel, "format_signature": lambda **k: None,
              "dense_tensor_format": lambda *a: None, "_MAX_BLACKWELL_TOKENS": ((1 << 31) - 1) // 7168,
              "_MAX_AMD_GLUON_TOKENS": 65536, "_MAX_N": 12}
    res_ns["select_attn_res_fwd_kernel"] = source.lift(root / RESIDUAL_INIT_PY, "select_attn_res_fwd_kernel", res_ns)
    attn_res_fwd = source.lift(root / RESIDUAL_INIT_PY, "attn_res_fwd", res_ns)

    model_py = root / MODEL_PY
    nn = types.SimpleNamespace(Module=object)
    ns: dict[str, Any] = {"torch": torch, "nn": nn, "RMSNorm": object, "attn_res_fwd": attn_res_fwd,
                          "ceil_div": _ceil_div, "PPStageState": PPStageState, "Optional": typing.Optional,
                          "logger": types.SimpleNamespace(info=lambda *a, **k: None)}
    apply_attn_res = source.lift(model_py, "_apply_attn_res", ns)
    ns["_apply_attn_res"] = apply_attn_res
    capture_attnres = source.lift(model_py, "KimiLinearDecoderLayer.capture_attnres", ns)
    capture_stream = source.lift(model_py, "KimiLinearModel._dspark_capture_stream", ns)
    forward = source.lift(model_py, "KimiLinearModel.forward", ns)
    refresh = source.lift(model_py, "KimiLinearModel._refresh_dflash_capture_fallback", ns)
    set_layers = source.lift(model_py, "KimiLinearForCausalLM.set_dflash_layers_to_capture", ns)
    set_stream = source.lift(model_py, "KimiLinearForCausalLM.set_dflash_aux_hidden_stream", ns)

    def attn_res(prefix, delta, blocks, norm_weight, qk_weight, output_norm_weight, num_blocks, block_write_idx,
                 eps, output_norm_eps):  # noqa: ANN001  (base.ATTN_RES)
        return attn_res_fwd(prefix, blocks.permute(1, 0, 2), qk_weight, norm_weight, eps,
                            out_norm_weight=output_norm_weight, out_norm_eps=output_norm_eps, delta=delta,
                            num_valid_blocks=num_blocks, block_write_idx=block_write_idx)

    class Layer:
        """One decoder layer of a stage (stand-in math, real capture_attnres)."""

        def __init__(self, i: int, block_size: int, weights: Any, scale: torch.Tensor | None, eps: float) -> None:
            self.layer_id, self.block_size, self.w, self.scale, self.eps = i, block_size, weights, scale, eps
            self.self_attention_res_norm = _norm(weights.attn_res_norm[i], eps)
            self.self_attention_res_proj = _proj(weights.attn_res_proj[i])
            self.prev_valid_blocks = _ceil_div(i, block_size)
            self.is_block_write_layer = i % block_size == 0
            self.block_write_idx = i // block_size
            self._dflash_attnres_capture_fallback = False

        def capture_attnres(self, prefix_sum: torch.Tensor, block_residual: torch.Tensor) -> torch.Tensor:
            return capture_attnres(self, prefix_sum, block_residual)

        def __call__(self, positions, prefix_sum, ctx, block_residual):  # noqa: ANN001
            i, w, eps = self.layer_id, self.w, self.eps
            bank = block_residual.permute(1, 0, 2)  # the mirror's [T, NB, H] view of the block-major bank
            write = i // self.block_size if self.is_block_write_layer else -1
            normed = mirror.attn_res(prefix_sum, None, bank, w.attn_res_norm[i], w.attn_res_proj[i],
                                     w.input_layernorm[i], self.prev_valid_blocks, write, eps, eps)
            attn = torch.tanh(normed.float() * self.scale[i].float()).to(normed.dtype)
            # a block-write layer's snapshot consumed the prefix: the attention output restarts it
            prefix = attn if self.is_block_write_layer else prefix_sum + attn
            mixed = mirror.attn_res(prefix, None, bank, w.mlp_res_norm[i], w.mlp_res_proj[i],
                                    w.post_attention_layernorm[i],
                                    self.prev_valid_blocks + int(self.is_block_write_layer), -1, eps, eps)
            return prefix + torch.tanh(mixed.float() * 0.5).to(mixed.dtype), block_residual

    class Missing:
        """PPMissingLayer: another stage's layer."""

    def model(num_layers: int, block_size: int, start: int, end: int, weights: Any, scale: torch.Tensor | None,
              eps: float, stream: str) -> Any:
        m = types.SimpleNamespace(
            config=types.SimpleNamespace(num_hidden_layers=num_layers, attn_res_block_size=block_size),
            layers=[Layer(i, block_size, weights, scale, eps) if start <= i < end else Missing()
                    for i in range(num_layers)],
            pp_start_layer=start, pp_end_layer=end, mapping=types.SimpleNamespace(is_last_pp_rank=end == num_layers),
            dflash_aux_stream=stream, layers_to_capture=[], eagle3_layers_to_capture=(), _dflash_capture_idx_map={},
            output_attn_res_proj=_proj(weights.output_res_proj) if end == num_layers else None,
            output_attn_res_norm=_norm(weights.output_res_norm, eps) if end == num_layers else None,
            norm=_norm(weights.output_res_norm, eps) if end == num_layers else None)
        m._dspark_capture_stream = types.MethodType(capture_stream, m)
        m._refresh_dflash_capture_fallback = types.MethodType(refresh, m)
        return m

    def aux_capture(layer_idx, prefix_sum, pending, bank, *, enabled, weights, block_size, end_layer, num_layers,
                    is_last_rank, eps, non_final_stage="raise"):  # noqa: ANN001  (base.AUX_CAPTURE)
        prefix = prefix_sum if pending is None else prefix_sum + pending
        stream = "attn_res" if enabled and weights is not None else "prefix"
        if weights is None:
            return capture_stream(types.SimpleNamespace(dflash_aux_stream=stream), layer_idx, prefix, bank)
        # the stage that owns the tap: layer_idx + 1's, or the last stage for the last layer's tap
        owner = min(layer_idx + 1, num_layers - 1)
        m = model(num_layers, block_size, owner, num_layers if owner == num_layers - 1 else owner + 1, weights,
                  None, eps, stream)
        return m._dspark_capture_stream(layer_idx, prefix, bank.permute(1, 0, 2))

    context_py = root / CONTEXT_PY
    begin_stage = source.lift(context_py, "DSparkContextProducer.begin_stage", {"torch": torch})
    add_capture = source.lift(context_py, "DSparkContextProducer.add_capture", {"torch": torch})
    if "begin_stage" in mutate:
        begin_stage = mutate["begin_stage"](begin_stage)

    class Producer:
        """DSparkContextProducer with its real begin_stage and add_capture; the draft model behind it
        records each tap it is given and projects it by a per-tap fp32 scale (a stand-in projection:
        the accumulator's hand-off between stages is what is checked)."""

        def __init__(self, hidden: int, first: bool, taps: list[torch.Tensor], written: list[torch.Tensor]) -> None:
            self.written = written
            def project(idx: int, h: torch.Tensor) -> torch.Tensor:
                taps.append(h.clone())
                return h.float() * (idx + 1.5)

            self.model = types.SimpleNamespace(hidden_size=hidden, project_target_tap=project,
                                               mapping=types.SimpleNamespace(is_first_pp_rank=first))
            self.begin_stage = types.MethodType(begin_stage, self)
            self.add_capture = types.MethodType(add_capture, self)

        def write_context(self, projected, positions, cache_locs) -> None:  # noqa: ANN001
            self.written.append(projected.clone())  # the last stage's sum; the cache write is path 1's

    def pp_taps(plan: PPTapPlan, embeddings: torch.Tensor, weights: Any, scale: torch.Tensor, eps: float = 1e-5,
                *, with_hidden: bool = False, link: Any = None, **_: Any) -> Any:
        """The taps the stages hand the DSpark context producer, in the order it receives them (with_hidden:
        (taps, {"hidden": the model's last hidden state, "projected_context": the last stage's fp32 sum})).
        `link` (harness/pp_ranks.py): run only stage link.rank, its PPStageState received with link.recv()
        and sent with link.send(); the taps are then this stage's own, the hidden state and sum the last's."""
        stream = "attn_res" if plan.aux_stream else "prefix"
        t = embeddings.shape[0]
        positions = torch.arange(t, device=embeddings.device)
        taps: list[torch.Tensor] = []
        written: list[torch.Tensor] = []
        inbound: PPStageState | None = None
        out: Any = None
        stages = plan.stages()
        for rank, (start, end) in enumerate(stages):
            if link is not None and rank != link.rank:
                continue
            if link is not None and rank > 0:
                inbound = link.recv()
            m = model(plan.num_layers, plan.block_size, start, end, weights, scale, eps, stream)
            causal = types.SimpleNamespace(model=m, config=m.config)
            try:
                # DSpark checkpoints name 0-indexed completed layers: tap t is layer t - 1's output
                set_layers(causal, [tap - 1 for tap in plan.taps])
                set_stream(causal, stream)
            except ValueError as e:
                raise StageRefused(f"stage {rank} [{start}, {end}): {e}") from e
            ctx = types.SimpleNamespace(
                dspark_context_producer=Producer(embeddings.shape[1], rank == 0, taps, written),
                target_capture_sink=None,
                num_extends=0, input_num_tokens=t,
                attn_backend=types.SimpleNamespace(decode_window_locations=lambda: positions))
            out = forward(m, None, positions, ctx, input_embeds=embeddings.clone() if rank == 0 else None,
                          pp_inbound=inbound)
            if rank < len(stages) - 1:
                inbound = mutate.get("sent", lambda state: state)(out[0].sent())
                if link is not None:
                    link.send(inbound)
        if not with_hidden or (link is not None and link.rank < len(stages) - 1):
            return taps
        return taps, {"hidden": out[0], "projected_context": written[-1]}

    def capture_split(num_layers: int, block_size: int, captured: list[int], stream: str) -> list[bool]:
        """Each layer's `_dflash_attnres_capture_fallback` (the layer declines the fused AttnRes graph and runs
        split) after `set_dflash_layers_to_capture(captured)` (0-indexed completed layers) and
        `set_dflash_aux_hidden_stream(stream)`, in either order's final state, on one stage holding every
        layer. The flag only steers CUDA's fused graph, so no CPU output shows it: it is read directly."""
        flags = []
        one = torch.ones(num_layers, 1)  # no forward runs: any weights do
        weights = types.SimpleNamespace(attn_res_norm=one, attn_res_proj=one, output_res_proj=one[0],
                                        output_res_norm=one[0])
        for order in (0, 1):
            m = model(num_layers, block_size, 0, num_layers, weights, None, 1e-5, "prefix")
            causal = types.SimpleNamespace(model=m, config=m.config)
            steps = [lambda: set_layers(causal, list(captured)), lambda: set_stream(causal, stream)]
            for step in (steps if order == 0 else steps[::-1]):
                step()
            flags.append([bool(layer._dflash_attnres_capture_fallback) for layer in m.layers])
        if flags[0] != flags[1]:
            raise AssertionError(f"the split layers depend on the setters' order: {flags[0]} then {flags[1]}")
        return flags[0]

    return types.SimpleNamespace(attn_res=attn_res, aux_capture=aux_capture, pp_taps=pp_taps,
                                 attn_res_fwd=attn_res_fwd, capture_split=capture_split)
