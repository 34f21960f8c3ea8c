"""The known-divergence ledger: where a real engine disagrees with the oracle or breaks a contract.

Nothing is loosened for these: each entry marks exactly its (engine, version,
property test[, mode]) case `xfail(strict=True)` pointing back here (root
conftest), so an upstream fix turns the case red and the entry must then be
removed. Each entry carries the minimal reproducer hypothesis found and the
upstream issue. `modes` limits an entry to the modes it was seen in (a race on
the GPU does not happen under the sequential Triton interpreter); empty means
every mode.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Divergence:
    id: str
    engine: str
    version: str
    subject: str
    test: str  # the property test's function name
    what: str
    reproducer: str
    upstream: str
    modes: tuple[str, ...] = ()


LEDGER: tuple[Divergence, ...] = (
    Divergence(
        id="K3N-001", engine="vllm-rocm", version="0.33.0", subject="aux_capture",
        test="test_branch1_tap_mixes_with_the_next_layers_weights_and_blocks",
        what="the ROCm aux tap (amd/linear.py _maybe_add_hidden_state) returns the prefix sum and ignores "
             "VLLM_KIMI_K3_AUX_ATTN_RES_STREAM, so with the flag on it is not the next layer's mixture",
        reproducer="TapCase(num_layers=2, block_size=1, stage_end=2, layer_idx=0, tokens=1, hidden=16, seed=0): "
                   "max_abs 0.70 vs budget 0.013, cosine 0.956",
        upstream="vllm#56434 (open)",
    ),
    Divergence(
        id="K3N-002", engine="vllm-rocm", version="0.33.0", subject="aux_capture",
        test="test_branch2_tap_on_the_last_rank_mixes_with_the_output_weights",
        what="same cause as K3N-001 after the last layer: the output mixture is never formed",
        reproducer="TapCase(num_layers=2, block_size=1, stage_end=1, layer_idx=0, tokens=1, hidden=16, seed=0): "
                   "max_abs 1.39 vs budget 0.010, cosine 0.777",
        upstream="vllm#56434 (open); see also vllm#50815 (the tap after the last layer)",
    ),
    Divergence(
        id="K3N-003", engine="vllm-rocm", version="0.33.0", subject="aux_capture",
        test="test_branch3_non_final_stage_raises_when_configured_to",
        what="at the end of a non-final PP stage the ROCm tap returns the prefix where the NVIDIA path "
             "of the same release refuses (RuntimeError): the two platforms disagree on branch 3",
        reproducer="TapCase(num_layers=2, block_size=1, stage_end=1, layer_idx=0, tokens=1, hidden=16, seed=0): "
                   "no exception raised",
        upstream="vllm#56434 (open)",
    ),
    Divergence(
        id="K3N-004", engine="vllm", version="0.33.0", subject="attn_res",
        test="test_a_block_written_in_the_call_is_mixed_with_its_written_value",
        what="nvidia/ops/attn_res.py _attn_res_kernel stores the prefix into bank row block_write_idx and then "
             "loads the sources with another thread layout; the tl.debug_barrier() between them is only "
             "emitted when HAS_DELTA, so without a delta a write inside [0, num_blocks) races with the loads "
             "and the mixture sometimes uses the old row. Seen at small hidden sizes (hidden 32, 1 token, "
             "num_blocks 2: 7 of 200 calls over budget, 2 distinct outputs for one input); not seen in 200 calls "
             "at hidden 7168. The same input passes on a re-run (hypothesis: FlakyFailure). KimiK3DecoderLayer "
             "always writes at num_blocks, so the model's own calls are not affected",
        reproducer="AttnResCase(tokens=1, hidden=32, bank=2, num_blocks=2, block_write_idx=0, with_delta=False, "
                   "with_output_norm=False, seed=0, scale=0.01, outliers=30.0): ratio 139.7 on the first call, "
                   "within budget on the re-run (H200, triton 3.6.0); scripts/repro_attn_res_write_race.py counts it",
        upstream="none found (not reported yet)",
        modes=("source-gpu", "import"),
    ),
    Divergence(
        id="K3N-005", engine="vllm-rocm", version="0.33.0", subject="attn_res",
        test="test_a_block_written_in_the_call_is_mixed_with_its_written_value",
        what="same race as K3N-004 in amd/ops/attn_res.py (the ROCm Triton kernel, run on the H200)",
        reproducer="AttnResCase(tokens=1, hidden=32, bank=2, num_blocks=2, block_write_idx=0, with_delta=False, "
                   "with_output_norm=False, seed=7, scale=1.0, outliers=30.0): 64 of 200 calls over budget (worst "
                   "ratio 86), 3 distinct outputs (scripts/repro_attn_res_write_race.py, H200)",
        upstream="none found (not reported yet)",
        modes=("source-gpu", "import"),
    ),
    Divergence(
        id="K3N-006", engine="tokenspeed", version="0.1.1", subject="finalize_projection",
        test="test_sharded_adds_no_rounding_beyond_its_partials_when_taps_cancel",
        what="K3DSparkModel.project_target_tap returns linear(hidden, weight) in bf16, so every tap's "
             "projection is rounded to bf16 before it enters the fp32 stage accumulator (add_capture), and "
             "finalize_target_projection rounds the fp32 sum to bf16 before the norm; the stage partials travel "
             "in fp32 but carry u_bf16 * |p_i| per tap. When taps cancel, that is far above the unsharded "
             "path's one rounding of the sum (project_target_hidden: one GEMM over all taps). The accuracy "
             "property counts these declared roundings (extras['projection_roundings']) and passes; this one "
             "does not count them",
        reproducer="ProjectionCase(taps=2, tokens=1, hidden=16, hidden_out=16, stages=((0, 1),), order=(0,), "
                   "seed=0, scale=0.01, outliers=0.0) with cancelling taps (fixtures.builders."
                   "cancelling_projection_inputs): max_abs 1.19e-02 vs budget 5.5e-04 (ratio 21.6); on the H200 a "
                   "random case (seed 141, 6 taps x 32, 1 token, 16 out) reached ratio 1.05 of the plain budget",
        upstream="none found (not reported yet)",
    ),
    Divergence(
        id="K3N-007", engine="vllm-rocm", version="0.33.0", subject="attn_res",
        test="test_attn_res_within_rounding_budget_of_oracle",
        what="amd/ops/attn_res.py _attn_res_kernel compiled for the H200 gives different outputs for one input "
             "when it has a delta, the output norm and the 4-source tile (BLOCK_L 4, 8 warps: fewer than 256 "
             "tokens and num_blocks >= 2), with no bank write; the NVIDIA kernel of the same release on the same "
             "input is deterministic and within budget. Seen on NVIDIA hardware only (the kernel is meant for "
             "ROCm, where its compiler may lay the reductions out differently); not seen without the delta, "
             "without the output norm, at BLOCK_L 1, or at hidden 7168",
        reproducer="AttnResCase(tokens=1, hidden=128, bank=4, num_blocks=4, block_write_idx=-1, with_delta=True, "
                   "with_output_norm=True, seed=0, scale=0.01, outliers=30.0): 49 of 300 calls over budget (ratio up "
                   "to 107, cosine 0.991), 4 distinct outputs (scripts/repro_attn_res_flaky.py, H200, run 11)",
        upstream="none found (not reported yet)",
        modes=("source-gpu", "import"),
    ),
)


def lookup(engine: str, version: str, test: str, mode: str) -> Divergence | None:
    """The entry for this case, if any; `mode` is the mode the engine's kernels run in here."""
    for d in LEDGER:
        # a mode's variant (source-gpu+ops: the same kernels, with compiled ops built here) matches its base
        if (d.engine, d.version, d.test) == (engine, version, test) and (
                not d.modes or mode in d.modes or mode.split("+", 1)[0] in d.modes):
            return d
    return None
