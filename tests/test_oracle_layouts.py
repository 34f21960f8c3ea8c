"""Exact contracts of the oracle's layout functions: presets, cache placement, transfer plans."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from k3num.fixtures.tensors import Draw
from k3num.oracles.metrics import assert_bitwise_equal
from k3num.refmodel import geometry, mla
from k3num.refmodel.transfer_plan import KVLayout, flat_plan, head_aware_plan


def test_k3_presets_carry_the_published_geometry() -> None:
    ds = geometry.preset("k3-dspark")
    assert isinstance(ds, geometry.MLADraftGeometry)
    assert (ds.hidden, ds.num_layers, ds.kv_width, ds.fused_qkv_a_width) == (7168, 5, 576, 2112)
    assert ds.rope.yarn is not None and ds.rope.yarn.factor == 32.0 and ds.rope.style == "gptj"
    plain = geometry.preset("k3-dspark-plain-rope")
    assert isinstance(plain, geometry.MLADraftGeometry) and plain.rope.yarn is None
    ar = geometry.preset("k3-attnres")
    assert isinstance(ar, geometry.AttnResGeometry)
    assert (ar.num_blocks, ar.max_sources) == (8, 9)
    df = geometry.preset("k3-dflash")
    assert isinstance(df, geometry.DFlashGeometry)
    assert (df.num_layers, df.num_kv_heads, df.head_dim, df.rope.style) == (6, 8, 128, "neox")
    assert df.fc_in_features == 6 * 7168


@pytest.mark.parametrize("full,tiny", [("k3-dspark", "tiny-dspark"), ("k3-attnres", "tiny-attnres"),
                                       ("k3-dflash", "tiny-dflash")])
def test_tiny_presets_share_the_structure_of_the_full_ones(full: str, tiny: str) -> None:
    assert type(geometry.preset(full)) is type(geometry.preset(tiny))


@given(seed=st.integers(0, 2**32 - 1), per_layer=st.booleans())
def test_cache_slot_lands_at_block_and_offset_and_nothing_else_changes(seed: int, per_layer: bool) -> None:
    d = Draw(seed)
    L, nb, bs, kvl, r, n = 2, 3, 4, 6, 4, 5
    caches = d.normal((L, nb, bs, kvl + r))
    kv_c, k_pe = d.normal((L, n, kvl)), d.normal((L, n, r))
    if per_layer:
        slots = torch.stack([d.permutation(nb * bs)[:n] for _ in range(L)])
        slots[:, 0] = -1
    else:
        slots = d.permutation(nb * bs)[:n]
        slots[-1] = -1
    out = mla.write_mla_cache(caches, kv_c, k_pe, slots)
    expected = caches.clone()
    sl = slots if per_layer else slots.expand(L, n)
    for layer in range(L):
        for t in range(n):
            s = int(sl[layer, t])
            if s >= 0:
                expected[layer, s // bs, s % bs] = torch.cat([kv_c[layer, t], k_pe[layer, t]])
    assert_bitwise_equal(out, expected, "cache after write")
    assert not torch.equal(out, caches), "something was written"


def test_write_mla_cache_does_not_modify_its_input() -> None:
    d = Draw(1)
    caches = d.normal((1, 2, 2, 3))
    before = caches.clone()
    mla.write_mla_cache(caches, d.normal((1, 2, 2)), d.normal((1, 2, 1)), torch.tensor([0, 3]))
    assert_bitwise_equal(caches, before, "caches after the call")


def _brief_layouts(layout: str = "head_major") -> tuple[KVLayout, KVLayout]:
    # BRIEF §3: P TP4 (2 heads a rank), D TP32 (1 head a rank), page 64, head_dim 128, bf16.
    src = KVLayout(4, 8, 128, 64, 2, tuple(10**6 * r for r in range(4)), layout)  # type: ignore[arg-type]
    dst = KVLayout(32, 8, 128, 64, 2, tuple(2_000_000 + 10**7 * r for r in range(32)), layout)  # type: ignore[arg-type]
    return src, dst


def test_transfer_plan_reproduces_the_briefs_addresses() -> None:
    src, dst = _brief_layouts()
    assert (src.page_bytes, dst.page_bytes) == (32768, 16384)
    right = [e for e in head_aware_plan(src, dst, [5], [2]) if e.dst_addr < 3_000_000]
    flat = [e for e in flat_plan(src, dst, [5], [2]) if e.dst_addr < 3_000_000]
    assert [(e.dst_addr, e.nbytes) for e in right] == [(2032768, 16384)]
    assert [(e.dst_addr, e.nbytes) for e in flat] == [(2065536, 32768)]


@pytest.mark.parametrize("layout", ["head_major", "token_major"])
@pytest.mark.parametrize("src_tp,dst_tp", [(4, 32), (32, 4), (2, 8), (8, 8), (1, 2)])
def test_head_aware_plan_fills_every_destination_byte_exactly_once(layout: str, src_tp: int, dst_tp: int) -> None:
    heads, hd, ps, b = 8, 4, 4, 2
    src = KVLayout(src_tp, heads, hd, ps, b, tuple(10**5 * r for r in range(src_tp)), layout)  # type: ignore[arg-type]
    dst = KVLayout(dst_tp, heads, hd, ps, b, tuple(10**8 + 10**5 * r for r in range(dst_tp)), layout)  # type: ignore[arg-type]
    src_pages, dst_pages = [3, 0], [1, 4]
    plan = head_aware_plan(src, dst, src_pages, dst_pages)
    written: dict[int, int] = {}
    for e in plan:
        for k in range(e.nbytes):
            assert e.dst_addr + k not in written, "a destination byte written twice"
            written[e.dst_addr + k] = e.src_addr + k
    # every destination byte of every (rank, page) is written, from the same head/token at the source
    for r in range(dst_tp):
        for sp, dp in zip(src_pages, dst_pages):
            for head in dst.heads_of(r):
                for tok in range(ps):
                    for k in range(src.item_bytes):
                        want = src.addr(src.owner_of(head), sp, tok, head) + k
                        assert written.pop(dst.addr(r, dp, tok, head) + k) == want
    assert not written, "bytes written outside the destination pages"


@given(seed=st.integers(0, 2**32 - 1), with_cache=st.booleans())
def test_precompute_context_kv_is_context_kv_then_write(seed: int, with_cache: bool) -> None:
    g = geometry.preset("tiny-dspark")
    assert isinstance(g, geometry.MLADraftGeometry)
    d = Draw(seed)
    n = 6
    x, w = d.normal((n, g.hidden)), d.normal((g.num_layers, g.kv_width, g.hidden))
    nw, pos = d.positive((g.num_layers, g.kv_lora_rank)), d.integers(0, 100, (n,))
    caches = d.normal((g.num_layers, 4, 4, g.kv_width)) if with_cache else None
    slots = d.permutation(16)[:n] - 2 if with_cache else None  # some slots negative
    kv_c, k_pe, new = mla.precompute_context_kv(x, w, nw, pos, g.rope, g.eps, caches, slots)
    want_c, want_pe = mla.context_kv(x, w, nw, pos, g.rope, g.eps)
    assert_bitwise_equal(kv_c, want_c, "kv_c")
    assert_bitwise_equal(k_pe, want_pe, "k_pe")
    if caches is None or slots is None:
        assert new is None, "no slot mapping: compute only"
    else:
        assert new is not None
        assert_bitwise_equal(new, mla.write_mla_cache(caches, want_c, want_pe, slots), "caches")
