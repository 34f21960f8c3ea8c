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
