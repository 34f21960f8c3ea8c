"""The drift properties at the full K3 shapes, on the GPU (nightly).

Same checks as the small-shape properties (the `check_*` functions), with the
geometry fixed to K3's (BRIEF §1-3) and hypothesis drawing the seed, the token
count and the case flags: context KV at hidden 7168 with 5 layers, AttnRes
with 8 committed blocks (9 sources) at hidden 7168, and the 6-tap partial
projection at hidden 7168 for every stage partition and order.
"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from fixtures.strategies import AttnResCase, ProjectionCase, k3_context_kv_case, seeds
from properties.test_attn_res import check_attn_res_within_rounding_budget
from properties.test_context_kv import check_fused_within_budget_of_unfused
from properties.test_partial_projection import TRANSFER, check_sharded_within_budget_of_unsharded
from refmodel import geometry

pytestmark = [pytest.mark.gpu, pytest.mark.nightly]
DEVICE = "cuda"
TOKENS = st.sampled_from([1, 64, 1024])


@given(seed=seeds, tokens=TOKENS, plain=st.booleans())
def test_k3_fused_context_kv_within_budget_of_unfused_baseline(engine, seed: int, tokens: int, plain: bool) -> None:
    g = geometry.preset("k3-dspark-plain-rope" if plain else "k3-dspark")
    assert isinstance(g, geometry.MLADraftGeometry)
    check_fused_within_budget_of_unfused(engine, k3_context_kv_case(tokens, seed, g.rope), DEVICE)


@given(seed=seeds, tokens=TOKENS, num_blocks=st.integers(0, 8), delta=st.booleans(), onorm=st.booleans())
def test_k3_attn_res_within_rounding_budget_of_oracle(engine, seed: int, tokens: int, num_blocks: int,
                                                      delta: bool, onorm: bool) -> None:
    case = AttnResCase(tokens, 7168, 8, num_blocks, -1 if num_blocks == 8 else num_blocks, delta, onorm, seed,
                       1.0, 30.0)
    check_attn_res_within_rounding_budget(engine, case, DEVICE)


@pytest.mark.parametrize("transfer", sorted(TRANSFER))
@given(seed=seeds, tokens=TOKENS, owner=st.lists(st.integers(0, 5), min_size=6, max_size=6), data=st.data())
def test_k3_sharded_within_budget_of_unsharded(engine, transfer: str, seed: int, tokens: int, owner: list[int],
                                              data: st.DataObject) -> None:
    stages = tuple(tuple(i for i in range(6) if owner[i] == s) for s in range(6))
    order = tuple(data.draw(st.permutations(range(6))))
    case = ProjectionCase(6, tokens, 7168, 7168, stages, order, seed, 1.0, 30.0)
    check_sharded_within_budget_of_unsharded(engine, case, transfer, DEVICE)
