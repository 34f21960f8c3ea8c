"""The expected decided-flip count (oracles/tokens.py `predicted_flips`) against the flips counted on planted
Gaussian logit errors of known spread: the derivation (P(j overtakes the top-1) = erfc(m_j / 2σ) / 2, the union
over the nearest runners-up) predicts what a large run counts, and a derivation off by the √2 of a difference of
two errors would not."""

from __future__ import annotations

import math

import pytest
import torch

from k3num.oracles import tokens


def _planted(sigma: float, positions: int = 40000, vocab: int = 32, seed: int = 0) -> tokens.BlockVerdict:
    g = torch.Generator().manual_seed(seed)
    oracle = torch.randn(positions, vocab, generator=g, dtype=torch.float64)
    subject = oracle + sigma * torch.randn(positions, vocab, generator=g, dtype=torch.float64)
    return tokens.judge_block(subject, oracle, delta=0.0)  # every position decided: every flip is counted


@pytest.mark.parametrize("sigma", [0.01, 0.03])
def test_the_predicted_flips_are_the_flips_counted_on_planted_errors_of_known_size(sigma: float) -> None:
    """Errors small against the margins (the regime near delta the severity is about): predicted = counted
    within 10% and 4 Poisson deviations; the √2-less derivation misses by more."""
    v = _planted(sigma)
    counted, predicted = v.count(tokens.DIVERGED), v.predicted_flips
    assert counted > 200, counted  # enough flips to compare
    assert abs(counted - predicted) <= 0.1 * predicted + 4 * math.sqrt(predicted), (sigma, counted, predicted)
    # the derivation without the difference's sqrt(2) (P = Q(m / sigma)) predicts another count, outside the bound
    wrong = sum(min(1.0, sum(0.5 * math.erfc(m / (math.sqrt(2) * s)) for m in ms))
                for ms, s in zip(v.margins, v.logit_rms))
    assert abs(counted - wrong) > 0.1 * wrong + 4 * math.sqrt(wrong), (sigma, counted, wrong)


def test_with_errors_near_the_margins_the_prediction_is_an_upper_estimate() -> None:
    """σ a third of the typical margin: several competitors overtake at once and the union bound counts each,
    so the prediction exceeds the count (it never falls below it)."""
    v = _planted(0.1, positions=6000)
    assert v.predicted_flips >= v.count(tokens.DIVERGED) > 0


def test_a_subject_equal_to_the_oracle_predicts_no_flip_and_a_near_tie_is_not_counted() -> None:
    oracle = torch.tensor([[3.0, 1.0, 0.0], [1.0, 0.99, 0.0]], dtype=torch.float64)
    v = tokens.judge_block(oracle.clone(), oracle, delta=0.5)
    assert v.predicted_flips == 0.0 and v.predicted_flip_rate == 0.0
    noisy = tokens.judge_block(oracle + torch.tensor([[0.0, 0.3, 0.0], [0.0, 0.5, 0.0]], dtype=torch.float64),
                               oracle, delta=0.5)
    assert noisy.decided == 1 and 0 < noisy.predicted_flips < 1  # the near-tie (gap 0.01 < delta) counts nothing
    assert noisy.margins[0] == (2.0, 3.0) and len(noisy.logit_rms) == 2


def _decided_block(seed: int, delta: float) -> torch.Tensor:
    """Oracle logits [16, 256] whose every position is decided (top-two gap of at least 3 delta)."""
    g = torch.Generator().manual_seed(seed)
    o = torch.randn(16, 256, generator=g, dtype=torch.float64)
    top = o.argmax(dim=1)
    o[torch.arange(16), top] = o.max(dim=1).values + 3 * delta
    return o


def test_a_logit_past_delta_at_a_decided_position_is_outside_the_budget_where_a_share_rule_saw_nothing() -> None:
    """The decided-token rule is per position, from the margins: a subject that moves one vocabulary column by 40
    delta at every position (a 1/256 share of the logits: the old 99th-percentile rule passed it) and one that
    moves a single logit of one decided position by 1.5 delta are outside the budget; a subject within delta / 2
    everywhere, and one whose only large error sits at a near-tie, are not."""
    delta = 0.1
    o = _decided_block(0, delta)
    g = torch.Generator().manual_seed(1)
    small = o + (torch.rand(o.shape, generator=g, dtype=torch.float64) - 0.5) * delta * 0.9
    assert tokens.judge_block(small, o, delta).decided_over_budget == 0
    column = o.clone()
    low = int(o[0].argmin())
    column[:, low] -= 40 * delta  # the column moved away from the top: no flip, a budget broken everywhere
    v = tokens.judge_block(column, o, delta)
    assert v.count(tokens.DIVERGED) == 0 and v.q99_err_over_delta <= 1 and v.decided_over_budget == 16
    stray = o.clone()
    stray[3, low] += 1.5 * delta
    assert tokens.judge_block(stray, o, delta).decided_over_budget == 1
    tie = o.clone()
    tie[5, int(o[5].argmax())] = o[5].topk(2).values[1] + delta / 4  # position 5 made a near-tie of the oracle
    moved = tie.clone()
    moved[5, low] += 1.5 * delta
    assert tokens.judge_block(moved, tie, delta).decided_over_budget == 0
