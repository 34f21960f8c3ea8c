"""Deliberately broken mirrors: each carries one realistic bug in one subject.

Loaded as a pytest plugin (`-p tests.mutants`), it registers one engine per
mutant (`mutant-<name>`); it carries only that subject (the rest skip). The
self-test `test_mutants_are_caught.py` runs the property suite on all of them
under the `ci` profile and asserts each fails at least one property, which
is how the suite proves its power.
"""

from __future__ import annotations

import dataclasses
import os
import types
from collections.abc import Callable

import pytest
import torch

from k3num.engines import base, mirror, registry, standins
from k3num.engines.mirror import attn_res as m_attn
from k3num.engines.mirror import context_kv as m_ckv
from k3num.engines.mirror import markov as m_markov
from k3num.engines.mirror import projection as m_proj
from k3num.engines.mirror import transfer as m_transfer
from k3num.refmodel import attn_res as ref_attn
from k3num.refmodel.geometry import RopeSpec


def _unfused_q_not_discarded(x, fused_w, norm, pos, rope: RopeSpec, eps):
    width = norm.shape[1] + rope.rotary_dim
    all_kv = torch.stack([(x @ w.T)[:, :width] for w in fused_w])  # offset 0: Q columns kept, KV dropped
    return m_ckv.norm_rope(all_kv, norm, pos, rope, eps)


def _fused_with(*, norm_row0: bool = False, token_major_positions: bool = False, swap_style: bool = False,
                bf16_accumulation: bool = False) -> Callable:
    def fused(x, kv_a, norm, pos, rope: RopeSpec, eps, caches=None, slot_mapping=None):
        num_layers, width, hidden = kv_a.shape
        merged = kv_a.reshape(num_layers * width, hidden)
        if bf16_accumulation:  # the reduction over hidden summed in bf16, 8 columns at a time
            y = torch.zeros(x.shape[0], merged.shape[0], dtype=x.dtype)
            for c in range(0, hidden, 8):
                y = y + x[:, c : c + 8] @ merged[:, c : c + 8].T
        else:
            y = x @ merged.T
        all_kv = y.view(x.shape[0], num_layers, width).permute(1, 0, 2)
        if norm_row0:
            norm = norm[:1].expand_as(norm)  # one norm row for every layer
        if swap_style:
            rope = RopeSpec(rope.rotary_dim, rope.theta, "neox" if rope.style == "gptj" else "gptj", rope.yarn)
        if token_major_positions:  # positions not repeated per layer: token-major instead of layer-major
            kv_c, k_pe = m_ckv.norm_rope(all_kv, norm, pos.repeat_interleave(num_layers), rope, eps, repeat=False)
        else:
            kv_c, k_pe = m_ckv.norm_rope(all_kv, norm, pos, rope, eps)
        if caches is not None and slot_mapping is not None:
            m_ckv.write_cache(caches, kv_c, k_pe, slot_mapping)
        return kv_c, k_pe

    return fused


def _finalize_norm_per_stage(partials, norm_weight, eps, transfer_dtype, order):
    acc = torch.zeros_like(partials[0], dtype=transfer_dtype)
    for s in order:  # each stage normalises its own partial before the sum
        acc = acc + m_proj.rms_norm(partials[s], norm_weight, eps, transfer_dtype)
    return acc.to(partials[0].dtype)


def _stage_partial_shifted(taps, fc_weight, members):
    k, n, h = taps.shape
    if not members:
        return torch.zeros(n, fc_weight.shape[0], dtype=taps.dtype)
    cols = torch.cat([(torch.arange(i * h, (i + 1) * h) + 1) % (k * h) for i in members])  # off by one column
    return taps[members].permute(1, 0, 2).reshape(n, len(members) * h) @ fc_weight[:, cols].T


def _attn_res_delta_twice(prefix, delta, blocks, *args):
    if delta is not None:
        prefix.copy_((prefix.float() + delta.float()).to(prefix.dtype))  # applied here ...
    return m_attn.attn_res(prefix, delta, blocks, *args)  # ... and again inside


def _attn_res_bank_write_on_read(prefix, delta, blocks, norm, qk, onorm, num_blocks, write_idx, eps, oeps):
    if write_idx < 0:
        write_idx = min(num_blocks, blocks.shape[1] - 1)  # "next free row" written on a read-only call
    return m_attn.attn_res(prefix, delta, blocks, norm, qk, onorm, num_blocks, write_idx, eps, oeps)


def _capture_with(*, current_layer: bool = False, branch2_next_layer: bool = False, drop_pending: bool = False
                  ) -> Callable:
    def capture(layer_idx, prefix_sum, pending, bank, *, enabled, weights, block_size, end_layer, num_layers,
                is_last_rank, eps, non_final_stage="raise"):
        if drop_pending and not (enabled and weights is not None):
            return prefix_sum.clone()  # the disabled path forgot the pending MLP output
        prefix = prefix_sum if pending is None else prefix_sum + pending
        if not (enabled and weights is not None):
            return prefix
        if layer_idx + 1 < end_layer:
            w_idx = layer_idx if current_layer else layer_idx + 1  # the current layer's weights
            norm_w, proj_w = weights.attn_res_norm[w_idx], weights.attn_res_proj[w_idx]
            nbl = m_attn.LayerWiring(layer_idx + 1, block_size).prev_valid_blocks
        elif is_last_rank and branch2_next_layer:  # the next-layer path taken on the model's last layer
            norm_w, proj_w = weights.attn_res_norm[layer_idx], weights.attn_res_proj[layer_idx]
            nbl = m_attn.LayerWiring(layer_idx + 1, block_size).prev_valid_blocks
        elif is_last_rank:
            norm_w, proj_w, nbl = weights.output_res_norm, weights.output_res_proj, -(-num_layers // block_size)
        elif non_final_stage == "prefix":
            return prefix
        else:
            raise m_attn.NonFinalStageTapError("non-final stage")
        return m_attn.attn_res(prefix, None, bank, norm_w, proj_w, None, nbl, -1, eps, 0.0)

    return capture


def _duplicate_with(*, clone: bool = False, same_object: bool = False, shard_off_by_one: bool = False,
                    weight_only: bool = False, drop_original: bool = False) -> Callable:
    def duplicate(weights, num_layers):
        for name, weight in weights:
            head, marker, param = name.partition(".self_attn.kv_a_proj_with_mqa.")
            if not (drop_original and marker):
                yield name, weight
            if not marker or (weight_only and param != "weight"):  # quantized params silently skipped
                continue
            idx = head.rsplit(".", 1)[-1]
            if not idx.isdecimal() or int(idx) >= num_layers:
                continue
            copy = weight if same_object else (weight.clone() if clone else weight.detach())
            copy.shard_id = int(idx) + (1 if shard_off_by_one else 0)
            yield f"context_kv_proj.{param}", copy

    return duplicate


WEIGHT_MUTANTS: dict[str, Callable] = {
    "context_copy_is_a_clone": _duplicate_with(clone=True),
    "context_copy_is_the_same_object": _duplicate_with(same_object=True),
    "context_shard_id_off_by_one": _duplicate_with(shard_off_by_one=True),
    "quantized_params_not_duplicated": _duplicate_with(weight_only=True),
    "original_kv_tensor_dropped": _duplicate_with(drop_original=True),
}

def _draft_kv_norm_across_heads(ctx, k_weight, v_weight, k_norm, positions, rope, eps):
    num_layers, width, _ = k_weight.shape
    d, n = k_norm.shape[1], ctx.shape[0]
    ks, vs = [], []
    for layer in range(num_layers):
        k = ctx @ k_weight[layer].T  # [N, KVH*D]
        kf = k.float()
        e = eps[layer] if isinstance(eps, (list, tuple)) else eps
        k = (kf * torch.rsqrt(kf.square().mean(-1, keepdim=True) + e)).to(k.dtype)  # one rms over all heads
        k = k.view(n, width // d, d) * k_norm[layer]
        cache = m_ckv.rope_cache(rope, int(positions.max()) + 1, torch.float32, ctx.device)
        k = m_ckv.rotary(k.reshape(-1, d), positions.repeat_interleave(width // d), cache, rope.style)
        ks.append(k.view(n, width // d, d))
        vs.append((ctx @ v_weight[layer].T).view(n, width // d, d))
    return torch.stack(ks), torch.stack(vs)


def _attn_res_one_bank_row_too_many(prefix, delta, blocks, norm, qk, onorm, num_blocks, write_idx, eps, oeps):
    # off by one in the source count: bank rows [0, num_blocks] mixed, plus the prefix
    return m_attn.attn_res(prefix, delta, blocks, norm, qk, onorm, min(num_blocks + 1, blocks.shape[1]), write_idx,
                           eps, oeps)


def _attn_res_bank_written_before_delta(prefix, delta, blocks, norm, qk, onorm, num_blocks, write_idx, eps, oeps):
    if write_idx >= 0:
        blocks[:, write_idx].copy_(prefix)  # the bank snapshot taken before the delta is added
    out = m_attn.attn_res(prefix, delta, blocks, norm, qk, onorm, num_blocks, -1, eps, oeps)
    return out


def _capture_pending_as_delta(layer_idx, prefix_sum, pending, bank, *, enabled, weights, block_size, end_layer,
                              num_layers, is_last_rank, eps, non_final_stage="raise"):
    if not (enabled and weights is not None):
        return prefix_sum if pending is None else prefix_sum + pending
    branch = ref_attn.aux_tap_branch(layer_idx, weights, block_size, end_layer, num_layers, is_last_rank)
    if branch is None:
        if non_final_stage == "prefix":
            return prefix_sum + pending if pending is not None else prefix_sum
        raise m_attn.NonFinalStageTapError("non-final stage")
    norm_w, proj_w, nbl = branch
    # pending handed to the kernel as delta: the kernel writes prefix + pending back into the caller's prefix_sum
    return m_attn.attn_res(prefix_sum, pending, bank, norm_w, proj_w, None, nbl, -1, eps, 0.0)


def _capture_branch3_wrong(*, drop_pending: bool) -> Callable:
    def capture(layer_idx, prefix_sum, pending, bank, *, enabled, weights, block_size, end_layer, num_layers,
                is_last_rank, eps, non_final_stage="raise"):
        if enabled and weights is not None and layer_idx + 1 >= end_layer and not is_last_rank:
            # branch 3: never refuses; the fallback optionally forgets the pending MLP output
            return prefix_sum.clone() if drop_pending or pending is None else prefix_sum + pending
        return m_attn.capture_aux_stream(layer_idx, prefix_sum, pending, bank, enabled=enabled, weights=weights,
                                         block_size=block_size, end_layer=end_layer, num_layers=num_layers,
                                         is_last_rank=is_last_rank, eps=eps, non_final_stage=non_final_stage)

    return capture


def _fused_cache_with(*, write_without_mapping: bool = False, swap_block_offset: bool = False) -> Callable:
    def fused(x, kv_a, norm, pos, rope, eps, caches=None, slot_mapping=None):
        kv_c, k_pe = m_ckv.context_kv_fused(x, kv_a, norm, pos, rope, eps)
        if caches is None:
            return kv_c, k_pe
        if slot_mapping is None and write_without_mapping:
            slot_mapping = torch.arange(x.shape[0])  # "compute only" taken as "write token t to slot t"
        if slot_mapping is None:
            return kv_c, k_pe
        num_layers, (num_blocks, bs, _) = len(caches), caches[0].shape
        slots = slot_mapping if slot_mapping.dim() == 2 else slot_mapping.expand(num_layers, -1)
        entries = torch.cat([kv_c, k_pe], -1).to(caches[0].dtype)
        for layer in range(num_layers):
            for t in range(x.shape[0]):
                s = int(slots[layer, t])
                if s < 0 and not write_without_mapping:
                    continue
                if s < 0:
                    s = t  # negative slots written too
                b, o = (s % num_blocks, s // num_blocks) if swap_block_offset else (s // bs, s % bs)
                if b < num_blocks and o < bs:
                    caches[layer][b, o] = entries[layer, t]
        return kv_c, k_pe

    return fused


def _stage_partial_empty_garbage(taps, fc_weight, members):
    if not members:  # an empty stage sends its (never written) buffer
        return torch.full((taps.shape[1], fc_weight.shape[0]), 1.0, dtype=taps.dtype)
    return m_proj.stage_partial(taps, fc_weight, members)


def _unsharded_token_major_concat(taps, fc_weight, norm_weight, eps):
    k, n, h = taps.shape
    y = taps.reshape(n, k * h) @ fc_weight.T  # [K, N, H] flattened without moving taps next to each other
    return m_proj.rms_norm(y, norm_weight, eps, taps.dtype)


def _mix_without_prefix(prefix, bank, nvb, norm, proj, eps):
    if nvb == 0:
        return prefix.clone()
    # the running prefix left out of the sources: softmax over the committed blocks only
    src = bank[:, :nvb].float()
    logits = (src @ (norm.float() * proj.float())) * torch.rsqrt(src.square().mean(-1) + eps)
    return torch.einsum("ts,tsh->th", torch.softmax(logits, -1), src).to(prefix.dtype)


def _mirror_kernel_with(*, softmax: Callable | None = None, to_storage: Callable | None = None,
                        sources: Callable | None = None) -> Callable:
    """The mirror's attn_res in float32 with its softmax (logits [T, S] -> weights), its output conversion
    (float32 [T, H], the prefix -> storage) or its float32 sources ([T, S, H] -> what it scores and mixes)
    replaced: one realistic slip each."""
    def kernel(prefix, delta, blocks, norm, qk, onorm, num_blocks, write_idx, eps, oeps):
        a = torch.float32
        if delta is not None:
            prefix.copy_((prefix.to(a) + delta.to(a)).to(prefix.dtype))
        if write_idx >= 0:
            blocks[:, write_idx].copy_(prefix)
        if num_blocks == 0:
            mixed = prefix.to(a)
        else:
            src = torch.cat([blocks[:, :num_blocks].to(a), prefix.to(a).unsqueeze(1)], dim=1)
            src = sources(src) if sources else src
            logits = (src @ (norm.to(a) * qk.to(a))) * torch.rsqrt(src.square().mean(-1) + eps)
            mixed = torch.einsum("ts,tsh->th", (softmax or (lambda x: torch.softmax(x, dim=-1)))(logits), src)
        if onorm is not None:
            mixed = mixed * torch.rsqrt(mixed.square().mean(-1, keepdim=True) + oeps) * onorm.to(a)
        return to_storage(mixed, prefix) if to_storage else mixed.to(prefix.dtype)

    return kernel


def _exp_without_max(logits: torch.Tensor) -> torch.Tensor:
    """A softmax that skips its max subtraction: exact in exact arithmetic, inf / inf or 0 / 0 once a score
    leaves float32 exp's range."""
    e = logits.exp()
    return e / e.sum(-1, keepdim=True)


def _softmax_with_a_batch_wide_max(logits: torch.Tensor) -> torch.Tensor:
    """A softmax whose maximum is the whole batch's (logits [T, S]): one non-finite row reaches every row."""
    e = (logits - logits.max()).exp()
    return e / e.sum(-1, keepdim=True)


def _mix_with_a_batch_wide_max(prefix, bank, nvb, norm, proj, eps):
    """The read-only mixture with its softmax's maximum taken over the whole batch (one tile of every row):
    exact in exact arithmetic and within budget on finite rows of moderate scores, but a NaN or an infinity in
    one row reaches the maximum, and through it every other row."""
    return _mirror_kernel_with(softmax=_softmax_with_a_batch_wide_max)(prefix, None, bank, norm, proj, None, nvb, -1,
                                                                       eps, 0.0)


def _clamped_to_fp16_range(src: torch.Tensor) -> torch.Tensor:
    """Sources clamped to +-65504 before they are scored and mixed (a sanitising clamp kept from an fp16 port):
    exact below fp16's largest finite value, wrong for a massive activation above it."""
    return src.clamp(-65504.0, 65504.0)


def _mix_clamped_to_fp16_range(prefix, bank, nvb, norm, proj, eps):
    """The read-only mixture with its sources clamped to fp16's range (_clamped_to_fp16_range)."""
    return _mirror_kernel_with(sources=_clamped_to_fp16_range)(prefix, None, bank, norm, proj, None, nvb, -1, eps,
                                                               0.0)


def _read_from_its_first_element(w: torch.Tensor | None) -> torch.Tensor | None:
    """A 1-D view read as a pointer kernel without a stride check reads it: its first element, then the next ones
    of its buffer, whatever its stride."""
    return w if w is None or w.stride(-1) == 1 else w.as_strided(w.shape, (1,))


def _attn_res_weights_read_as_contiguous(prefix, delta, blocks, norm, qk, onorm, num_blocks, write_idx, eps, oeps):
    """The mirror's attn_res with its weights read as if contiguous (a weight expanded from one value, or every
    other element of a wider buffer, reads its buffer's neighbours)."""
    f = _read_from_its_first_element
    return m_attn.attn_res(prefix, delta, blocks, f(norm), f(qk), f(onorm), num_blocks, write_idx, eps, oeps)


def _truncated_when_batched(mixed: torch.Tensor, prefix: torch.Tensor) -> torch.Tensor:
    """The batched path (more than one row: another kernel, as engines pick one by the row count) converts to bf16
    by truncation, the single-row path to nearest: within a bf16 ulp either way, and a row alone differs from the
    row in its batch in about half its elements."""
    if prefix.shape[0] == 1 or prefix.dtype != torch.bfloat16:
        return mixed.to(prefix.dtype)
    return (mixed.contiguous().view(torch.int32) & -65536).view(torch.float32).to(torch.bfloat16)  # toward zero


def _draft_v_truncated_when_batched(ctx, k_weight, v_weight, k_norm, positions, rope, eps):
    """The draft's V projection on a batch (more than one row: another GEMM, as engines pick one by the row count)
    converts its float32 products to bf16 toward zero, a row alone to nearest: a row alone differs from the row in
    its batch in about half its V elements (the accuracy property sees the truncation too, where it passes the
    budget's half ulp)."""
    k, v = m_proj.draft_context_kv(ctx, k_weight, v_weight, k_norm, positions, rope, eps)
    if ctx.shape[0] == 1 or v.dtype != torch.bfloat16:
        return k, v
    exact = torch.stack([(ctx.float() @ w.float().T).view(v.shape[1:]) for w in v_weight])
    return k, (exact.contiguous().view(torch.int32) & -65536).view(torch.float32).to(torch.bfloat16)


_TAP_WORKSPACE: dict[tuple, torch.Tensor] = {}


def _capture_into_a_reused_workspace(layer_idx, prefix_sum, pending, bank, **kw):
    """The mirror's tap, returned in one workspace per shape that every call reuses: each tap is right when it is
    returned, and the next call overwrites the one the draft holds."""
    out = m_attn.capture_aux_stream(layer_idx, prefix_sum, pending, bank, **kw)
    buf = _TAP_WORKSPACE.setdefault((tuple(out.shape), out.dtype, str(out.device)), torch.empty_like(out))
    return buf.copy_(out)


MUTANTS: dict[str, dict[str, base.Subject]] = {
    "softmax_without_max_subtraction": {base.ATTN_RES: _mirror_kernel_with(softmax=_exp_without_max)},
    "attn_res_max_over_the_batch": {base.ATTN_RES: _mirror_kernel_with(softmax=_softmax_with_a_batch_wide_max)},
    "tap_in_a_reused_workspace": {base.AUX_CAPTURE: _capture_into_a_reused_workspace},
    "batched_path_truncates": {base.ATTN_RES: _mirror_kernel_with(to_storage=_truncated_when_batched)},
    "weights_read_as_contiguous": {base.ATTN_RES: _attn_res_weights_read_as_contiguous},
    "sources_clamped_to_fp16_range": {base.ATTN_RES: _mirror_kernel_with(sources=_clamped_to_fp16_range),
                                      base.ATTN_RES_MIX: _mix_clamped_to_fp16_range,
                                      base.ATTN_RES_MIX_TRITON: _mix_clamped_to_fp16_range,
                                      base.ATTN_RES_MIX_EAGER: _mix_clamped_to_fp16_range},
    "draft_k_norm_across_heads": {base.DRAFT_CONTEXT_KV: _draft_kv_norm_across_heads},
    "draft_v_truncated_when_batched": {base.DRAFT_CONTEXT_KV: _draft_v_truncated_when_batched},
    "one_bank_row_too_many": {base.ATTN_RES: _attn_res_one_bank_row_too_many},
    "bank_row_written_before_delta": {base.ATTN_RES: _attn_res_bank_written_before_delta},
    "pending_passed_as_delta": {base.AUX_CAPTURE: _capture_pending_as_delta},
    "branch3_never_refuses": {base.AUX_CAPTURE: _capture_branch3_wrong(drop_pending=False)},
    "branch3_fallback_drops_pending": {base.AUX_CAPTURE: _capture_branch3_wrong(drop_pending=True)},
    "cache_written_without_slot_mapping": {base.CONTEXT_KV_FUSED: _fused_cache_with(write_without_mapping=True)},
    "slot_block_and_offset_swapped": {base.CONTEXT_KV_FUSED: _fused_cache_with(swap_block_offset=True)},
    "empty_stage_sends_garbage": {base.STAGE_PARTIAL: _stage_partial_empty_garbage},
    "unsharded_taps_concatenated_token_major": {base.PROJECT_UNSHARDED: _unsharded_token_major_concat},
    "mixture_max_over_the_batch": {base.ATTN_RES_MIX: _mix_with_a_batch_wide_max,
                                   base.ATTN_RES_MIX_TRITON: _mix_with_a_batch_wide_max,
                                   base.ATTN_RES_MIX_EAGER: _mix_with_a_batch_wide_max},
    "mixture_without_the_prefix_source": {base.ATTN_RES_MIX: _mix_without_prefix,
                                          base.ATTN_RES_MIX_TRITON: _mix_without_prefix,
                                          base.ATTN_RES_MIX_EAGER: _mix_without_prefix},
    "unfused_q_not_discarded": {base.CONTEXT_KV_UNFUSED: _unfused_q_not_discarded},
    "one_norm_row_for_all_layers": {base.CONTEXT_KV_FUSED: _fused_with(norm_row0=True)},
    "positions_not_repeated_per_layer": {base.CONTEXT_KV_FUSED: _fused_with(token_major_positions=True)},
    "neox_gptj_pairing_swapped": {base.CONTEXT_KV_FUSED: _fused_with(swap_style=True)},
    "norm_per_stage_before_sum": {base.FINALIZE_PROJECTION: _finalize_norm_per_stage},
    "tap_column_block_shifted": {base.STAGE_PARTIAL: _stage_partial_shifted},
    "delta_written_back_twice": {base.ATTN_RES: _attn_res_delta_twice},
    "bank_row_written_on_read_only_call": {base.ATTN_RES: _attn_res_bank_write_on_read},
    "branch1_current_layer_weights": {base.AUX_CAPTURE: _capture_with(current_layer=True)},
    "branch2_takes_next_layer_path": {base.AUX_CAPTURE: _capture_with(branch2_next_layer=True)},
    "disabled_path_drops_pending": {base.AUX_CAPTURE: _capture_with(drop_pending=True)},
    "bf16_accumulation_over_reduction": {base.CONTEXT_KV_FUSED: _fused_with(bf16_accumulation=True)},
}


def _pairs_by_plain_lookup(src, dst, n_src, n_dst, allow_positional_fallback=False):
    if n_src == 0:
        return []
    if src and dst:
        where = {lid: j for j, lid in enumerate(dst)}  # repeated ids (K and V) collapse to one entry
        return [(i, where[lid]) for i, lid in enumerate(src) if lid in where]
    return [(i, i) for i in range(min(n_src, n_dst))]  # positional pairing of PP-heterogeneous peers


TRANSFER_MUTANTS: dict[str, Callable] = {"transfer_pairs_by_plain_lookup": _pairs_by_plain_lookup}


class _FlatSender(m_transfer.KVSender):
    """Seed 003's bug in the mirror: the decode's item lengths are not compared, every page copied flat."""

    def send(self, *args, dst_kv_item_len, dst_item_lens=None):
        return super().send(*args, dst_kv_item_len=args[1][0] if args[1] else dst_kv_item_len,
                            dst_item_lens=None if dst_item_lens is None else [args[1][0]] * len(dst_item_lens))


KV_TRANSFER_MUTANTS = {"kv_transfer_ignores_decode_item_len": _FlatSender}
class _StaleKWorkspace:
    """The DFlash materializer's state-between-calls bug: its K workspace, kept across calls, is added to
    instead of overwritten (the first call is right, every later one is not)."""

    def __init__(self) -> None:
        self.ws: dict = {}

    def __call__(self, *args):
        k, v = m_proj.draft_context_kv(*args)
        ws = self.ws.setdefault((tuple(k.shape), k.device), torch.zeros(k.shape, device=k.device))
        ws.add_(k.float())
        return ws.to(k.dtype), v


# the DFlash materializer (an engine extra with DRAFT_CONTEXT_KV's signature): the K norm over all heads,
# and a workspace that keeps state between calls
def _materialize_first_layer_eps(ctx, k_weight, v_weight, k_norm, positions, rope, eps):
    """Every layer's K normed with layer 0's epsilon (the per-layer eps_values not indexed by layer)."""
    first = eps[0] if isinstance(eps, (list, tuple)) else eps
    return m_proj.draft_context_kv(ctx, k_weight, v_weight, k_norm, positions, rope, first)


MATERIALIZE_MUTANTS = {"draft_kv_materialize_norm_across_heads": lambda *a: _draft_kv_norm_across_heads(*a),
                       "draft_kv_materialize_stale_workspace": _StaleKWorkspace(),
                       "draft_kv_materialize_first_layer_eps": _materialize_first_layer_eps}


def _tap_owned_by_producing_layer(layer_id, num_layers, stream):
    if stream not in ("prefix", "attn_res"):
        raise ValueError(stream)
    return layer_id  # the AttnRes tap assigned like a prefix tap: its stage lacks the consumer's weights


def _prefix_tap_owned_by_consumer(layer_id, num_layers, stream):
    if stream not in ("prefix", "attn_res"):
        raise ValueError(stream)
    return min(layer_id + 1, num_layers - 1)  # both streams assigned to the consumer's stage


def _unknown_stream_as_prefix(layer_id, num_layers, stream):
    return min(layer_id + 1, num_layers - 1) if stream == "attn_res" else layer_id  # no refusal


OWNER_MUTANTS: dict[str, Callable] = {
    "attn_res_tap_owned_by_its_own_layer": _tap_owned_by_producing_layer,
    "prefix_tap_owned_by_the_consumer": _prefix_tap_owned_by_consumer,
    "unknown_tap_stream_taken_as_prefix": _unknown_stream_as_prefix,
}

class _BrokenOps(standins.ContextKVOps):
    """The per-op subjects of the fused context-KV path with one planted bug (`bug`)."""

    def __init__(self, bug: str) -> None:
        self.bug = bug

    def rms_norm_grouped(self, x, weight, eps):
        xf = x.float()
        normed = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)
        if self.bug == "norm_rounded_twice":  # the normalised row rounded before the weight is applied
            return (normed.to(x.dtype).float() * weight.float()[:, None, :]).to(x.dtype)
        if self.bug == "norm_weight_row_0":
            return (normed * weight.float()[0]).to(x.dtype)
        return super().rms_norm_grouped(x, weight, eps)

    def rotary(self, positions, x, cos_sin_cache, is_neox):
        if self.bug != "rotary_rounded_twice":
            return super().rotary(positions, x, cos_sin_cache, is_neox)
        d = cos_sin_cache.shape[-1]
        cos, sin = cos_sin_cache[positions, : d // 2].float(), cos_sin_cache[positions, d // 2:].float()
        xf = x[:, 0].float()
        a, b = (xf[:, : d // 2], xf[:, d // 2:]) if is_neox else (xf[:, 0::2], xf[:, 1::2])
        low = x.dtype  # each product rounded to the storage dtype before the sum
        def r(t):
            return t.to(low).float()

        p, q = r(a * cos) - r(b * sin), r(b * cos) + r(a * sin)
        out = torch.cat([p, q], -1) if is_neox else torch.stack([p, q], -1).flatten(-2)
        return out.to(low)[:, None]

    def insert_per_layer(self, kv_c, k_pe, cache, slots, kv_cache_dtype="auto", scale=None):
        if self.bug == "fp8_scale_multiplied" and kv_cache_dtype != "auto":
            scale = 1.0 / scale  # x * scale where the cache holds x / scale
        if self.bug == "fp8_bad_scale_saturated" and kv_cache_dtype != "auto":  # no check: x / 0 saturates
            return standins.write_fp8_unchecked(kv_c, k_pe, cache, slots, kv_cache_dtype, scale)
        if self.bug != "per_layer_insert_offset_swapped":
            return super().insert_per_layer(kv_c, k_pe, cache, slots, kv_cache_dtype, scale)
        bs, keep = cache.shape[1], slots >= 0  # block and offset swapped where they fit
        s = slots[keep]
        blk, off = s // bs, s % bs
        swap = (off < cache.shape[0]) & (blk < bs)
        blk, off = torch.where(swap, off, blk), torch.where(swap, blk, off)
        cache[blk, off] = torch.cat([kv_c, k_pe], -1)[keep]

    def insert_grouped(self, kv_c, k_pe, caches, slot_mapping, kv_cache_dtype="auto", kv_scales=None):
        if kv_cache_dtype != "auto":
            for layer, cache in enumerate(caches):  # through this class's per-layer insert (and its bug)
                self.insert_per_layer(kv_c[layer], k_pe[layer], cache, slot_mapping[layer], kv_cache_dtype,
                                      kv_scales[layer:layer + 1])
            return None
        if self.bug == "insert_pointers_in_address_order":  # the pointer array sorted by address
            caches = sorted(caches, key=lambda c: c.data_ptr())
        super().insert_grouped(kv_c, k_pe, caches, slot_mapping)


OPS_MUTANTS = ("norm_rounded_twice", "norm_weight_row_0", "rotary_rounded_twice", "insert_pointers_in_address_order",
               "per_layer_insert_offset_swapped", "fp8_scale_multiplied", "fp8_bad_scale_saturated")


class _BrokenEpilogue(standins.MlaEpilogue):
    """The fused MLA prefill epilogue with one planted bug (`bug`); the same bugs are planted in vLLM's CUDA
    kernel for the GPU (scripts/mla_epilogue_plants.py)."""

    def __init__(self, bug: str) -> None:
        self.bug = bug

    def _rot(self, x, positions, table):
        if self.bug == "epilogue_rope_sin_negated" and table is not None:  # each pair turned the other way
            table = torch.cat([table[:, : table.shape[1] // 2], -table[:, table.shape[1] // 2:]], -1)
        return standins._rotate32(x, positions, table)

    def insert(self, q, k_nope, k_pe, kv_c, cache, slots, positions=None, cos_sin_cache=None):
        t, h, p = k_nope.shape
        pe = self._rot(k_pe, positions, cos_sin_cache).to(k_nope.dtype)
        if cos_sin_cache is not None:
            q[..., p:] = self._rot(q[..., p:], positions, cos_sin_cache).to(q.dtype)
        rows = torch.cat([kv_c, pe], -1)
        if self.bug == "epilogue_skipped_slot_written":  # a skipped token's -1 indexes the cache's last row
            cache.view(-1, cache.shape[-1])[slots.to(torch.int64)] = rows
        else:
            standins._write_rows(cache, rows, slots)
        key_pe = k_pe if self.bug == "epilogue_key_pe_unrotated" else pe
        return torch.cat([k_nope, key_pe[:, None, :].expand(t, h, pe.shape[-1])], -1)

    def insert_fp8(self, q, k_nope, k_pe, kv_c, v, cache, slots, q_scale_inv, k_scale_inv, v_scale_inv,
                   cache_scale_inv, positions=None, cos_sin_cache=None):
        t, h, p = k_nope.shape
        pe = self._rot(k_pe, positions, cos_sin_cache)
        q_pe = self._rot(q[..., p:], positions, cos_sin_cache)
        if self.bug == "epilogue_fp8_rope_via_bf16":  # the rotated values stored as bf16 before they are quantized
            pe, q_pe = pe.to(torch.bfloat16).float(), q_pe.to(torch.bfloat16).float()
        if self.bug == "epilogue_cache_with_k_scale":  # the cache quantized with the attention key's scale
            cache_scale_inv = k_scale_inv
        q32 = torch.cat([q[..., :p].float(), q_pe], -1)
        k32 = torch.cat([k_nope.float(), pe[:, None, :].expand(t, h, pe.shape[-1])], -1)
        standins._write_rows(cache, standins._e4m3(torch.cat([kv_c.float(), pe], -1), cache_scale_inv)
                             .view(torch.uint8), slots)
        return standins._e4m3(q32, q_scale_inv), standins._e4m3(k32, k_scale_inv), standins._e4m3(v.float(),
                                                                                                  v_scale_inv)

    def decode(self, ql_nope, q_pe, kv_c, k_pe, cache, slots, q_scale_inv=None, cache_scale_inv=None,
               positions=None, cos_sin_cache=None):
        if self.bug == "epilogue_decode_q_pe_unrotated":  # the latent query's rope part left as it came
            super().decode(ql_nope, q_pe, kv_c, k_pe, cache, slots, q_scale_inv, cache_scale_inv, positions,
                           cos_sin_cache)  # the cache as it should be
            plain = torch.cat([ql_nope.float(), q_pe.float()], -1)
            return plain.to(ql_nope.dtype) if q_scale_inv is None else standins._e4m3(plain, q_scale_inv)
        if self.bug == "epilogue_decode_cache_with_q_scale":  # the decode's fp8 cache quantized with the query's scale
            cache_scale_inv = q_scale_inv
        return super().decode(ql_nope, q_pe, kv_c, k_pe, cache, slots, q_scale_inv, cache_scale_inv, positions,
                              cos_sin_cache)


def _draft_config_mutant(bug: str) -> types.SimpleNamespace:
    """The mirror's draft configuration (engines/mirror/draft_config.py) with one planted bug."""
    from k3num.engines.mirror import draft_config as dc

    cfg = mirror._draft_config()
    if bug == "dense_draft_fp8_for_gqa":  # every draft gets the fp8 cache, the GQA ones too
        def configure(spec_config, text_config, rocm=False):
            dc.configure_dense_draft(spec_config, text_config, rocm)
            if spec_config.kv_cache_dtype == "auto":
                spec_config.kv_cache_dtype = "fp8"
        cfg.configure_dense_draft = configure
    if bug == "dense_draft_overrides_users_dtype":  # the default replaces what the user chose
        def configure_over(spec_config, text_config, rocm=False):
            spec_config.kv_cache_dtype = None
            dc.configure_dense_draft(spec_config, text_config, rocm)
        cfg.configure_dense_draft = configure_over
    if bug == "gqa_page_not_a_divisor":  # the block shrinks by 64 until it fits, divisor or not
        def fit(spec, page_size):
            for b in range(spec.block_size, 0, -dc.ALIGN):
                if dataclasses.replace(spec, block_size=b).page_size_bytes <= page_size:
                    return dataclasses.replace(spec, block_size=b)
            raise ValueError(f"no draft block fits the target's {page_size}-byte KV page: {spec}")
        cfg.fit_draft_page = fit
    if bug == "gqa_mla_counted_as_draft":  # every attention layer, MLA too, taken for the draft's
        def groups(specs, block_outermost, planner):
            draft = {n: s for n, s in specs.items() if isinstance(s, dc.Spec)}
            target = {n: s for n, s in specs.items() if n not in draft}
            if not draft or not target or block_outermost:
                return planner.get_kv_cache_groups(None, specs)
            page = max(s.page_size_bytes for s in target.values())
            unified = planner.unify_kv_cache_spec_page_size({**target, **{n: dc.fit_draft_page(s, page)
                                                                          for n, s in draft.items()}})
            return (planner.get_kv_cache_groups(None, {n: unified[n] for n in target})
                    + planner.get_kv_cache_groups(None, {n: unified[n] for n in draft}))
        cfg.kv_cache_groups = groups
    return cfg


DRAFT_CONFIG_MUTANTS = ("dense_draft_fp8_for_gqa", "dense_draft_overrides_users_dtype", "gqa_page_not_a_divisor",
                        "gqa_mla_counted_as_draft")

EPILOGUE_MUTANTS = ("epilogue_rope_sin_negated", "epilogue_fp8_rope_via_bf16", "epilogue_cache_with_k_scale",
                    "epilogue_skipped_slot_written", "epilogue_key_pe_unrotated", "epilogue_decode_q_pe_unrotated",
                    "epilogue_decode_cache_with_q_scale")

class _BrokenMarkov(m_markov.MarkovSteps):
    """The mirror's fused Markov steps with one planted bug (`bug`); its loop and its sampler stay correct, as an
    engine's are separate code. The same kinds of bug are planted in vLLM's Triton kernels
    (scripts/markov_plants.py), which the interpreter runs on the CPU (tests/test_markov_plants.py)."""

    def __init__(self, bug: str) -> None:
        self.bug = bug

    def fused(self, batch):  # noqa: C901  (one branch per bug)
        b, bug = batch, self.bug
        anchor = b.input_ids[b.anchor_idx].to(torch.int64)
        prev = anchor
        for step in range(b.steps):
            if bug == "markov_prev_is_anchor":  # every step biased by the anchor, not the previous step's token
                prev = anchor
            if bug == "markov_bias_unrounded":  # the dot added to the base logits before any rounding
                logits = (b.base[:, step].float() + b.w1[prev].float() @ b.w2.float().T).to(b.base.dtype)
            else:
                logits = m_markov.step_logits(b.base[:, step], m_markov.bias(b.w1, b.w2, prev, b.base.dtype))
            cached = logits
            if bug == "markov_cache_after_temperature":  # the cache holds the logits divided by the temperature
                slot = b.idx_map[:, step].to(torch.int64).clamp(min=0)
                t = b.temperature[slot].float()[:, None]
                cached = torch.where(t != 0, logits.float() / torch.where(t != 0, t, torch.ones_like(t)),
                                     logits.float()).to(logits.dtype)
            self.write_cache(b, step, cached)
            if bug == "markov_padded_row_written":  # a padded row (slot -1) written into the cache's last row
                pad = b.idx_map[:, step] < 0
                if bool(pad.any()):
                    b.cache[-1, step, : logits.shape[-1]] = logits[pad][0]
            if bug == "markov_vocab_tail_written":  # the cache row's entries past V written too
                b.cache[:, step, logits.shape[-1]:] = 0
            if bug == "markov_noise_without_step":  # every step draws step 0's noise
                tok = self.sample(logits, b, 0)
            elif bug == "markov_last_max_kept":  # of equal keys the last wins
                slot = b.idx_map[:, step].to(torch.int64)
                s = slot.clamp(min=0)
                keys = m_markov.gumbel_keys(logits, torch.where(slot >= 0, b.temperature[s], 0 * b.temperature[s]),
                                            torch.where(slot >= 0, b.seeds[s], 0 * b.seeds[s]), step,
                                            b.sample_pos[:, step] - 1 + m_markov.SALT, b.use_fp64)
                tok = keys.shape[-1] - 1 - m_markov.first_argmax(keys.flip(-1))
            elif bug == "markov_nan_row_out_of_range":  # a NaN row matches no maximum: its token is V, past the end
                slot = b.idx_map[:, step].to(torch.int64)
                s = slot.clamp(min=0)
                keys = m_markov.gumbel_keys(logits, torch.where(slot >= 0, b.temperature[s], 0 * b.temperature[s]),
                                            torch.where(slot >= 0, b.seeds[s], 0 * b.seeds[s]), step,
                                            b.sample_pos[:, step] - 1 + m_markov.SALT, b.use_fp64)
                best = keys.max(-1, keepdim=True).values
                idx = torch.arange(keys.shape[-1], device=keys.device).expand_as(keys)
                tok = torch.where(keys == best, idx, keys.shape[-1]).min(-1).values
            else:
                tok = self.sample(logits, b, step)
            b.tokens[: b.rows, step] = tok
            prev = tok

    def loop(self, batch, fuse_bias=False, watermarked=False):
        if self.bug == "markov_watermark_key_at_p" and watermarked:  # the watermarker keys the draw by P, not P - 1
            m_markov.MarkovSteps.fused(dataclasses.replace(batch, sample_pos=batch.sample_pos + 1))
            return
        m_markov.MarkovSteps.loop(batch, fuse_bias)


MARKOV_MUTANTS = ("markov_prev_is_anchor", "markov_bias_unrounded", "markov_cache_after_temperature",
                  "markov_padded_row_written", "markov_vocab_tail_written", "markov_noise_without_step",
                  "markov_last_max_kept", "markov_nan_row_out_of_range", "markov_watermark_key_at_p")

# --- the hunt's families (oracles/hunt.py): state kept between calls, rows left unwritten, reads past
# the rows a call may read, taps lost between PP stages


class _StaleWorkspace:
    """A kernel that accumulates its result into a workspace it allocates once and never clears (the
    state-between-calls bug): the first call is right, every later one is not."""

    def __init__(self, fn: Callable) -> None:
        self.fn, self.ws = fn, {}

    def __call__(self, prefix, *args):
        out = self.fn(prefix, *args)
        ws = self.ws.setdefault((tuple(out.shape), out.device), torch.zeros(out.shape, device=out.device))
        ws.add_(out.float())
        return ws.to(out.dtype)


def _attn_res_last_token_unwritten(prefix, *args):
    """The output allocated uninitialised and every token's row written but the last (a grid one block
    short)."""
    full = m_attn.attn_res(prefix, *args)
    out = torch.empty_like(full)
    out[:-1] = full[:-1]
    return out if full.shape[0] > 1 else full


def _mix_reads_row_past_nvb(prefix, bank, nvb, norm, proj, eps):
    """The bank rows loaded without the nvb mask: one row past the valid ones is mixed in."""
    return m_attn.mix_read_only(prefix, bank, min(nvb + 1, bank.shape[1]) if nvb else 0, norm, proj, eps)


def _residual_tail_unwritten(prefix, bank, nvb, norm, proj, out_norm, eps):
    """Columns written by whole 64-wide tiles only (the grid's H // 64): the tail stays uninitialised."""
    full = m_attn.aggregate_normed(prefix, bank, nvb, norm, proj, out_norm, eps)
    out = torch.empty_like(full)
    cols = full.shape[1] // 64 * 64
    out[:, :cols] = full[:, :cols]
    return out


HUNT_MUTANTS: dict[str, dict[str, base.Subject]] = {
    "attn_res_stale_workspace": {base.ATTN_RES: _StaleWorkspace(m_attn.attn_res)},
    "mix_stale_workspace": {base.ATTN_RES_MIX_EAGER: _StaleWorkspace(m_attn.mix_read_only)},
    "attn_res_last_token_unwritten": {base.ATTN_RES: _attn_res_last_token_unwritten},
    "mix_reads_row_past_nvb": {base.ATTN_RES_MIX_TRITON: _mix_reads_row_past_nvb},
    "residual_tail_unwritten": {base.ATTN_RES_RESIDUAL: _residual_tail_unwritten},
}
MUTANTS.update(HUNT_MUTANTS)


def _pp_mutant(bug: str) -> Callable:
    """vLLM's real PP forward loop (engines/vllm_adapter/pp_forward.py) with one piece broken."""
    from k3num.engines.vllm_adapter import pp_forward
    from k3num.supply import fetch

    def relay_nothing(self, intermediate_tensors, output_intermediate_tensors):  # a middle stage drops upstream taps
        return output_intermediate_tensors

    def slot_base_off_by_one(real):
        def layout(self):
            real(self)
            if self._aux_slot_base_cached:
                self._aux_slot_base_cached += 1
                self._aux_upstream_total_cached = self._aux_upstream_total_cached and self._aux_slot_base_cached
        return layout

    def pack_drops_last(real):  # the stage's last tap is not handed to the next stage
        return lambda self, aux: real(self, aux[:-1])

    mutate = {"tap_not_relayed": {"relay": lambda real: relay_nothing},
              "tap_slot_base_off_by_one": {"_cache_aux_pp_layout": slot_base_off_by_one},
              "tap_not_packed": {"pack_local_aux_hidden_states": pack_drops_last}}[bug]
    kernel = m_attn.attn_res
    return pp_forward.bind(fetch.Source("vllm").root, kernel, "nvidia", mutate=mutate)


PP_MUTANTS = ("tap_not_relayed", "tap_slot_base_off_by_one", "tap_not_packed")


def _block_fp8_loader(bug: str) -> Callable:
    """The mirror's merged block-FP8 loader with one piece broken."""
    from k3num.engines.mirror import weights as m_weights

    def load(tensors, num_layers, block):
        bn, bk = block
        width, hidden = next(t for name, t in tensors if name == "weight").shape
        if bug == "block_rows_by_arrival":  # each shard placed where it arrives, not at its shard id
            seen: dict[str, int] = {}
            relabelled = []
            for name, t in tensors:
                c = t.detach()
                c.shard_id = seen.setdefault(name, 0)
                seen[name] += 1
                relabelled.append((name, c))
            return m_weights.load_block_fp8(relabelled, num_layers, block)
        # "block_scales_rounded_up": any shard geometry accepted, scale rows at ceil(offset / bn)
        weight = torch.empty(num_layers * width, hidden, dtype=torch.float8_e4m3fn)
        scale = torch.full((-(-num_layers * width // bn), -(-hidden // bk)), float("nan"))
        per = -(-width // bn)
        for name, t in tensors:
            lyr = t.shard_id
            if name == "weight":
                weight[lyr * width:(lyr + 1) * width] = t
            else:
                off = -(-lyr * width // bn)
                scale[off:off + per] = t[: scale.shape[0] - off]
        return weight, scale

    return load


def _nvfp4_first_global(tensors, num_layers):
    """Differing global scales accepted, the first shard's used for all."""
    from k3num.engines.mirror import weights as m_weights

    first = next(t for name, t in tensors if name == "weight_global_scale")
    same = []
    for name, t in tensors:
        if name == "weight_global_scale":
            c = first.detach().clone()
            c.shard_id = t.shard_id
            t = c
        same.append((name, t))
    return m_weights.load_nvfp4(same, num_layers)


FP8_MUTANTS = ("block_rows_by_arrival", "block_scales_rounded_up", "nvfp4_first_global")
LOADING_MUTANTS = ("merged_rows_of_rank_0",)


def _merged_rows_of_rank_0(tensors, num_layers, world, rank):
    """The merged column-parallel load with every rank given rank 0's rows of each part."""
    from k3num.engines.mirror import weights as m_weights

    return m_weights.load_merged_at_rank(tensors, num_layers, world, 0)


def _refuses_inside_the_mix(prefix, delta, blocks, norm, qk, onorm, num_blocks, write_idx, eps, oeps):
    """A write inside the mixed range refused, though the engine declares no precondition."""
    if 0 <= write_idx < num_blocks:
        raise ValueError("block_write_idx must append")
    return m_attn.attn_res(prefix, delta, blocks, norm, qk, onorm, num_blocks, write_idx, eps, oeps)


def _refuses_after_the_delta(prefix, delta, blocks, norm, qk, onorm, num_blocks, write_idx, eps, oeps):
    """TokenSpeed's precondition (a write must append), checked after the delta was written back."""
    if delta is not None:
        prefix.copy_((prefix.float() + delta.float()).to(prefix.dtype))
    if write_idx not in (-1, num_blocks):
        raise ValueError("block_write_idx must append within block_residual")
    return m_attn.attn_res(prefix, None, blocks, norm, qk, onorm, num_blocks, write_idx, eps, oeps)


def _appending_rule(num_blocks: int, write: int, bank: int) -> bool:
    return write == -1 or (write == num_blocks and write < bank)


def _tokenspeed_pp(bug: str) -> Callable:
    """TokenSpeed's real PP forward (engines/tokenspeed_adapter/attn_res.py) with one piece broken."""
    from k3num.engines import source
    from k3num.engines.tokenspeed_adapter import attn_res as tokenspeed_attn_res
    from k3num.engines.tokenspeed_adapter import kernels as tokenspeed_kernels
    from k3num.supply import fetch

    root = fetch.Source("tokenspeed").root
    fwd = source.lift(root / tokenspeed_kernels.RESIDUAL_TORCH_PY, "torch_attn_res_fwd", {"torch": torch})

    def drop_last_bank_row(state):  # the stage hands on one snapshot row too few
        return tokenspeed_attn_res.PPStageState(state.hidden_states, state.block_residual[:-1],
                                                state.projected_context)

    def restart_sum(real):  # a downstream stage starts its projection sum from zero
        return lambda self, hidden, inbound: real(self, hidden, None if inbound is None else inbound * 0)

    mutate = {"pp_bank_row_not_handed_on": {"sent": drop_last_bank_row},
              "pp_projection_sum_restarted": {"begin_stage": restart_sum}}[bug]
    return tokenspeed_attn_res.bind(root, fwd, mutate).pp_taps


TOKENSPEED_PP_MUTANTS = ("pp_bank_row_not_handed_on", "pp_projection_sum_restarted")


def _segmented_over_whole_row(x, weight, eps):
    """The per-tap fc_norm with its statistics over every segment of the row together."""
    s, h = weight.shape
    flat = m_proj.rms_norm(x.reshape(*x.shape[:-2], s * h), weight.reshape(-1), eps, x.dtype)
    return flat.reshape(x.shape)


def _fc_norm_row0_for_every_tap(taps, fc_weight, fc_norm, norm_weight, eps):
    """Every tap normed by tap 0's fc_norm row."""
    if fc_norm is not None:
        fc_norm = fc_norm[:1].expand_as(fc_norm).contiguous()
    return m_proj.project_unsharded_fc_norm(taps, fc_weight, fc_norm, norm_weight, eps)


# mutants that carry engine extras beside (or instead of) broken subjects: name -> (subjects, extras)
EXTRA_MUTANTS: dict[str, tuple[dict[str, base.Subject], dict[str, object]]] = {
    "attn_res_refuses_undeclared": ({base.ATTN_RES: _refuses_inside_the_mix}, {}),
    "attn_res_refusal_after_delta": ({base.ATTN_RES: _refuses_after_the_delta}, {"attn_res_admits": _appending_rule}),
    "segmented_norm_over_the_whole_row": (
        {base.PROJECT_UNSHARDED: m_proj.project_unsharded},
        {"segmented_rmsnorm": _segmented_over_whole_row,
         "project_unsharded_fc_norm": lambda t, f, w, n, e: m_proj.project_unsharded(
             t if w is None else _segmented_over_whole_row(t.permute(1, 0, 2), w, e).permute(1, 0, 2), f, n, e)}),
    "fc_norm_row0_for_every_tap": ({base.PROJECT_UNSHARDED: m_proj.project_unsharded},
                                   {"segmented_rmsnorm": m_proj.segmented_rms_norm,
                                    "project_unsharded_fc_norm": _fc_norm_row0_for_every_tap}),
}


ALL = sorted([*MUTANTS, *WEIGHT_MUTANTS, *TRANSFER_MUTANTS, *KV_TRANSFER_MUTANTS, *MATERIALIZE_MUTANTS,
              *OWNER_MUTANTS, *OPS_MUTANTS, *EPILOGUE_MUTANTS, *DRAFT_CONFIG_MUTANTS, *MARKOV_MUTANTS, *PP_MUTANTS,
              *FP8_MUTANTS, *LOADING_MUTANTS, *EXTRA_MUTANTS, *TOKENSPEED_PP_MUTANTS])


# --- drifting subjects: NOT bugs the properties must catch. Each adds one extra rounding where the
# budget has room, so every property still passes while the err/budget ratios move up; the regression
# gate (oracles.history, `k3num report --gate`) must notice them. `K3NUM_DRIFT=NAME` puts one in place
# of the mirror (tests/test_history_gate.py).


def _unsharded_norm_rounded(taps, fc_weight, norm_weight, eps):
    """The unsharded projection's RMSNorm with its 1/rms and its normalised row each rounded to the storage
    dtype before the weight is applied (two extra roundings, about one ulp more on every element, where the
    budget of a GEMM over k taps has room)."""
    k, n, h = taps.shape
    y = (taps.permute(1, 0, 2).reshape(n, k * h) @ fc_weight.T).float()
    low = taps.dtype
    scale = torch.rsqrt(y.square().mean(-1, keepdim=True) + eps).to(low).float()
    return ((y * scale).to(low).float() * norm_weight.float()).to(low)


DRIFT = {
    "unsharded_norm_rounded": {base.PROJECT_UNSHARDED: _unsharded_norm_rounded},
}
DRIFT_ENV = "K3NUM_DRIFT"


def build_drift(name: str) -> base.Engine:
    """The mirror with one drifting subject, under the mirror's own name: hypothesis derives its
    derandomized draws from the test's node id, so only a subject named `mirror` meets the very cases the
    mirror's history holds. Its version says which drift it carries (a different source to the gate)."""
    engine = mirror.build()
    subjects = dict(engine.subjects)
    subjects.update(DRIFT[name])
    extras = dict(engine.extras)
    if base.PROJECT_UNSHARDED in DRIFT[name]:  # the fc_norm projection is the same projection, drifted too
        drifted = subjects[base.PROJECT_UNSHARDED]
        extras["project_unsharded_fc_norm"] = lambda t, f, w, n, e: drifted(
            t if w is None else m_proj.segmented_rms_norm(t.permute(1, 0, 2), w, e).permute(1, 0, 2), f, n, e)
    return dataclasses.replace(engine, version=f"{engine.version}+drift-{name}", subjects=subjects, extras=extras)


def build(name: str) -> base.Engine:
    """The mirror reduced to the path of the broken piece (everything else is absent and skips), so
    the self-test spends its time only where the bug is."""
    extras: dict[str, object] = {}
    if name in WEIGHT_MUTANTS:
        loading = mirror.weight_loading()
        loading.duplicate = WEIGHT_MUTANTS[name]
        extras["weight_loading"] = loading
    if name in TRANSFER_MUTANTS:
        extras["transfer_pairs"] = TRANSFER_MUTANTS[name]
    if name in MATERIALIZE_MUTANTS:
        extras["draft_kv_materialize"] = MATERIALIZE_MUTANTS[name]
    if name in KV_TRANSFER_MUTANTS:
        extras["kv_transfer"] = types.SimpleNamespace(manager=KV_TRANSFER_MUTANTS[name],
                                                      route=m_transfer.kv_route)
    if name in OWNER_MUTANTS:
        extras["tap_owner"] = OWNER_MUTANTS[name]
    if name in OPS_MUTANTS:
        extras["context_kv_ops"] = _BrokenOps(name)
    if name in EPILOGUE_MUTANTS:
        extras["mla_epilogue"] = _BrokenEpilogue(name)
    if name in DRAFT_CONFIG_MUTANTS:
        extras["draft_config"] = _draft_config_mutant(name)
    if name in MARKOV_MUTANTS:
        extras["markov_steps"] = _BrokenMarkov(name)
    if name in PP_MUTANTS:
        extras["pp_taps"] = _pp_mutant(name)
    if name in FP8_MUTANTS[:2]:
        extras["block_fp8_loading"] = _block_fp8_loader(name)
        extras["weight_loading"] = mirror.weight_loading()
    if name == "nvfp4_first_global":
        extras["nvfp4_loading"] = _nvfp4_first_global
    if name == "merged_rows_of_rank_0":
        extras["merged_loading_tp"] = _merged_rows_of_rank_0
    if name in TOKENSPEED_PP_MUTANTS:
        extras["pp_taps"] = _tokenspeed_pp(name)
        extras["pp_taps_hidden"] = True
    broken = dict(MUTANTS.get(name, {}))
    if name in EXTRA_MUTANTS:
        broken.update(EXTRA_MUTANTS[name][0])
        extras.update(EXTRA_MUTANTS[name][1])
    correct = mirror.subjects()
    subjects = {s: correct[s] for group in PATHS if set(group) & set(broken) for s in group}
    subjects.update(broken)
    return base.Engine(name=f"mutant-{name}", version="0", mode="reference", subjects=subjects, extras=extras,
                       missing={s: "a mutant carries only the path of its broken subject" for s in base.SUBJECTS})


# the subjects that are exercised together (a broken one keeps its correct companions)
PATHS = (
    (base.CONTEXT_KV_FUSED, base.CONTEXT_KV_UNFUSED),
    (base.ATTN_RES,),
    (base.AUX_CAPTURE,),
    (base.STAGE_PARTIAL, base.FINALIZE_PROJECTION, base.PROJECT_UNSHARDED),
    (base.DRAFT_CONTEXT_KV,),
    (base.ATTN_RES_MIX, base.ATTN_RES_MIX_TRITON, base.ATTN_RES_MIX_EAGER),
    (base.ATTN_RES_RESIDUAL,),
)


# a bug planted over a real engine's pinned bytes, under the engine's own name, so that its ledger entries
# apply: `K3NUM_PLANT=NAME pytest -p tests.mutants --engine sglang` (tests/test_ledger_files.py). The
# on-grid one scales SGLang's model aggregation where hidden % 1024 == 0: outside K3N-008's rule (off the
# grid), in the very test the entry covers
PLANT_ENV = "K3NUM_PLANT"


def _scaled_on_grid(fn: base.Subject) -> base.Subject:
    def planted(prefix, bank, nvb, norm, proj, out_norm, eps):
        out = fn(prefix, bank, nvb, norm, proj, out_norm, eps)
        return (out.float() * 1.03).to(out.dtype) if out.shape[-1] % 1024 == 0 else out

    return planted


PLANTS = {"sglang-on-grid-scaled": ("sglang", base.ATTN_RES_RESIDUAL, _scaled_on_grid)}


def _planted(name: str, factory: Callable[[], base.Engine]) -> base.Engine:
    _, subject_name, plant = PLANTS[name]
    real = factory()
    subjects = dict(real.subjects)
    subjects[subject_name] = plant(real.subject(subject_name))
    return dataclasses.replace(real, subjects=subjects)


def pytest_configure(config) -> None:
    plant = os.environ.get(PLANT_ENV)
    if plant:
        if plant not in PLANTS:
            raise pytest.UsageError(f"{PLANT_ENV}={plant!r}: known plants are {sorted(PLANTS)}")
        name = PLANTS[plant][0]
        registry.known()
        real = registry._FACTORIES[name]  # the engine's own factory, wrapped
        registry.register(name, lambda src, mode: _planted(plant, lambda: real(src, mode)), pin=registry.pin_of(name))
    for name in ALL:
        registry.register(f"mutant-{name}", lambda name=name: build(name))
    drift = os.environ.get(DRIFT_ENV)
    if drift:  # `K3NUM_DRIFT=NAME pytest -p tests.mutants --engine mirror`: the mirror drifts
        if drift not in DRIFT:
            raise pytest.UsageError(f"{DRIFT_ENV}={drift!r}: known drifts are {sorted(DRIFT)}")
        registry.known()  # the built-in factories first, so that this one replaces the mirror's
        registry.register("mirror", lambda: build_drift(drift))
        registry.register("mirror-pristine", mirror.build)  # the base of a check of the drift (test_check.py)
