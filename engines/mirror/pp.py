"""The mirror's aux taps across PP stages (extras["pp_taps"]): the one-stage answer for any plan.

The decoder layers are `standin_layer`: the real K3 decoder layer's AttnRes state flow
(vllm nvidia/model.py KimiDecoderLayer: the pending delta added into the prefix, the bank row
written at a block's first layer, the prefix restarted by the attention output there, the MLP
mixture over one more block) with this mirror's attn_res, and an elementwise tanh standing for
attention and MLP. The real engines' PP loops run the same layers (engines/vllm_adapter/
pp_forward.py), so a split run must reproduce these taps bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from k3num.engines.base import PPTapPlan
from k3num.engines.mirror import attn_res as mirror


def standin_layer(i: int, block_size: int, weights: Any, scale: torch.Tensor, eps: float) -> Callable:
    """Decoder layer i under the NVIDIA loop's state names: (positions, hidden_states = pending delta,
    residual = bank, prefix_sum) -> (delta, prefix_sum, bank)."""
    write = i % block_size == 0
    prev = -(-i // block_size)

    def layer(positions: torch.Tensor | None, hidden_states: torch.Tensor | None, residual: torch.Tensor,
              prefix_sum: torch.Tensor | None = None, **_: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        assert prefix_sum is not None
        normed = mirror.attn_res(prefix_sum, hidden_states, residual, weights.attn_res_norm[i],
                                 weights.attn_res_proj[i], weights.input_layernorm[i], prev,
                                 i // block_size if write else -1, eps, eps)
        attn = torch.tanh(normed.float() * scale[i].float()).to(normed.dtype)
        delta: torch.Tensor | None
        if write:  # a new block starts: the attention output is the new prefix
            prefix_sum, delta = attn, None
        else:
            delta = attn
        mixed = mirror.attn_res(prefix_sum, delta, residual, weights.mlp_res_norm[i], weights.mlp_res_proj[i],
                                weights.post_attention_layernorm[i], prev + write, -1, eps, eps)
        return torch.tanh(mixed.float() * 0.5).to(mixed.dtype), prefix_sum, residual

    return layer


def pp_taps(plan: PPTapPlan, embeddings: torch.Tensor, weights: Any, scale: torch.Tensor,
            eps: float = 1e-5, **_: Any) -> list[torch.Tensor]:
    """The taps a one-stage run hands the draft (the plan's stages do not matter here)."""
    t, h = embeddings.shape
    nb = -(-plan.num_layers // plan.block_size)
    bank = torch.zeros(t, nb, h, dtype=embeddings.dtype, device=embeddings.device)
    prefix, delta = embeddings.clone(), None
    taps = [prefix.clone()] if 0 in plan.taps else []
    for i in range(plan.num_layers):
        delta, prefix, bank = standin_layer(i, plan.block_size, weights, scale, eps)(None, delta, bank, prefix)
        if i + 1 not in plan.taps:
            continue
        p = prefix + delta
        if plan.aux_stream:
            if i + 1 < plan.num_layers:
                norm, proj = weights.attn_res_norm[i + 1], weights.attn_res_proj[i + 1]
                blocks = -(-(i + 1) // plan.block_size)
            else:
                norm, proj, blocks = weights.output_res_norm, weights.output_res_proj, nb
            p = mirror.attn_res(p, None, bank, norm, proj, None, blocks, -1, eps, 0.0)
        taps.append(p)
    return taps
