"""Mirror of prefill/decode transfer-entry pairing by layer id (SGLang `build_transfer_entry_pairs`).

Our own statement of the contract (BRIEF §3): with layer ids on both peers, pair
the i-th source entry with the next unused destination entry of the same layer
id (ids repeat across tensor groups, e.g. K and V); a missing id or metadata
whose length does not match the entries is an error; without ids, pair
positionally only when both sides have the same number of entries (or the
caller allows a fallback and the destination has at least as many).
"""

from __future__ import annotations

from collections import deque


def build_transfer_entry_pairs(src_layer_ids: list[int], dst_layer_ids: list[int], n_src: int, n_dst: int,
                               allow_positional_fallback: bool = False) -> list[tuple[int, int]]:
    if n_src == 0:
        return []
    if bool(src_layer_ids) != bool(dst_layer_ids):
        if not allow_positional_fallback:
            raise RuntimeError("layer ids on one peer only")
        src_layer_ids, dst_layer_ids = [], []
    if src_layer_ids:
        if len(src_layer_ids) != n_src or len(dst_layer_ids) != n_dst:
            raise RuntimeError("layer id lists do not match the entry counts")
        free: dict[int, deque[int]] = {}
        for j, lid in enumerate(dst_layer_ids):
            free.setdefault(lid, deque()).append(j)
        pairs = []
        for i, lid in enumerate(src_layer_ids):
            if not free.get(lid):
                raise RuntimeError(f"destination has no entry left for layer {lid}")
            pairs.append((i, free[lid].popleft()))
        return pairs
    if n_dst < n_src or (n_src != n_dst and not allow_positional_fallback):
        raise RuntimeError("positional pairing across PP-heterogeneous peers")
    return [(i, i) for i in range(n_src)]


class KVSender:
    """Our statement of a prefill rank's draft-KV send to one decode rank, on the interface SGLang's
    KV path has (per-entry pointers and item lengths, page indices, layer ids; no head layout): pair
    the entries (build_transfer_entry_pairs), refuse when a paired entry's decode item length differs
    from the prefill's (the pages then hold other heads: no flat copy is right, and the interface
    cannot reslice), else copy each run of contiguous pages with one block."""

    def __init__(self, *, pp_size: int = 1, is_mla: bool = True, prefill_start_layer: int = 0) -> None:
        self.pp_size, self.start = pp_size, prefill_start_layer

    def send(self, kv_ptrs, item_lens, layer_ids, dst_ptrs, dst_layer_ids, src_pages, dst_pages, *,
             dst_kv_item_len, dst_item_lens=None):
        from k3num.engines.sglang_adapter.transfer import Sent

        if layer_ids or dst_layer_ids:
            pairs = build_transfer_entry_pairs(list(layer_ids or []), list(dst_layer_ids or []), len(kv_ptrs),
                                               len(dst_ptrs), allow_positional_fallback=self.pp_size == 1)
        else:
            pairs = [(i, self.start + i) for i in range(len(kv_ptrs))]
        lens = list(dst_item_lens) if dst_item_lens is not None else [dst_kv_item_len] * len(dst_ptrs)
        for i, j in pairs:
            if lens[j] != item_lens[i]:
                return Sent(-1, [], f"entry {i}: decode item length {lens[j]} is not the prefill's {item_lens[i]}")
        runs, blocks = [], []
        for p, q in zip(src_pages, dst_pages):
            if runs and runs[-1][0] + runs[-1][2] == p and runs[-1][1] + runs[-1][2] == q:
                runs[-1][2] += 1
            else:
                runs.append([p, q, 1])
        for i, j in pairs:
            n = item_lens[i]
            blocks += [(kv_ptrs[i] + p * n, dst_ptrs[j] + q * n, k * n) for p, q, k in runs]
        return Sent(0, blocks, "")


def kv_route(is_mla: bool, is_hybrid_mla: bool, attn_tp_size: int, dst_attn_tp_size: int, *,
             enable_staging: bool = False, staging: bool = False) -> str:
    """Which KV path a backend and TP pair takes (the worker's rule, as we state it)."""
    if is_mla or is_hybrid_mla or attn_tp_size == dst_attn_tp_size:
        return "send_kvcache"
    return "staging" if enable_staging and staging else "send_kvcache_slice"
