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
  kv_a_layernorm on kv_c) then `apply_latent_rope` (k_pe rotated in place), driven by
  `K3DSparkModel.write_context_kv` itself (its layer loop and its split of each row at
  kv_lora_rank into the pool's two halves), make CONTEXT_KV_UNFUSED: TokenSpeed projects
  context KV per layer without computing Q.
Each stage's context_proj weight is the global weight's columns of its local taps,
concatenated in local order, as `K3DSparkModel.load_weights` slices it under PP.
Stand-ins, named in `real_ops`: `ReplicatedLinear` (torch linear in the weight
dtype) and TokenSpeed's `RMSNorm` layer (fp32 math, one rounding).
"""

from __future__ import annotations

import functools
import types
from typing import Any

import torch

from k3num.engines import base, source, standins, subjects, triton_support
from k3num.engines.mirror.context_kv import rope_cache
from k3num.engines.registry import EngineUnavailable
from k3num.engines.tokenspeed_adapter import attn_res as tokenspeed_attn_res
from k3num.engines.tokenspeed_adapter import kernels as tokenspeed_kernels
from k3num.supply import fetch, installed

PIN = fetch.PINS["tokenspeed"]
MODEL_PY = "tokenspeed/runtime/models/kimi_k3_dspark.py"
CONTEXT_PY = "tokenspeed/runtime/execution/dspark_context.py"
# what this adapter lifts, for `k3num coverage`: (file, function) -> (language, K3 path, subject or contract)
BOUND = {
    (MODEL_PY, "K3DSparkModel.project_target_tap"): ("python", "3", "stage_partial"),
    (CONTEXT_PY, "DSparkContextProducer.add_capture"): ("python", "3", "stage_partial,pp_taps"),
    (MODEL_PY, "K3DSparkModel.finalize_target_projection"): ("python", "3", "finalize_projection"),
    (MODEL_PY, "_context_tap_owner_layer"): ("python", "2", "tap_owner"),
    (MODEL_PY, "K3DSparkAttention.project_latent_kv"): ("python", "1", "context_kv_unfused"),
    (MODEL_PY, "K3DSparkAttention.apply_latent_rope"): ("python", "1", "context_kv_unfused"),
    (MODEL_PY, "K3DSparkModel.write_context_kv"): ("python", "1", "context_kv_unfused"),
    (MODEL_PY, "K3DSparkModel.project_target_hidden"): ("python", "3", "project_unsharded,project_unsharded_fc_norm"),
    (tokenspeed_kernels.SEGMENTED_PY, "segmented_rmsnorm"): ("python", "3", "segmented_rmsnorm"),
    (tokenspeed_kernels.SEGMENTED_PY, "_segmented_rmsnorm_kernel"): ("triton", "3", "segmented_rmsnorm"),
    (tokenspeed_kernels.EMBED_INIT_PY, "apply_k_rope"): ("python", "1", "context_kv_unfused,context_kv_ops"),
    (tokenspeed_kernels.EMBED_INIT_PY, "apply_rope"): ("python", "1", "context_kv_unfused,context_kv_ops"),
    (tokenspeed_kernels.EMBED_TRITON_PY, "apply_rope_triton"): ("python", "1", "context_kv_unfused,context_kv_ops"),
    (tokenspeed_kernels.EMBED_TRITON_PY, "_rope_apply_kernel"): ("triton", "1", "context_kv_unfused,context_kv_ops"),
    (tokenspeed_kernels.ROPE_PY, "apply_rope_with_cos_sin_cache_inplace"): (
        "cuda", "1", "context_kv_unfused,context_kv_ops"),
    (tokenspeed_kernels.KVCACHE_TRITON_PY, "set_mla_kv_buffer_triton"): ("python", "1", "context_kv_ops"),
    (tokenspeed_kernels.KVCACHE_TRITON_PY, "_set_mla_kv_buffer_kernel"): ("triton", "1", "context_kv_ops"),
    (tokenspeed_kernels.KVCACHE_TRITON_PY, "_set_mla_kv_buffer_per_loc_kernel"): ("triton", "1", "context_kv_ops"),
    (tokenspeed_kernels.RESIDUAL_TORCH_PY, "torch_attn_res_fwd"): ("python", "2", "attn_res,aux_capture,pp_taps"),
    (tokenspeed_attn_res.RESIDUAL_INIT_PY, "attn_res_fwd"): ("python", "2", "attn_res,aux_capture,pp_taps"),
    (tokenspeed_attn_res.RESIDUAL_INIT_PY, "select_attn_res_fwd_kernel"): ("python", "2", "attn_res"),
    (tokenspeed_attn_res.MODEL_PY, "_apply_attn_res"): ("python", "2", "aux_capture,pp_taps"),
    (tokenspeed_attn_res.MODEL_PY, "KimiLinearDecoderLayer.capture_attnres"): ("python", "2", "aux_capture,pp_taps"),
    (tokenspeed_attn_res.MODEL_PY, "KimiLinearModel._dspark_capture_stream"): ("python", "2", "aux_capture,pp_taps"),
    (tokenspeed_attn_res.MODEL_PY, "KimiLinearModel.forward"): ("python", "2", "pp_taps"),
    (tokenspeed_attn_res.MODEL_PY, "KimiLinearModel._refresh_dflash_capture_fallback"): ("python", "2",
                                                                                    "pp_taps,capture_split"),
    (tokenspeed_attn_res.MODEL_PY, "KimiLinearForCausalLM.set_dflash_layers_to_capture"): ("python", "2", "pp_taps"),
    (tokenspeed_attn_res.MODEL_PY, "KimiLinearForCausalLM.set_dflash_aux_hidden_stream"): ("python", "2", "pp_taps"),
    (CONTEXT_PY, "DSparkContextProducer.begin_stage"): ("python", "2", "pp_taps"),
}


def coverage_rows() -> list[tuple[str, str, str, str, str, str]]:
    """What this adapter binds, in the one format every adapter declares for `k3num coverage` (engine, file,
    function, language, K3 path, subject or contract)."""
    return [("tokenspeed", file, function, *row) for (file, function), row in BOUND.items()]
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


def build(src: fetch.Source, mode: str) -> base.Engine:
    """TokenSpeed's subjects, read from `src` (the pinned cache or a local tree) in `mode` (--engine-mode)."""
    root = src.root
    inst, note = installed.select(src, mode, (MODEL_PY, CONTEXT_PY), ())
    if inst is None and not fetch.verified_manifest(src):
        raise EngineUnavailable(f"tokenspeed {PIN.version} source is not in {root}: run `k3num fetch tokenspeed`")
    files = inst.root if inst else root
    model_py, context_py = files / MODEL_PY, files / CONTEXT_PY
    interpret = not torch.cuda.is_available()
    kern, kern_note = None, ""
    if inst is None:
        try:
            if interpret:
                triton_support.require_interpreter()
                triton_support.round_bf16_to_nearest_even()
            kern = tokenspeed_kernels.load(files, interpret)
        except (EngineUnavailable, source.SourceError) as e:
            kern_note = f"tokenspeed-kernel's Triton kernels are not bound ({e}): stand-ins run instead"
    try:
        attn = tokenspeed_attn_res.bind(files, source.lift(files / tokenspeed_kernels.RESIDUAL_TORCH_PY,
                                                           "torch_attn_res_fwd", {"torch": torch}))
    except (source.SourceError, OSError) as e:
        raise EngineUnavailable(f"tokenspeed {PIN.version}: {e}") from e
    # globals of the lifted code: the installed modules' own, or torch and the pinned kernels (stand-ins
    # where triton is missing)
    model_ns = inst.namespace(MODEL_PY, {}) if inst else {
        "torch": torch, "segmented_rmsnorm": kern.segmented_rmsnorm if kern else None,
        "apply_k_rope": kern.apply_k_rope if kern else _apply_k_rope}
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
        got = source.signature_of(model_py, "K3DSparkModel.write_context_kv")
        if got != ["self", "ctx_hidden", "positions", "cache_locs", "token_to_kv_pool"]:
            raise source.SourceError(f"K3DSparkModel.write_context_kv signature changed: {got}")
        write_context_kv = source.lift(model_py, "K3DSparkModel.write_context_kv", model_ns)
    except source.SourceError as e:
        raise EngineUnavailable(f"tokenspeed {PIN.version}: {e}") from e

    def context_kv(x: torch.Tensor, fused_w: torch.Tensor, norm: torch.Tensor, positions: torch.Tensor,
                   rope: Any, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """TokenSpeed's own `K3DSparkModel.write_context_kv` (lifted): per draft layer project_latent_kv (KV
        rows of fused_qkv_a only, norm on kv_c), apply_latent_rope on the k_pe tail with the layer's fp32
        cos/sin cache, then the pool's set_mla_kv_buffer with the row split at kv_lora_rank; the pool here
        keeps what each layer was given (kv_c [N, kv_lora], k_pe [N, r]), in its layer order."""
        num_layers, width_all, _ = fused_w.shape
        kv_lora, r = norm.shape[1], rope.rotary_dim
        max_pos = int(positions.max()) + 1 if positions.numel() else 1
        rotary = types.SimpleNamespace(cos_sin_cache=rope_cache(rope, max_pos, torch.float32, x.device),
                                       is_neox_style=rope.style == "neox")
        layers = []
        for layer in range(num_layers):
            attn = types.SimpleNamespace(
                kv_lora_rank=kv_lora, qk_rope_head_dim=r, q_lora_rank=width_all - kv_lora - r,
                fused_qkv_a_proj_with_mqa=types.SimpleNamespace(weight=fused_w[layer]),
                kv_a_layernorm=standins.RMSNorm(norm[layer], eps), rotary_emb=rotary, attn_mqa=layer,
            )
            attn.project_latent_kv = functools.partial(latent_kv, attn)
            attn.apply_latent_rope = functools.partial(latent_rope, attn)
            layers.append(types.SimpleNamespace(self_attn=attn))
        n = x.shape[0]
        pool = _KeptRows(num_layers, n)
        write_context_kv(types.SimpleNamespace(layers=layers), x, positions,
                         torch.arange(n, dtype=torch.int64, device=x.device), pool)
        if n == 0:  # write_context_kv returns before any layer: nothing to write
            empty = x.new_empty((num_layers, 0, kv_lora + r))
            return empty[..., :kv_lora], empty[..., kv_lora:]
        return pool.stacked()

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

    def unsharded_fc_norm(taps: torch.Tensor, fc: torch.Tensor, fc_norm: torch.Tensor | None, norm: torch.Tensor,
                          eps: float) -> torch.Tensor:
        """project_target_hidden on a draft whose config has fc_norm (fc_norm [K, H]: one RMSNorm per tap,
        their weights stacked as load_weights leaves `_fc_norm_weight`), or without it (None)."""
        k, n, h = taps.shape
        model = _model(h, fc, tuple(range(k)), standins.RMSNorm(norm, eps), lifted)
        if fc_norm is not None:
            model.fc_norm = [standins.RMSNorm(fc_norm[i], eps) for i in range(k)]
            model._fc_norm_weight = fc_norm.contiguous()
        return lifted["hidden"](model, taps.permute(1, 0, 2).reshape(n, k * h).contiguous())

    sha = inst.sha256(MODEL_PY) if inst else fetch.verified_manifest(src)[MODEL_PY]
    sha_of = inst.sha256 if inst else (lambda rel: fetch.verified_manifest(src)[rel])
    extras: dict[str, Any] = {
        "tap_owner": owner,
        # the roundings inside the sharded path that the property's budget must count (model.py):
        # project_target_tap returns linear(hidden, weight) in the weight dtype, one bf16 rounding per
        # tap, summed into the fp32 stage accumulator; finalize_target_projection casts the fp32 sum to
        # the norm weight's dtype before the norm, one more rounding of the pre-norm sum
        "projection_roundings": {"tap": torch.bfloat16, "tap_accumulate": torch.float32, "pre_norm": torch.bfloat16},
        # torch_attn_res_fwd rounds the mix to bf16 before its fused output norm takes its statistics
        "attn_res_roundings": {"pre_out_norm": torch.bfloat16},
        # select_attn_res_fwd_kernel's precondition: a block write appends (write == num_valid_blocks)
        "attn_res_admits": lambda num_blocks, write, bank: write == -1 or (write == num_blocks and write < bank),
        # an AttnRes tap is taken on the stage that owns its consumer (_context_tap_owner_layer)
        "aux_capture_owner_stage": True,
        # its forward takes a tap of the running prefix sum alone (`capture_tap(layer_idx)` ->
        # `_dspark_capture_stream(layer_idx, prefix_sum, block_residual)`), which the next layers then change in
        # place: the tap's lifetime property calls it so (no pending MLP output)
        "aux_capture_takes_pending": False,
        "pp_taps": attn.pp_taps, "pp_taps_standins": tokenspeed_attn_res.STANDINS, "pp_taps_hidden": True,
        "capture_split": attn.capture_split,
        # project_target_tap's bf16 linear picks its GEMM kernel by the row count (measured on the CPU: a row
        # alone and in a batch of 3 differ by a bf16 rounding of one tap's product, 4 fp32 ulps of the partial)
        "batch_variant": {base.STAGE_PARTIAL: subjects.gemm_by_row_count},
    }
    real = IMPORT_OPS if inst else STANDIN_OPS
    run_mode = "import" if inst else "source-lifted"
    notes = [note, kern_note]
    if kern is not None:
        extras["context_kv_ops"] = _Ops(kern)
        extras["project_unsharded_fc_norm"] = unsharded_fc_norm
        extras["segmented_rmsnorm"] = kern.segmented_rmsnorm
        run_mode = "source-interpreter" if interpret else "source-gpu"
        real = KERNEL_OPS
        notes += [kern.note, *((triton_support.NEAREST_EVEN_ADAPTATION,) if interpret else ())]
    return base.Engine(
        name="tokenspeed", version=inst.version if inst else src.version,
        mode=run_mode, real_ops=real, mode_note="; ".join(filter(None, notes)),
        subjects={base.STAGE_PARTIAL: stage_partial, base.FINALIZE_PROJECTION: finalize,
                  base.PROJECT_UNSHARDED: unsharded, base.CONTEXT_KV_UNFUSED: context_kv,
                  base.ATTN_RES: attn.attn_res, base.AUX_CAPTURE: attn.aux_capture},
        source_sha256={**{s: sha for s in (base.STAGE_PARTIAL, base.FINALIZE_PROJECTION, base.PROJECT_UNSHARDED,
                                           base.CONTEXT_KV_UNFUSED)},
                       base.ATTN_RES: sha_of(tokenspeed_kernels.RESIDUAL_TORCH_PY),
                       base.AUX_CAPTURE: sha_of(tokenspeed_attn_res.MODEL_PY),
                       "pp_taps": sha_of(tokenspeed_attn_res.MODEL_PY)},
        extras=extras,
        missing={
            base.CONTEXT_KV_FUSED: "TokenSpeed 0.1.1 projects context KV per draft layer (bound as the per-layer "
                                   "subject context_kv_unfused); it has no cross-layer fused GEMM",
            base.DRAFT_CONTEXT_KV: "TokenSpeed 0.1.1's DSpark draft is MLA; the DFlash GQA path is SGLang's",
            **{s: "TokenSpeed 0.1.1 has one AttnRes entry point, attn_res_fwd (bound as attn_res; its read-only "
                  "calls are the aux tap's, bound as aux_capture)"
               for s in (base.ATTN_RES_MIX, base.ATTN_RES_MIX_TRITON, base.ATTN_RES_MIX_EAGER, base.ATTN_RES_RESIDUAL)},
        },
    )


KERNEL_OPS = ("real: tokenspeed-kernel apply_k_rope (the Triton kernel, or the CUDA rope.so where it loads: the mode "
              "note says which), set_mla_kv_buffer_triton, torch_attn_res_fwd, _segmented_rmsnorm_kernel; stand-in: "
              "ReplicatedLinear (torch linear), RMSNorm layer (fp32 math, one rounding)")


class _KeptRows:
    """The pool `write_context_kv` writes into, keeping each layer's (kv_c, k_pe) as given: one call per
    layer (its `attn_mqa` is the layer's index), every location in order, no write mask."""

    def __init__(self, num_layers: int, n: int) -> None:
        self.rows: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.num_layers, self.n = num_layers, n

    def set_mla_kv_buffer(self, layer: int, loc: torch.Tensor, cache_k: torch.Tensor, cache_v: torch.Tensor,
                          write_mask: torch.Tensor | None = None) -> None:
        if layer in self.rows:
            raise AssertionError(f"write_context_kv wrote layer {layer} twice")
        if write_mask is not None or not torch.equal(loc.cpu(), torch.arange(self.n)):
            raise AssertionError("write_context_kv passed a write mask or other locations than it was given")
        self.rows[layer] = (cache_k.clone(), cache_v.clone())

    def stacked(self) -> tuple[torch.Tensor, torch.Tensor]:
        """kv_c [L, N, kv_lora], k_pe [L, N, r]; a layer never written is an error, not zeros."""
        missing = [i for i in range(self.num_layers) if i not in self.rows]
        if missing:
            raise AssertionError(f"write_context_kv wrote no rows for layer(s) {missing}")
        return (torch.stack([self.rows[i][0] for i in range(self.num_layers)]),
                torch.stack([self.rows[i][1] for i in range(self.num_layers)]))


class _Ops:
    """TokenSpeed's context-KV ops under properties/test_context_kv_ops.py's interface (rotary, rotary_qk,
    insert_per_layer; it has no grouped norm nor grouped insert)."""

    def __init__(self, kern: Any) -> None:
        self.kern = kern

    def rotary(self, positions: torch.Tensor, x: torch.Tensor, cos_sin_cache: torch.Tensor,
               is_neox: bool) -> torch.Tensor:
        """apply_k_rope on a copy (it rotates k in place), head_size = the rotary width, as apply_latent_rope."""
        return self.kern.apply_k_rope(positions, x.clone(), x.shape[-1], cos_sin_cache, is_neox=is_neox)

    def rotary_qk(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, head_size: int,
                  cos_sin_cache: torch.Tensor, is_neox: bool, q_out: torch.Tensor | None = None,
                  k_out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """apply_rope as the attention calls it: q [T, Hq * D], k [T, Hk * D], the first R = cos_sin_cache's
        width lanes of each head rotated, the rest passed through; into q_out / k_out where given, else in
        place. Returns (q, k) rotated."""
        return self.kern.apply_rope(positions, q, k, head_size, cos_sin_cache, is_neox=is_neox, q_rope_out=q_out,
                                    k_rope_out=k_out)

    def insert_per_layer(self, kv_c: torch.Tensor, k_pe: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor,
                         kv_cache_dtype: str = "auto", scale: torch.Tensor | None = None) -> None:
        """set_mla_kv_buffer_triton into the layer's [NB, BS, W] cache seen as TokenSpeed's pool does, one
        row per slot. TokenSpeed skips a row by its write_mask, not by a negative slot: a skipped slot (< 0)
        becomes write_mask False with its location pointed at a slot another row writes (the kernel must
        neither read nor write it)."""
        if kv_cache_dtype != "auto":
            raise NotImplementedError("TokenSpeed's MLA pool converts FP8 rows at unit scale (the kernel's .to() of "
                                      "an fp8 view); it takes no per-layer scale")
        nb, bs, w = cache.shape
        if cache.stride(2) != 1 or cache.stride(0) != bs * cache.stride(1):
            raise NotImplementedError("TokenSpeed's pool rows are uniformly strided ([slots, W]); this cache's "
                                      "blocks are not")
        keep = slots >= 0
        decoy = slots[keep][0] if bool(keep.any()) else torch.zeros((), dtype=slots.dtype, device=slots.device)
        loc = torch.where(keep, slots, decoy).contiguous()
        rows = cache.as_strided((nb * bs, w), (cache.stride(1), 1))
        self.kern.set_mla_kv_buffer(rows, loc, kv_c.contiguous(), k_pe.contiguous(), write_mask=keep.contiguous())
