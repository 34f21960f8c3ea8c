"""DSpark's sequential Markov draft steps, the mirror's statement of them (vLLM 0.34.0's fused steps,
specialized_decode/drafter/markov.py, and the loop they replace, dspark/speculator.py `_sample_markov_chain`, are
bound against the same interface: engines/vllm_adapter/markov.py).

Each of a request's k draft steps adds the Markov head's bias of the previous token to the step's base logits and
samples the step's token from them: bias = bf16(fp32 dot(markov_w1[prev], markov_w2[v])) (the GEMV's output,
rounded once to the logits' dtype), logits = bf16(fp32(base) + fp32(bias)) (a tensor add), cached before
temperature; the token is Gumbel-max over the logits (plain first argmax at temperature 0); step 0's previous
token is the request's anchor, step s's is step s - 1's token.

A batch (`MarkovBatch`, shapes below) is the speculator's buffers as the fused steps read them. An engine's
`markov_steps` capability offers:
- `fused(batch)`: the fused launches; writes batch.cache (through row_mapping) and batch.tokens.
- `loop(batch, fuse_bias=False)`: the engine's own step-by-step loop, the same buffers written (`fuse_bias`: the
  bias handed to the sampler, which adds it, rather than added before it).
- `sample(logits [R, V], batch, step) -> [R] int64`: the engine's sampler alone on given logits of the batch's
  rows at `step` (its seed, position, temperature): what a step must have drawn from its own cached logits.

The mirror's noise is its own (a splitmix hash of seed, step, position and token), not vLLM's murmur3: the
properties relate an engine's fused steps to its own loop and sampler, never across engines.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

SALT = 1 << 30  # a draft's noise keys its position past the target's (vLLM's _DRAFT_NOISE_SALT)


@dataclass
class MarkovBatch:
    """R rows (requests) of k steps over a V-token draft vocabulary, Markov rank r; S request-state slots.

    base [R, k, V] bf16 or fp32; w1 [V1, r] bf16 (markov_w1, V1 >= every token); w2 [V, r] bf16 (markov_w2);
    input_ids [T] int32 and anchor_idx [R] int64 (row r's anchor token is input_ids[anchor_idx[r]]);
    idx_map [R, k] int32 (the row's request-state slot at each step, -1: a padded row); sample_pos [R, k] int64
    (the sampled token's position P; noise keyed by P - 1); temperature [S] fp32; seeds [S] int64;
    cache [C, k, Vc] base's dtype, Vc >= V (the draft logits cache, written); row_mapping [S] int32 or None
    (slot -> cache row, -1: none; None: row = slot); tokens [S, k] int64 (draft_tokens, rows 0..R-1 written);
    use_fp64: fp64 Gumbel keys; noise: the precomputed-noise path where the engine has one."""

    base: torch.Tensor
    w1: torch.Tensor
    w2: torch.Tensor
    input_ids: torch.Tensor
    anchor_idx: torch.Tensor
    idx_map: torch.Tensor
    sample_pos: torch.Tensor
    temperature: torch.Tensor
    seeds: torch.Tensor
    cache: torch.Tensor
    row_mapping: torch.Tensor | None
    tokens: torch.Tensor
    use_fp64: bool = False
    noise: bool = False

    @property
    def rows(self) -> int:
        return self.base.shape[0]

    @property
    def steps(self) -> int:
        return self.base.shape[1]


# splitmix64's multipliers as int64 (written in hex: the harness's modules keep numeric literals out of
# hypothesis's literal pool, harness/literal_pool.py)
_M1 = int("bf58476d1ce4e5b9", 16) - (1 << 64)
_M2 = int("94d049bb133111eb", 16) - (1 << 64)


def _mix(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's finalizer on int64 (wrapping arithmetic; the shifts made logical by a mask)."""
    x = x ^ ((x >> 30) & ((1 << 34) - 1))
    x = x * _M1
    x = x ^ ((x >> 27) & ((1 << 37) - 1))
    x = x * _M2
    return x ^ ((x >> 31) & ((1 << 33) - 1))


def gumbel_keys(logits: torch.Tensor, temperature: torch.Tensor, seed: torch.Tensor, step: int, pos: torch.Tensor,
                use_fp64: bool) -> torch.Tensor:
    """[R, V] the mirror's Gumbel-max keys of logits [R, V] (fp32 math; fp64 keys if use_fp64) for rows of
    temperature [R], seed [R], position pos [R] (P - 1 + SALT): logits / t + g, g = -log(-log(u)) with u in (0, 1)
    a hash of (seed, step, pos, token); plain logits at t = 0."""
    r, v = logits.shape
    tok = torch.arange(v, device=logits.device, dtype=torch.int64)
    h = _mix(_mix(_mix(seed.to(torch.int64) ^ (step << 40))[:, None] ^ pos.to(torch.int64)[:, None]) ^ tok[None])
    u = (((h >> 11) & ((1 << 53) - 1)).to(torch.float64) + 1) / float((1 << 53) + 1)
    t = temperature.float()[:, None]
    lf = torch.where(t != 0, logits.float() / torch.where(t != 0, t, torch.ones_like(t)), logits.float())
    g = -torch.log(-torch.log(u))
    if use_fp64:
        return torch.where(t != 0, lf.double() + g, lf.double())
    return torch.where(t != 0, lf + g.float(), lf)


def first_argmax(keys: torch.Tensor) -> torch.Tensor:
    """[R] the first index of each row's maximum (torch.argmax's rules, stated rather than assumed: of equal
    maxima the first; a NaN is the maximum, so a row with one yields its first NaN's index, always in range)."""
    best = keys.max(-1, keepdim=True).values  # NaN where the row has one
    idx = torch.arange(keys.shape[-1], device=keys.device).expand_as(keys)
    hit = (keys == best) | (torch.isnan(keys) & torch.isnan(best))
    return torch.where(hit, idx, keys.shape[-1]).min(-1).values


def bias(w1: torch.Tensor, w2: torch.Tensor, prev: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[R, V] the Markov head's bias of tokens prev [R]: the fp32 dot of markov_w1[prev] and each markov_w2 row,
    rounded once to `dtype`."""
    return (w1[prev].float() @ w2.float().T).to(dtype)


def step_logits(base: torch.Tensor, bias_: torch.Tensor) -> torch.Tensor:
    """[R, V] base + bias as a tensor add of base's dtype: one fp32 add, rounded once."""
    return (base.float() + bias_.float()).to(base.dtype)


class MarkovSteps:
    """The mirror's `markov_steps`: its loop is its fused steps (one statement of the contract)."""

    @staticmethod
    def sample(logits: torch.Tensor, batch: MarkovBatch, step: int) -> torch.Tensor:
        slot = batch.idx_map[:, step].to(torch.int64)
        valid = slot >= 0
        s = slot.clamp(min=0)
        temp = torch.where(valid, batch.temperature[s], torch.zeros_like(batch.temperature[s]))
        seed = torch.where(valid, batch.seeds[s], torch.zeros_like(batch.seeds[s]))
        pos = batch.sample_pos[:, step] - 1 + SALT
        return first_argmax(gumbel_keys(logits, temp, seed, step, pos, batch.use_fp64))

    @staticmethod
    def fused(batch: MarkovBatch) -> None:
        prev = batch.input_ids[batch.anchor_idx].to(torch.int64)
        for step in range(batch.steps):
            logits = step_logits(batch.base[:, step], bias(batch.w1, batch.w2, prev, batch.base.dtype))
            MarkovSteps.write_cache(batch, step, logits)
            tok = MarkovSteps.sample(logits, batch, step)
            batch.tokens[: batch.rows, step] = tok
            prev = tok

    @staticmethod
    def loop(batch: MarkovBatch, fuse_bias: bool = False, watermarked: bool = False) -> None:
        """The step-by-step loop (`fuse_bias`: the bias added by the sampler instead of before it; one rounding
        either way; `watermarked`: through a draft watermarker that marks no row, which samples as the plain
        loop does): the mirror's own fused steps, never a subclass's."""
        MarkovSteps.fused(batch)

    @staticmethod
    def write_cache(batch: MarkovBatch, step: int, logits: torch.Tensor) -> None:
        """Row r's step logits into the cache row of its slot (none for a padded row or an unmapped slot)."""
        slot = batch.idx_map[:, step].to(torch.int64)
        row = slot if batch.row_mapping is None else torch.where(
            slot >= 0, batch.row_mapping[slot.clamp(min=0)].to(torch.int64), -1)
        keep = row >= 0
        batch.cache[row[keep], step, : logits.shape[-1]] = logits[keep]
