"""Quantized shards of the fused context-KV projection through the engine's own loading code.

Block FP8 (128 x 128 blocks, `refmodel.quant`): each draft layer's `kv_a_proj_with_mqa` weight and
`weight_scale_inv`, quantized on their own as a checkpoint holds them, go through the engine's
`_duplicate_context_kv_weights` (the weight-loading contract) and its merged-layer loader
(extras["block_fp8_loading"]: vLLM's real `MergedColumnParallelLinear.weight_loader_v2` and
parameter classes) in a drawn arrival order. Exact contract: the merged parameters, dequantized as
the block GEMM reads them (row r with scale row r // 128), equal the row-stack of the per-layer
dequantized weights, for any number of layers, any arrival order and per-layer scales that differ.
An engine may refuse a shard geometry instead (recorded in the CSV with its message).

NVFP4, compressed-tensors (extras["nvfp4_loading"]: vLLM's `CompressedTensorsW4A4Fp4.create_weights`,
the merged loader and the scheme's `process_weights_after_loading`) and ModelOpt
(extras["nvfp4_modelopt_loading"]: modelopt.py's `KNvfp4Static` weight scheme): the same exact contract, with
the weight dequantized as the NVFP4 GEMM reads it (e2m1 x group scale x the one float32 per-tensor
multiplier the scheme keeps; a one-layer checkpoint's is fp32(1 / its global scale)), for shards
quantized on their own (global scales that differ) or sharing one global scale. A warning the
engine logs is reported in the failure message, but it is not a refusal.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st

from k3num.fixtures.strategies import seeds
from k3num.harness import ledger_models, ledger_run
from k3num.properties.checks.quantized_loading import refused as _refused
from k3num.refmodel import quant

BLOCK = (quant.FP8_BLOCK, quant.FP8_BLOCK)
K3_WIDTH = 576  # kv_lora_rank 512 + rope 64: 4.5 blocks of 128 rows


def _shards(layers: int, width: int, hidden: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per-layer block-FP8 shards whose block scales differ across rows and layers."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for layer in range(layers):
        rows = torch.linspace(0.25, 4.0, width, dtype=torch.float64)[torch.randperm(width, generator=g)]
        w = torch.randn(width, hidden, generator=g, dtype=torch.float64) * rows[:, None] * (1 + layer)
        out.append(quant.quantize_fp8_block(w))
    return out


def _checkpoint_stream(shards, order: list[int]) -> list[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors in arrival order, with the DSpark naming (BRIEF §1)."""
    stream = []
    for layer in order:
        w, s = shards[layer]
        stream += [(f"model.layers.{layer}.self_attn.kv_a_proj_with_mqa.weight", w),
                   (f"model.layers.{layer}.self_attn.kv_a_proj_with_mqa.weight_scale_inv", s)]
    return stream


@given(layers=st.integers(1, 5), width=st.sampled_from([128, 256, K3_WIDTH, 192]), hidden=st.sampled_from([128, 256]),
       data=st.data(), seed=seeds)
@example(layers=5, width=K3_WIDTH, hidden=256, data=None, seed=0)  # K3N-011: the K3 DSpark draft's geometry
def test_block_fp8_merged_shards_dequantize_to_the_per_layer_weights(engine, layers: int, width: int, hidden: int,
                                                                     data, seed: int) -> None:
    load = engine.extras.get("block_fp8_loading")
    loading = engine.extras.get("weight_loading")
    if load is None or loading is None:
        pytest.skip(f"engine {engine.name} {engine.version} has no block-FP8 merged-layer loader")
    order = list(range(layers)) if data is None else data.draw(st.permutations(range(layers)), label="order")
    shards = _shards(layers, width, hidden, seed)
    duplicated = loading.duplicate(iter(_checkpoint_stream(shards, order)), layers)
    tensors = [(name.rsplit(".", 1)[-1], t) for name, t in duplicated if name.startswith("context_kv_proj.")]
    assert len(tensors) == 2 * layers, f"the duplicator yielded {len(tensors)} merged-layer tensors for {layers} layers"
    detail = f"layers={layers};W={width};H={hidden};order={order}"
    try:
        weight, scale = load(tensors, layers, BLOCK)
    except (ValueError, NotImplementedError) as e:
        _refused(engine, detail, e)
        return
    except RuntimeError as e:  # what was raised, for the ledger's bug model (K3N-011: the loader's narrow)
        ledger_run.observe(ledger_models.BLOCK_FP8_MERGE, (shards, order, quant.FP8_BLOCK), e)
        raise
    unwritten = int(scale.isnan().any(1).sum())
    assert not unwritten, f"{detail}: {unwritten} of {scale.shape[0]} scale rows never written"
    got = quant.dequantize_fp8_block(weight, scale)
    want = torch.cat([quant.dequantize_fp8_block(w, s) for w, s in shards])
    wrong = (got != want).any(1).view(layers, width).sum(1).tolist()
    if sum(wrong):  # the layers' own shards and what was loaded, for the ledger's bug model
        ledger_run.observe(ledger_models.BLOCK_FP8_MERGE, (shards, order, quant.FP8_BLOCK), (weight, scale))
    assert sum(wrong) == 0, (f"{detail}: dequantized as the block GEMM reads it, the merged weight differs from "
                             f"the per-layer weights in {wrong} rows per layer (of {width})")


NVFP4 = {  # format -> (the engine's loader, the checkpoint names: packed, group scale, per-tensor scale)
    "compressed-tensors": ("nvfp4_loading", ("weight_packed", "weight_scale", "weight_global_scale")),
    "modelopt": ("nvfp4_modelopt_loading", ("weight", "weight_scale", "weight_scale_2")),
}


def _nvfp4_shards(layers: int, width: int, hidden: int, seed: int, shared: bool, naming: str
                  ) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    ws = [torch.randn(width, hidden, generator=g, dtype=torch.float64) * (1 + layer) for layer in range(layers)]
    if not shared:
        return [quant.quantize_nvfp4(w, naming=naming) for w in ws]
    q = quant.quantize_nvfp4(torch.cat(ws), naming=naming)  # one global scale for all: the rows split into shards
    packed, group, per_tensor = NVFP4[naming][1]
    return [{packed: q[packed][i * width:(i + 1) * width], group: q[group][i * width:(i + 1) * width],
             per_tensor: q[per_tensor]} for i in range(layers)]


def _one_layer_multiplier(shard: dict[str, torch.Tensor], naming: str) -> torch.Tensor:
    """The float32 factor an NVFP4 GEMM applies to a one-layer checkpoint's weight: 1 / global scale
    (compressed-tensors stores a divisor) or scale_2 itself (ModelOpt stores a multiplier)."""
    if naming == "compressed-tensors":
        return (1.0 / shard["weight_global_scale"]).to(torch.float32)
    return shard["weight_scale_2"]


@pytest.mark.parametrize("naming", list(NVFP4))
@given(layers=st.integers(1, 4), width=st.sampled_from([64, K3_WIDTH]), shared=st.booleans(), data=st.data(),
       seed=seeds)
@example(layers=5, width=K3_WIDTH, shared=False, data=None, seed=0)  # K3N-012 / K3N-013: per-layer scales
def test_nvfp4_merged_shards_dequantize_to_the_per_layer_weights(engine, naming: str, layers: int, width: int,
                                                                 shared: bool, data, seed: int) -> None:
    key, names = NVFP4[naming]
    load = engine.extras.get(key)
    if load is None:
        pytest.skip(f"engine {engine.name} {engine.version} has no {naming} NVFP4 merged-layer loader")
    order = list(range(layers)) if data is None else data.draw(st.permutations(range(layers)), label="order")
    shards = _nvfp4_shards(layers, width, 64, seed, shared, naming)
    tensors = []
    for layer in order:
        for name in names:
            t = shards[layer][name].detach().clone()
            t.shard_id = layer
            tensors.append((name, t))
        if naming == "compressed-tensors":
            t = torch.ones(1)
            t.shard_id = layer
            tensors.append(("input_global_scale", t))
    detail = f"{naming};layers={layers};W={width};shared_global={shared};order={order}"
    try:
        got = load(tensors, layers)
    except (ValueError, NotImplementedError) as e:
        _refused(engine, detail, e)
        return
    # the GEMM multiplies by a float32 per-tensor factor; both sides dequantize with one
    deq = quant.dequantize_nvfp4_modelopt(got["weight"], got["weight_scale"], got["weight_multiplier"])
    want = torch.cat([quant.dequantize_nvfp4_modelopt(s[names[0]], s[names[1]], _one_layer_multiplier(s, naming))
                      for s in shards])
    wrong = (deq != want).any(1).view(layers, width).sum(1).tolist()
    if sum(wrong):  # the layers' own pieces and what was loaded, for the ledger's bug model
        ledger_run.observe(ledger_models.NVFP4_MERGE, tuple((s[names[0]], s[names[1]], _one_layer_multiplier(s, naming))
                                                            for s in shards),
                           (got["weight"], got["weight_scale"], got["weight_multiplier"]))
    ratio = [round(float((deq[i * width:(i + 1) * width] / want[i * width:(i + 1) * width]).nanmedian()), 4)
             for i in range(layers)]
    warned = f"; the engine warned: {got['warnings'][0][:120]}" if got["warnings"] else ""
    assert sum(wrong) == 0, (f"{detail}: dequantized as the NVFP4 GEMM reads it, the merged weight differs from the "
                             f"per-layer weights in {wrong} rows per layer (of {width}); median ratio per layer "
                             f"{ratio}{warned}")
