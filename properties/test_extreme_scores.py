"""The AttnRes softmax where its scores leave exp's float32 range.

A source's score is dot(v, norm * qk) * rsqrt(mean(v^2) + eps): for the drawn sources about N(0, |norm * qk|_2),
which the suite's other properties keep near 1 (qk drawn at h^-0.5), where a softmax is exact whether or not it
subtracts its maximum first. float32's exp overflows to inf past 88.72 and underflows to 0 below -103.97, so a
softmax that skips the subtraction returns inf / inf or 0 / 0 (NaN) there and nowhere else. Scaling qk (the
mixture's projection) by SCORE_SCALES puts the scores' spread at about 128 and 1024, far past both ends, while the
oracle (float64, its own maximum subtracted) and the budget (derived from the same inputs, so it follows the
scores' magnitude) stay exact. K3's trained score weights are not published; the property states what the
kernels must do for any weight they can be given, and K3's massive activations (outlier channels far above the
rest) reach such scores through v.
"""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given
from hypothesis import strategies as st

from k3num.fixtures.strategies import AttnResCase, attn_res_cases, seeds
from k3num.properties.checks.attn_res import as_admitted, check_attn_res_within_rounding_budget
from k3num.properties.checks.attn_res_mix import SUBJECTS, check_read_only_mixture
from k3num.properties.support import DEVICE

# the scores' spread: past float32 exp's range at either end (88.72 overflow, -103.97 underflow) by 1.4x and 10x
SCORE_SCALES = st.sampled_from([128.0, 1024.0])


@given(case=attn_res_cases(num_blocks=lambda bank: st.integers(1, bank)), score_scale=SCORE_SCALES)
def test_attn_res_within_budget_where_scores_leave_exps_range(engine, case: AttnResCase, score_scale: float) -> None:
    """The model's calls (no write inside the mix), at least one block beside the prefix, with the scores scaled
    past exp's range: within the accuracy property's budget of the oracle."""
    if 0 <= case.block_write_idx < case.num_blocks:
        case = dataclasses.replace(case, block_write_idx=case.num_blocks if case.num_blocks < case.bank else -1)
    case = as_admitted(engine, case)
    check_attn_res_within_rounding_budget(engine, case, DEVICE, prop="attn_res_within_budget_at_extreme_scores",
                                          qk_scale=score_scale)


@pytest.mark.parametrize("hidden", [64, 1024])
@pytest.mark.parametrize("name", SUBJECTS)
@given(tokens=st.integers(1, 4), nvb=st.integers(1, 8), seed=seeds, score_scale=SCORE_SCALES)
def test_read_only_mixture_within_budget_where_scores_leave_exps_range(engine, name: str, hidden: int, tokens: int,
                                                                       nvb: int, seed: int,
                                                                       score_scale: float) -> None:
    """SGLang's read-only mixtures (its Triton score and combine pair at hidden 1024) with the scores scaled past
    exp's range: within the mixture property's budget of the oracle, the inputs unchanged."""
    check_read_only_mixture(engine, name, tokens, hidden, nvb, seed, DEVICE, proj_scale=score_scale,
                            prop="read_only_mixture_within_budget_at_extreme_scores")
