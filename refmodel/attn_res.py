"""Block AttnRes in float64: the mixing kernel, the residual stream, the aux-state tap.

Mirrors vLLM 0.33.0 `vllm/models/kimi_k3/nvidia/ops/attn_res.py` (the kernel
contract, BRIEF §2), the per-layer wiring of `KimiDecoderLayer` and the model
end, and `KimiLinearModel._capture_aux_hidden_stream` with its three branches.
State the kernel mutates in place (prefix, bank) comes back as new tensors.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, NamedTuple

import torch

from k3num.refmodel import checks, rmsnorm


class NonFinalStageTapError(RuntimeError):
    """A tap after the last layer of a non-final PP stage (vLLM 0.33.0 refuses it)."""


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def mix(sources: torch.Tensor, q: torch.Tensor, eps: float) -> torch.Tensor:
    """Softmax-over-depth mixture of raw sources.

    sources: [T, S, H]; q: [H] (= norm_weight * qk_weight). Returns [T, H]:
    sum_j softmax_j(dot(v_j, q) * rsqrt(mean(v_j^2) + eps)) v_j.
    """
    return _mix(sources, q, eps)[0]


def _mix(sources: torch.Tensor, q: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(the mixture [T, H], mean(v^2) of every source [T, S]): `mix`, with the mean squares it reads."""
    h = sources.shape[-1]
    ms = torch.linalg.vector_norm(sources, dim=-1).square_().div_(h)  # mean(v^2) without a [T, S, H] temporary
    logits = (sources @ q) * torch.rsqrt(ms + eps)  # [T, S]
    alpha = torch.softmax(logits, dim=-1)  # [T, S]
    return torch.einsum("ts,tsh->th", alpha, sources), ms


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
    *,
    prefix_storage_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The attn_res kernel contract.

    prefix: [T, H]; delta: [T, H] or None; blocks: [T, NB, H]; norm_weight,
    qk_weight, output_norm_weight: [H]. num_blocks in [0, NB];
    block_write_idx in [-1, NB). Returns (output [T, H], new_prefix [T, H],
    new_blocks [T, NB, H]):
    p = prefix + delta (rounded through prefix_storage_dtype when given; this
    is what production stores back into prefix) or prefix; bank row
    block_write_idx := p; sources blocks[:, :num_blocks] then p; the mixture,
    then the output RMSNorm when output_norm_weight is given.
    The inputs are never written. new_blocks is `blocks` itself when nothing is
    written (block_write_idx == -1: the bank is unchanged, and a copy of it would be
    most of the call's memory traffic); every other result is a new tensor.
    """
    return attn_res_with_sources(prefix, delta, blocks, norm_weight, qk_weight, output_norm_weight, num_blocks,
                                 block_write_idx, eps, output_norm_eps, prefix_storage_dtype=prefix_storage_dtype)[:3]


class AttnResParts(NamedTuple):
    """Everything one attn_res call computes: its three results, the sources it mixed
    [T, num_blocks + 1, H] (new_blocks[:, :num_blocks], then new_prefix) and the mixture before the
    output norm [T, H] (`output` itself when there is no output norm)."""

    output: torch.Tensor
    new_prefix: torch.Tensor
    new_blocks: torch.Tensor
    sources: torch.Tensor
    mixture: torch.Tensor


def attn_res_with_sources(
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
    *,
    prefix_storage_dtype: torch.dtype | None = None,
) -> AttnResParts:
    """`attn_res` with the parts a budget reads (AttnResParts: the sources and the pre-norm mixture; the
    judges take them instead of stacking the sources again and mixing twice).

    Validation: shapes and arguments before any arithmetic; finiteness of every input resolved with
    one device sync at the end, read off what the call computes where that is exact: a NaN or Inf in
    a mixed source (prefix, delta and the mixed bank rows) makes its mean square non-finite, and an
    overflowing mean square of finite sources is rechecked on the inputs and passes; the bank rows
    not mixed and the weights are checked directly. The error, when one is raised, is the input
    check's (the first non-finite input, in argument order)."""
    checks.float64("prefix", prefix, (None, None), finite=False)
    t, h = prefix.shape
    if delta is not None:
        checks.float64("delta", delta, (t, h), finite=False)
    checks.float64("blocks", blocks, (t, None, h), finite=False)
    bank = blocks.shape[1]
    checks.float64("norm_weight", norm_weight, (h,), finite=False)
    checks.float64("qk_weight", qk_weight, (h,), finite=False)
    if output_norm_weight is not None:
        checks.float64("output_norm_weight", output_norm_weight, (h,), finite=False)
    tensors = dict(
        prefix=prefix, delta=delta, blocks=blocks, norm_weight=norm_weight,
        qk_weight=qk_weight, output_norm_weight=output_norm_weight,
    )
    checks.same_device(**tensors)
    if not isinstance(num_blocks, int) or not 0 <= num_blocks <= bank:
        raise ValueError(f"num_blocks: expected an int in [0, {bank}] (the bank size), got {num_blocks!r}")
    if not isinstance(block_write_idx, int) or not -1 <= block_write_idx < bank:
        raise ValueError(f"block_write_idx: expected an int in [-1, {bank}), got {block_write_idx!r}")
    eps = checks.positive_float("eps", eps)
    output_norm_eps = checks.nonnegative_float("output_norm_eps", output_norm_eps)

    def exact() -> None:
        checks.all_finite(**tensors)

    if delta is None:
        p = prefix
    else:
        p = prefix + delta
        if prefix_storage_dtype is not None:
            p = p.to(prefix_storage_dtype).to(torch.float64)
    new_prefix = p.clone() if p is prefix else p
    new_blocks = blocks
    if block_write_idx >= 0:
        new_blocks = blocks.clone()
        new_blocks[:, block_write_idx] = p
    deferred = checks.Deferred()
    if num_blocks == 0:
        mixed = p.clone()
        sources = p.unsqueeze(1)
        deferred.finite(**tensors)
    else:
        sources = torch.cat([new_blocks[:, :num_blocks], p.unsqueeze(1)], dim=1)  # [T, S, H]
        mixed, ms = _mix(sources, norm_weight * qk_weight, eps)
        deferred.suspect(torch.isfinite(ms).all(), exact)  # prefix, delta, the mixed bank rows
        if 0 <= block_write_idx < num_blocks:  # the written row's old value is not mixed
            unmixed = blocks
        else:
            unmixed = blocks[:, num_blocks:]
        weights = [w for w in (norm_weight, qk_weight, output_norm_weight) if w is not None]
        if h:
            deferred.suspect(torch.isfinite(torch.stack(torch.aminmax(torch.stack(weights)))).all(), exact)
        if unmixed.numel():
            deferred.suspect(torch.isfinite(torch.stack(torch.aminmax(unmixed))).all(), exact)
    out = mixed if output_norm_weight is None else rmsnorm.normalize(mixed, output_norm_weight, output_norm_eps)
    deferred.raise_first()
    return AttnResParts(out, new_prefix, new_blocks, sources, mixed)


@dataclass(frozen=True)
class LayerWiring:
    """vLLM `KimiDecoderLayer`'s AttnRes bookkeeping for layer i with block size S."""

    layer_idx: int
    block_size: int

    @property
    def is_block_write_layer(self) -> bool:
        return self.layer_idx % self.block_size == 0

    @property
    def block_write_idx(self) -> int:
        return self.layer_idx // self.block_size

    @property
    def prev_valid_blocks(self) -> int:
        return _cdiv(self.layer_idx, self.block_size)


@dataclass(frozen=True)
class AttnResWeights:
    """Per-layer AttnRes weights of a model, stacked over layers (each [L, H]) plus the output pair ([H])."""

    attn_res_norm: torch.Tensor
    attn_res_proj: torch.Tensor
    input_layernorm: torch.Tensor
    mlp_res_norm: torch.Tensor
    mlp_res_proj: torch.Tensor
    post_attention_layernorm: torch.Tensor
    output_res_norm: torch.Tensor
    output_res_proj: torch.Tensor


@dataclass(frozen=True)
class AttnResStream:
    """Everything the Block-AttnRes residual stream produced, per layer.

    attn_inputs, mlp_inputs: [L, T, H] the normed sublayer inputs;
    attn_mixtures, mlp_mixtures: [L, T, H] the pre-norm mixtures;
    prefixes: [L, T, H] prefix_sum after layer i's MLP side (pending m_i not added);
    banks: [L, T, NB, H] the bank after layer i;
    taps: [L, T, H] the pre-norm mixture the consumer of layer i's output reads
    (layer i+1's attention-side mixture; the model-end mixture for the last layer);
    output: [T, H] the model-end mixture.
    """

    attn_inputs: torch.Tensor
    mlp_inputs: torch.Tensor
    attn_mixtures: torch.Tensor
    mlp_mixtures: torch.Tensor
    prefixes: torch.Tensor
    banks: torch.Tensor
    taps: torch.Tensor
    output: torch.Tensor


def attn_res_stream(
    embeddings: torch.Tensor,
    attn_outputs: torch.Tensor,
    mlp_outputs: torch.Tensor,
    weights: AttnResWeights,
    block_size: int,
    eps: float,
    *,
    prefix_storage_dtype: torch.dtype | None = None,
) -> AttnResStream:
    """Run the whole Block-AttnRes stream of a model with teacher-forced sublayer outputs.

    embeddings: [T, H]; attn_outputs, mlp_outputs: [L, T, H] (what layer i's
    attention and MLP returned). Follows vLLM's wiring: attention side
    attn_res(prefix, prev_mlp_out, bank, attn_res_norm_i, attn_res_proj_i,
    input_layernorm_i, prev_valid_blocks, write idx or -1); MLP side: on a write
    layer the attention output becomes the new prefix, else it is the delta,
    num_blocks = prev_valid_blocks + is_write, no bank write,
    post_attention_layernorm; model end: attn_res(prefix, last_mlp_out, bank,
    output_res_norm, output_res_proj, None, cdiv(L, S), -1).
    """
    checks.float64("embeddings", embeddings, (None, None))
    t, h = embeddings.shape
    checks.float64("attn_outputs", attn_outputs, (None, t, h))
    num_layers = attn_outputs.shape[0]
    checks.float64("mlp_outputs", mlp_outputs, (num_layers, t, h))
    for name in AttnResWeights.__dataclass_fields__:
        w = getattr(weights, name)
        checks.float64(f"weights.{name}", w, (h,) if name.startswith("output_") else (num_layers, h))
    if not isinstance(block_size, int) or block_size <= 0:
        raise ValueError(f"block_size: expected a positive int, got {block_size!r}")
    nb = _cdiv(num_layers, block_size)
    bank = torch.zeros(t, nb, h, dtype=torch.float64, device=embeddings.device)
    prefix, pending = embeddings, None
    rec: dict[str, list[torch.Tensor]] = {k: [] for k in ("ai", "mi", "am", "mm", "pre", "bank")}
    kw = {"prefix_storage_dtype": prefix_storage_dtype}
    for i in range(num_layers):
        wiring = LayerWiring(i, block_size)
        write = wiring.block_write_idx if wiring.is_block_write_layer else -1
        am, prefix, bank = attn_res(
            prefix, pending, bank, weights.attn_res_norm[i], weights.attn_res_proj[i], None,
            wiring.prev_valid_blocks, write, eps, eps, **kw,
        )
        ai = rmsnorm.normalize(am, weights.input_layernorm[i], eps)
        if wiring.is_block_write_layer:
            prefix, delta = attn_outputs[i], None
        else:
            delta = attn_outputs[i]
        nbl = wiring.prev_valid_blocks + int(wiring.is_block_write_layer)
        mm, prefix, bank = attn_res(
            prefix, delta, bank, weights.mlp_res_norm[i], weights.mlp_res_proj[i], None,
            nbl, -1, eps, eps, **kw,
        )
        mi = rmsnorm.normalize(mm, weights.post_attention_layernorm[i], eps)
        pending = mlp_outputs[i]
        for key, v in zip(rec, (ai, mi, am, mm, prefix, bank)):
            rec[key].append(v)
    output, _, _ = attn_res(
        prefix, pending, bank, weights.output_res_norm, weights.output_res_proj, None,
        nb, -1, eps, eps, **kw,
    )
    taps = torch.stack(rec["am"][1:] + [output])
    return AttnResStream(
        attn_inputs=torch.stack(rec["ai"]),
        mlp_inputs=torch.stack(rec["mi"]),
        attn_mixtures=torch.stack(rec["am"]),
        mlp_mixtures=torch.stack(rec["mm"]),
        prefixes=torch.stack(rec["pre"]),
        banks=torch.stack(rec["bank"]),
        taps=taps,
        output=output,
    )


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
    non_final_stage: Literal["raise", "prefix"] = "raise",
) -> torch.Tensor:
    """The aux-state tap after layer `layer_idx` (DFlash/DSpark hidden-state capture).

    prefix_sum, pending_mlp_out: [T, H]; bank: [T, NB, H]. weights is None when
    the model has no AttnRes. `end_layer` is one past the last layer of this PP
    stage, `num_layers` the model's layer count. Disabled (flag off or no
    AttnRes): prefix_sum + pending, bit-for-bit. Branch 1 (a later layer on this
    stage): mix with layer i+1's attention-side weights and prev_valid_blocks.
    Branch 2 (last layer, last rank): the output weights with cdiv(L, S) blocks.
    Branch 3 (last layer of a non-final stage): raise (vLLM 0.33.0) or return
    the prefix (the PR version). Every mixture is read-only: no delta, no bank
    write, no output norm.
    """
    checks.float64("prefix_sum", prefix_sum, (None, None), finite=False)
    t, h = prefix_sum.shape
    if pending_mlp_out is not None:
        checks.float64("pending_mlp_out", pending_mlp_out, (t, h), finite=False)
    checks.float64("bank", bank, (t, None, h), finite=False)
    checks.same_device(prefix_sum=prefix_sum, pending_mlp_out=pending_mlp_out, bank=bank)
    checks.all_finite(prefix_sum=prefix_sum, pending_mlp_out=pending_mlp_out, bank=bank)  # one sync for the three
    if non_final_stage not in ("raise", "prefix"):
        raise ValueError(f"non_final_stage: expected 'raise' or 'prefix', got {non_final_stage!r}")
    if not 0 <= layer_idx < end_layer <= num_layers:
        raise ValueError(
            f"layer_idx: expected 0 <= layer_idx < end_layer <= num_layers, "
            f"got {layer_idx}, {end_layer}, {num_layers}"
        )
    prefix = prefix_sum if pending_mlp_out is None else prefix_sum + pending_mlp_out
    if not (enabled and weights is not None):
        return prefix.clone()
    branch = aux_tap_branch(layer_idx, weights, block_size, end_layer, num_layers, is_last_rank)
    if branch is None and non_final_stage == "prefix":
        return prefix.clone()
    if branch is None:
        raise NonFinalStageTapError(
            f"aux tap after layer {layer_idx}: last layer of a non-final PP stage"
        )
    norm_w, proj_w, nbl = branch
    out, _, _ = attn_res(prefix, None, bank, norm_w, proj_w, None, nbl, -1, eps, 0.0)
    return out


def aux_tap_branch(
    layer_idx: int, weights: AttnResWeights, block_size: int, end_layer: int, num_layers: int, is_last_rank: bool
) -> tuple[torch.Tensor, torch.Tensor, int] | None:
    """The branch of the aux tap after layer `layer_idx` (capture_aux_stream's docstring), as the weights it
    mixes with: (norm [H], proj [H], the blocks it reads). Branch 1: layer i+1's attention-side pair and
    prev_valid_blocks; branch 2: the output pair and cdiv(L, S); None for branch 3. Any dtype: it selects
    rows, it computes nothing (the bf16 mirror takes its branch from here too)."""
    if layer_idx + 1 < end_layer:
        consumer = LayerWiring(layer_idx + 1, block_size)
        return weights.attn_res_norm[layer_idx + 1], weights.attn_res_proj[layer_idx + 1], consumer.prev_valid_blocks
    if is_last_rank:
        return weights.output_res_norm, weights.output_res_proj, _cdiv(num_layers, block_size)
    return None
