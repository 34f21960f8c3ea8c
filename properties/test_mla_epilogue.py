"""The MLA layer's fused prefill epilogue: RoPE on the query's and the key's rope dims, the full key concatenated per
head, the latent cache insert, bf16 and fp8 (vLLM's fused_mla_key_concat_kv_cache ops, what the DSpark draft's own
MLA layers write their prefill tokens' cache with; refmodel/mla_epilogue.py is the float64 oracle).

An engine offers it as `extras["mla_epilogue"]` (engines.standins.MlaEpilogue's interface): the mirror's own
everywhere, vLLM's compiled epilogue where `k3num build-ops` built it (mode source-gpu+ops). Elsewhere it is
absent and these skip with the reason.

What is copied is checked bit for bit: the query's first P dims, the key's k_nope part, every head's copy of the
rotated k_pe (one value, H + 1 copies), the cache entry's kv_c part, every byte outside the mapped slots, and, with
an fp8 cache, every unrotated element against refmodel.quant.fp8_e4m3_times (the fp32 product, clamped, rounded to
nearest even). What is rotated is checked elementwise as "rounded once, to nearest": the fp32 rotation y of an
element v (the float64 rotation by the table's own cos/sin) errs by at most 2.5 u32 |pair| (two products and a
difference, |cos|, |sin| <= 1), and nearest rounding adds at most half the output format's spacing at |v|
(oracles.budgets.half_spacing), so |out - v| <= half_spacing(v) + 2.5 u32 |pair|; with an fp8 output the product
by the reciprocal scale s adds u32 |v| and scales the rotation's term by s. An intermediate rounding (the rotated
value stored as bf16 before it is quantized, say) reaches a neighbour the bound does not admit whenever v lies near
a midpoint of the output format: in a row of 64 rotated elements that is nearly every row.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from k3num.engines.mirror.context_kv import rope_cache
from k3num.fixtures.strategies import seeds
from k3num.oracles import budgets
from k3num.oracles.records import judge
from k3num.properties.support import DEVICE, LOW, assert_bitwise, report, up
from k3num.refmodel import geometry, mla_epilogue, quant

P, R, C, V = 128, 64, 512, 128  # K3's MLA: qk_nope_head_dim, qk_rope_head_dim, kv_lora_rank, v_head_dim
BLOCK = 16
SPEC = geometry.preset("k3-dspark-plain-rope").rope  # the draft's default GPT-J rope over 64 dims
E4M3 = torch.float8_e4m3fn
SUBJECT = "mla_epilogue"


def _epilogue(engine):
    """The engine's fused MLA epilogue, or a skip naming why."""
    ops = engine.extras.get("mla_epilogue")
    if ops is None:
        why = engine.missing.get("mla_epilogue") or engine.mode_note or "not bound"
        pytest.skip(f"engine {engine.name} {engine.version} ({engine.mode}) has no fused MLA epilogue here: {why}")
    return ops


def _case(seed: int, tokens: int, heads: int, rope: bool, max_pos: int, magnitude: float):
    """Inputs laid out as the layer hands them over: q [T, H, P + R]; k_nope [T, H, P] and v [T, H, V] strided
    halves of one kv_b_proj output; kv_c [T, C] contiguous (normed); k_pe [T, R] a strided view of the kv_a output;
    positions [T]; the fp32 table [max_pos, R] or None; slots [T] on DEVICE (every third skipped, -1)."""
    gen = torch.Generator().manual_seed(seed)
    q = (torch.randn(tokens, heads, P + R, generator=gen) * magnitude).to(LOW).to(DEVICE)
    kv_b = (torch.randn(tokens, heads, P + V, generator=gen) * magnitude).to(LOW).to(DEVICE)
    kv_a = (torch.randn(tokens, C + R, generator=gen) * magnitude).to(LOW).to(DEVICE)
    positions = torch.randint(0, max_pos, (tokens,), generator=gen).to(DEVICE)
    num_blocks = -(-2 * tokens // BLOCK)
    slots = torch.randperm(num_blocks * BLOCK, generator=gen)[:tokens]
    slots[seed % 3:: 3] = -1
    table = rope_cache(SPEC, max_pos, torch.float32, torch.device(DEVICE)) if rope else None
    return (q, kv_b[..., :P], kv_a[:, :C].contiguous(), kv_a[:, C:], kv_b[..., P:], positions, table,
            slots.to(DEVICE), num_blocks, gen)


def _rows(table: torch.Tensor | None, positions: torch.Tensor) -> torch.Tensor | None:
    return None if table is None else table.double()[positions]


def _pair_norm(x: torch.Tensor) -> torch.Tensor:
    """|pair| of every element of x [..., R] (float64): sqrt(a^2 + b^2) of its pair (2i, 2i+1), on both."""
    a, b = x[..., 0::2], x[..., 1::2]
    n = torch.sqrt(a * a + b * b)
    return torch.stack([n, n], -1).flatten(-2)


def _nearest(engine, prop: str, what: str, out: torch.Tensor, v: torch.Tensor, slack: torch.Tensor,
             fmt: torch.dtype, seed: int, detail: str) -> None:
    """Judge |out - v| <= half_spacing(v, fmt) + slack elementwise (out decoded to float64)."""
    allowed = budgets.half_spacing(v, fmt) + slack
    report(judge(property=prop, engine=engine, subject=SUBJECT, actual=up(out.float()) / allowed,
                 reference=v / allowed, budget=budgets.Budget(1.0, "elementwise |out-ref|<=half_spacing(ref)+fp32 "
                                                                     "slack (rounded once, to nearest)"),
                 seed=seed, reduction_len=2, detail=f"{what};{detail}"))


def _written_rows(cache: torch.Tensor, before: torch.Tensor, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(the rows the mapped slots hold now, which tokens were mapped), after asserting that nothing else in the
    cache changed (skipped slots and every other byte keep their bits)."""
    keep = slots >= 0
    where = (slots[keep] // BLOCK, slots[keep] % BLOCK)
    written = cache[where]
    expected = before.clone()
    expected[where] = written
    assert_bitwise(cache, expected, "the cache outside the mapped slots (skipped slots and every other byte)")
    return written, keep


@given(seed=seeds, tokens=st.integers(1, 40), heads=st.integers(1, 8), rope=st.booleans(),
       max_pos=st.sampled_from([8, 4096, 32768]))
def test_bf16_epilogue_copies_what_it_does_not_rotate_and_rotates_rounded_once_to_nearest(engine, seed, tokens,
                                                                                           heads, rope, max_pos):
    """The bf16 epilogue: q's first P dims kept, its rope dims rotated in place; k = [k_nope | rot(k_pe)] for
    every head; slot t of the cache = [kv_c | rot(k_pe)] (the same rotated bits as the key), skipped slots and
    every other byte kept. Without a table nothing rotates and everything is a copy."""
    ops = _epilogue(engine)
    q, k_nope, kv_c, k_pe, _, positions, table, slots, num_blocks, gen = _case(seed, tokens, heads, rope, max_pos,
                                                                                2.0)
    cache = torch.randn(num_blocks, BLOCK, C + R, generator=gen).to(LOW).to(DEVICE)
    q_before, cache_before = q.clone(), cache.clone()
    k = ops.insert(q, k_nope, k_pe, kv_c, cache, slots, positions if rope else None, table)
    q_ref, k_ref, _ = mla_epilogue.prefill_epilogue(up(q_before), up(k_nope), up(k_pe), up(kv_c),
                                                    _rows(table, positions))
    assert k.shape == (tokens, heads, P + R) and k.dtype == LOW, f"the key: {k.dtype} {list(k.shape)}"
    assert_bitwise(q[..., :P], q_before[..., :P], "the query's first P dims (not rotated)")
    assert_bitwise(k[..., :P], k_nope.contiguous(), "the key's k_nope part")
    assert_bitwise(k[..., P:], k[:, :1, P:].expand(tokens, heads, R).contiguous(), "every head's rotated k_pe")
    expected = cache_before.clone()
    keep = slots >= 0
    expected[slots[keep] // BLOCK, slots[keep] % BLOCK] = torch.cat([kv_c, k[:, 0, P:]], -1)[keep]
    assert_bitwise(cache, expected, "the cache: mapped slots [kv_c | the key's rotated k_pe], every other byte kept")
    detail = f"bf16;rope={rope};T={tokens};H={heads};max_pos={max_pos}"
    if not rope:
        assert_bitwise(q, q_before, "the query without a table")
        assert_bitwise(k[:, 0, P:], k_pe.contiguous(), "the key's k_pe without a table")
        return
    u32 = budgets.U32
    _nearest(engine, "mla_epilogue_bf16_rounded_once", "k_pe", k[:, 0, P:], k_ref[:, 0, P:],
             2.5 * u32 * _pair_norm(up(k_pe)), LOW, seed, detail)
    _nearest(engine, "mla_epilogue_bf16_rounded_once", "q_pe", q[..., P:], q_ref[..., P:],
             2.5 * u32 * _pair_norm(up(q_before[..., P:])), LOW, seed, detail)


@given(seed=seeds, tokens=st.integers(1, 32), heads=st.integers(1, 8), rope=st.booleans(),
       max_pos=st.sampled_from([8, 4096, 32768]),
       scales=st.lists(st.floats(0.0625, 8.0, allow_nan=False, width=32), min_size=4, max_size=4, unique=True))
def test_fp8_epilogue_quantizes_q_k_v_and_the_cache_each_with_its_own_scale(engine, seed, tokens, heads, rope,
                                                                             max_pos, scales):
    """The fp8 epilogue: q8 = E4M3([q_nope | rot(q_pe)] / q_scale), k8 = E4M3([k_nope | rot(k_pe)] / k_scale) per
    head, v8 = E4M3(v / v_scale), slot t of the uint8 cache = E4M3([kv_c | rot(k_pe)] / cache_scale), each by its
    own reciprocal scale (distinct here, so a swapped one is seen), clamped to +-448, rounded to nearest even; the
    unrotated elements exactly so, the rotated ones rounded once to nearest; q is not written; skipped slots and
    every other byte of the cache kept."""
    ops = _epilogue(engine)
    q, k_nope, kv_c, k_pe, v, positions, table, slots, num_blocks, gen = _case(seed, tokens, heads, rope, max_pos,
                                                                                8.0)
    cache = torch.randint(0, 256, (num_blocks, BLOCK, C + R), generator=gen, dtype=torch.uint8).to(DEVICE)
    q_before, cache_before = q.clone(), cache.clone()
    inv = [torch.tensor([1.0 / s], dtype=torch.float32) for s in scales]  # q, k, v, cache: fp32 [1] each
    q8, k8, v8 = ops.insert_fp8(q, k_nope, k_pe, kv_c, v, cache, slots, *(i.to(DEVICE) for i in inv),
                                positions if rope else None, table)
    qs, ks, vs, cs = (float(i) for i in inv)
    assert_bitwise(q, q_before, "the bf16 query (the fp8 epilogue writes q8, not q)")
    for name, got, shape in (("q8", q8, (tokens, heads, P + R)), ("k8", k8, (tokens, heads, P + R)),
                             ("v8", v8, (tokens, heads, V))):
        assert got.dtype == E4M3 and got.shape == shape, f"{name}: {got.dtype} {list(got.shape)}, want {list(shape)}"
    b = lambda t: t.view(torch.uint8)  # noqa: E731  (bytes of an fp8 tensor)
    assert_bitwise(b(v8), quant.fp8_e4m3_times(v, vs), "v8 (v times 1/v_scale)")
    assert_bitwise(b(q8[..., :P]), quant.fp8_e4m3_times(q[..., :P], qs), "q8's first P dims (times 1/q_scale)")
    assert_bitwise(b(k8[..., :P]), quant.fp8_e4m3_times(k_nope, ks), "k8's k_nope part (times 1/k_scale)")
    assert_bitwise(b(k8[..., P:]), b(k8[:, :1, P:]).expand(tokens, heads, R).contiguous(), "every head's k8 rope part")
    written, keep = _written_rows(cache, cache_before, slots)
    assert_bitwise(written[:, :C], quant.fp8_e4m3_times(kv_c[keep], cs), "the cache's kv_c part (times 1/cache_scale)")
    detail = f"fp8;rope={rope};T={tokens};H={heads};max_pos={max_pos}"
    if not rope:
        assert_bitwise(b(q8[..., P:]), quant.fp8_e4m3_times(q[..., P:], qs), "q8's rope dims without a table")
        assert_bitwise(b(k8[:, 0, P:]), quant.fp8_e4m3_times(k_pe, ks), "k8's k_pe without a table")
        assert_bitwise(written[:, C:], quant.fp8_e4m3_times(k_pe[keep], cs), "the cache's k_pe without a table")
        return
    q_ref, k_ref, entry = mla_epilogue.prefill_epilogue(up(q), up(k_nope), up(k_pe), up(kv_c),
                                                        _rows(table, positions))
    big = torch.finfo(E4M3).max
    u32 = budgets.U32
    for what, got, rot, src, s in (("q_pe", q8[..., P:], q_ref[..., P:], up(q[..., P:]), qs),
                                   ("k_pe", k8[:, 0, P:], k_ref[:, 0, P:], up(k_pe), ks),
                                   ("cache k_pe", written[:, C:].view(E4M3), entry[keep][:, C:], up(k_pe[keep]), cs)):
        v_ref = (rot * s).clamp(-big, big)
        slack = 2.5 * u32 * (1 + u32) * s * _pair_norm(src) + u32 * v_ref.abs()
        _nearest(engine, "mla_epilogue_fp8_rounded_once", what, got, v_ref, slack, E4M3, seed, detail)


def _decode_case(seed: int, tokens: int, heads: int, rope: bool, max_pos: int, fp8: bool):
    """A decode step's inputs as the layer hands them over: ql_nope [T, H, C] the BMM's [H, T, C] output seen
    token-major (strided), q_pe [T, H, R] a strided view of the query, kv_c [T, C] contiguous, k_pe [T, R] a
    strided view; positions; the table or None; slots (every third -1); the cache (bf16 noise, or random bytes)."""
    gen = torch.Generator().manual_seed(seed)
    ql_nope = (torch.randn(heads, tokens, C, generator=gen) * 4).to(LOW).to(DEVICE).transpose(0, 1)
    q = (torch.randn(tokens, heads, P + R, generator=gen) * 4).to(LOW).to(DEVICE)
    kv_a = (torch.randn(tokens, C + R, generator=gen) * 4).to(LOW).to(DEVICE)
    positions = torch.randint(0, max_pos, (tokens,), generator=gen).to(DEVICE)
    num_blocks = -(-2 * tokens // BLOCK)
    slots = torch.randperm(num_blocks * BLOCK, generator=gen)[:tokens]
    slots[seed % 3:: 3] = -1
    table = rope_cache(SPEC, max_pos, torch.float32, torch.device(DEVICE)) if rope else None
    if fp8:
        cache = torch.randint(0, 256, (num_blocks, BLOCK, C + R), generator=gen, dtype=torch.uint8).to(DEVICE)
    else:
        cache = torch.randn(num_blocks, BLOCK, C + R, generator=gen).to(LOW).to(DEVICE)
    return ql_nope, q[..., P:], kv_a[:, :C].contiguous(), kv_a[:, C:], positions, table, slots.to(DEVICE), cache


def _rotated_part(engine, prop: str, what: str, got: torch.Tensor, rot: torch.Tensor, src: torch.Tensor,
                  scale: float | None, seed: int, detail: str) -> None:
    """A rotated part judged rounded once to nearest: bf16 (scale None) or E4M3 after the product by `scale`."""
    u32 = budgets.U32
    if scale is None:
        _nearest(engine, prop, what, got, rot, 2.5 * u32 * _pair_norm(src), LOW, seed, detail)
        return
    big = torch.finfo(E4M3).max
    v_ref = (rot * scale).clamp(-big, big)
    slack = 2.5 * u32 * (1 + u32) * scale * _pair_norm(src) + u32 * v_ref.abs()
    _nearest(engine, prop, what, got.view(E4M3), v_ref, slack, E4M3, seed, detail)


# up to 64 tokens the decode kernel splits each 576-wide row over three warps, beyond it one warp a row: both drawn
@given(seed=seeds, tokens=st.one_of(st.integers(1, 64), st.integers(65, 96)), heads=st.integers(1, 8),
       rope=st.booleans(), fp8=st.booleans(), max_pos=st.sampled_from([8, 4096, 32768]),
       scales=st.lists(st.floats(0.0625, 8.0, allow_nan=False, width=32), min_size=2, max_size=2, unique=True))
def test_decode_epilogue_concats_the_latent_query_and_inserts_the_entry_rounded_once(engine, seed, tokens, heads, rope,
                                                                                     fp8, max_pos, scales):
    """The decode epilogue: mqa_q[t, h] = [ql_nope | rot(q_pe)] (bf16, or E4M3 times 1/q_scale), slot t of the
    cache = [kv_c | rot(k_pe)] (bf16, or E4M3 times 1/cache_scale): the unrotated parts exactly, the rotated ones
    rounded once to nearest; skipped slots and every other byte of the cache kept."""
    ops = _epilogue(engine)
    ql_nope, q_pe, kv_c, k_pe, positions, table, slots, cache = _decode_case(seed, tokens, heads, rope, max_pos, fp8)
    before = cache.clone()
    inv = [torch.tensor([1.0 / s], dtype=torch.float32) for s in scales] if fp8 else [None, None]
    mqa = ops.decode(ql_nope, q_pe, kv_c, k_pe, cache, slots, *(None if i is None else i.to(DEVICE) for i in inv),
                     positions if rope else None, table)
    qs, cs = (None, None) if not fp8 else (float(inv[0]), float(inv[1]))
    want_dtype = E4M3 if fp8 else LOW
    assert mqa.dtype == want_dtype and mqa.shape == (tokens, heads, C + R), f"mqa_q: {mqa.dtype} {list(mqa.shape)}"
    written, keep = _written_rows(cache, before, slots)
    if fp8:
        assert_bitwise(mqa[..., :C].view(torch.uint8), quant.fp8_e4m3_times(ql_nope, qs), "mqa_q's latent part")
        assert_bitwise(written[:, :C], quant.fp8_e4m3_times(kv_c[keep], cs), "the cache's kv_c part")
    else:
        assert_bitwise(mqa[..., :C], ql_nope.contiguous(), "mqa_q's latent part")
        assert_bitwise(written[:, :C], kv_c[keep], "the cache's kv_c part")
    if not rope:
        if fp8:
            assert_bitwise(mqa[..., C:].view(torch.uint8), quant.fp8_e4m3_times(q_pe, qs), "mqa_q's rope part")
            assert_bitwise(written[:, C:], quant.fp8_e4m3_times(k_pe[keep], cs), "the cache's k_pe")
        else:
            assert_bitwise(mqa[..., C:], q_pe.contiguous(), "mqa_q's rope part without a table")
            assert_bitwise(written[:, C:], k_pe[keep], "the cache's k_pe without a table")
        return
    q_ref, entry = mla_epilogue.decode_epilogue(up(ql_nope), up(q_pe), up(kv_c), up(k_pe), _rows(table, positions))
    detail = f"decode;{'fp8' if fp8 else 'bf16'};T={tokens};H={heads};max_pos={max_pos}"
    prop = "mla_decode_epilogue_rounded_once"
    _rotated_part(engine, prop, "q_pe", mqa[..., C:], q_ref[..., C:], up(q_pe), qs, seed, detail)
    _rotated_part(engine, prop, "cache k_pe", written[:, C:], entry[keep][:, C:], up(k_pe[keep]), cs, seed, detail)


@given(seed=seeds, tokens=st.one_of(st.integers(1, 64), st.integers(65, 96)), rope=st.booleans(), fp8=st.booleans(),
       scale=st.floats(0.0625, 8.0, allow_nan=False, width=32))
def test_a_tokens_cache_entry_is_the_same_whether_its_prefill_or_its_decode_wrote_it(engine, seed, tokens, rope, fp8,
                                                                                   scale):
    """The same token (kv_c, k_pe, position, slot) written by the prefill insert and by the decode insert into two
    copies of one cache: the same bytes everywhere, so what a later step reads does not depend on which of the two
    wrote the token (bf16, and fp8 at one cache scale)."""
    ops = _epilogue(engine)
    ql_nope, q_pe, kv_c, k_pe, positions, table, slots, cache = _decode_case(seed, tokens, 1, rope, 4096, fp8)
    by_prefill, by_decode = cache.clone(), cache.clone()
    pos = positions if rope else None
    gen = torch.Generator().manual_seed(seed + 1)
    q = torch.randn(tokens, 1, P + R, generator=gen).to(LOW).to(DEVICE)
    k_nope = torch.randn(tokens, 1, P, generator=gen).to(LOW).to(DEVICE)
    inv = torch.tensor([1.0 / scale], dtype=torch.float32, device=DEVICE)
    if fp8:
        v = torch.randn(tokens, 1, V, generator=gen).to(LOW).to(DEVICE)
        ops.insert_fp8(q, k_nope, k_pe, kv_c, v, by_prefill, slots, inv, inv, inv, inv, pos, table)
        ops.decode(ql_nope, q_pe, kv_c, k_pe, by_decode, slots, inv, inv, pos, table)
    else:
        ops.insert(q, k_nope, k_pe, kv_c, by_prefill, slots, pos, table)
        ops.decode(ql_nope, q_pe, kv_c, k_pe, by_decode, slots, None, None, pos, table)
    assert_bitwise(by_decode, by_prefill, f"the {'fp8' if fp8 else 'bf16'} cache written by decode against prefill "
                                          f"(rope={rope})")
