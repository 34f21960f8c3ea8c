"""Judging a block's proposals against the float64 oracle's: per position IDENTICAL / TIE-BREAK / DIVERGED.

A numeric drift matters to speculative decoding where it changes a proposed token. Per position of a
draft block, against the oracle's logits (float64, the K3 paths and the draft's remainder all exact):

- the oracle's top-1 and its top-two gap (top-1 logit minus the runner-up's);
- the subject's top-1 and its logit error (max over the vocabulary of |subject - oracle|);
- the label: IDENTICAL (same top-1), TIE-BREAK (the top-1 differs where the oracle's gap is below
  `delta`: a near-tie, which any rounding may break), DIVERGED (the top-1 differs although the gap is at
  least `delta`: a decided token flipped);
- the block's agreement length: the leading positions whose proposal equals the oracle's (what greedy
  verification would accept from this drafter if the target agreed with the float64 drafter);
- KL(oracle || subject) of the softmaxed logits, and the near-tie density (the share of positions whose
  gap is below delta). `delta` is the logit budget (oracles.budgets.logit_budget);
- the expected number of decided flips (`predicted_flips`): a decided position flips when the error lifts a
  competitor j over the top-1, e_j - e_1 > m_j (m_j: the oracle's margin of the top-1 over competitor j).
  Taking the position's logit errors as independent with the spread σ its own error vector shows (the RMS of
  subject - oracle over the vocabulary), e_j - e_1 has spread σ√2, so P(j overtakes) = Q(m_j / (σ√2)) =
  erfc(m_j / (2σ)) / 2, and P(flip) <= min(1, Σ_j Q(m_j / (σ√2))) over the COMPETITORS nearest competitors
  (the union bound; the far ones add nothing at the margins that matter). The sum over the decided positions
  is the count a large run of blocks like these would show (tests/test_tokens.py checks it against the flips
  counted on planted Gaussian errors of known σ, within 10% while σ is small against the margins; near them
  the union bound counts competitors that overtake together, and the figure is an upper estimate). A subject
  within delta / 2 everywhere predicts ~0.

Shapes: logits [B, V] per block (B positions, V the vocabulary).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

IDENTICAL, TIE_BREAK, DIVERGED = "IDENTICAL", "TIE-BREAK", "DIVERGED"
COMPETITORS = 4  # the oracle's runners-up whose overtaking `predicted_flips` counts


@dataclass(frozen=True)
class BlockVerdict:
    """One block of proposals against the oracle's."""

    labels: tuple[str, ...]  # per position
    oracle_top1: tuple[int, ...]
    subject_top1: tuple[int, ...]
    gap: tuple[float, ...]  # the oracle's top-1 minus top-2 logit, per position
    logit_err: tuple[float, ...]  # max |subject - oracle| over the vocabulary, per position
    delta: float  # the logit budget the labels used
    agreement: int  # leading positions whose proposal equals the oracle's
    kl: float  # mean over positions of KL(oracle || subject)
    # the oracle's top-1 margins over its COMPETITORS runners-up, and the RMS of subject - oracle, per position
    margins: tuple[tuple[float, ...], ...] = field(default=())
    logit_rms: tuple[float, ...] = field(default=())
    err_q99: float = math.nan  # the 99th percentile of |subject - oracle| over the block's B x V logits

    @property
    def positions(self) -> int:
        return len(self.labels)

    @property
    def decided(self) -> int:
        """Positions whose oracle gap is at least delta: the ones a correct subject must not flip."""
        return sum(g >= self.delta for g in self.gap)

    @property
    def near_ties(self) -> int:
        return self.positions - self.decided

    def count(self, label: str) -> int:
        return self.labels.count(label)

    @property
    def decided_over_budget(self) -> int:
        """Decided positions (gap >= delta) where some logit is further than delta from the oracle's: outside the
        logit budget where the token is decided, whether or not it flipped in this block. A correct path stays
        below delta / 2 everywhere (delta is twice the noise floor's error), so the threshold is the budget
        itself, per position, not a share of the block's logits."""
        return sum(g >= self.delta and e > self.delta for g, e in zip(self.gap, self.logit_err))

    @property
    def exposed(self) -> int:
        """Decided positions within the logit error's reach: delta <= gap < 2 x the position's logit error (the
        top-two difference moves by at most twice the largest logit error, so only these can flip). A
        subject within delta / 2 of the oracle everywhere exposes none; one that drifts past it exposes the
        decided positions with the smallest margins, whether or not one flipped in the blocks run."""
        return sum(self.delta <= g < 2 * e for g, e in zip(self.gap, self.logit_err))

    @property
    def predicted_flips(self) -> float:
        """The expected count of decided positions whose top-1 the error overturns (the module docstring)."""
        total = 0.0
        for g, ms, sigma in zip(self.gap, self.margins, self.logit_rms):
            if g < self.delta or sigma <= 0:
                continue
            total += min(1.0, sum(0.5 * math.erfc(m / (2.0 * sigma)) for m in ms))
        return total

    @property
    def predicted_flip_rate(self) -> float:
        """predicted_flips over the decided positions (0 where none is decided)."""
        return self.predicted_flips / self.decided if self.decided else 0.0

    @property
    def worst_err_over_delta(self) -> float:
        return max(self.logit_err) / self.delta if self.delta > 0 else float("inf")

    @property
    def q99_err_over_delta(self) -> float:
        """The block's high-quantile logit error over delta: past 1, at least 1% of its logits are further than
        delta from the oracle's, a latent divergence whether or not a decided token flipped (a correct path's
        stays near 0.4; one stray logit past delta, as two extra roundings of a projection give, does not
        move it)."""
        return self.err_q99 / self.delta if self.delta > 0 else float("inf")


def top_two(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(top-1 index [B], gap [B]) of logits [B, V] (V >= 2), in float64."""
    if logits.dim() != 2 or logits.shape[1] < 2:
        raise ValueError(f"logits: expected [B, V] with V >= 2, got {list(logits.shape)}")
    vals, idx = torch.topk(logits.double(), 2, dim=1)
    return idx[:, 0], vals[:, 0] - vals[:, 1]


def judge_block(subject: torch.Tensor, oracle: torch.Tensor, delta: float) -> BlockVerdict:
    """Label each position of one block (subject [B, V] any float dtype, oracle [B, V] float64)."""
    if subject.shape != oracle.shape:
        raise ValueError(f"subject logits {list(subject.shape)} and oracle logits {list(oracle.shape)} differ")
    if not (delta >= 0):
        raise ValueError(f"delta: expected a logit budget >= 0, got {delta}")
    s = subject.double()
    o_top, gap = top_two(oracle)
    s_top = torch.argmax(s, dim=1)
    err = (s - oracle).abs().amax(dim=1)
    rms = (s - oracle).square().mean(dim=1).sqrt()
    q99 = torch.quantile((s - oracle).abs().flatten(), 0.99)
    k = min(COMPETITORS + 1, oracle.shape[1])
    top = torch.topk(oracle.double(), k, dim=1).values
    margins = top[:, :1] - top[:, 1:]  # [B, k - 1]
    log_p = torch.log_softmax(oracle.double(), dim=1)
    log_q = torch.log_softmax(s, dim=1)
    kl = (log_p.exp() * (log_p - log_q)).sum(dim=1).mean()
    # one device-to-host transfer of everything the verdict holds (indices < 2**53 are exact in float64)
    rows = torch.cat([torch.stack([o_top.double(), s_top.double(), gap, err, rms]).reshape(-1), kl.reshape(1),
                      margins.reshape(-1), q99.reshape(1)]).tolist()
    b = len(o_top)
    rms_list = rows[4 * b:5 * b]
    flat = rows[5 * b + 1:-1]
    margin_rows = tuple(tuple(flat[i * (k - 1):(i + 1) * (k - 1)]) for i in range(b))
    o_list, s_list = [int(i) for i in rows[:b]], [int(i) for i in rows[b:2 * b]]
    gaps, errs = rows[2 * b:3 * b], rows[3 * b:4 * b]
    same = [o == t for o, t in zip(o_list, s_list)]
    labels = tuple(IDENTICAL if same_i else (TIE_BREAK if g < delta else DIVERGED) for same_i, g in zip(same, gaps))
    agreement = next((i for i, ok in enumerate(same) if not ok), len(same))
    return BlockVerdict(labels, tuple(o_list), tuple(s_list), tuple(gaps), tuple(errs), float(delta), agreement,
                        rows[5 * b], margin_rows, tuple(rms_list), rows[-1])
