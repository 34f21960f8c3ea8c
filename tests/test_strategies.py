"""fixtures/strategies.py's case strategies are parametrisable: a field given its own strategy is drawn from it
(a dependent field from a function of what it depends on), a name that is no field is refused, and a case
outside its own bounds is refused rather than drawn."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from k3num.fixtures.strategies import (
    attn_res_cases,
    context_kv_cases,
    draft_kv_cases,
    draft_step_cases,
    kv_transfer_cases,
    projection_cases,
    tap_cases,
)


@settings(max_examples=25, database=None, deadline=None)
@given(case=attn_res_cases(num_blocks=st.just(0), with_delta=st.just(False),
                           block_write_idx=lambda bank: st.just(bank - 1)))
def test_an_attn_res_field_given_its_own_strategy_is_drawn_from_it(case) -> None:
    assert case.num_blocks == 0 and not case.with_delta and case.block_write_idx == case.bank - 1


@settings(max_examples=25, database=None, deadline=None)
@given(step=draft_step_cases("dflash", vocab=st.just(256), kv_heads=lambda heads: st.just(heads)),
       ctx=context_kv_cases(tokens=st.just(1)), kv=draft_kv_cases(kv_heads=st.just(2)))
def test_the_other_case_strategies_take_a_fields_strategy_too(step, ctx, kv) -> None:
    assert step.vocab == 256 and step.kv_heads == step.num_heads
    assert ctx.tokens == 1 and kv.kv_heads == 2


@settings(max_examples=25, database=None, deadline=None)
@given(tap=tap_cases(position="inner", num_layers=st.just(6), layer_idx=lambda end: st.just(end - 2)),
       end=tap_cases(position="stage_end", stage_end=lambda layers: st.just(layers)),
       proj=projection_cases(taps=st.just(3), stages=lambda k: st.just([[2], [], [0, 1]]),
                             order=lambda n: st.just(list(range(n))[::-1])),
       xfer=kv_transfer_cases(layers=st.just(2), stage=lambda layers: st.just(range(layers)),
                              src_pages=st.just([5, 1]), dst_pages=lambda n: st.just([0, 7][:n]),
                              dst_tp=st.just(8), dst_rank=lambda tp: st.just(tp - 1)))
def test_the_tap_projection_and_transfer_strategies_take_a_fields_strategy(tap, end, proj, xfer) -> None:
    assert tap.num_layers == 6 and tap.layer_idx == tap.stage_end - 2
    assert end.stage_end == end.num_layers and end.layer_idx == end.stage_end - 1
    assert proj.taps == 3 and proj.stages == ((2,), (), (0, 1)) and proj.order == (2, 1, 0)
    assert xfer.layers == 2 and xfer.stage == (0, 1) and xfer.src_pages == (5, 1) and xfer.dst_pages == (0, 7)
    assert xfer.dst_tp == 8 and xfer.dst_rank == 7


def _draw_once(strategy) -> None:
    @settings(max_examples=1, database=None, deadline=None)
    @given(strategy)
    def one(_) -> None:
        pass

    one()


def test_a_name_that_is_no_field_is_refused_naming_the_fields() -> None:
    with pytest.raises(ValueError, match="AttnResCase has no field num_block; its fields: tokens, hidden, bank"):
        _draw_once(attn_res_cases(num_block=st.just(0)))
    with pytest.raises(ValueError, match="DraftStepCase has no field heads"):
        _draw_once(draft_step_cases("dspark", heads=st.just(2)))


def test_an_attn_res_case_outside_its_bank_is_refused() -> None:
    with pytest.raises(ValueError, match="num_blocks 9 and block_write_idx .* must lie in a bank of 2"):
        _draw_once(attn_res_cases(bank=st.just(2), num_blocks=st.just(9)))


def test_a_drawn_field_that_contradicts_the_case_is_refused_naming_it() -> None:
    with pytest.raises(ValueError, match="at position 'stage_end' it is stage_end - 1"):
        _draw_once(tap_cases(position="stage_end", layer_idx=lambda end: st.just(0)))
    with pytest.raises(ValueError, match="position: expected 'inner' or 'stage_end', got 'middle'"):
        _draw_once(tap_cases(position="middle"))
    with pytest.raises(ValueError, match=r"stages: expected a partition of the taps 0..2"):
        _draw_once(projection_cases(taps=st.just(3), stages=lambda k: st.just([[0], [0, 1, 2]])))
    with pytest.raises(ValueError, match="order: expected a permutation of the 2 stages"):
        _draw_once(projection_cases(taps=st.just(2), stages=lambda k: st.just([[0], [1]]),
                                    order=lambda n: st.just([0, 0])))
    with pytest.raises(ValueError, match="dst_pages: expected 2 pages, one per source page"):
        _draw_once(kv_transfer_cases(src_pages=st.just([0, 1]), dst_pages=lambda n: st.just([3])))
    with pytest.raises(ValueError, match="KVTransferCase has no field pages"):
        _draw_once(kv_transfer_cases(pages=st.just([0])))
