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
