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
