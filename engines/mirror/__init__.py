"""The mirror engine: our own low-precision PyTorch implementations of the production algorithms.

It proves the harness before it meets real engines (and serves as the eager
low-precision baseline the real engines are judged against). CPU and CUDA.
"""

from __future__ import annotations

import types

from k3num.engines import base
from k3num.engines.mirror import attn_res, context_kv, pp, projection, transfer, weights
from k3num.engines.subjects import batched_matmul_by_position

VERSION = "0.1.0"


def subjects() -> dict[str, base.Subject]:
    return {
        base.CONTEXT_KV_FUSED: context_kv.context_kv_fused,
        base.CONTEXT_KV_UNFUSED: context_kv.context_kv_unfused,
        base.ATTN_RES: attn_res.attn_res,
        base.AUX_CAPTURE: attn_res.capture_aux_stream,
        base.STAGE_PARTIAL: projection.stage_partial,
        base.FINALIZE_PROJECTION: projection.finalize_projection,
        base.PROJECT_UNSHARDED: projection.project_unsharded,
        base.DRAFT_CONTEXT_KV: projection.draft_context_kv,
        base.ATTN_RES_MIX: attn_res.mix_read_only,
        base.ATTN_RES_MIX_TRITON: attn_res.mix_read_only,
        base.ATTN_RES_MIX_EAGER: attn_res.mix_read_only,
        base.ATTN_RES_RESIDUAL: attn_res.aggregate_normed,
    }


def build() -> base.Engine:
    return base.Engine(name="mirror", version=VERSION, mode="reference", subjects=subjects(),
                       extras={"weight_loading": weight_loading(),
                               "transfer_pairs": transfer.build_transfer_entry_pairs,
                               "tap_owner": attn_res.tap_owner_layer, "pp_taps": pp.pp_taps,
                               "block_fp8_loading": weights.load_block_fp8, "nvfp4_loading": weights.load_nvfp4,
                               "merged_loading_tp": weights.load_merged_at_rank,
                               "nvfp4_modelopt_loading": weights.load_nvfp4_modelopt,
                               "context_kv_ops": _context_kv_ops(), "mla_epilogue": _mla_epilogue(),
                               "draft_config": _draft_config(), "markov_steps": _markov_steps(),
                               "draft_kv_materialize": projection.draft_context_kv,
                               "segmented_rmsnorm": projection.segmented_rms_norm,
                               "project_unsharded_fc_norm": projection.project_unsharded_fc_norm,
                               "kv_transfer": types.SimpleNamespace(manager=transfer.KVSender,
                                                                    route=transfer.kv_route),
                               # torch's CPU matmul blocks its reductions by the batch's shape: every batch size
                               # is its own tiling (rows are not bitwise batch-invariant across sizes)
                               "attn_res_tiling": lambda tokens, num_blocks: f"T={tokens}",
                               # at hidden 1024 the mixtures' batched matmul moves a row's reduction with its
                               # place in the batch (measured: 2 bf16 ulps with the batch of 2 reversed)
                               "batch_variant": {s: batched_matmul_by_position for s in (
                                   base.ATTN_RES_MIX, base.ATTN_RES_MIX_EAGER, base.ATTN_RES_MIX_TRITON,
                                   base.ATTN_RES_RESIDUAL)}})


def _context_kv_ops():
    from k3num.engines.standins import ContextKVOps  # standins builds on the mirror's kernels

    return ContextKVOps()


def _draft_config() -> types.SimpleNamespace:
    from k3num.engines.mirror import draft_config as dc

    return types.SimpleNamespace(configure_dense_draft=dc.configure_dense_draft, fit_draft_page=dc.fit_draft_page,
                                 kv_cache_groups=dc.kv_cache_groups, Backend=dc.Backend, Spec=dc.Spec,
                                 MLASpec=dc.MLASpec, StateSpec=dc.StateSpec, Planner=dc.Planner)


def _markov_steps():
    from k3num.engines.mirror.markov import MarkovSteps

    return MarkovSteps()


def _mla_epilogue():
    from k3num.engines.standins import MlaEpilogue  # standins builds on the mirror's kernels

    return MlaEpilogue()


def weight_loading() -> types.SimpleNamespace:
    return types.SimpleNamespace(duplicate=weights.duplicate, mapper=weights.Mapper())
