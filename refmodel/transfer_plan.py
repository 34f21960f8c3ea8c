"""Head-aware draft-KV transfer plan between a prefill (P) and a decode (D) layout.

Mirrors the byte arithmetic of prefill/decode disaggregation in SGLang
(`DFlashAttention` holds max(1, total_kv_heads // tp) KV heads per rank,
replicating heads when tp > total; seed 003 §4, BRIEF §3). A page of one
layer's K holds page_size tokens of the rank's heads; "head_major" lays a page
out [heads, page_size, head_dim], "token_major" [page_size, heads, head_dim].
The right plan moves, for every destination rank and head it holds, that
head's bytes from the source rank that owns it; the flat plan (the bug the
seed found) uses the source's page size for the destination offset and the
copy length.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, NamedTuple


class TransferEntry(NamedTuple):
    src_addr: int
    dst_addr: int
    nbytes: int


@dataclass(frozen=True)
class KVLayout:
    """One side's draft-KV layout for one layer's K (or V) buffer."""

    tp_size: int
    total_kv_heads: int
    head_dim: int
    page_size: int
    dtype_bytes: int
    base_addrs: tuple[int, ...]
    layout: Literal["head_major", "token_major"] = "head_major"

    def __post_init__(self) -> None:
        for name in ("tp_size", "total_kv_heads", "head_dim", "page_size", "dtype_bytes"):
            if getattr(self, name) <= 0:
                raise ValueError(f"KVLayout.{name}: expected > 0, got {getattr(self, name)}")
        tp, heads = self.tp_size, self.total_kv_heads
        if heads % tp and tp % heads:
            raise ValueError(
                f"KVLayout.tp_size: expected a divisor or multiple of total_kv_heads {heads}, got {tp}"
            )
        if len(self.base_addrs) != tp:
            raise ValueError(
                f"KVLayout.base_addrs: expected one address per rank ({tp}), got {len(self.base_addrs)}"
            )
        if self.layout not in ("head_major", "token_major"):
            raise ValueError(f"KVLayout.layout: expected 'head_major' or 'token_major', got {self.layout!r}")

    @property
    def heads_per_rank(self) -> int:
        return max(1, self.total_kv_heads // self.tp_size)

    @property
    def item_bytes(self) -> int:
        """One token of one head."""
        return self.head_dim * self.dtype_bytes

    @property
    def page_bytes(self) -> int:
        return self.page_size * self.heads_per_rank * self.item_bytes

    def heads_of(self, rank: int) -> range:
        """Global KV head ids held by `rank` (replicated when tp > heads)."""
        if self.tp_size <= self.total_kv_heads:
            return range(rank * self.heads_per_rank, (rank + 1) * self.heads_per_rank)
        head = rank * self.total_kv_heads // self.tp_size
        return range(head, head + 1)

    def owner_of(self, head: int) -> int:
        """The lowest rank holding `head`."""
        return next(r for r in range(self.tp_size) if head in self.heads_of(r))

    def addr(self, rank: int, page: int, token: int, head: int) -> int:
        """Byte address of (page, token, global head) on `rank`."""
        local = head - self.heads_of(rank).start
        if self.layout == "head_major":
            within = local * self.page_size + token
        else:
            within = token * self.heads_per_rank + local
        return self.base_addrs[rank] + page * self.page_bytes + within * self.item_bytes


def _check_pair(src: KVLayout, dst: KVLayout, src_pages: Sequence[int], dst_pages: Sequence[int]) -> None:
    for name in ("total_kv_heads", "head_dim", "page_size", "dtype_bytes"):
        if getattr(src, name) != getattr(dst, name):
            raise ValueError(
                f"dst.{name}: expected the source's {getattr(src, name)}, got {getattr(dst, name)}"
            )
    if len(src_pages) != len(dst_pages):
        raise ValueError(
            f"dst_pages: expected as many pages as src_pages ({len(src_pages)}), got {len(dst_pages)}"
        )
    for name, pages in (("src_pages", src_pages), ("dst_pages", dst_pages)):
        if any(p < 0 for p in pages):
            raise ValueError(f"{name}: expected page ids >= 0, got {list(pages)}")


def head_aware_plan(
    src: KVLayout, dst: KVLayout, src_pages: Sequence[int], dst_pages: Sequence[int]
) -> list[TransferEntry]:
    """Every destination rank's heads, page by page, from the source rank that owns each head.

    Contiguous runs (both addresses advancing together) are coalesced into one entry.
    """
    _check_pair(src, dst, src_pages, dst_pages)
    out: list[TransferEntry] = []
    item = src.item_bytes
    for d in range(dst.tp_size):
        for head in dst.heads_of(d):
            s = src.owner_of(head)
            for sp, dp in zip(src_pages, dst_pages):
                for token in range(src.page_size):
                    e = TransferEntry(src.addr(s, sp, token, head), dst.addr(d, dp, token, head), item)
                    last = out[-1] if out else None
                    if (
                        last
                        and last.src_addr + last.nbytes == e.src_addr
                        and last.dst_addr + last.nbytes == e.dst_addr
                    ):
                        out[-1] = TransferEntry(last.src_addr, last.dst_addr, last.nbytes + item)
                    else:
                        out.append(e)
    return out


def flat_plan(
    src: KVLayout, dst: KVLayout, src_pages: Sequence[int], dst_pages: Sequence[int]
) -> list[TransferEntry]:
    """The flat plan for comparison: source page size used for destination offset and length."""
    _check_pair(src, dst, src_pages, dst_pages)
    out = []
    for d in range(dst.tp_size):
        s = src.owner_of(dst.heads_of(d).start)
        for sp, dp in zip(src_pages, dst_pages):
            out.append(
                TransferEntry(
                    src.base_addrs[s] + sp * src.page_bytes,
                    dst.base_addrs[d] + dp * src.page_bytes,
                    src.page_bytes,
                )
            )
    return out
