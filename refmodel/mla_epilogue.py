"""The MLA layer's prefill epilogue in float64: RoPE on the query's and the key's rope dims, the full key
concatenated per head, the latent cache entry.

What vLLM's fused epilogue (vllm/models/kimi_k3/nvidia/ops/fused_mla_key_concat_kv_cache.py over
csrc/fused_kimi_k3_mla_key_concat_kv_cache_kernel.cu, the same in 0.33.0 and 0.34.0) computes for the prefill
tokens of an MLA layer, the DSpark draft's own layers among them (`MultiHeadLatentAttention`, vllm/models/kimi_k3/
nvidia/mla.py):

    q[t, h, P:]   <- rot(q[t, h, P:], t)                    (in place; the first P dims untouched)
    k[t, h]       =  [k_nope[t, h] | rot(k_pe[t], t)]       (every head the same rotated k_pe)
    cache[slot_t] =  [kv_c[t] | rot(k_pe[t], t)]            (slot_t < 0: not written)

and for a decode token (`decode_epilogue`, the same file's decode ops, right before the latent attention):

    mqa_q[t, h]   =  [ql_nope[t, h] | rot(q_pe[t, h], t)]    (the absorbed query's latent part and its rope part)
    cache[slot_t] =  [kv_c[t] | rot(k_pe[t], t)]            (the same entry the prefill epilogue writes)

with rot the GPT-J rotation of the pairs (2i, 2i+1) by the angle of pair i at the token's position, read from
the caller's cos/sin table (rows [cos | sin]); without a table (K3's NoPE target layers) rot is the identity.
The oracle rotates by the table's own values, so the table's rounding is the table's, not the epilogue's.
"""

from __future__ import annotations

import torch

from k3num.refmodel import checks


def rotate_pairs(x: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
    """x [T, *, R] float64, cos_sin [T, R] float64 (row t: [cos of the R/2 pairs | their sin]) -> x with every
    pair (2i, 2i+1) of token t rotated: (a cos_i - b sin_i, b cos_i + a sin_i). A new tensor of x's shape."""
    checks.float64("x", x)
    checks.float64("cos_sin", cos_sin)
    t, r = x.shape[0], x.shape[-1]
    if r % 2 or cos_sin.shape != (t, r):
        raise ValueError(f"cos_sin: expected shape [{t}, {r}] for x {list(x.shape)} (an even rope width), "
                         f"got {list(cos_sin.shape)}")
    view = (t,) + (1,) * (x.dim() - 2) + (r // 2,)
    c, s = cos_sin[:, : r // 2].reshape(view), cos_sin[:, r // 2:].reshape(view)
    a, b = x[..., 0::2], x[..., 1::2]
    return torch.stack([a * c - b * s, b * c + a * s], -1).flatten(-2)


def prefill_epilogue(q: torch.Tensor, k_nope: torch.Tensor, k_pe: torch.Tensor, kv_c: torch.Tensor,
                     cos_sin: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q [T, H, P + R], k_nope [T, H, P], k_pe [T, R], kv_c [T, C] float64; cos_sin [T, R] float64 (each token's
    table row) or None (no RoPE) -> (q_out [T, H, P + R], k [T, H, P + R], entry [T, C + R]) float64, new tensors:
    the query with its rope dims rotated, the full key of every head, the latent cache entry of every token."""
    for name, x, dims in (("q", q, 3), ("k_nope", k_nope, 3), ("k_pe", k_pe, 2), ("kv_c", kv_c, 2)):
        checks.float64(name, x)
        if x.dim() != dims:
            raise ValueError(f"{name}: expected {dims} dims, got shape {list(x.shape)}")
    t, h, p = k_nope.shape
    r = k_pe.shape[1]
    if q.shape != (t, h, p + r) or k_pe.shape[0] != t or kv_c.shape[0] != t:
        raise ValueError(f"shapes disagree: q {list(q.shape)}, k_nope {list(k_nope.shape)}, k_pe {list(k_pe.shape)}, "
                         f"kv_c {list(kv_c.shape)} (want q [T, H, P + R] with k_nope [T, H, P], k_pe [T, R])")
    pe = k_pe if cos_sin is None else rotate_pairs(k_pe, cos_sin)
    q_out = q.clone()
    if cos_sin is not None:
        q_out[..., p:] = rotate_pairs(q[..., p:], cos_sin)
    k = torch.cat([k_nope, pe[:, None, :].expand(t, h, r)], -1)
    return q_out, k, torch.cat([kv_c, pe], -1)


def decode_epilogue(ql_nope: torch.Tensor, q_pe: torch.Tensor, kv_c: torch.Tensor, k_pe: torch.Tensor,
                    cos_sin: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """ql_nope [T, H, C], q_pe [T, H, R], kv_c [T, C], k_pe [T, R] float64; cos_sin [T, R] float64 or None ->
    (mqa_q [T, H, C + R], entry [T, C + R]) float64, new tensors: every head's latent query with its rope part
    rotated, and the token's latent cache entry (the prefill epilogue's entry for the same token)."""
    for name, x, dims in (("ql_nope", ql_nope, 3), ("q_pe", q_pe, 3), ("kv_c", kv_c, 2), ("k_pe", k_pe, 2)):
        checks.float64(name, x)
        if x.dim() != dims:
            raise ValueError(f"{name}: expected {dims} dims, got shape {list(x.shape)}")
    t, h, _ = ql_nope.shape
    if q_pe.shape[:2] != (t, h) or kv_c.shape[0] != t or k_pe.shape[0] != t or q_pe.shape[2] != k_pe.shape[1]:
        raise ValueError(f"shapes disagree: ql_nope {list(ql_nope.shape)}, q_pe {list(q_pe.shape)}, kv_c "
                         f"{list(kv_c.shape)}, k_pe {list(k_pe.shape)} (want [T, H, C], [T, H, R], [T, C], [T, R])")
    q_rot = q_pe if cos_sin is None else rotate_pairs(q_pe, cos_sin)
    pe = k_pe if cos_sin is None else rotate_pairs(k_pe, cos_sin)
    return torch.cat([ql_nope, q_rot], -1), torch.cat([kv_c, pe], -1)
