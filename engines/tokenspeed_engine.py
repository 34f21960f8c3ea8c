"""TokenSpeed 0.1.1's real K3 DSpark PP projection code as subjects (BRIEF §4).

Lifted from the fetched, hash-checked wheel files (source mode) or, where
TokenSpeed 0.1.1 is installed on a CUDA machine, from the installed files with
their modules' own globals (import mode: the real `apply_k_rope` and
`segmented_rmsnorm`), and run on stand-in models that carry real weights:
- `K3DSparkModel.project_target_tap` (one owned tap's column block of the stage's
  context_proj, looked up by its LOCAL index) and `DSparkContextProducer.add_capture`
  (adds it into the float32 pipeline accumulator) make STAGE_PARTIAL: a stage's taps
  added from zero, in tap order. The runtime adds each tap straight into the
  running inbound sum; summing a stage from zero and then adding the stage is a
  reordering of float32 additions, stated here because it is the adapter's.
- `K3DSparkModel.finalize_target_projection` (the context norm once, after the sum)
  makes FINALIZE_PROJECTION after the stage sums are added in order in float32, the
  only transfer dtype TokenSpeed accepts (`begin_stage` refuses others).
- `K3DSparkModel.project_target_hidden` is PROJECT_UNSHARDED.
- `_context_tap_owner_layer` (which stage produces a target tap) is the `tap_owner` contract.
- `K3DSparkAttention.project_latent_kv` (the KV rows of each draft layer's fused_qkv_a,
  kv_a_layernorm on kv_c) then `apply_latent_rope` (k_pe rotated in place) make
  CONTEXT_KV_UNFUSED: TokenSpeed projects context KV per layer without computing Q.
Each stage's context_proj weight is the global weight's columns of its local taps,
concatenated in local order, as `K3DSparkModel.load_weights` slices it under PP.
Stand-ins, named in `real_ops`: `ReplicatedLinear` (torch linear in the weight
dtype) and TokenSpeed's `RMSNorm` layer (fp32 math, one rounding).
"""

from __future__ import annotations

import types
from typing import Any

import torch

from k3num.engines import base, source, standins
from k3num.engines.mirror.context_kv import rope_cache
from k3num.engines.registry import EngineUnavailable
from k3num.supply import fetch, installed

PIN = fetch.PINS["tokenspeed"]
MODEL_PY = "tokenspeed/runtime/models/kimi_k3_dspark.py"
CONTEXT_PY = "tokenspeed/runtime/execution/dspark_context.py"
# what this adapter lifts, for `k3num coverage`: (file, function) -> (language, K3 path, subject or contract)
BOUND = {
    (MODEL_PY, "K3DSparkModel.project_target_tap"): ("python", "3", "stage_partial"),
    (CONTEXT_PY, "DSparkContextProducer.add_capture"): ("python", "3", "stage_partial"),
    (MODEL_PY, "K3DSparkModel.finalize_target_projection"): ("python", "3", "finalize_projection"),
    (MODEL_PY, "K3DSparkModel.project_target_hidden"): ("python", "3", "project_unsharded"),
    (MODEL_PY, "_context_tap_owner_layer"): ("python", "2", "tap_owner"),
    (MODEL_PY, "K3DSparkAttention.project_latent_kv"): ("python", "1", "context_kv_unfused"),
    (MODEL_PY, "K3DSparkAttention.apply_latent_rope"): ("python", "1", "context_kv_unfused"),
}
STANDIN_OPS = ("stand-in: ReplicatedLinear (torch linear), RMSNorm layer (fp32 math, one rounding), "
               "tokenspeed_kernel apply_k_rope (fp32 math, one rounding; fp32 cos/sin cache)")


def _apply_k_rope(positions: torch.Tensor, k: torch.Tensor, head_dim: int, cos_sin_cache: torch.Tensor,
                  is_neox: bool) -> torch.Tensor:
    """tokenspeed_kernel's apply_k_rope: k [M, 1, R] rotated into a new tensor."""
    return standins.rotate_heads(positions, k, cos_sin_cache, is_neox)


def _model(taps_hidden: int, fc: torch.Tensor, local: tuple[int, ...], norm: standins.RMSNorm | None,
           lifted: dict) -> Any:
    cols = [fc[:, i * taps_hidden : (i + 1) * taps_hidden] for i in local]  # the loader's PP slice
    m = types.SimpleNamespace(
        local_tap_indices=local, config=types.SimpleNamespace(target_hidden_size=taps_hidden),
        context_proj=standins.Linear(torch.cat(cols, dim=1)) if local else None, context_norm=norm, fc_norm=None,
        _fc_norm_weight=None, hidden_size=fc.shape[0],
    )
    m.project_target_tap = lambda idx, h: lifted["tap"](m, idx, h)
    m.finalize_target_projection = lambda p: lifted["finalize"](m, p)
    return m


IMPORT_OPS = ("real: tokenspeed_kernel apply_k_rope, segmented_rmsnorm (the installed modules' globals); stand-in: "
              "ReplicatedLinear (torch linear), RMSNorm layer (fp32 math, one rounding)")


def build() -> base.Engine:
    root = fetch.source_dir("tokenspeed")
    inst, note = installed.select("tokenspeed", (MODEL_PY, CONTEXT_PY), ())
    if inst is None and not fetch.verified_manifest("tokenspeed"):
        raise EngineUnavailable(f"tokenspeed {PIN.version} source is not in {root}: run `k3num fetch tokenspeed`")
    files = inst.root if inst else root
    model_py, context_py = files / MODEL_PY, files / CONTEXT_PY
    # globals of the lifted code: the installed modules' own, or torch and stand-ins for the kernels
    model_ns = inst.namespace(MODEL_PY, {}) if inst else {"torch": torch, "segmented_rmsnorm": None,
                                                           "apply_k_rope": _apply_k_rope}
    context_ns = inst.namespace(CONTEXT_PY, {}) if inst else {"torch": torch}
    try:
        for qual, want in (("K3DSparkModel.project_target_tap", ["self", "capture_idx", "hidden"]),
                           ("K3DSparkModel.finalize_target_projection", ["self", "projected"]),
                           ("K3DSparkModel.project_target_hidden", ["self", "target_hidden"])):
            got = source.signature_of(model_py, qual)
            if got != want:
                raise source.SourceError(f"{qual} signature changed: {got}")
        lifted = {
            "tap": source.lift(model_py, "K3DSparkModel.project_target_tap", model_ns),
            "finalize": source.lift(model_py, "K3DSparkModel.finalize_target_projection", model_ns),
            "hidden": source.lift(model_py, "K3DSparkModel.project_target_hidden", model_ns),
            "add": source.lift(context_py, "DSparkContextProducer.add_capture", context_ns),
        }
        owner = source.lift(model_py, "_context_tap_owner_layer", model_ns)
        latent_kv = source.lift(model_py, "K3DSparkAttention.project_latent_kv", model_ns)
        latent_rope = source.lift(model_py, "K3DSparkAttention.apply_latent_rope", model_ns)
    except source.SourceError as e:
        raise EngineUnavailable(f"tokenspeed {PIN.version}: {e}") from e

    def context_kv(x: torch.Tensor, fused_w: torch.Tensor, norm: torch.Tensor, positions: torch.Tensor,
                   rope: Any, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """Per draft layer: project_latent_kv (KV rows of fused_qkv_a only, norm on kv_c), then
        apply_latent_rope on the k_pe tail with the layer's fp32 cos/sin cache."""
        num_layers, width_all, _ = fused_w.shape
        kv_lora, r = norm.shape[1], rope.rotary_dim
        max_pos = int(positions.max()) + 1 if positions.numel() else 1
        rotary = types.SimpleNamespace(cos_sin_cache=rope_cache(rope, max_pos, torch.float32, x.device),
                                       is_neox_style=rope.style == "neox")
        outs = []
        for layer in range(num_layers):
            attn = types.SimpleNamespace(
                kv_lora_rank=kv_lora, qk_rope_head_dim=r, q_lora_rank=width_all - kv_lora - r,
                fused_qkv_a_proj_with_mqa=types.SimpleNamespace(weight=fused_w[layer]),
                kv_a_layernorm=standins.RMSNorm(norm[layer], eps), rotary_emb=rotary,
            )
            latent = latent_kv(attn, x)
            outs.append(latent_rope(attn, positions, latent))
        out = torch.stack(outs)  # [L, N, kv_lora + r]
        return out[..., :kv_lora], out[..., kv_lora:]

    def stage_partial(taps: torch.Tensor, fc: torch.Tensor, members: list[int]) -> torch.Tensor:
        if taps.dtype == torch.float64:
            raise NotImplementedError("TokenSpeed 0.1.1 accumulates the pipeline sum in float32 only")
        k, n, h = taps.shape
        acc = torch.zeros(n, fc.shape[0], dtype=torch.float32, device=taps.device)  # begin_stage's accumulator
        model = _model(h, fc, tuple(sorted(members)), None, lifted)
        producer = types.SimpleNamespace(model=model)
        for i in sorted(members):
            lifted["add"](producer, acc, i, taps[i])
        return acc

    def finalize(partials: list[torch.Tensor], norm: torch.Tensor, eps: float, transfer: torch.dtype,
                 order: list[int]) -> torch.Tensor:
        if transfer != torch.float32:
            raise NotImplementedError(
                f"TokenSpeed 0.1.1 sends the pipeline sum in float32 only (begin_stage refuses {transfer})")
        acc = torch.zeros_like(partials[0], dtype=torch.float32)
        for s in order:
            acc.add_(partials[s])
        model = _model(1, torch.zeros(norm.shape[0], 0, dtype=norm.dtype), (), standins.RMSNorm(norm, eps), lifted)
        return model.finalize_target_projection(acc)

    def unsharded(taps: torch.Tensor, fc: torch.Tensor, norm: torch.Tensor, eps: float) -> torch.Tensor:
        k, n, h = taps.shape
        model = _model(h, fc, tuple(range(k)), standins.RMSNorm(norm, eps), lifted)
        return lifted["hidden"](model, taps.permute(1, 0, 2).reshape(n, k * h))

    sha = inst.sha256(MODEL_PY) if inst else fetch.verified_manifest("tokenspeed")[MODEL_PY]
    return base.Engine(
        name="tokenspeed", version=inst.version if inst else fetch.version_label("tokenspeed"),
        mode="import" if inst else "source-lifted", real_ops=IMPORT_OPS if inst else STANDIN_OPS, mode_note=note,
        subjects={base.STAGE_PARTIAL: stage_partial, base.FINALIZE_PROJECTION: finalize,
                  base.PROJECT_UNSHARDED: unsharded, base.CONTEXT_KV_UNFUSED: context_kv},
        source_sha256={s: sha for s in (base.STAGE_PARTIAL, base.FINALIZE_PROJECTION, base.PROJECT_UNSHARDED,
                                        base.CONTEXT_KV_UNFUSED)},
        # the roundings inside the sharded path that the property's budget must count (model.py):
        # project_target_tap returns linear(hidden, weight) in the weight dtype, one bf16 rounding per
        # tap, summed into the fp32 stage accumulator; finalize_target_projection casts the fp32 sum to
        # the norm weight's dtype before the norm, one more rounding of the pre-norm sum
        extras={"tap_owner": owner,
                "projection_roundings": {"tap": torch.bfloat16, "tap_accumulate": torch.float32,
                                         "pre_norm": torch.bfloat16}},
        missing={
            base.CONTEXT_KV_FUSED: "TokenSpeed 0.1.1 projects context KV per draft layer (bound as the per-layer "
                                   "subject context_kv_unfused); it has no cross-layer fused GEMM",
            base.ATTN_RES: "not bound yet: TokenSpeed 0.1.1 has AttnRes (runtime/models/kimi_k3.py _apply_attn_res, "
                           "calling tokenspeed-kernel 0.1.4's attn_res_fwd), but neither file is fetched here",
            base.AUX_CAPTURE: "not bound yet: TokenSpeed 0.1.1 mixes its taps in runtime/models/kimi_k3.py "
                              "(capture_attnres, _dspark_capture_stream), which is not fetched here (its stage "
                              "assignment, _context_tap_owner_layer, is checked as the tap_owner contract)",
            base.DRAFT_CONTEXT_KV: "TokenSpeed 0.1.1's DSpark draft is MLA; the DFlash GQA path is SGLang's",
        },
    )
