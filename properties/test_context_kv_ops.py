"""Per-op contracts of the fused context-KV path's compiled ops (vLLM's `ops.rms_norm` with a 2-D
weight, `ops.rotary_embedding`, `concat_and_cache_mla_grouped`), one property each.

An engine offers them as `extras["context_kv_ops"]` (engines.standins.ContextKVOps' interface):
the mirror's kernels everywhere, vLLM's own CUDA ops where `k3num build-ops` built them (mode
source-gpu+ops). Elsewhere vLLM's ops are absent and these skip with the reason.

"Rounded once" is checked elementwise, which a max-abs budget cannot do: with fp32 math and one
rounding to bf16, every output element is within u_bf16 |y| of the fp32 result y, and y within
eps32 |ref| of the float64 oracle ref, so |out - ref| <= (u_bf16 (1 + eps32) + eps32) |ref|
(oracles.budgets.rounded_once_rtol). A second rounding anywhere (the normalised row rounded before
the weight is applied, say) reaches 2 u_bf16 |ref| on some element of a row of hundreds.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from k3num.engines.mirror.context_kv import rope_cache
from k3num.fixtures.builders import CACHE_LAYOUTS, paged_caches, same_views
from k3num.fixtures.strategies import seeds
from k3num.harness import ledger_models, ledger_run
from k3num.oracles import budgets
from k3num.oracles.records import judge
from k3num.properties.support import DEVICE, LOW, assert_bitwise, report, up
from k3num.refmodel import geometry, rmsnorm

EPS = 1e-5


def _ops(engine, *needed: str):
    """The engine's context-KV ops, or a skip naming why; `needed`: the ops the property calls (an engine
    binds the ones its path has: TokenSpeed has no grouped norm nor grouped insert)."""
    ops = engine.extras.get("context_kv_ops")
    if ops is None:
        pytest.skip(f"engine {engine.name} {engine.version} ({engine.mode}) has no compiled context-KV ops here: "
                    f"{engine.mode_note or 'not bound'}")
    lacking = [n for n in needed if not hasattr(ops, n)]
    if lacking:
        pytest.skip(f"engine {engine.name} {engine.version}: its context-KV path has no {', '.join(lacking)}")
    return ops


def _elementwise(engine, prop: str, op: str, out: torch.Tensor, ref: torch.Tensor, scale: torch.Tensor, rtol: float,
                 rule: str, seed: int, n: int, detail: str) -> None:
    """Judge |out - ref| <= rtol * scale elementwise: both sides divided by scale (floored at the
    smallest normal float64, so a zero scale cannot divide by zero)."""
    scale = scale.clamp_min(torch.finfo(torch.float64).tiny)
    report(judge(property=prop, engine=engine, subject=op, actual=up(out) / scale, reference=ref / scale,
                 budget=budgets.Budget(rtol, f"elementwise {rule}, rtol={rtol:.3g} (rounded once)"), seed=seed,
                 reduction_len=n, detail=detail))


def _rotated(xs: torch.Tensor, c64: torch.Tensor, neox: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(the float64 rotation of xs [..., R] by the cache rows c64 [..., R] = [cos | sin] (broadcast), the
    elementwise scale of its bound). A rotated element y = a cos - b sin in fp32: two products and a difference
    err by <= u32 (|a cos| + |b sin|) + u32 |y| <= 2.5 u32 |pair| (|cos|, |sin| <= 1, |a cos| + |b sin| <=
    sqrt(2) |pair|), then one bf16 rounding: |out - ref| <= u |ref| + (1 + u) 2.5 u32 |pair| = u * scale.
    The rotary property writes the same formula out in its body, kept as it was: under `ci` a test's draws are
    derandomized from its own source, so editing the body would change every draw and its drift records."""
    r = xs.shape[-1]
    cos, sin = c64[..., : r // 2], c64[..., r // 2:]
    if neox:
        a, b = xs[..., : r // 2], xs[..., r // 2:]
        ref = torch.cat([a * cos - b * sin, b * cos + a * sin], -1)
    else:
        a, b = xs[..., 0::2], xs[..., 1::2]
        ref = torch.stack([a * cos - b * sin, b * cos + a * sin], -1).flatten(-2)
    u = budgets.unit_roundoff(LOW)
    pair = torch.sqrt(a * a + b * b)
    pair = torch.cat([pair, pair], -1) if neox else torch.stack([pair, pair], -1).flatten(-2)
    return ref, ref.abs() + (1 + u) * 2.5 * budgets.U32 / u * pair


@given(seed=seeds, layers=st.integers(1, 6), tokens=st.integers(1, 40), dim=st.sampled_from([64, 128, 512]))
def test_grouped_rms_norm_row_l_is_normed_by_weight_row_l_in_fp32_rounded_once(engine, seed, layers, tokens, dim):
    ops = _ops(engine, "rms_norm_grouped")
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(layers, tokens, dim, generator=gen) * 3).to(LOW).to(DEVICE)
    w = (torch.rand(layers, dim, generator=gen) * 2 + 0.1).to(LOW).to(DEVICE)
    out = ops.rms_norm_grouped(x, w, EPS)
    ref = torch.stack([rmsnorm.rms_norm(up(x[layer]), up(w[layer]), EPS) for layer in range(layers)])
    # fp32 terms: the sum of squares (gamma_D / 2 in the rsqrt), rsqrt, mean, two products: 4 u32
    eps32 = budgets.gamma(dim, budgets.U32) / 2 + 4 * budgets.U32
    _elementwise(engine, "grouped_rms_norm_rounded_once", "ops.rms_norm", out, ref, ref.abs(),
                 budgets.rounded_once_rtol(LOW, eps32), "|out-ref|<=rtol*|ref|", seed, dim, f"L={layers};D={dim}")
    perm = torch.randperm(layers, generator=gen).to(DEVICE)
    assert_bitwise(ops.rms_norm_grouped(x[perm].contiguous(), w[perm].contiguous(), EPS), out[perm],
                   "grouped rms_norm with the groups and their weight rows permuted together")


@given(seed=seeds, rows=st.integers(1, 64), neox=st.booleans(), max_pos=st.sampled_from([8, 4096, 32768]))
def test_rotary_embedding_rotates_in_fp32_rounded_once(engine, seed, rows, neox, max_pos):
    ops = _ops(engine, "rotary")
    g = geometry.preset("k3-dspark-plain-rope")
    spec = dataclasses.replace(g.rope, style="neox" if neox else "gptj")
    gen = torch.Generator().manual_seed(seed)
    r = spec.rotary_dim
    x = (torch.randn(rows, 1, r, generator=gen) * 2).to(LOW).to(DEVICE)
    pos = torch.randint(0, max_pos, (rows,), generator=gen).to(DEVICE)
    cache = rope_cache(spec, max_pos, torch.float32, torch.device(DEVICE))  # vLLM's cache is fp32
    out = ops.rotary(pos, x, cache, neox)
    # the oracle rotates by the fp32 cache's own cos/sin (the angle error is the cache's, not the op's)
    c64 = cache.double()[pos]
    cos, sin = c64[:, : r // 2], c64[:, r // 2:]
    xs = up(x)[:, 0]
    if neox:
        a, b = xs[:, : r // 2], xs[:, r // 2:]
        ref = torch.cat([a * cos - b * sin, b * cos + a * sin], -1)
    else:
        a, b = xs[:, 0::2], xs[:, 1::2]
        ref = torch.stack([a * cos - b * sin, b * cos + a * sin], -1).flatten(-2)
    # a rotated element y = a cos - b sin in fp32: two products and a difference err by <= u32 (|a cos| +
    # |b sin|) + u32 |y| <= 2.5 u32 |pair| (|cos|, |sin| <= 1, |a cos| + |b sin| <= sqrt(2) |pair|), then one
    # bf16 rounding: |out - ref| <= u |ref| + (1 + u) 2.5 u32 |pair| = u * scale with the scale below
    u = budgets.unit_roundoff(LOW)
    pair = torch.sqrt(a * a + b * b)
    pair = torch.cat([pair, pair], -1) if neox else torch.stack([pair, pair], -1).flatten(-2)
    scale = ref.abs() + (1 + u) * 2.5 * budgets.U32 / u * pair
    _elementwise(engine, "rotary_rounded_once", "ops.rotary_embedding", out[:, 0], ref, scale, u,
                 "|out-ref|<=u*(|ref|+(1+u)*2.5*u32/u*|pair|)", seed, 2,
                 f"{'neox' if neox else 'gptj'};R={r};max_pos={max_pos}")


@given(seed=seeds, layers=st.integers(1, 6), tokens=st.integers(1, 48), per_layer=st.booleans(),
       layout=st.sampled_from(CACHE_LAYOUTS))
def test_grouped_cache_insert_writes_exactly_the_given_slots(engine, seed, layers, tokens, per_layer, layout):
    check_insert_writes_exactly_the_given_slots(_ops(engine, "insert_grouped"), seed, layers, tokens, per_layer,
                                                layout, grouped=True)


# from 512 rows TokenSpeed's write takes its per-location kernel: one branch in four draws such a call
@given(seed=seeds, layers=st.integers(1, 3),
       tokens=st.one_of(st.integers(1, 16), st.integers(1, 16), st.integers(1, 16), st.integers(512, 520)),
       per_layer=st.booleans(), layout=st.sampled_from(CACHE_LAYOUTS))
def test_per_layer_cache_insert_writes_exactly_the_given_slots(engine, seed, layers, tokens, per_layer, layout):
    """One layer's insert at a time (vLLM's concat_and_cache_mla; TokenSpeed's set_mla_kv_buffer_triton,
    whose skipped rows are write-masked with their location pointed at a slot another row writes). From 512
    rows TokenSpeed's write takes its per-location kernel, below it its per-element one: both are drawn (a
    call of 512 rows or more with one layer: the interpreter runs it slowly, and one layer shows the kernel)."""
    check_insert_writes_exactly_the_given_slots(_ops(engine, "insert_per_layer"), seed, 1 if tokens >= 512 else layers,
                                                tokens, per_layer, layout, grouped=False)


def check_insert_writes_exactly_the_given_slots(ops, seed: int, layers: int, tokens: int, per_layer: bool,
                                                layout: str, *, grouped: bool) -> None:
    """Every mapped slot of layer l holds [kv_c_l | k_pe_l] of its token, every skipped slot (-1) and every
    other byte of the caches' buffer keeps its bits."""
    gen = torch.Generator().manual_seed(seed)
    kv_lora, r, block_size = 512, 64, 16
    num_blocks = -(-2 * tokens // block_size)
    kv_c = torch.randn(layers, tokens, kv_lora, generator=gen).to(LOW).to(DEVICE)
    k_pe = torch.randn(layers, tokens, r, generator=gen).to(LOW).to(DEVICE)
    caches, buf = paged_caches(layers, num_blocks, block_size, kv_lora + r, layout, gen, LOW, DEVICE)
    caches = list(caches)
    rows = layers if per_layer else 1
    slots = torch.stack([torch.randperm(num_blocks * block_size, generator=gen)[:tokens] for _ in range(rows)])
    slots[:, seed % 3:: 3] = -1
    slots = slots.to(DEVICE).expand(layers, tokens)
    before = buf.clone()
    if grouped:
        ops.insert_grouped(kv_c, k_pe, caches, slots)
    else:
        for layer in range(layers):
            ops.insert_per_layer(kv_c[layer], k_pe[layer], caches[layer], slots[layer].contiguous())
    expected = before.clone()
    views = same_views(caches, buf, expected)
    for layer in range(layers):
        s = slots[layer]
        keep = s >= 0
        views[layer][s[keep] // block_size, s[keep] % block_size] = torch.cat([kv_c[layer], k_pe[layer]], -1)[keep]
    assert_bitwise(buf, expected, f"the {layout} caches' buffer after the {'grouped' if grouped else 'per-layer'} "
                                  "insert")


@given(seed=seeds, layers=st.integers(1, 6), tokens=st.integers(1, 48), per_layer=st.booleans(),
       layout=st.sampled_from(CACHE_LAYOUTS))
def test_per_layer_and_grouped_inserts_write_the_same_bytes(engine, seed, layers, tokens, per_layer, layout):
    """vLLM's per-layer insert (`concat_and_cache_mla`, what `do_kv_cache_update` calls when the layers'
    caches differ) and the grouped one (`concat_and_cache_mla_grouped`), on the same inputs into two copies
    of the same caches: the same bytes everywhere, skipped slots (-1) included."""
    ops = _ops(engine, "insert_grouped", "insert_per_layer")
    gen = torch.Generator().manual_seed(seed)
    kv_lora, r, block_size = 512, 64, 16
    num_blocks = -(-2 * tokens // block_size)
    kv_c = torch.randn(layers, tokens, kv_lora, generator=gen).to(LOW).to(DEVICE)
    k_pe = torch.randn(layers, tokens, r, generator=gen).to(LOW).to(DEVICE)
    grouped, gbuf = paged_caches(layers, num_blocks, block_size, kv_lora + r, layout, gen, LOW, DEVICE)
    single = [c.clone() for c in grouped]  # the same bytes, each layer its own tensor (differing layouts allowed)
    rows = layers if per_layer else 1
    slots = torch.stack([torch.randperm(num_blocks * block_size, generator=gen)[:tokens] for _ in range(rows)])
    slots[:, seed % 3:: 3] = -1
    slots = slots.to(DEVICE).expand(layers, tokens)
    ops.insert_grouped(kv_c, k_pe, list(grouped), slots)
    for layer in range(layers):
        ops.insert_per_layer(kv_c[layer], k_pe[layer], single[layer], slots[layer].contiguous())
    for layer in range(layers):
        assert_bitwise(single[layer], grouped[layer], f"layer {layer}'s {layout} cache: per-layer against grouped")


def _fp8_cache_case(seed: int, layers: int, tokens: int):
    """(kv_c [L,N,512], k_pe [L,N,64] bf16 on DEVICE, L uint8 caches [NB,16,576] of random bytes, their copies,
    slots [L,N] on the CPU (distinct per layer, none skipped), block_size) for the FP8 insert properties."""
    gen = torch.Generator().manual_seed(seed)
    kv_lora, r, block_size = 512, 64, 16
    num_blocks = -(-2 * tokens // block_size)
    kv_c = (torch.randn(layers, tokens, kv_lora, generator=gen) * 4).to(LOW).to(DEVICE)
    k_pe = (torch.randn(layers, tokens, r, generator=gen) * 4).to(LOW).to(DEVICE)
    caches = [torch.randint(0, 256, (num_blocks, block_size, kv_lora + r), generator=gen, dtype=torch.uint8).to(DEVICE)
              for _ in range(layers)]
    before = [c.clone() for c in caches]
    slots = torch.stack([torch.randperm(num_blocks * block_size, generator=gen)[:tokens] for _ in range(layers)])
    return kv_c, k_pe, caches, before, slots, block_size


@given(seed=seeds, layers=st.integers(1, 4), tokens=st.integers(1, 32), fmt=st.sampled_from(["fp8_e4m3", "fp8_e5m2"]),
       scales=st.lists(st.floats(0.0625, 8.0, allow_nan=False, width=32), min_size=4, max_size=4, unique=True),
       grouped=st.booleans())
def test_fp8_cache_slots_hold_their_layers_scaled_entry_and_nothing_else_changes(engine, seed, layers, tokens, fmt,
                                                                                  scales, grouped):
    """An FP8 KV cache (uint8 storage), per-layer scales that differ: every mapped slot of layer l holds
    refmodel.quant.fp8_kv_entry([kv_c | k_pe], scale_l) byte for byte (vLLM's fp32 division, saturated,
    rounded to nearest even), skipped slots and every other byte keep theirs; so a layer's scale reaches
    only that layer. The grouped insert takes kv_scales [L], the per-layer one its layer's scale. An insert
    may refuse a format (it must then raise and write nothing)."""
    from k3num.refmodel import quant

    ops = _ops(engine, "insert_grouped" if grouped else "insert_per_layer")
    kv_c, k_pe, caches, before, slots, block_size = _fp8_cache_case(seed, layers, tokens)
    slots[:, seed % 3:: 3] = -1
    slots = slots.to(DEVICE)
    kv_scales = torch.tensor(scales[:layers], dtype=torch.float32, device=DEVICE)
    try:
        if grouped:
            ops.insert_grouped(kv_c, k_pe, caches, slots, fmt, kv_scales)
        else:
            for layer in range(layers):
                ops.insert_per_layer(kv_c[layer], k_pe[layer], caches[layer], slots[layer].contiguous(), fmt,
                                     kv_scales[layer:layer + 1])
    except (RuntimeError, ValueError, NotImplementedError) as e:  # a refused format
        for layer in range(layers):
            assert_bitwise(caches[layer], before[layer], f"layer {layer}'s cache after a refused {fmt} insert ({e})")
        return
    for layer in range(layers):
        want = before[layer].clone()
        s, keep = slots[layer], slots[layer] >= 0
        entries = quant.fp8_kv_entry(torch.cat([kv_c[layer], k_pe[layer]], -1), scales[layer], fmt)
        want[s[keep] // block_size, s[keep] % block_size] = entries[keep]
        assert_bitwise(caches[layer], want, f"layer {layer}'s {fmt} cache (scale {scales[layer]:g}, "
                                            f"{'grouped' if grouped else 'per-layer'} insert)")


@given(seed=seeds, layers=st.integers(1, 4), tokens=st.integers(1, 24), fmt=st.sampled_from(["fp8_e4m3", "fp8_e5m2"]),
       bad=st.sampled_from([0.0, -0.0, float("inf"), float("-inf"), float("nan")]), grouped=st.booleans())
def test_fp8_insert_with_a_zero_or_nonfinite_scale_refuses_or_poisons_visibly(engine, seed, layers, tokens, fmt, bad,
                                                                             grouped):
    """One layer's `_k_scale` is 0 or not finite (a checkpoint or a calibration gone wrong). x / scale is then
    inf, NaN or 0 for every element, and a saturating conversion turns that into +-max or 0: plausible-looking
    bytes. The insert must refuse (raise, and write nothing anywhere), or leave that layer's mapped slots
    visibly poisoned (every byte there an FP8 NaN). Silently saturated entries are a finding."""
    ops = _ops(engine, "insert_grouped" if grouped else "insert_per_layer")
    kv_c, k_pe, caches, before, slots, block_size = _fp8_cache_case(seed, layers, tokens)
    slots = slots.to(DEVICE)
    victim = seed % layers
    scales = [1.0 + 0.5 * i for i in range(layers)]
    scales[victim] = bad
    kv_scales = torch.tensor(scales, dtype=torch.float32, device=DEVICE)
    try:
        if grouped:
            ops.insert_grouped(kv_c, k_pe, caches, slots, fmt, kv_scales)
        else:  # the victim layer's own insert (each layer's is a call of its own)
            ops.insert_per_layer(kv_c[victim], k_pe[victim], caches[victim], slots[victim].contiguous(), fmt,
                                 kv_scales[victim:victim + 1])
    except (RuntimeError, ValueError) as e:  # refused: nothing the call could reach may have changed
        for layer in range(layers):
            assert_bitwise(caches[layer], before[layer], f"layer {layer}'s cache after a refused insert ({e})")
        return
    from k3num.refmodel import quant

    fp8 = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}[fmt]
    written = caches[victim][slots[victim] // block_size, slots[victim] % block_size]
    nan = torch.isnan(written.view(fp8).float())
    if bool(nan.all()):
        return
    # what the bytes are, said for the reader: a saturating conversion of x / scale or not (the ledger's bug
    # model computes its own from the observed call's inputs and bytes)
    x = torch.cat([kv_c[victim], k_pe[victim]], -1)
    ledger_run.observe(ledger_models.FP8_INSERT, (x, bad, fmt), written)
    sat = quant.fp8_quotient_bytes(x, bad, fmt)
    same = (written == sat) | (nan & torch.isnan(sat.view(fp8).float()))
    what = ("every byte is x / scale saturated (refmodel.quant.fp8_quotient_bytes)" if bool(same.all()) else
            f"{int((~same).sum())} of {same.numel()} bytes are not x / scale saturated")
    pytest.fail(f"layer {victim}'s scale {bad} was taken: {int((~nan).sum())} of {nan.numel()} bytes in its slots are "
                f"not NaN (e.g. {sorted(set(written[~nan].flatten()[:64].tolist()))[:8]}), written without a refusal; "
                f"{what}", pytrace=False)


# partial rotary (a tail of each head passed through), query heads beside the key heads, and the out buffers:
# the attention's call, where the context write rotates keys alone at the full rotary width
@given(seed=seeds, tokens=st.integers(1, 12), q_heads=st.integers(0, 3), k_heads=st.integers(1, 2),
       rotary=st.sampled_from([32, 64]), tail=st.sampled_from([0, 0, 8, 48, 64]), neox=st.booleans(),
       into_out=st.booleans(), max_pos=st.sampled_from([8, 4096]))
def test_rope_rotates_every_query_and_key_head_and_passes_the_tail_through(engine, seed, tokens, q_heads, k_heads,
                                                                          rotary, tail, neox, into_out, max_pos):
    """Each head's first R lanes are rotated at its token's position (fp32 math, one rounding: the rotary
    property's bound), lanes R..D-1 are copied bit for bit; with out buffers the inputs stay unchanged."""
    ops = _ops(engine, "rotary_qk")
    g = geometry.preset("k3-dspark-plain-rope")
    spec = dataclasses.replace(g.rope, rotary_dim=rotary, style="neox" if neox else "gptj")
    d = rotary + tail
    gen = torch.Generator().manual_seed(seed)
    q = (torch.randn(tokens, q_heads * d, generator=gen) * 2).to(LOW).to(DEVICE)
    k = (torch.randn(tokens, k_heads * d, generator=gen) * 2).to(LOW).to(DEVICE)
    pos = torch.randint(0, max_pos, (tokens,), generator=gen).to(DEVICE)
    cache = rope_cache(spec, max_pos, torch.float32, torch.device(DEVICE))
    q_in, k_in = q.clone(), k.clone()
    outs = (torch.full_like(q, float("nan")), torch.full_like(k, float("nan"))) if into_out else (None, None)
    got_q, got_k = ops.rotary_qk(pos, q, k, d, cache, neox, *outs)
    if into_out:
        assert_bitwise(q, q_in, "the query with q_out given (it must not be rotated in place)")
        assert_bitwise(k, k_in, "the key with k_out given (it must not be rotated in place)")
    for name, got, x, heads in (("query", got_q, q_in, q_heads), ("key", got_k, k_in, k_heads)):
        if heads == 0:
            continue
        got, x = got.view(tokens, heads, d), x.view(tokens, heads, d)
        assert_bitwise(got[..., rotary:], x[..., rotary:], f"the {name} heads' lanes {rotary}..{d - 1} (not rotated)")
        ref, scale = _rotated(up(x[..., :rotary]), cache.double()[pos][:, None, :], neox)
        u = budgets.unit_roundoff(LOW)
        _elementwise(engine, "rope_qk_rounded_once", "apply_rope", got[..., :rotary], ref, scale, u,
                     "|out-ref|<=u*(|ref|+(1+u)*2.5*u32/u*|pair|)", seed, 2,
                     f"{name};heads={heads};R={rotary};D={d};{'neox' if neox else 'gptj'};out={into_out}")
