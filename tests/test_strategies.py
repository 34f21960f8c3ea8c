"""fixtures/strategies.py's case strategies are parametrisable: a field given its own strategy is drawn from it
(a dependent field from a function of what it depends on), a name that is no field is refused, and a case
outside its own bounds is refused rather than drawn."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from k3num.fixtures.strategies import attn_res_cases, context_kv_cases, draft_kv_cases, draft_step_cases


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
