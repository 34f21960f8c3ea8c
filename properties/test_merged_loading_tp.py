"""A merged column-parallel layer's weight, loaded on each tensor-parallel rank.

vLLM's merged column-parallel layers (the target's `gate_up_proj` and `in_proj_qkvgfab`, the draft's
fused context-KV projection) take one checkpoint tensor per merged part. On TP rank r of w each part's
loader (`load_merged_column_weight`) keeps rows r * W / w onward, W / w of them, and puts them at the part's
offset in the rank's parameter. The K3 draft's merged context-KV layer is built with disable_tp (rank 0 of 1),
so the quantized-loading properties, which load it, only ever ran rank 0: a rank offset computed wrongly is
0 there either way.

Exact contract (extras["merged_loading_tp"]): on every rank of a drawn world size, for any number of parts,
part widths that are not powers of two and any arrival order, the rank's merged weight is the row-stack of
its rows of each part, bit for bit; the ranks' weights together hold every row of every part once.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from k3num.fixtures.strategies import seeds
from k3num.properties.support import assert_bitwise


@given(layers=st.integers(1, 5), world=st.sampled_from([1, 2, 4, 8]), part=st.integers(1, 24),
       hidden=st.integers(1, 48), data=st.data(), seed=seeds)
def test_each_tp_rank_loads_its_rows_of_every_merged_part(engine, layers: int, world: int, part: int, hidden: int,
                                                          data, seed: int) -> None:
    load = engine.extras.get("merged_loading_tp")
    if load is None:
        pytest.skip(f"engine {engine.name} {engine.version} has no merged column-parallel loader at TP ranks")
    order = data.draw(st.permutations(range(layers)), label="order")
    width = world * part
    g = torch.Generator().manual_seed(seed)
    shards = [torch.randn(width, hidden, generator=g).to(torch.bfloat16) for _ in range(layers)]
    got = []
    for rank in range(world):
        tensors = []
        for layer in order:
            t = shards[layer].clone()
            t.shard_id = layer
            tensors.append(("weight", t))
        weight = load(tensors, layers, world, rank)
        want = torch.cat([s[rank * part:(rank + 1) * part] for s in shards])
        assert_bitwise(weight, want, f"rank {rank} of {world}'s merged weight ({layers} parts of {width} rows, "
                                     f"arrival order {order}) against its rows of each part")
        got.append(weight.view(layers, part, hidden))
    assert_bitwise(torch.cat(got, 1).view(layers, width, hidden), torch.stack(shards),
                   "the ranks' weights together against every row of every part")
