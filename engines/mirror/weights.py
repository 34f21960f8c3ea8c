"""Mirror of vLLM's weight-loading contract for the fused DSpark context-KV projection.

Our own implementation of BRIEF §1's contract (vLLM 0.33.0 `_duplicate_context_kv_weights`
and `K3DSparkForCausalLM.hf_to_vllm_mapper`), so the weight-loading properties can be
proven on it and on its mutants before they meet vLLM's own code.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

_MARKER = ".self_attn.kv_a_proj_with_mqa."


def duplicate(weights: Iterable[tuple[str, torch.Tensor]], num_layers: int) -> Iterator[tuple[str, torch.Tensor]]:
    for name, weight in weights:
        yield name, weight
        head, marker, param = name.partition(_MARKER)
        if not marker:
            continue
        idx = head.rsplit(".", 1)[-1]
        if not idx.isdecimal() or int(idx) >= num_layers:
            continue
        copy = weight.detach()  # same storage, a new tensor object
        copy.shard_id = int(idx)  # type: ignore[attr-defined]
        yield f"context_kv_proj.{param}", copy


class Mapper:
    """Drop, stack with a shard id, then prefix `model.` (the order vLLM's WeightsMapper applies)."""

    dropped = ("confidence_head", "embed_tokens", "lm_head")
    stacked = {".gate_proj": (".gate_up_proj", 0), ".up_proj": (".gate_up_proj", 1),
               ".q_a_proj": (".fused_qkv_a_proj", 0), ".kv_a_proj_with_mqa": (".fused_qkv_a_proj", 1)}

    def apply(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        for name, data in weights:
            if any(d in name for d in self.dropped):
                continue
            for old, (new, shard) in self.stacked.items():
                if old in name:
                    name = name.replace(old, new, 1)
                    data.shard_id = shard  # type: ignore[attr-defined]
            yield "model." + name, data


def load_block_fp8(tensors: list[tuple[str, torch.Tensor]], num_layers: int, block: tuple[int, int]
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """The merged layer's block-FP8 parameters from per-layer shards, as a block GEMM reads them
    (row r uses scale row r // bn): each layer's rows at l * W, its scale rows at l * W / bn. That
    layout exists only when W is whole bn-row blocks; otherwise a merged block would straddle two
    layers with two scales, so the load is refused."""
    bn, bk = block
    width, hidden = next(t for name, t in tensors if name == "weight").shape
    if width % bn:
        raise ValueError(f"block-FP8 merged layer: a shard of {width} rows is not whole {bn}-row blocks "
                         f"({width / bn:g} blocks): its blocks would share scale rows with the next layer's")
    weight = torch.empty(num_layers * width, hidden, dtype=torch.float8_e4m3fn)
    scale = torch.full((num_layers * width // bn, -(-hidden // bk)), float("nan"), dtype=torch.float32)
    for name, t in tensors:
        lyr = t.shard_id
        if name == "weight":
            weight[lyr * width:(lyr + 1) * width] = t
        elif name == "weight_scale_inv":
            scale[lyr * width // bn:(lyr + 1) * width // bn] = t
        else:
            raise ValueError(f"block_fp8_loading: no parameter {name!r} in a block-FP8 merged layer")
    return weight, scale


def load_merged_at_rank(tensors: list[tuple[str, torch.Tensor]], num_layers: int, world: int, rank: int
                        ) -> torch.Tensor:
    """A merged column-parallel layer's weight [L * W / world, H] on TP rank `rank` of `world`, from per-layer
    shards ("weight" [W, H] with .shard_id, in any arrival order): each layer's rows rank * W / world onward,
    W / world of them, at l * W / world. A width the ranks cannot split evenly is refused."""
    width, hidden = next(t for name, t in tensors if name == "weight").shape
    if width % world:
        raise ValueError(f"merged column-parallel layer: a shard of {width} rows does not split over {world} ranks")
    part = width // world
    weight = torch.full((num_layers * part, hidden), float("nan"), dtype=tensors[0][1].dtype)
    for name, t in tensors:
        if name != "weight":
            raise ValueError(f"merged_loading_tp: no parameter {name!r} in an unquantized merged layer")
        weight[t.shard_id * part:(t.shard_id + 1) * part] = t[rank * part:(rank + 1) * part]
    return weight


def load_nvfp4(tensors: list[tuple[str, torch.Tensor]], num_layers: int) -> dict[str, object]:
    """A merged compressed-tensors NVFP4 layer from per-layer shards: the GEMM applies one global
    scale to the whole weight, so the shards must share theirs; differing ones are refused (each
    shard's group scales were computed against its own)."""
    width, half = next(t for name, t in tensors if name == "weight_packed").shape
    groups = next(t for name, t in tensors if name == "weight_scale").shape[1]
    weight = torch.empty(num_layers * width, half, dtype=torch.uint8)
    scale = torch.empty(num_layers * width, groups, dtype=torch.float8_e4m3fn)
    globals_: dict[int, float] = {}
    for name, t in tensors:
        lyr = t.shard_id
        if name == "weight_packed":
            weight[lyr * width:(lyr + 1) * width] = t
        elif name == "weight_scale":
            scale[lyr * width:(lyr + 1) * width] = t
        elif name == "weight_global_scale":
            globals_[lyr] = float(t.reshape(-1)[0])
        elif name != "input_global_scale":
            raise ValueError(f"nvfp4_loading: no parameter {name!r} in a compressed-tensors NVFP4 merged layer")
    if len(set(globals_.values())) > 1:
        raise ValueError(f"NVFP4 merged layer: the shards' weight global scales differ ({sorted(globals_.items())}); "
                         "one global scale cannot dequantize them all")
    g = next(iter(globals_.values()))
    return {"weight": weight, "weight_scale": scale, "weight_multiplier": torch.tensor([1.0 / g]), "warnings": []}


def load_nvfp4_modelopt(tensors: list[tuple[str, torch.Tensor]], num_layers: int) -> dict[str, object]:
    """A merged ModelOpt NVFP4 layer: as load_nvfp4, the shards' weight_scale_2 (a multiplier) must agree."""
    renamed = []
    for name, t in tensors:
        if name == "weight":
            name = "weight_packed"
        elif name == "weight_scale_2":
            c = (1.0 / t).to(torch.float32)
            c.shard_id = t.shard_id
            name, t = "weight_global_scale", c
        renamed.append((name, t))
    out = load_nvfp4(renamed, num_layers)
    scale_2 = {float(t.reshape(-1)[0]) for n, t in tensors if n == "weight_scale_2"}
    out["weight_multiplier"] = torch.tensor([next(iter(scale_2))], dtype=torch.float32)
    return out
