"""The weight-loading contract of vLLM's fused DSpark context-KV projection, stated independently.

From BRIEF §1 (read in vLLM 0.33.0 `_duplicate_context_kv_weights` and
`K3DSparkForCausalLM.hf_to_vllm_mapper`): a checkpoint tensor named
`...layers.<i>.self_attn.kv_a_proj_with_mqa.<param>` with a decimal i < num_layers
is also loaded as `context_kv_proj.<param>` with shard_id i; after the mapper every
name carries the `model.` prefix, kv_a_proj_with_mqa loads into fused_qkv_a_proj
as shard 1, q_a_proj as shard 0, gate/up into gate_up_proj as shards 0/1, and
the confidence head, embeddings and LM head are dropped. These functions
compute what the loader must see, for the properties to compare against.
"""

from __future__ import annotations

import re

KV_MARKER = ".self_attn.kv_a_proj_with_mqa."
_KV = re.compile(r"^(?:.*\.)?layers\.(?P<idx>[^.]*)\.self_attn\.kv_a_proj_with_mqa\.(?P<param>.+)$")


def kv_layer(name: str, num_layers: int) -> int | None:
    """The draft layer a KV-projection tensor belongs to, or None (not KV, not decimal, out of range)."""
    m = _KV.match(name)
    if not m or not m.group("idx").isdecimal():
        return None
    i = int(m.group("idx"))
    return i if i < num_layers else None


def expected_duplicated(names: list[str], num_layers: int) -> list[tuple[str, int | None]]:
    """(name, shard_id of the copy or None) in the order _duplicate_context_kv_weights must yield."""
    out: list[tuple[str, int | None]] = []
    for name in names:
        out.append((name, None))
        layer = kv_layer(name, num_layers)
        if layer is not None:
            out.append((f"context_kv_proj.{name.partition(KV_MARKER)[2]}", layer))
    return out


_DROPPED = ("confidence_head", "embed_tokens", "lm_head")
_STACKED = {".gate_proj": (".gate_up_proj", 0), ".up_proj": (".gate_up_proj", 1),
            ".q_a_proj": (".fused_qkv_a_proj", 0), ".kv_a_proj_with_mqa": (".fused_qkv_a_proj", 1)}


def expected_mapped(name: str, copy_shard: int | None) -> tuple[str, int | None] | None:
    """What the loader must receive for one yielded tensor: (name, shard_id) or None if dropped."""
    if any(d in name for d in _DROPPED):
        return None
    shard = copy_shard
    for old, (new, sid) in _STACKED.items():
        if old in name:
            name, shard = name.replace(old, new, 1), sid
    return "model." + name, shard


def missing_layers(mapped: list[tuple[str, int | None]], num_layers: int, param: str = "weight") -> list[int]:
    """Draft layers with no `model.context_kv_proj.<param>` shard among the mapped tensors
    (vLLM itself does not check this: a renamed checkpoint silently leaves a hole)."""
    have = {sid for name, sid in mapped if name == f"model.context_kv_proj.{param}"}
    return [i for i in range(num_layers) if i not in have]
