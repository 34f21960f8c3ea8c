"""DSpark's Markov head in float64: the transition bias of a previous token, and the sequential draft steps it
feeds.

The head (vLLM's DSparkMarkovHead; vllm/models/kimi_k3/nvidia/dspark_mla.py builds it for K3's DSpark drafter)
embeds the previous token, e = markov_w1[prev] [r], and projects it over the draft vocabulary,
bias[v] = sum_i e[i] markov_w2[v, i]. A drafter's k steps are sequential: step s's logits are its base logits plus
the bias of step s - 1's token (step 0: the request's anchor, the last accepted token), and its token is drawn from
them (the first argmax at temperature 0).

- `bias(w1, w2, prev)`: the float64 bias and the sum of the products' magnitudes (what a float32 dot's rounding
  error is bounded by; oracles.budgets.dot_rounded_interval).
- `greedy_chain(base, w1, w2, anchor)`: the k steps at temperature 0 in float64: each step's logits and token.

Pure functions, float64 in and out (checked); the weights are taken as the values they hold (a bf16 checkpoint's
weights widened exactly).
"""

from __future__ import annotations

import torch

from k3num.refmodel import checks


def bias(w1: torch.Tensor, w2: torch.Tensor, prev: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w1 [V1, r], w2 [V, r] float64, prev [R] int64 -> (bias [R, V], magnitude [R, V]): bias = w1[prev] @ w2^T,
    magnitude = |w1[prev]| @ |w2|^T (both float64)."""
    e = _embed(w1, w2, prev)
    return e @ w2.T, e.abs() @ w2.abs().T


def _embed(w1: torch.Tensor, w2: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
    """w1[prev] [R, r] after checking the weights and the token ids (bias's checks)."""
    checks.float64("w1", w1)
    checks.float64("w2", w2)
    if w1.dim() != 2 or w2.dim() != 2 or w1.shape[1] != w2.shape[1]:
        raise ValueError(f"w1 {list(w1.shape)}, w2 {list(w2.shape)}: expected [V1, r] and [V, r] of one rank r")
    if prev.dtype not in (torch.int32, torch.int64) or prev.dim() != 1:
        raise ValueError(f"prev: expected a 1-d integer tensor of token ids, got {prev.dtype} {list(prev.shape)}")
    if prev.numel() and (int(prev.min()) < 0 or int(prev.max()) >= w1.shape[0]):
        raise ValueError(f"prev: token ids must lie in [0, {w1.shape[0]}), got [{int(prev.min())}, "
                         f"{int(prev.max())}]")
    return w1[prev.long()]


def greedy_chain(base: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
                 anchor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """base [R, k, V], w1 [V1, r], w2 [V, r] float64, anchor [R] int64 -> (logits [R, k, V] float64, tokens [R, k]
    int64): logits[:, s] = base[:, s] + bias(token of step s - 1, the anchor at s = 0), token = the first argmax."""
    checks.float64("base", base)
    if base.dim() != 3 or base.shape[2] != w2.shape[0]:
        raise ValueError(f"base: expected [R, k, {w2.shape[0]}], got {list(base.shape)}")
    prev = anchor.long().to(base.device)
    logits, tokens = [], []
    for s in range(base.shape[1]):
        step = base[:, s] + _embed(w1, w2, prev) @ w2.T  # the bias alone: the chain needs no magnitude
        best = step.max(-1, keepdim=True).values
        idx = torch.arange(step.shape[-1], device=step.device).expand_as(step)
        prev = torch.where(step == best, idx, step.shape[-1]).min(-1).values
        logits.append(step)
        tokens.append(prev)
    return torch.stack(logits, 1), torch.stack(tokens, 1)
