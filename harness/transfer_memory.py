"""The draft K/V as a decode reads it after a prefill/decode transfer: an engine's copy plan applied to bytes.

`properties/test_kv_transfer.py` judges a sender's plan by its addresses. This module runs the plan: the
prefill's paged draft K/V caches are laid out in byte buffers at the synthetic addresses the property uses
(`judges.transfer_buffer`, `refmodel.transfer_plan.KVLayout`), every decode rank's sender plans its copies
with the engine's released code (`extras["kv_transfer"]`, SGLang's Mooncake sender lifted), the copies are
made byte for byte, and the decode's caches are read back as K/V. A decode byte no copy writes keeps the
value of a fresh cache: zero. The V buffers are copied by the same plan as the K buffers (one plan per
layer buffer; the sender plans K and V of a layer alike).

Shapes: k, v [L, N, KVH, D] (L draft layers, N context tokens, KVH KV heads, D head_dim), bf16. Token n of
the context sits in page `src_pages[n // page_size]` at slot `n % page_size` on the prefill and in
`dst_pages[n // page_size]` on the decode. The decode's TP is at most KVH, so each head has one decode rank.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from k3num.fixtures.strategies import KVTransferCase
from k3num.harness import judges

_BASE = {"src": 1_000_000, "dst": 2_000_000}  # judges.transfer_buffer's bases
_LAYERS_PER_RANK = 8  # judges.transfer_buffer spaces (rank, layer) buffers as rank * 8 + layer


class TransferRefused(RuntimeError):
    """The sender concluded the transfer with a failure: the decode gets nothing to draft from."""


@dataclass(frozen=True)
class Transfer:
    """One prefill/decode pairing of the draft K/V: TP sizes, page size and layout, the pages used."""

    src_tp: int
    dst_tp: int
    page_size: int
    layout: str = "head_major"
    page_offset: int = 2  # decode page = prefill page + this (seed 003: page 0 -> page 2)

    def label(self) -> str:
        return f"P TP{self.src_tp} -> D TP{self.dst_tp}, page {self.page_size} {self.layout}"


class _Memory:
    """Byte buffers per (side, rank, layer), grown on demand; an address resolves to its buffer."""

    def __init__(self) -> None:
        self.buffers: dict[tuple[str, int, int], np.ndarray] = {}

    def _at(self, side: str, addr: int, n: int) -> tuple[np.ndarray, int]:
        idx, off = divmod(addr - _BASE[side], judges.TRANSFER_SPAN)
        if idx < 0 or off + n > judges.TRANSFER_SPAN:
            raise ValueError(f"{side} address {addr} (+{n}) is outside every {side} buffer")
        rank, layer = divmod(idx, _LAYERS_PER_RANK)
        key = (side, rank, layer)
        buf = self.buffers.get(key, np.zeros(0, np.uint8))
        if buf.size < off + n:
            buf = np.concatenate([buf, np.zeros(off + n - buf.size, np.uint8)])
            self.buffers[key] = buf
        return buf, off

    def write(self, side: str, addr: int, data: np.ndarray) -> None:
        buf, off = self._at(side, addr, data.size)
        buf[off:off + data.size] = data

    def read(self, side: str, addr: int, n: int) -> np.ndarray:
        buf, off = self._at(side, addr, n)
        return buf[off:off + n].copy()


def _case(t: Transfer, kv: torch.Tensor, pages: int, dst_rank: int) -> KVTransferCase:
    layers, _, heads, head_dim = kv.shape
    return KVTransferCase(heads=heads, src_tp=t.src_tp, dst_tp=t.dst_tp, head_dim=head_dim, page_size=t.page_size,
                          layout=t.layout, layers=layers, stage=tuple(range(layers)), publish_ids=True,
                          publish_lens=False, src_pages=tuple(range(pages)),
                          dst_pages=tuple(p + t.page_offset for p in range(pages)), dst_rank=dst_rank)


def plans(t: Transfer, kv_transfer: Any, kv: torch.Tensor) -> list[tuple[int, int, int]]:
    """Every decode rank's copies as its sender plans them (the released code; publish_lens off, as the
    worker's send_kvcache calls it). TransferRefused when a sender concludes with a failure."""
    layers, n = kv.shape[0], kv.shape[1]
    pages = -(-n // t.page_size)
    blocks: list[tuple[int, int, int]] = []
    for d in range(t.dst_tp):
        case = _case(t, kv, pages, d)
        s = judges.transfer_sender(case)
        src, dst = judges.transfer_layouts(case, 0)
        manager = kv_transfer.manager(pp_size=1, is_mla=True, prefill_start_layer=0)
        sent = manager.send([judges.transfer_buffer("src", s, layer) for layer in range(layers)],
                            [src.page_bytes] * layers, list(range(layers)),
                            [judges.transfer_buffer("dst", d, layer) for layer in range(layers)],
                            list(range(layers)), list(case.src_pages), list(case.dst_pages),
                            dst_kv_item_len=dst.page_bytes, dst_item_lens=None)
        if sent.ret != 0:
            raise TransferRefused(f"{t.label()}: decode rank {d}'s sender refused ({sent.failure})")
        blocks += sent.blocks
    return blocks


def carry(t: Transfer, kv: torch.Tensor, blocks: list[tuple[int, int, int]]) -> torch.Tensor:
    """kv [L, N, KVH, D] bf16 written into the prefill's paged caches, `blocks` copied, the decode's caches read
    back -> [L, N, KVH, D] bf16 as the decode ranks hold it."""
    if kv.dtype != torch.bfloat16 or kv.dim() != 4:
        raise ValueError(f"kv: expected [L, N, KVH, D] bfloat16, got {tuple(kv.shape)} {kv.dtype}")
    layers, n, heads, head_dim = kv.shape
    if t.dst_tp > heads:
        raise ValueError(f"{t.label()}: the decode's TP must not exceed the {heads} KV heads (one rank a head)")
    pages = -(-n // t.page_size)
    mem = _Memory()
    case = _case(t, kv, pages, 0)
    item = head_dim * judges.TRANSFER_DTYPE_BYTES
    host = kv.detach().cpu().contiguous().view(torch.int16).numpy().view(np.uint8)  # [L, N, KVH, 2 * D], one copy
    for layer in range(layers):
        src, _ = judges.transfer_layouts(case, layer)
        for r in range(t.src_tp):
            for h in src.heads_of(r):
                for tok in range(n):
                    page, slot = divmod(tok, t.page_size)
                    mem.write("src", src.addr(r, case.src_pages[page], slot, h), host[layer, tok, h])
    for s, d, length in blocks:
        mem.write("dst", d, mem.read("src", s, length))
    out = torch.empty(layers, n, heads, head_dim, dtype=torch.int16)
    for layer in range(layers):
        _, dst = judges.transfer_layouts(case, layer)
        for h in range(heads):
            r = dst.owner_of(h)
            for tok in range(n):
                page, slot = divmod(tok, t.page_size)
                raw = mem.read("dst", dst.addr(r, case.dst_pages[page], slot, h), item)
                out[layer, tok, h] = torch.from_numpy(raw.view(np.int16).copy())
    return out.view(torch.bfloat16).to(kv.device)


def transferred(t: Transfer, kv_transfer: Any, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(k, v) [L, N, KVH, D] bf16 -> (k, v) as the decode reads them after the engine's transfer."""
    blocks = plans(t, kv_transfer, k)
    return carry(t, k, blocks), carry(t, v, blocks)
