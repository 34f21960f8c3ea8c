"""Properties on a real (or fine-tuned) checkpoint: `--checkpoint DIR` (fixtures/checkpoint.py).

The checkpoint's own names, tensors and geometry (config.json) replace the random weights: its
outliers and norm scales are what random weights lack. Read once per run, memory-mapped. Without
`--checkpoint` these skip, saying so; a checkpoint that contradicts its config was refused before
the run, naming the file and the tensor.
- the weight-loading contract over the checkpoint's real tensor names;
- the fused context KV with its kv_a_proj_with_mqa (dequantized when quantized) and kv_a_layernorm
  weights, against the oracle under the live property's baseline rule;
- its quantized shards through the engine's merged-layer loader (exact, as test_quantized_loading);
- attn_res with its per-layer AttnRes norm and projection weights, under `mixture_budget`.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from k3num.engines import base
from k3num.engines.mirror import context_kv as eager
from k3num.fixtures import checkpoint as ckpt
from k3num.fixtures.tensors import Draw
from k3num.harness import ledger_models, ledger_run, run
from k3num.harness.judges import EPS, OUT_EPS, attn_res_oracle, fused_context_kv
from k3num.oracles.records import judge
from k3num.properties.checks.quantized_loading import refused as _refused
from k3num.properties.support import DEVICE, LOW, report, subject
from k3num.refmodel import quant


def _checkpoint(draft: bool | None = None) -> ckpt.Checkpoint:
    c = ckpt.opened(run.current().checkpoint)
    if c is None:
        pytest.skip("no checkpoint: pass --checkpoint DIR (Hugging Face layout, model.safetensors.index.json)")
    if draft is True and not c.is_draft:
        pytest.skip(f"{c.root}: not a DSpark draft checkpoint (no kv_lora_rank in config.json)")
    if draft is False and not c.has_attn_res:
        pytest.skip(f"{c.root}: no K3 target layers with AttnRes (no attn_res_block_size in config.json)")
    return c


def _stream(c: ckpt.Checkpoint) -> list[tuple[str, torch.Tensor]]:
    return [(name, c.tensor(name)) for name in sorted(c.weight_map)]


def test_checkpoint_kv_shards_yield_one_copy_each_with_their_layer_as_shard_id(engine) -> None:
    c = _checkpoint(draft=True)
    loading = engine.extras.get("weight_loading")
    if loading is None:
        pytest.skip(f"engine {engine.name} {engine.version} has no weight-loading contract")
    layers = c.draft_geometry().num_layers
    copies: dict[int, dict[str, torch.Tensor]] = {}
    originals = _stream(c)
    for name, t in loading.duplicate(iter(originals), layers):
        if name.startswith("context_kv_proj."):
            copies.setdefault(t.shard_id, {})[name.rsplit(".", 1)[-1]] = t
    want = ckpt.KV_PARAMS[c.quant]
    for layer in range(layers):
        got = copies.get(layer, {})
        assert set(got) == want, f"{c.root}: layer {layer}: copies {sorted(got)}, its shards {sorted(want)}"
        for p, t in got.items():
            original = c.tensor(ckpt.kv_name(layer, p))
            assert t.data_ptr() == original.data_ptr(), f"layer {layer} {p}: not the same storage"


@given(tokens=st.integers(1, 8), seed=st.integers(0, 2**16))
def test_checkpoint_fused_context_kv_within_budget_of_unfused_baseline(engine, tokens: int, seed: int) -> None:
    c = _checkpoint(draft=True)
    fused = subject(engine, base.CONTEXT_KV_FUSED)
    g = c.draft_geometry()
    kv_a = torch.stack([c.kv_weight(layer) for layer in range(g.num_layers)]).to(LOW).to(DEVICE)
    norm = torch.stack([c.kv_norm(layer) for layer in range(g.num_layers)]).to(LOW).to(DEVICE)
    d = Draw.for_device(seed, DEVICE)
    x = d.normal((tokens, g.hidden)).to(LOW).to(DEVICE)
    positions = d.integers(0, 4096, (tokens,)).to(DEVICE)
    kv_c, k_pe = fused(x, kv_a, norm, positions, g.rope, g.eps)
    q_rows = torch.zeros(g.num_layers, g.q_lora_rank, g.hidden, dtype=LOW, device=DEVICE)
    b_c, b_pe = eager.context_kv_unfused(x, torch.cat([q_rows, kv_a], 1), norm, positions, g.rope, g.eps)
    expected = fused_context_kv(x, kv_a, norm, positions, g.rope, g.eps, (b_c, b_pe))
    for name, out in (("kv_c", kv_c), ("k_pe", k_pe)):
        report(judge(property="checkpoint_fused_within_budget_of_unfused", engine=engine,
                     subject=base.CONTEXT_KV_FUSED, actual=out, reference=expected[name].reference,
                     budget=expected[name].budget, seed=seed, reduction_len=g.hidden,
                     detail=f"{name};checkpoint={c.root.name};quant={c.quant}"))


def test_checkpoint_quantized_shards_load_as_the_per_layer_weights(engine) -> None:
    c = _checkpoint(draft=True)
    if c.quant == "none":
        pytest.skip(f"{c.root}: not quantized")
    key = {"fp8": "block_fp8_loading", "nvfp4-ct": "nvfp4_loading", "nvfp4-modelopt": "nvfp4_modelopt_loading"}[c.quant]
    load, loading = engine.extras.get(key), engine.extras.get("weight_loading")
    if load is None or loading is None:
        pytest.skip(f"engine {engine.name} {engine.version} has no {key} loader")
    g = c.draft_geometry()
    tensors = [(n.rsplit(".", 1)[-1], t) for n, t in loading.duplicate(iter(_stream(c)), g.num_layers)
               if n.startswith("context_kv_proj.")]
    shards = [c.kv_shard(layer) for layer in range(g.num_layers)]
    order = [t.shard_id for n, t in tensors if n in ("weight", "weight_packed")]  # the arrival order
    try:
        if c.quant == "fp8":
            weight, scale = load(tensors, g.num_layers, (quant.FP8_BLOCK, quant.FP8_BLOCK))
            got = quant.dequantize_fp8_block(weight, scale)
        else:
            extra = _input_scales(g.num_layers) if c.quant == "nvfp4-ct" else []
            loaded = load(tensors + extra, g.num_layers)
            got = quant.dequantize_nvfp4_modelopt(loaded["weight"], loaded["weight_scale"], loaded["weight_multiplier"])
    except (ValueError, NotImplementedError) as e:  # a refusal is a result: recorded, with its message
        _refused(engine, f"checkpoint={c.root};quant={c.quant}", e)
        return
    except RuntimeError as e:  # what was raised, for the ledger's bug model (K3N-011: the loader's narrow)
        if c.quant == "fp8":
            ledger_run.observe(ledger_models.BLOCK_FP8_MERGE, (_fp8_layers(shards), order, quant.FP8_BLOCK), e)
        raise
    if c.quant == "fp8":
        want = torch.cat([c.kv_weight(layer) for layer in range(g.num_layers)])
    elif c.quant == "nvfp4-ct":  # as a one-layer checkpoint's NVFP4 GEMM reads it: fp32(1 / global scale)
        want = torch.cat([quant.dequantize_nvfp4_modelopt(*_nvfp4_layer(s, c.quant)) for s in shards])
    else:  # ModelOpt: scale_2 is the multiplier itself
        want = torch.cat([c.kv_weight(layer) for layer in range(g.num_layers)])
    wrong = (got != want).any(1).view(g.num_layers, g.kv_width).sum(1).tolist()
    if sum(wrong) and c.quant == "fp8":  # the layers' own shards and what was loaded, for the ledger's bug models
        ledger_run.observe(ledger_models.BLOCK_FP8_MERGE, (_fp8_layers(shards), order, quant.FP8_BLOCK),
                           (weight, scale))
    elif sum(wrong):
        ledger_run.observe(ledger_models.NVFP4_MERGE, tuple(_nvfp4_layer(s, c.quant) for s in shards),
                           (loaded["weight"], loaded["weight_scale"], loaded["weight_multiplier"]))
    assert sum(wrong) == 0, (f"{c.root} ({c.quant}): dequantized as the GEMM reads it, the merged weight differs from "
                             f"the checkpoint's per-layer weights in {wrong} rows per layer (of {g.kv_width})")


def _fp8_layers(shards: list[dict[str, torch.Tensor]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each layer's (fp8 weight [W, H], block scale [ceil(W / 128), ceil(H / 128)]), in layer order."""
    return [(s["weight"], s["weight_scale_inv"]) for s in shards]


def _nvfp4_layer(s: dict[str, torch.Tensor], fmt: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A layer's (packed e2m1, group scale, the float32 multiplier a one-layer checkpoint's GEMM applies)."""
    if fmt == "nvfp4-ct":
        return s["weight_packed"], s["weight_scale"], (1.0 / s["weight_global_scale"]).to(torch.float32)
    return s["weight"], s["weight_scale"], s["weight_scale_2"]


def _input_scales(layers: int) -> list[tuple[str, torch.Tensor]]:
    out = []
    for layer in range(layers):
        t = torch.ones(1)
        t.shard_id = layer
        out.append(("input_global_scale", t))
    return out


@given(data=st.data(), tokens=st.integers(1, 4), seed=st.integers(0, 2**16), delta=st.booleans())
def test_checkpoint_attn_res_within_rounding_budget_of_oracle(engine, data, tokens: int, seed: int,
                                                              delta: bool) -> None:
    c = _checkpoint(draft=False)
    fn = subject(engine, base.ATTN_RES)
    w = c.attn_res_weights()
    layers, bs = w.attn_res_norm.shape[0], int(c.config["attn_res_block_size"])
    i = data.draw(st.integers(0, layers - 1), label="layer")
    nb = -(-i // bs)  # the blocks layer i mixes (KimiDecoderLayer.prev_valid_blocks)
    h = w.attn_res_norm.shape[1]
    d = Draw.for_device(seed, DEVICE)
    prefix = d.normal((tokens, h)).to(LOW).to(DEVICE)
    dl = d.normal((tokens, h)).to(LOW).to(DEVICE) if delta else None
    bank = d.normal((tokens, max(nb, 1), h)).to(LOW).to(DEVICE)
    norm, qk = w.attn_res_norm[i].to(DEVICE), w.attn_res_proj[i].to(DEVICE)
    onorm = w.input_layernorm[i].to(DEVICE)
    want, budget = attn_res_oracle(engine, prefix, dl, bank, norm, qk, onorm, nb, -1)
    out = fn(prefix.clone(), dl, bank.clone(), norm, qk, onorm, nb, -1, EPS, OUT_EPS)
    report(judge(property="checkpoint_attn_res_within_rounding_budget", engine=engine, subject=base.ATTN_RES,
                 actual=out, reference=want, budget=budget, seed=seed, reduction_len=h * (nb + 1),
                 detail=f"layer={i};nb={nb};checkpoint={c.root.name}"))
