"""DSpark's sequential Markov draft steps: vLLM 0.34.0's fused steps (specialized_decode/drafter/markov.py: per step
a Triton kernel for the bias GEMV on the tensor cores, the add, the cache write and each program's Gumbel-max, and a
select kernel) against the loop they replace (dspark/speculator.py `_sample_markov_chain`), its sampler
(gumbel.py `gumbel_sample`) and the float64 Markov bias (refmodel/markov.py).

An engine offers them as `extras["markov_steps"]` (engines/mirror/markov.py's interface): the mirror's own
everywhere, vLLM's from 0.34.0 on (on a GPU as released; under the interpreter with the adaptations its adapter
declares). Elsewhere they are absent and these skip with the reason.

The release claims the fused steps sample exactly as the loop does, except for the summation order of the
bias's rank-r dot product. So:
- each step's cached logits lie in the loop's rounding of *some* order of that dot: bf16(fp32(base) +
  fp32(bf16(dot))) for a float32 dot in any order (oracles.budgets.dot_rounded_interval; both roundings are
  monotone, so the ends of the dot's interval bound the logits), with the previous token the kernel's own
  previous step's (the anchor at step 0); nothing else in the cache or the draft tokens is written (padded rows,
  an unmapped cache row, the vocabulary's tail past V);
- each step's token is exactly what vLLM's sampler draws from the step's cached logits (the same seed, step,
  position and temperature; the first of equal maxima);
- where every order of the dot gives the same float32 sum (weights on a coarse grid), the fused steps are the
  loop bit for bit: tokens and cache, at temperature 0 and above, fp32 and fp64 keys, hashed and precomputed
  noise, the loop's bias added by the sampler or before it.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from k3num.engines.mirror.markov import MarkovBatch
from k3num.fixtures.strategies import seeds
from k3num.oracles import budgets
from k3num.properties.support import DEVICE, assert_bitwise, up
from k3num.refmodel import markov

# the fused steps and the sampler compute `tl.where(temp != 0, logits / temp, logits)`: the quotient is computed
# on every lane, rows at temperature 0 included (x / 0 is +-inf, 0 / 0 NaN), and `where` discards it there. On a
# GPU no warning is raised; under Triton's interpreter numpy warns about each such division. Expected there, so
# filtered there (the interpreter's module only); the properties judge every value written.
pytestmark = pytest.mark.filterwarnings(
    "ignore:divide by zero encountered in divide:RuntimeWarning:triton.runtime.interpreter",
    "ignore:invalid value encountered in divide:RuntimeWarning:triton.runtime.interpreter")

LOW = torch.bfloat16
SENTINEL = -3.0  # what the cache holds before a call (its unwritten part must keep it)
NOISE_ROWS = 32  # the release precomputes noise for at most this many sampled rows (markov.py NOISE_ROWS)
TEMPERATURES = (0.0, 0.5, 1.0, 1.7)
K3_VOCAB, K3_RANK = 163840, 256  # K3's draft vocabulary and Markov rank (markov.py: markov_w2 is 163840 x 256)


def _steps(engine):
    """The engine's Markov steps, or a skip naming why."""
    steps = engine.extras.get("markov_steps")
    if steps is None:
        why = engine.missing.get("markov_steps") or engine.mode_note or "not bound"
        pytest.skip(f"engine {engine.name} {engine.version} ({engine.mode}) has no fused Markov steps here: {why}")
    return steps


def _grid(gen: torch.Generator, *shape: int) -> torch.Tensor:
    """Weights on the grid {-15..15} / 16 (bf16-exact): every product is a multiple of 1/256 below 1, so every
    partial sum of a rank <= 256 dot is a multiple of 1/256 below 256, exact in float32 (24 bits) in any order;
    the dot itself mostly needs more bits than bf16 has (a bias left unrounded is seen)."""
    return torch.randint(-15, 16, shape, generator=gen).float() / 16


def _batch(seed: int, rows: int, steps: int, vocab: int, rank: int, temps: list[float], fp64: bool, noise: bool,
           mapped: bool, padded: bool, ties: bool, exact: bool, dtype: torch.dtype = LOW,
           device: str = DEVICE) -> MarkovBatch:
    """A batch as the speculator lays it out (engines/mirror/markov.py MarkovBatch): rows + 2 request slots, the
    rows' slots a random choice; with `mapped` the cache rows permuted and one slot unmapped; with `padded` the
    last row a padded one (slot -1); with `ties` each row's best base logit repeated a tile and a program later
    (same base, same markov_w2 row: equal logits, which only the first-of-equal-maxima rule decides at temperature
    0); `exact`: weights on _grid."""
    gen = torch.Generator().manual_seed(seed)
    slots = rows + 2
    if exact:
        w1, w2 = _grid(gen, vocab, rank), _grid(gen, vocab, rank)
    else:
        w1 = torch.randn(vocab, rank, generator=gen) / rank ** 0.5
        w2 = torch.randn(vocab, rank, generator=gen)
    base = torch.randn(rows, steps, vocab, generator=gen) * 2
    if ties and vocab > 64:
        # each row's best logit three times where vocab allows: at i, one tile on (i + 64: the same program's next
        # tile, or the next program's first) and one program on (i + 256); same base, same markov_w2 row
        first = torch.randint(0, vocab - 64, (rows, steps), generator=gen)
        for r in range(rows):
            for s in range(steps):
                i = int(first[r, s])
                twins = [j for j in (i + 64, i + 256) if j < vocab]
                base[r, s, [i, *twins]] = base[r, s].max() + 8
                w2[twins] = w2[i].clone()
    slot = torch.randperm(slots, generator=gen)[:rows].to(torch.int32)
    if padded and rows > 1:
        slot[-1] = -1
    row_mapping = None
    if mapped:
        row_mapping = torch.randperm(slots, generator=gen).to(torch.int32)
        if rows > 1:  # the first row's slot has no cache row (another rank's, say)
            row_mapping[int(slot[0])] = -1
    input_ids = torch.randint(0, vocab, (rows * 3,), generator=gen, dtype=torch.int32)
    anchor_idx = torch.randperm(rows * 3, generator=gen)[:rows]
    pos = torch.randint(1, 1 << 20, (rows, 1), generator=gen) + torch.arange(steps)
    temperature = torch.tensor([temps[i % len(temps)] for i in range(slots)], dtype=torch.float32)
    seeds_ = torch.randint(0, 1 << 62, (slots,), generator=gen)
    cache = torch.full((slots, steps, vocab + 8), SENTINEL, dtype=dtype)
    tokens = torch.full((slots, steps), -7, dtype=torch.int64)
    d = device
    return MarkovBatch(base=base.to(dtype).to(d), w1=w1.to(LOW).to(d), w2=w2.to(LOW).to(d), input_ids=input_ids.to(d),
                       anchor_idx=anchor_idx.to(d), idx_map=slot[:, None].expand(rows, steps).contiguous().to(d),
                       sample_pos=pos.to(d), temperature=temperature.to(d), seeds=seeds_.to(d), cache=cache.to(d),
                       row_mapping=None if row_mapping is None else row_mapping.to(d), tokens=tokens.to(d),
                       use_fp64=fp64, noise=noise and not fp64 and rows * steps <= NOISE_ROWS)


def _cache_rows(b: MarkovBatch) -> torch.Tensor:
    """[R] each row's cache row (-1: a padded row or an unmapped slot: nothing written)."""
    slot = b.idx_map[:, 0].long()
    if b.row_mapping is None:
        return slot
    return torch.where(slot >= 0, b.row_mapping.long()[slot.clamp(min=0)], -1)


def _clone(b: MarkovBatch) -> MarkovBatch:
    return MarkovBatch(**{k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in vars(b).items()})


def _check_cache(b: MarkovBatch, before: torch.Tensor, tokens_before: torch.Tensor) -> None:
    """Each written row's step s logits within the loop's rounding of some order of the bias dot (prev: the
    anchor, then the kernel's own previous token); every other cache element and the draft tokens of the slots
    past the rows unchanged."""
    rows, vocab, rank, dtype = b.rows, b.base.shape[-1], b.w1.shape[1], b.base.dtype
    crow = _cache_rows(b)
    written = crow >= 0
    expected = before.clone()
    expected[crow[written], :, :vocab] = b.cache[crow[written], :, :vocab]
    assert_bitwise(b.cache, expected, "the cache outside the written rows' first V entries of each step")
    assert_bitwise(b.tokens[rows:], tokens_before[rows:], "the draft tokens of the slots past the batch's rows")
    tokens = b.tokens[:rows]
    assert bool(((tokens >= 0) & (tokens < vocab)).all()), f"tokens outside [0, {vocab}): {tokens.tolist()}"
    prev = b.input_ids[b.anchor_idx].long().cpu()
    w1, w2, on = up(b.w1).cpu(), up(b.w2).cpu(), written.cpu()
    for s in range(b.steps):
        exact_dot, magnitude = markov.bias(w1, w2, prev)
        lo, hi = budgets.dot_rounded_interval(exact_dot, magnitude, rank, dtype)
        base = b.base[:, s].cpu()
        lo_l, hi_l = ((base.float() + x.float()).to(dtype) for x in (lo, hi))
        got = b.cache[crow[written], s, :vocab].cpu()
        inside = (got >= lo_l[on]) & (got <= hi_l[on])
        if not bool(inside.all()):
            r, v = (int(i) for i in (~inside).nonzero()[0])
            row = int(on.nonzero()[r])
            raise AssertionError(
                f"step {s}: {int((~inside).sum())} of {inside.numel()} cached logits outside the loop's rounding of "
                f"any order of the bias dot; first: row {row}, token {v}: {float(got[r, v])!r} not in "
                f"[{float(lo_l[row, v])!r}, {float(hi_l[row, v])!r}] (base {float(base[row, v])!r}, exact dot "
                f"{float(exact_dot[row, v])!r}, previous token {int(prev[row])})")
        prev = tokens[:, s].long().cpu()


def _check_tokens(ops, b: MarkovBatch) -> None:
    """Each written row's step s token = the engine's sampler's draw from the logits the step cached."""
    crow = _cache_rows(b)
    written = crow >= 0
    if not bool(written.any()):
        return
    for s in range(b.steps):
        logits = torch.zeros(b.rows, b.base.shape[-1], dtype=b.cache.dtype, device=b.cache.device)
        logits[written] = b.cache[crow[written], s, : b.base.shape[-1]]
        drawn = ops.sample(logits, b, s)
        assert_bitwise(b.tokens[: b.rows, s][written], drawn[written].to(torch.int64),
                       f"step {s}'s tokens against the sampler's draws from the step's cached logits "
                       f"(temperatures {b.temperature.tolist()})")


def _check_loop(ops, b: MarkovBatch, fuse_bias: bool) -> None:
    """The fused steps' tokens and cache = the engine's own loop's, bit for bit (b: weights on _grid)."""
    ref = _clone(b)
    ops.fused(b)
    ops.loop(ref, fuse_bias)
    assert_bitwise(b.tokens, ref.tokens, "the draft tokens against the loop's")
    assert_bitwise(b.cache, ref.cache, "the draft logits cache against the loop's")


cases = dict(seed=seeds, rows=st.integers(1, 5), steps=st.integers(1, 4), vocab=st.integers(1, 700),
             rank=st.sampled_from([16, 32, 64]), temps=st.lists(st.sampled_from(TEMPERATURES), min_size=1,
                                                                  max_size=3),
             fp64=st.booleans(), noise=st.booleans(), mapped=st.booleans(), padded=st.booleans(), ties=st.booleans())


@given(**cases, fp32_logits=st.booleans())
def test_fused_markov_caches_each_steps_logits_as_the_loop_rounds_some_order_of_the_bias_dot(
        engine, seed, rows, steps, vocab, rank, temps, fp64, noise, mapped, padded, ties, fp32_logits):
    """Row r's step s cache row = bf16(fp32(base) + fp32(bf16(dot))) elementwise for a float32 dot of
    markov_w1[prev] and markov_w2 in some order (prev: the row's anchor at s = 0, its own step s - 1 token after);
    with fp32 logits the bias is not rounded (the head's dtype is the logits'). Every other cache element (padded
    rows, an unmapped row, the tail past V, other slots) and the draft tokens of rows past R keep their bits."""
    ops = _steps(engine)
    b = _batch(seed, rows, steps, vocab, rank, temps, fp64, noise, mapped, padded, ties, False,
               torch.float32 if fp32_logits else LOW)
    before, tokens_before = b.cache.clone(), b.tokens.clone()
    ops.fused(b)
    _check_cache(b, before, tokens_before)


@given(**cases, exact=st.booleans())
def test_fused_markov_token_is_the_samplers_draw_from_its_own_cached_logits(
        engine, seed, rows, steps, vocab, rank, temps, fp64, noise, mapped, padded, ties, exact):
    """Each written row's step s token is exactly the engine's sampler's draw from the logits the step cached
    (its seed mixed with s, position P - 1 past the draft salt, its temperature; the first of equal maxima)."""
    ops = _steps(engine)
    b = _batch(seed, rows, steps, vocab, rank, temps, fp64, noise, mapped, padded, ties, exact)
    ops.fused(b)
    _check_tokens(ops, b)


@given(**cases, fuse_bias=st.booleans(), fp32_logits=st.booleans())
def test_fused_markov_is_the_loop_bit_for_bit_when_every_order_of_the_bias_dot_is_exact(
        engine, seed, rows, steps, vocab, rank, temps, fp64, noise, mapped, padded, ties, fuse_bias, fp32_logits):
    """With weights on a grid where the float32 dot is exact in any order, the fused steps write the very cache
    and draft tokens of the engine's own loop (the loop's bias added before its sampler or by it; bf16 logits, or
    fp32 ones with an fp32 head)."""
    ops = _steps(engine)
    _check_loop(ops, _batch(seed, rows, steps, vocab, rank, temps, fp64, noise, mapped, padded, ties, exact=True,
                            dtype=torch.float32 if fp32_logits else LOW), fuse_bias)


@pytest.mark.gpu
@pytest.mark.nightly
@given(seed=seeds, rows=st.sampled_from([1, 7, 16, 17, 33]), steps=st.integers(1, 4),
       temps=st.lists(st.sampled_from(TEMPERATURES), min_size=1, max_size=3), fp64=st.booleans(),
       noise=st.booleans(), mapped=st.booleans(), ties=st.booleans(), exact=st.booleans(), fuse_bias=st.booleans())
def test_k3_fused_markov_steps_hold_all_three_at_k3s_vocabulary_and_rank(engine, seed, rows, steps, temps, fp64,
                                                                         noise, mapped, ties, exact, fuse_bias):
    """At K3's draft vocabulary (163,840: 640 programs of 256 entries) and Markov rank (256), with row counts on
    both sides of the kernel's 16-row blocks: random weights hold the cache and token relations above, weights on
    the grid the loop's bits."""
    ops = _steps(engine)
    b = _batch(seed, rows, steps, K3_VOCAB, K3_RANK, temps, fp64, noise, mapped, rows > 1, ties, exact,
               device="cuda")
    if exact:
        _check_loop(ops, b, fuse_bias)
        return
    before, tokens_before = b.cache.clone(), b.tokens.clone()
    ops.fused(b)
    _check_cache(b, before, tokens_before)
    _check_tokens(ops, b)


POISONS = ("nan_one", "nan_all", "neg_inf_all", "pos_inf_one")


# two runs of the fused steps per example: the vocabulary drawn to 300 (two programs) keeps it within the others' time
@given(**{k: v for k, v in cases.items() if k not in ("rows", "vocab")}, rows=st.integers(2, 5),
       vocab=st.integers(1, 300), data=st.data())
def test_fused_markov_non_finite_rows_draw_in_range_tokens_and_leave_the_finite_rows_as_they_were(
        engine, seed, rows, steps, vocab, rank, temps, fp64, noise, mapped, padded, ties, data):
    """The non-finite contract (ROCm/ATOM#2160: NaN logits rows made a fused argmax return an out-of-range id;
    sglang#32277: all -inf rows wrote a sentinel as a token id). Some rows' base logits at one step hold a NaN,
    are NaN or -inf throughout, or hold a +inf, among finite rows. Every draft token is in [0, V) (never an
    index past the vocabulary nor a sentinel); each finite row's tokens and cached logits are bit for bit those of
    the same batch with every row finite; a poisoned row's cache holds NaN exactly where its base does and the
    base's infinities where it has them (the bias is finite), and nothing past its own rows is written."""
    ops = _steps(engine)
    clean = _batch(seed, rows, steps, vocab, rank, temps, fp64, noise, mapped, padded, ties, False)
    poisoned = data.draw(st.sets(st.integers(0, rows - 1), min_size=1, max_size=rows - 1), label="poisoned rows")
    b = _clone(clean)
    base = b.base.clone()
    for r in sorted(poisoned):
        kind = data.draw(st.sampled_from(POISONS), label=f"row {r}")
        s = data.draw(st.integers(0, steps - 1), label=f"row {r} step")
        v = data.draw(st.integers(0, vocab - 1), label=f"row {r} token")
        if kind == "nan_one":
            base[r, s, v] = float("nan")
        elif kind == "nan_all":
            base[r, s] = float("nan")
        elif kind == "neg_inf_all":
            base[r, s] = float("-inf")
        else:
            base[r, s, v] = float("inf")
    b.base = base
    before, tokens_before = b.cache.clone(), b.tokens.clone()
    ops.fused(clean)
    ops.fused(b)
    tokens = b.tokens[:rows]
    assert bool(((tokens >= 0) & (tokens < vocab)).all()), (
        f"draft tokens outside [0, {vocab}) with non-finite rows {sorted(poisoned)}: {tokens.tolist()}")
    assert_bitwise(b.tokens[rows:], tokens_before[rows:], "the draft tokens of the slots past the batch's rows")
    crow = _cache_rows(b)
    finite = [r for r in range(rows) if r not in poisoned]
    assert_bitwise(b.tokens[finite], clean.tokens[finite], f"the finite rows' {finite} tokens beside non-finite rows")
    written = {int(crow[r]) for r in range(rows) if int(crow[r]) >= 0}
    for r in range(rows):
        c = int(crow[r])
        if c < 0:
            continue
        if r in poisoned:
            got, want = b.cache[c, :, :vocab], base[r]
            assert_bitwise(torch.isnan(got), torch.isnan(want), f"row {r}'s NaN logits in the cache (where the base's)")
            inf = torch.isinf(want)
            assert_bitwise(got[inf], want[inf].to(got.dtype), f"row {r}'s infinite logits in the cache")
        else:
            assert_bitwise(b.cache[c], clean.cache[c], f"finite row {r}'s cached logits beside non-finite rows")
    others = [c for c in range(b.cache.shape[0]) if c not in written]
    assert_bitwise(b.cache[others], before[others], "the cache rows no batch row maps to")


@given(**{k: v for k, v in cases.items() if k not in ("temps", "noise", "mapped")},
       temps=st.lists(st.sampled_from(TEMPERATURES), min_size=1, max_size=3).filter(any), fp32_logits=st.booleans())
def test_a_draft_watermarker_that_marks_no_row_samples_what_the_plain_loop_samples(
        engine, seed, rows, steps, vocab, rank, temps, fp64, padded, ties, fp32_logits):
    """Disabled-path equivalence of the speculator's draft-watermarker branch: through a watermarker that marks
    no row (engines/vllm_adapter/markov.py `_NoRowMarked`: the release's sampler on the arguments the branch hands
    it), the loop's draft tokens and cache are the plain loop's bit for bit. The branch keys each draw by the
    position before the sampled token (P - 1) as the plain branch does; a key one off moves every draw at a
    non-zero temperature (some drawn here). Cache rows unmapped: the branch hands the watermarker no row mapping."""
    ops = _steps(engine)
    b = _batch(seed, rows, steps, vocab, rank, temps, fp64, False, False, padded, ties, exact=False,
               dtype=torch.float32 if fp32_logits else LOW)
    marked = _clone(b)
    ops.loop(b)
    ops.loop(marked, watermarked=True)
    assert_bitwise(marked.tokens, b.tokens, "the draft tokens through a watermarker marking no row")
    assert_bitwise(marked.cache, b.cache, "the draft logits cache through a watermarker marking no row")
