"""harness/transfer_memory.py: a copy plan applied to the draft K/V's bytes, as `k3num impact --ledger` runs
K3N-013's transfer. The carrier is proven on refmodel's head-aware plan, which must hand the decode exactly
what the prefill wrote, for every TP pairing and page layout; a plan that copies one chunk too few, or one
head's bytes to another's address, is seen."""

from __future__ import annotations

import pytest
import torch

from k3num.harness import judges
from k3num.harness import transfer_memory as tm
from k3num.refmodel.transfer_plan import head_aware_plan
from k3num.supply import fetch

PAIRS = [(1, 1), (2, 8), (4, 8), (8, 8), (8, 4), (8, 2), (4, 1)]


def _kv(layers: int = 2, tokens: int = 7, heads: int = 8, head_dim: int = 16) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    return torch.randn(layers, tokens, heads, head_dim, generator=g).to(torch.bfloat16)


def _head_aware(t: tm.Transfer, kv: torch.Tensor) -> list[tuple[int, int, int]]:
    pages = -(-kv.shape[1] // t.page_size)
    case = tm._case(t, kv, pages, 0)
    blocks: list[tuple[int, int, int]] = []
    for layer in range(kv.shape[0]):
        src, dst = judges.transfer_layouts(case, layer)
        blocks += [tuple(e) for e in head_aware_plan(src, dst, list(case.src_pages), list(case.dst_pages))]
    return blocks


@pytest.mark.parametrize("layout", ["head_major", "token_major"])
@pytest.mark.parametrize("src_tp,dst_tp", PAIRS)
def test_the_head_aware_plan_carries_every_byte_to_the_decode_exactly(src_tp, dst_tp, layout) -> None:
    kv = _kv()
    t = tm.Transfer(src_tp, dst_tp, 4, layout)
    assert torch.equal(tm.carry(t, kv, _head_aware(t, kv)).view(torch.int16), kv.view(torch.int16))


def test_a_plan_one_chunk_short_or_with_swapped_heads_is_seen() -> None:
    kv = _kv()
    t = tm.Transfer(4, 8, 4)
    blocks = _head_aware(t, kv)
    short = tm.carry(t, kv, blocks[:-1])
    assert not torch.equal(short, kv) and (short == 0).any()  # the decode keeps a fresh cache's zeros there
    (s0, d0, n0), (s1, d1, n1) = blocks[0], blocks[1]
    assert n0 == n1
    swapped = tm.carry(t, kv, [(s1, d0, n0), (s0, d1, n1), *blocks[2:]])
    assert not torch.equal(swapped, kv)


def test_the_carrier_refuses_what_it_cannot_lay_out() -> None:
    kv = _kv(heads=4)
    with pytest.raises(ValueError, match="must not exceed the 4 KV heads"):
        tm.carry(tm.Transfer(4, 8, 4), kv, [])
    with pytest.raises(ValueError, match=r"expected \[L, N, KVH, D\] bfloat16"):
        tm.carry(tm.Transfer(4, 4, 4), kv.float(), [])


def test_sglangs_plan_carries_the_kv_exactly_at_one_tp_and_not_across_tp_sizes() -> None:
    """The released sender at equal attention TP is the identity (K3N-013's control); across TP sizes the
    decode reads other bytes than the prefill wrote (K3N-013)."""
    if fetch.missing_files("sglang"):
        pytest.skip("sglang is not fetched (k3num fetch sglang)")
    from k3num.engines import registry

    kv_transfer = registry.get("sglang").extras["kv_transfer"]
    kv = _kv()
    for same in (tm.Transfer(8, 8, 4), tm.Transfer(4, 4, 4)):
        assert torch.equal(tm.carry(same, kv, tm.plans(same, kv_transfer, kv)), kv)
    across = tm.Transfer(4, 8, 4)
    assert not torch.equal(tm.carry(across, kv, tm.plans(across, kv_transfer, kv)), kv)
