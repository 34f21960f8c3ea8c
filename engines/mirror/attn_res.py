"""Mirror of the AttnRes kernel and the aux-state tap, as vLLM 0.33.0 runs them.

The kernel contract (BRIEF §2, `vllm/models/kimi_k3/nvidia/ops/attn_res.py`):
p = round_to_storage(fp32(prefix) + fp32(delta)) written back into `prefix`
in place; bank row block_write_idx := p in place; the softmax-over-depth
mixture of blocks[:num_blocks] and p in fp32; the optional output RMSNorm in
fp32; one rounding of the output. The tap follows
`KimiLinearModel._capture_aux_hidden_stream`: fold pending into the prefix
(never as delta), disabled -> that prefix, else a read-only kernel call with
the branch's weights.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from k3num.engines.mirror.context_kv import acc_dtype
from k3num.refmodel import attn_res as ref
from k3num.refmodel.attn_res import AttnResWeights, NonFinalStageTapError


def attn_res(
    prefix: torch.Tensor,
    delta: torch.Tensor | None,
    blocks: torch.Tensor,
    norm_weight: torch.Tensor,
    qk_weight: torch.Tensor,
    output_norm_weight: torch.Tensor | None,
    num_blocks: int,
    block_write_idx: int,
    eps: float,
    output_norm_eps: float,
) -> torch.Tensor:
    bank = blocks.shape[1]
    if not 0 <= num_blocks <= bank:
        raise ValueError(f"attn_res: num_blocks {num_blocks} is outside the bank's {bank} rows")
    if not -1 <= block_write_idx < bank:
        raise ValueError(f"attn_res: block_write_idx {block_write_idx} is outside the bank's {bank} rows")
    a = acc_dtype(prefix.dtype)
    if delta is not None:
        prefix.copy_((prefix.to(a) + delta.to(a)).to(prefix.dtype))  # the one write-back
    p = prefix
    if block_write_idx >= 0:
        blocks[:, block_write_idx].copy_(p)
    if num_blocks == 0:
        mixed = p.to(a)
    else:
        sources = torch.cat([blocks[:, :num_blocks].to(a), p.to(a).unsqueeze(1)], dim=1)  # [T, S, H]
        q = norm_weight.to(a) * qk_weight.to(a)
        logits = (sources @ q) * torch.rsqrt(sources.square().mean(-1) + eps)
        mixed = torch.einsum("ts,tsh->th", torch.softmax(logits, dim=-1), sources)
    if output_norm_weight is not None:
        mixed = mixed * torch.rsqrt(mixed.square().mean(-1, keepdim=True) + output_norm_eps)
        mixed = mixed * output_norm_weight.to(a)
    return mixed.to(prefix.dtype)


def capture_aux_stream(
    layer_idx: int,
    prefix_sum: torch.Tensor,
    pending_mlp_out: torch.Tensor | None,
    bank: torch.Tensor,
    *,
    enabled: bool,
    weights: AttnResWeights | None,
    block_size: int,
    end_layer: int,
    num_layers: int,
    is_last_rank: bool,
    eps: float,
    non_final_stage: str = "raise",
    mix: Callable[..., torch.Tensor] | None = None,
) -> torch.Tensor:
    """The tap (BRIEF §2): the prefix sum plus the pending MLP output, mixed where the stream flag is on with the
    branch's weights (refmodel.attn_res.aux_tap_branch) through `mix` (prefix, bank, nvb, norm, proj, eps -> the
    read-only mixture; None: this mirror's, mix_read_only). The draft step composes an engine's own mixture into
    it where the engine binds no tap (harness/draft_step.mixture_tap)."""
    prefix = prefix_sum if pending_mlp_out is None else prefix_sum + pending_mlp_out
    if not (enabled and weights is not None):
        return prefix
    branch = ref.aux_tap_branch(layer_idx, weights, block_size, end_layer, num_layers, is_last_rank)
    if branch is None:
        if non_final_stage == "prefix":
            return prefix
        raise NonFinalStageTapError(f"aux tap after layer {layer_idx}: last layer of a non-final PP stage")
    norm_w, proj_w, nbl = branch
    return (mix or mix_read_only)(prefix, bank, nbl, norm_w, proj_w, eps)


def mix_read_only(prefix: torch.Tensor, bank: torch.Tensor, nvb: int, norm_weight: torch.Tensor,
                  proj_weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The pre-norm mixture: the kernel with no delta, no bank write, no output norm."""
    return attn_res(prefix, None, bank, norm_weight, proj_weight, None, nvb, -1, eps, 0.0)


def aggregate_normed(prefix: torch.Tensor, bank: torch.Tensor, nvb: int, norm_weight: torch.Tensor,
                     proj_weight: torch.Tensor, out_norm_weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The model-level aggregation point: the mixture of the first nvb bank rows and the prefix,
    then the output norm (same eps), in one kernel call."""
    return attn_res(prefix, None, bank, norm_weight, proj_weight, out_norm_weight, nvb, -1, eps, eps)


def tap_owner_layer(layer_id: int, num_layers: int, stream: str) -> int:
    """The layer whose PP stage can produce the tap after `layer_id`: a prefix tap is its own layer's;
    an AttnRes tap needs the consumer's mixing weights (layer i + 1, or the output pair on the last
    layer's stage)."""
    if stream == "prefix":
        return layer_id
    if stream == "attn_res":
        return min(layer_id + 1, num_layers - 1)
    raise ValueError(f"stream: expected 'prefix' or 'attn_res', got {stream!r}")
