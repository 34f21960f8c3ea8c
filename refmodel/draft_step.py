"""The draft step of K3's block drafters in float64: from the K3 paths' outputs to the block's logits.

Both K3 drafters are block drafters: one forward of the draft model proposes a whole block of
positions, each attending to the context the K3 paths built and to the block itself (the block is
proposed at once, so within it attention is not causal). Greedy verification accepts the longest
prefix of the block that the target agrees with.

- DSpark (MLA; BRIEF §1, §6): the context's latent entries are path 1's output (`mla.context_kv`: kv_c
  [L, N, kv_lora] normed, k_pe [L, N, rope] rotated, written to the draft's MLA cache by vLLM 0.33.0
  `K3DSparkModel._precompute_fused_context_kv`). Each draft layer's attention is MLA in its decompressed
  form (generic, DeepSeek-V2): per head k = [W_uk kv_c | k_pe] and v = W_uv kv_c, q = [q_nope | rope(q_pe)]
  with q = q_proj x, or q_b rmsnorm(q_a x) where the weights have the low-rank form (vLLM 0.33.0's DSpark
  layers are MLA with q_lora_rank; drawn cases use q_proj); the block's own entries come from the layer's
  kv_a_proj_with_mqa as the context's do. With YaRN rope scaling (K3's own geometry, refmodel/geometry.py),
  the rotation's frequencies and cos/sin factor are rope.py's and the softmax scale 1/sqrt(Dn + R) is
  multiplied by mscale(factor, mscale_all_dim)^2, as DeepSeek-V2/V3's MLA attention does
  (`rope.softmax_scale_factor`). The block's tokens then pass the drafter's Markov head (vLLM's
  DSparkMarkovHead, which K3's DSpark drafter always builds: `markov_chain`, refmodel/markov.py): position i's
  logits plus the bias of position i - 1's token, the anchor's (the last accepted token) at i = 0. Not
  modelled: the confidence head.
- DFlash (GQA; seed 003 §4, §6): the context's K/V are path 3's follow-on (`partial_projection.
  draft_context_kv`: K normed per head and NeoX-rotated, V [L, N, KVH, D]; SGLang 0.5.23 `dflash.py`
  `DFlashAttention.kv_proj_only`, written to the draft KV pool). Each draft layer's attention is GQA
  (generic) over the context inside the sliding window and over the block; the block's own K/V are
  projected, K-normed and rotated like the context's. SGLang 0.5.23's DFlash attention norms the query per
  head too (q_norm); the weights may carry it (drawn cases do not).
- Generic in both (no K3 file is mirrored): the pre-attention and post-attention RMSNorms, the SwiGLU MLP,
  the residual adds, the final RMSNorm and the LM head. vLLM's DSpark shares the target's embedding and LM
  head; these functions take the head as given.

Pure functions, float64 only (checked), shapes in the docstrings. The paths' outputs come in as
arguments: the oracle feeds its own float64 paths, the harness feeds an engine's (harness/draft_step.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from k3num.refmodel import checks, markov, rmsnorm
from k3num.refmodel import rope as rope_ops
from k3num.refmodel.geometry import RopeSpec


@dataclass(frozen=True)
class DraftStepGeometry:
    """One drafter's step. `assumed` names the fields no seed gives and a config did not: they are this
    preset's assumption (a `--checkpoint` config.json replaces them)."""

    kind: str  # "dspark" (MLA) or "dflash" (GQA)
    hidden: int
    num_layers: int
    block: int  # positions proposed per step
    num_heads: int  # query heads
    head_dim: int  # dflash: the GQA head dim; dspark: qk_nope_head_dim
    v_head_dim: int  # dspark: the value head dim (dflash: head_dim)
    num_kv_heads: int  # dflash: GQA KV heads (dspark: the latent is shared by all heads)
    kv_lora_rank: int  # dspark
    rope: RopeSpec
    mlp_width: int
    vocab: int
    window: int  # dflash: the sliding window in positions (0: none)
    eps: float
    assumed: tuple[str, ...] = field(default=())
    markov_rank: int = 0  # dspark: the Markov head's rank (0: no head)

    def __post_init__(self) -> None:
        if self.kind not in ("dspark", "dflash"):
            raise ValueError(f"kind: expected 'dspark' or 'dflash', got {self.kind!r}")
        for name in ("hidden", "num_layers", "block", "num_heads", "head_dim", "v_head_dim", "mlp_width", "vocab"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: expected >= 1, got {getattr(self, name)}")
        if self.kind == "dflash" and (self.num_kv_heads < 1 or self.num_heads % self.num_kv_heads):
            raise ValueError(f"num_heads {self.num_heads}: expected a multiple of num_kv_heads {self.num_kv_heads}")
        if self.kind == "dspark" and self.kv_lora_rank < 1:
            raise ValueError(f"kv_lora_rank: expected >= 1, got {self.kv_lora_rank}")


# What the seeds give (block, layers, capture layers; DFlash's 8 KV heads x 128, window 4096) and what they do
# not: the query heads, the MLA head dims, the MLP width and the vocabulary are DeepSeek-V3 / Kimi K2's
# published values (128 heads, qk_nope 128, v 128, vocabulary 163,840), assumed for K3's drafters; the MLP
# width 2,048 is an assumption (a one-layer-wide drafter MLP); DFlash's 64 query heads likewise.
STEP_PRESETS: dict[str, DraftStepGeometry] = {
    "k3-dspark-step": DraftStepGeometry(
        "dspark", hidden=7168, num_layers=5, block=7, num_heads=128, head_dim=128, v_head_dim=128, num_kv_heads=1,
        kv_lora_rank=512, rope=RopeSpec(64, 50000.0, "gptj", None), mlp_width=2048, vocab=163840, window=0,
        eps=1e-5, assumed=("num_heads", "head_dim", "v_head_dim", "mlp_width", "vocab"),
        markov_rank=1 << 8),  # markov_w2 is 163840 x 256 (vLLM 0.34.0's drafter/markov.py)
    "k3-dflash-step": DraftStepGeometry(
        "dflash", hidden=7168, num_layers=6, block=16, num_heads=64, head_dim=128, v_head_dim=128, num_kv_heads=8,
        kv_lora_rank=0, rope=RopeSpec(128, 50000.0, "neox", None), mlp_width=2048, vocab=163840, window=4096,
        eps=1e-5, assumed=("num_heads", "mlp_width", "vocab", "rope.theta")),
}


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor, scale: float) -> torch.Tensor:
    """Softmax attention with grouped KV heads (generic).

    q: [B, NH, Dk]; k: [M, NKV, Dk]; v: [M, NKV, Dv] (NH a multiple of NKV: head h reads KV head
    h // (NH / NKV)); allowed: [B, M] bool (every row allows at least one entry). Returns [B, NH, Dv]."""
    checks.float64("q", q, (None, None, None))
    b, nh, dk = q.shape
    checks.float64("k", k, (None, None, dk))
    m, nkv = k.shape[0], k.shape[1]
    checks.float64("v", v, (m, nkv, None))
    if nh % nkv:
        raise ValueError(f"q: {nh} heads is not a multiple of k's {nkv} KV heads")
    if allowed.dtype != torch.bool or tuple(allowed.shape) != (b, m):
        raise ValueError(f"allowed: expected a bool [{b}, {m}] mask, got {allowed.dtype} {list(allowed.shape)}")
    if not bool(allowed.any(dim=1).all()):
        raise ValueError("allowed: a query position allows no entry")
    return _attend(q, k, v, allowed, scale)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor, scale: float) -> torch.Tensor:
    """`attention` unchecked: the steps' own call, whose arguments they built from checked inputs and whose mask
    allows every query its own block (_window_mask), so no row is empty."""
    nh, nkv = q.shape[1], k.shape[1]
    group = nh // nkv
    kk = k.repeat_interleave(group, dim=1)  # [M, NH, Dk]
    vv = v.repeat_interleave(group, dim=1)  # [M, NH, Dv]
    scores = torch.einsum("bhd,mhd->hbm", q, kk) * scale  # [NH, B, M]
    scores = scores.masked_fill(~allowed[None], float("-inf"))
    p = torch.softmax(scores, dim=-1)
    return torch.einsum("hbm,mhd->bhd", p, vv)


def swiglu(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """The MLP (generic): down(silu(gate x) * up x). x: [B, H]; gate, up: [F, H]; down: [H, F]."""
    a, u = x @ gate.T, x @ up.T
    return (a * torch.sigmoid(a) * u) @ down.T


def lm_logits(h: torch.Tensor, final_norm: torch.Tensor, lm_head: torch.Tensor, eps: float) -> torch.Tensor:
    """The final norm and the LM head (generic). h: [B, H]; final_norm: [H]; lm_head: [V, H]. -> [B, V]."""
    return rmsnorm.normalize(h, final_norm, eps) @ lm_head.T


def _window_mask(block_positions: torch.Tensor, ctx_positions: torch.Tensor, window: int) -> torch.Tensor:
    """[B, N + B]: every context entry within the window of the query position, and the whole block."""
    b = block_positions.shape[0]
    if window > 0:
        ctx = (block_positions[:, None] - ctx_positions[None, :]) < window
    else:
        ctx = torch.ones(b, ctx_positions.shape[0], dtype=torch.bool, device=block_positions.device)
    return torch.cat([ctx, torch.ones(b, b, dtype=torch.bool, device=block_positions.device)], dim=1)


@dataclass(frozen=True)
class DraftWeights:
    """The draft model's weights, float64, stacked per layer (L layers). Common: in_norm, post_norm [L, H];
    o_proj [L, H, NH*Dv]; gate, up [L, F, H]; down [L, H, F]; final_norm [H]; lm_head [V, H].
    DSpark: q_proj [L, NH*(Dn+R), H], or the query's low-rank form (a draft checkpoint's: q_a [L, Q, H], its
    norm q_a_norm [L, Q], q_b [L, NH*(Dn+R), Q]; q = q_b rmsnorm(q_a x)); kv_a [L, kv_lora+R, H] (the block's own
    latent KV, as path 1's weight); kv_norm [L, kv_lora]; w_uk [L, NH*Dn, kv_lora]; w_uv [L, NH*Dv, kv_lora].
    DFlash: q_proj [L, NH*D, H]; k_proj, v_proj [L, KVH*D, H]; k_norm [L, D]; q_norm [L, D] or None (the query
    normed per head before its rotation, as SGLang 0.5.23's DFlash attention; None: no query norm).
    DSpark's Markov head: markov_w1 [V, r], markov_w2 [V, r] (None: no head)."""

    in_norm: torch.Tensor
    q_proj: torch.Tensor | None
    o_proj: torch.Tensor
    post_norm: torch.Tensor
    gate: torch.Tensor
    up: torch.Tensor
    down: torch.Tensor
    final_norm: torch.Tensor
    lm_head: torch.Tensor
    kv_a: torch.Tensor | None = None
    kv_norm: torch.Tensor | None = None
    w_uk: torch.Tensor | None = None
    w_uv: torch.Tensor | None = None
    k_proj: torch.Tensor | None = None
    v_proj: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None
    q_a: torch.Tensor | None = None
    q_a_norm: torch.Tensor | None = None
    q_b: torch.Tensor | None = None
    q_norm: torch.Tensor | None = None
    markov_w1: torch.Tensor | None = None
    markov_w2: torch.Tensor | None = None


def dspark_query(x: torch.Tensor, w: DraftWeights, layer: int, eps: float) -> torch.Tensor:
    """DSpark layer `layer`'s query [B, NH*(Dn+R)] of the normed states x [B, H]: q_proj x, or in the low-rank
    form q_b rmsnorm(q_a x) (DeepSeek-V2's q_lora; the norm in float64 like every other here)."""
    if w.q_a is not None and w.q_a_norm is not None and w.q_b is not None:
        return rmsnorm.normalize(x @ w.q_a[layer].T, w.q_a_norm[layer], eps) @ w.q_b[layer].T
    assert w.q_proj is not None
    return x @ w.q_proj[layer].T


def dspark_step(kv_c: torch.Tensor, k_pe: torch.Tensor, ctx_positions: torch.Tensor, block_hidden: torch.Tensor,
                block_positions: torch.Tensor, w: DraftWeights, g: DraftStepGeometry) -> torch.Tensor:
    """The DSpark block's logits. kv_c: [L, N, kv_lora], k_pe: [L, N, R] (path 1's context entries: normed,
    rotated); ctx_positions: [N]; block_hidden: [B, H] (the block's input states); block_positions: [B].
    Returns [B, V]."""
    _check_step(block_hidden, block_positions, ctx_positions, w, g, "dspark",
                kv_c=(kv_c, (g.num_layers, ctx_positions.shape[0], g.kv_lora_rank)),
                k_pe=(k_pe, (g.num_layers, ctx_positions.shape[0], g.rope.rotary_dim)))
    assert w.kv_a is not None and w.kv_norm is not None and w.w_uk is not None and w.w_uv is not None
    nh, dn, dv, r, kvl = g.num_heads, g.head_dim, g.v_head_dim, g.rope.rotary_dim, g.kv_lora_rank
    allowed = _window_mask(block_positions, ctx_positions, 0)
    scale = rope_ops.softmax_scale_factor(g.rope) / math.sqrt(dn + r)  # YaRN's mscale^2 (DeepSeek's MLA), or 1
    h = block_hidden
    for layer in range(g.num_layers):
        x = rmsnorm.normalize(h, w.in_norm[layer], g.eps)
        q = dspark_query(x, w, layer, g.eps).view(-1, nh, dn + r)  # [B, NH, Dn + R]
        q_pe = rope_ops.rotate(q[..., dn:], block_positions, g.rope)
        own = x @ w.kv_a[layer].T  # [B, kv_lora + R]: the block's own latent entries
        own_c = rmsnorm.normalize(own[:, :kvl], w.kv_norm[layer], g.eps)
        own_pe = rope_ops.rotate(own[:, None, kvl:], block_positions, g.rope)[:, 0]
        c = torch.cat([kv_c[layer], own_c])  # [N + B, kv_lora]
        pe = torch.cat([k_pe[layer], own_pe])  # [N + B, R]
        k_nope = (c @ w.w_uk[layer].T).view(-1, nh, dn)
        k = torch.cat([k_nope, pe[:, None, :].expand(-1, nh, r)], dim=-1)  # [N + B, NH, Dn + R]
        v = (c @ w.w_uv[layer].T).view(-1, nh, dv)
        o = _attend(torch.cat([q[..., :dn], q_pe], dim=-1), k, v, allowed, scale)
        h = h + o.reshape(-1, nh * dv) @ w.o_proj[layer].T
        h = h + swiglu(rmsnorm.normalize(h, w.post_norm[layer], g.eps), w.gate[layer], w.up[layer], w.down[layer])
    return lm_logits(h, w.final_norm, w.lm_head, g.eps)


def dflash_step(ctx_k: torch.Tensor, ctx_v: torch.Tensor, ctx_positions: torch.Tensor, block_hidden: torch.Tensor,
                block_positions: torch.Tensor, w: DraftWeights, g: DraftStepGeometry) -> torch.Tensor:
    """The DFlash block's logits. ctx_k, ctx_v: [L, N, KVH, D] (path 3's draft context K/V: K normed per head
    and rotated); ctx_positions: [N]; block_hidden: [B, H]; block_positions: [B]. Returns [B, V]."""
    n = ctx_positions.shape[0]
    _check_step(block_hidden, block_positions, ctx_positions, w, g, "dflash",
                ctx_k=(ctx_k, (g.num_layers, n, g.num_kv_heads, g.head_dim)),
                ctx_v=(ctx_v, (g.num_layers, n, g.num_kv_heads, g.head_dim)))
    assert w.k_proj is not None and w.v_proj is not None and w.k_norm is not None
    nh, kvh, d = g.num_heads, g.num_kv_heads, g.head_dim
    allowed = _window_mask(block_positions, ctx_positions, g.window)
    h = block_hidden
    for layer in range(g.num_layers):
        x = rmsnorm.normalize(h, w.in_norm[layer], g.eps)
        assert w.q_proj is not None
        q = (x @ w.q_proj[layer].T).view(-1, nh, d)
        if w.q_norm is not None:
            q = rmsnorm.normalize(q, w.q_norm[layer], g.eps)
        q = rope_ops.rotate(q, block_positions, g.rope)
        own_k = rmsnorm.normalize((x @ w.k_proj[layer].T).view(-1, kvh, d), w.k_norm[layer], g.eps)
        own_k = rope_ops.rotate(own_k, block_positions, g.rope)
        own_v = (x @ w.v_proj[layer].T).view(-1, kvh, d)
        k, v = torch.cat([ctx_k[layer], own_k]), torch.cat([ctx_v[layer], own_v])  # [N + B, KVH, D]
        o = _attend(q, k, v, allowed, 1.0 / math.sqrt(d))
        h = h + o.reshape(-1, nh * d) @ w.o_proj[layer].T
        h = h + swiglu(rmsnorm.normalize(h, w.post_norm[layer], g.eps), w.gate[layer], w.up[layer], w.down[layer])
    return lm_logits(h, w.final_norm, w.lm_head, g.eps)


def _check_step(block_hidden: torch.Tensor, block_positions: torch.Tensor, ctx_positions: torch.Tensor,
                w: DraftWeights, g: DraftStepGeometry, kind: str,
                **context: tuple[torch.Tensor, checks.Shape]) -> None:
    """Every argument's dtype and shape (`context`: the paths' outputs, name -> (tensor, shape)), then every float
    tensor's finiteness with one device sync: a step is called per example, and a sync per tensor would stall
    the host once per weight."""
    if g.kind != kind:
        raise ValueError(f"geometry: a {g.kind} geometry given to the {kind} step")
    checks.float64("block_hidden", block_hidden, (g.block, g.hidden), finite=False)
    checks.integer("block_positions", block_positions, (g.block,))
    checks.integer("ctx_positions", ctx_positions, (None,))
    checks.float64("lm_head", w.lm_head, (g.vocab, g.hidden), finite=False)
    checks.float64("final_norm", w.final_norm, (g.hidden,), finite=False)
    for name in ("in_norm", "post_norm"):
        checks.float64(name, getattr(w, name), (g.num_layers, g.hidden), finite=False)
    needed: tuple[str, ...] = ("kv_a", "kv_norm", "w_uk", "w_uv") if kind == "dspark" else ("k_proj", "v_proj",
                                                                                          "k_norm")
    low_rank = ("q_a", "q_a_norm", "q_b")
    given = [n for n in low_rank if getattr(w, n) is not None]
    if kind == "dspark" and given and len(given) < len(low_rank):
        raise ValueError(f"weights: the low-rank query needs all of {', '.join(low_rank)}; given only "
                         f"{', '.join(given)}")
    if kind == "dflash" and given:
        raise ValueError(f"weights: {', '.join(given)}: the dflash step has no low-rank query")
    if kind == "dspark" and w.q_norm is not None:
        raise ValueError("weights: q_norm: the dspark step has no per-head query norm")
    needed += tuple(given) if kind == "dspark" and given else ("q_proj",)
    needed += ("q_norm",) if w.q_norm is not None else ()
    missing = [n for n in needed if getattr(w, n) is None]
    if missing:
        raise ValueError(f"weights: the {kind} step needs {', '.join(missing)}")
    for n in needed:
        checks.float64(n, getattr(w, n), finite=False)
    for name, (t, shape) in context.items():
        checks.float64(name, t, shape, finite=False)
    checks.all_finite(block_hidden=block_hidden, lm_head=w.lm_head, final_norm=w.final_norm, in_norm=w.in_norm,
                      post_norm=w.post_norm, **{n: getattr(w, n) for n in needed},
                      **{name: t for name, (t, _) in context.items()})


def markov_chain(logits: torch.Tensor, w: DraftWeights, anchor: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The block's logits [B, V] float64 through DSpark's Markov head (w.markov_w1, w.markov_w2 [V, r]): position
    i's logits plus the bias of position i - 1's token, the anchor's at i = 0, each token the first argmax. Returns
    (the biased logits [B, V], the tokens [B] int64)."""
    if w.markov_w1 is None or w.markov_w2 is None:
        raise ValueError("markov_chain: the weights have no Markov head (markov_w1, markov_w2)")
    out, tokens = markov.greedy_chain(logits[None], w.markov_w1, w.markov_w2,
                                      torch.tensor([anchor], device=logits.device))
    return out[0], tokens[0]
