"""The known-divergence ledger: where a real engine disagrees with the oracle or breaks a contract.

Nothing is loosened for these: each entry marks exactly its (engine, version,
property test) case `xfail(strict=True)` pointing back here (root conftest), so
an upstream fix turns the case red and the entry must then be removed. Each
entry carries the minimal reproducer hypothesis found and the upstream issue.
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
)


def lookup(engine: str, version: str, test: str) -> Divergence | None:
    for d in LEDGER:
        if (d.engine, d.version, d.test) == (engine, version, test):
            return d
    return None
