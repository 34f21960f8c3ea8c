"""The draft step's remainder in bf16 eager PyTorch: one declared implementation, the same for every engine.

What follows the K3 paths in a draft forward (the draft layers' attention over the context and the block,
the MLP, the final norm and the LM head) is not K3 code: every engine runs its own generic attention and
GEMMs there. To see what a K3 path's numerics do to the proposed tokens, and nothing else, the harness
runs one remainder for all engines: this one, in the storage dtype as a serving engine would (bf16
GEMMs accumulating in fp32, each output rounded to bf16; norms and softmax in fp32, rounded once), fed
with the engine's path outputs. refmodel/draft_step.py is its float64 counterpart, with the same structure
and shapes (read its docstring for what each part mirrors).
"""

from __future__ import annotations

import math

import torch

from k3num.engines.mirror import markov
from k3num.engines.mirror.context_kv import rotary, shared_rope_cache
from k3num.refmodel.draft_step import DraftStepGeometry, DraftWeights
from k3num.refmodel.rope import softmax_scale_factor


def _norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps) * w.float()).to(x.dtype)


def _table(block_positions: torch.Tensor, g: DraftStepGeometry) -> torch.Tensor:
    """The step's fp32 [cos | sin] table, up to its last block position (every rotation in the step is of the
    block's positions): read once per step, as the engines build theirs once."""
    return shared_rope_cache(g.rope, int(block_positions.max()) + 1, torch.float32, block_positions.device)


def _rope(x: torch.Tensor, positions: torch.Tensor, cache: torch.Tensor, g: DraftStepGeometry) -> torch.Tensor:
    """x [M, *, D]: the first rotary dims rotated (fp32 cos/sin table, one rounding), as the engines' RoPE."""
    shape = x.shape
    flat = x.reshape(shape[0], -1, shape[-1])
    out = rotary(flat.reshape(-1, shape[-1]), positions.repeat_interleave(flat.shape[1]), cache, g.rope.style)
    return out.view(shape)


def _dspark_query(x: torch.Tensor, w: DraftWeights, layer: int, eps: float) -> torch.Tensor:
    """As refmodel.draft_step.dspark_query: q_proj x, or q_b norm(q_a x) (the norm's output rounded once)."""
    if w.q_a is not None and w.q_a_norm is not None and w.q_b is not None:
        return _norm(x @ w.q_a[layer].T, w.q_a_norm[layer], eps) @ w.q_b[layer].T
    assert w.q_proj is not None
    return x @ w.q_proj[layer].T


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor, scale: float) -> torch.Tensor:
    group = q.shape[1] // k.shape[1]
    kk, vv = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.einsum("bhd,mhd->hbm", q, kk).float() * scale
    p = torch.softmax(scores.masked_fill(~allowed[None], float("-inf")), dim=-1).to(q.dtype)
    return torch.einsum("hbm,mhd->bhd", p, vv)


def _mlp(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    a, u = x @ gate.T, x @ up.T
    return (torch.nn.functional.silu(a.float()).to(x.dtype) * u) @ down.T


def _mask(block_positions: torch.Tensor, ctx_positions: torch.Tensor, window: int) -> torch.Tensor:
    b = block_positions.shape[0]
    ctx = ((block_positions[:, None] - ctx_positions[None, :]) < window) if window > 0 else torch.ones(
        b, ctx_positions.shape[0], dtype=torch.bool, device=block_positions.device)
    return torch.cat([ctx, torch.ones(b, b, dtype=torch.bool, device=block_positions.device)], dim=1)


def dspark_step(kv_c: torch.Tensor, k_pe: torch.Tensor, ctx_positions: torch.Tensor, block_hidden: torch.Tensor,
                block_positions: torch.Tensor, w: DraftWeights, g: DraftStepGeometry) -> torch.Tensor:
    """As refmodel.draft_step.dspark_step, in the dtype of block_hidden (bf16). Returns [B, V] logits."""
    assert w.kv_a is not None and w.kv_norm is not None and w.w_uk is not None and w.w_uv is not None
    nh, dn, dv, r, kvl = g.num_heads, g.head_dim, g.v_head_dim, g.rope.rotary_dim, g.kv_lora_rank
    allowed = _mask(block_positions, ctx_positions, 0)
    table = _table(block_positions, g)
    h = block_hidden
    for layer in range(g.num_layers):
        x = _norm(h, w.in_norm[layer], g.eps)
        q = _dspark_query(x, w, layer, g.eps).view(-1, nh, dn + r)
        q = torch.cat([q[..., :dn], _rope(q[..., dn:].contiguous(), block_positions, table, g)], dim=-1)
        own = x @ w.kv_a[layer].T
        own_c = _norm(own[:, :kvl], w.kv_norm[layer], g.eps)
        own_pe = _rope(own[:, None, kvl:].contiguous(), block_positions, table, g)[:, 0]
        c, pe = torch.cat([kv_c[layer], own_c]), torch.cat([k_pe[layer], own_pe])
        k = torch.cat([(c @ w.w_uk[layer].T).view(-1, nh, dn), pe[:, None, :].expand(-1, nh, r)], dim=-1)
        v = (c @ w.w_uv[layer].T).view(-1, nh, dv)
        o = _attention(q, k, v, allowed, softmax_scale_factor(g.rope) / math.sqrt(dn + r))  # YaRN's mscale^2
        h = h + o.reshape(-1, nh * dv) @ w.o_proj[layer].T
        h = h + _mlp(_norm(h, w.post_norm[layer], g.eps), w.gate[layer], w.up[layer], w.down[layer])
    return _norm(h, w.final_norm, g.eps) @ w.lm_head.T


def dflash_step(ctx_k: torch.Tensor, ctx_v: torch.Tensor, ctx_positions: torch.Tensor, block_hidden: torch.Tensor,
                block_positions: torch.Tensor, w: DraftWeights, g: DraftStepGeometry) -> torch.Tensor:
    """As refmodel.draft_step.dflash_step, in the dtype of block_hidden (bf16). Returns [B, V] logits."""
    assert w.k_proj is not None and w.v_proj is not None and w.k_norm is not None
    nh, kvh, d = g.num_heads, g.num_kv_heads, g.head_dim
    allowed = _mask(block_positions, ctx_positions, g.window)
    table = _table(block_positions, g)
    h = block_hidden
    for layer in range(g.num_layers):
        x = _norm(h, w.in_norm[layer], g.eps)
        assert w.q_proj is not None
        q = (x @ w.q_proj[layer].T).view(-1, nh, d)
        q = _rope(_norm(q, w.q_norm[layer], g.eps) if w.q_norm is not None else q, block_positions, table, g)
        own_k = _rope(_norm((x @ w.k_proj[layer].T).view(-1, kvh, d), w.k_norm[layer], g.eps), block_positions,
                      table, g)
        own_v = (x @ w.v_proj[layer].T).view(-1, kvh, d)
        k, v = torch.cat([ctx_k[layer], own_k]), torch.cat([ctx_v[layer], own_v])
        o = _attention(q, k, v, allowed, 1.0 / math.sqrt(d))
        h = h + o.reshape(-1, nh * d) @ w.o_proj[layer].T
        h = h + _mlp(_norm(h, w.post_norm[layer], g.eps), w.gate[layer], w.up[layer], w.down[layer])
    return _norm(h, w.final_norm, g.eps) @ w.lm_head.T


def markov_biased(logits: torch.Tensor, w: DraftWeights, prev: torch.Tensor) -> torch.Tensor:
    """The block's logits [B, V] (bf16) plus the Markov head's bias of each position's previous token prev [B],
    as the drafter's Markov steps compute it (engines/mirror/markov.py: the fp32 dot rounded to the logits' dtype,
    one fp32 add rounded; what properties/test_markov.py holds vLLM's fused steps to)."""
    assert w.markov_w1 is not None and w.markov_w2 is not None
    return markov.step_logits(logits, markov.bias(w.markov_w1, w.markov_w2, prev, logits.dtype))
