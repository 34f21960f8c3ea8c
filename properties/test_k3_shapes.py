"""The drift properties at the full K3 shapes, on the GPU (nightly).

Same checks as the small-shape properties (the `check_*` functions), with the
geometry fixed to K3's (BRIEF §1-3) and hypothesis drawing the seed, the token
count (1 to 8192, `fixtures.strategies.k3_tokens`) and the case flags: context
KV at hidden 7168 with 5 layers, AttnRes with 8 committed blocks (9 sources) at
hidden 7168, the read-only mixture (SGLang's aggregate_stream family) over the
same bank, the DFlash draft context K/V (6 layers, 8 KV heads x 128, full or
half rotary, both RoPE styles), and the 6-tap partial projection at hidden 7168
for every stage partition and order.
"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from k3num.fixtures.builders import CACHE_LAYOUTS
from k3num.fixtures.strategies import AttnResCase, DraftKVCase, ProjectionCase, k3_context_kv_case, k3_tokens, seeds
from k3num.oracles import hunt
from k3num.properties.checks.attn_res import check_attn_res_within_rounding_budget
from k3num.properties.checks.attn_res_mix import SUBJECTS as MIX_SUBJECTS
from k3num.properties.checks.attn_res_mix import check_read_only_mixture
from k3num.properties.checks.context_kv import (
    check_cache_slots,
    check_fused_within_budget_of_unfused,
    check_layer_output_depends_only_on_its_rows,
    check_layer_outputs_follow_their_row_block,
    check_no_slot_mapping_writes_nothing,
)
from k3num.properties.checks.determinism import attn_res_cloned, check_deterministic
from k3num.properties.checks.draft_kv import check_draft_kv_within_rounding_budget
from k3num.properties.checks.partial_projection import TRANSFER, check_sharded_within_budget_of_unsharded
from k3num.properties.support import shardable, subject
from k3num.refmodel import geometry
from k3num.refmodel.geometry import RopeSpec

pytestmark = [pytest.mark.gpu, pytest.mark.nightly]
DEVICE = "cuda"
TOKENS = k3_tokens


@given(seed=seeds, tokens=TOKENS, plain=st.booleans())
def test_k3_fused_context_kv_within_budget_of_unfused_baseline(engine, seed: int, tokens: int, plain: bool) -> None:
    g = geometry.preset("k3-dspark-plain-rope" if plain else "k3-dspark")
    assert isinstance(g, geometry.MLADraftGeometry)
    check_fused_within_budget_of_unfused(engine, k3_context_kv_case(tokens, seed, g.rope), DEVICE)


@given(seed=seeds, tokens=TOKENS, layout=st.sampled_from(CACHE_LAYOUTS))
def test_k3_cache_slot_lands_at_block_and_offset_and_nothing_else_changes(engine, seed: int, tokens: int,
                                                                          layout: str) -> None:
    g = geometry.preset("k3-dspark")
    assert isinstance(g, geometry.MLADraftGeometry)
    case = k3_context_kv_case(tokens, seed, g.rope)
    check_cache_slots(engine, case, DEVICE, layout)
    check_no_slot_mapping_writes_nothing(engine, case, DEVICE, layout)


@given(seed=seeds, tokens=TOKENS)
def test_k3_layer_outputs_depend_only_on_their_own_row_block(engine, seed: int, tokens: int) -> None:
    g = geometry.preset("k3-dspark")
    assert isinstance(g, geometry.MLADraftGeometry)
    case = k3_context_kv_case(tokens, seed, g.rope)
    check_layer_outputs_follow_their_row_block(engine, case, DEVICE)
    check_layer_output_depends_only_on_its_rows(engine, case, DEVICE)


@given(seed=seeds, tokens=TOKENS, num_blocks=st.integers(0, 8), delta=st.booleans(), onorm=st.booleans())
def test_k3_attn_res_within_rounding_budget_of_oracle(engine, seed: int, tokens: int, num_blocks: int,
                                                      delta: bool, onorm: bool) -> None:
    case = AttnResCase(tokens, 7168, 8, num_blocks, -1 if num_blocks == 8 else num_blocks, delta, onorm, seed,
                       1.0, 30.0)
    check_attn_res_within_rounding_budget(engine, case, DEVICE)


@shardable
@given(seed=seeds, tokens=st.integers(1, 64), num_blocks=st.integers(0, 8), delta=st.booleans(), onorm=st.booleans(),
       write=st.booleans())
def test_k3_attn_res_repeated_calls_are_bitwise_identical(engine, seed: int, tokens: int, num_blocks: int,
                                                         delta: bool, onorm: bool, write: bool) -> None:
    """The determinism hunt (oracles.hunt: 152 calls per case) at hidden 7168 with 8 committed blocks,
    decode-sized token counts (the 4-source tile of fewer than 256 tokens), the model's bank write."""
    case = AttnResCase(tokens, 7168, 9, num_blocks, num_blocks if write else -1, delta, onorm, seed, 1.0, 30.0)
    fn = subject(engine, "attn_res")
    check_deterministic(engine, "attn_res", attn_res_cloned(engine, fn, case, DEVICE), hunt.repeats_for(DEVICE), seed,
                        detail=f"K3;T={tokens};nb={num_blocks};delta={delta};onorm={onorm};write={write}")


@pytest.mark.parametrize("name", MIX_SUBJECTS)
@given(seed=seeds, tokens=TOKENS, nvb=st.integers(0, 8))
def test_k3_read_only_mixture_within_rounding_budget_of_oracle(engine, name: str, seed: int, tokens: int,
                                                               nvb: int) -> None:
    check_read_only_mixture(engine, name, tokens, 7168, nvb, seed, DEVICE)


@given(seed=seeds, tokens=TOKENS, rotary=st.sampled_from([128, 64]), style=st.sampled_from(["neox", "gptj"]))
def test_k3_draft_context_kv_within_rounding_budget_of_oracle(engine, seed: int, tokens: int, rotary: int,
                                                              style: str) -> None:
    g = geometry.preset("k3-dflash")
    assert isinstance(g, geometry.DFlashGeometry)
    rope = RopeSpec(rotary, g.rope.theta, style, g.rope.yarn)  # type: ignore[arg-type]
    case = DraftKVCase(g.hidden, g.num_layers, g.num_kv_heads, g.head_dim, rope, tokens, seed)
    check_draft_kv_within_rounding_budget(engine, case, DEVICE)


@pytest.mark.parametrize("transfer", sorted(TRANSFER))
@given(seed=seeds, tokens=TOKENS, owner=st.lists(st.integers(0, 5), min_size=6, max_size=6), data=st.data())
def test_k3_sharded_within_budget_of_unsharded(engine, transfer: str, seed: int, tokens: int, owner: list[int],
                                              data: st.DataObject) -> None:
    stages = tuple(tuple(i for i in range(6) if owner[i] == s) for s in range(6))
    order = tuple(data.draw(st.permutations(range(6))))
    case = ProjectionCase(6, tokens, 7168, 7168, stages, order, seed, 1.0, 30.0)
    check_sharded_within_budget_of_unsharded(engine, case, transfer, DEVICE)
