"""The ledger's fixes (harness/fixes.py): the ones whose failure shows on a CPU turn their properties
green on a patched copy here (the GPU ones are shown on the H200: docs/gpu-run.md); a fix whose
anchor is gone is refused naming the file."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from k3num.harness import fixes
from k3num.supply import fetch

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _fetched() -> None:
    for engine in ("vllm", "sglang"):
        if fetch.missing_files(engine):
            pytest.skip(f"{engine} is not fetched here: run `k3num fetch {engine}`")


def test_the_cpu_visible_fixes_turn_their_properties_green(tmp_path: Path) -> None:
    r = subprocess.run([sys.executable, "scripts/prove_fixes.py", "--cpu-only", "--out", str(tmp_path)], cwd=ROOT,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    table = (tmp_path / "fixes.csv").read_text()
    for fix_id in ("K3N-001/002", "K3N-008", "K3N-009/010"):
        assert fix_id in table
    assert "NOT SHOWN" not in table


def test_each_fix_applies_to_the_pinned_files_once(tmp_path: Path) -> None:
    for fix in fixes.FIXES:
        tree = fixes.patched_tree(fix, tmp_path / fix.id.replace("/", "_"))
        for rel, _ in fix.edits:
            assert (tree / rel).read_text() != (fetch.Source(fix.engine).root / rel).read_text(), (fix.id, rel)


def test_a_fix_whose_anchor_is_gone_is_refused_naming_the_file() -> None:
    text = (fetch.Source("vllm").root / fixes.VLLM_ATTN_RES).read_text().replace("tl.debug_barrier()", "pass")
    with pytest.raises(fixes.FixError, match="attn_res.py: expected one `if HAS_DELTA:` guarding"):
        fixes.barrier_under_write_block(text, fixes.VLLM_ATTN_RES)
    with pytest.raises(fixes.FixError, match="function _aggregate_fused not found"):
        fixes.aggregate_fused_through_dispatch("x = 1\n", fixes.SGLANG_ATTN)


def test_the_cpu_visible_kernel_mutants_are_caught(tmp_path: Path) -> None:
    """An unmasked load (harness.fixes.TREE_MUTANTS): the off-path property's guard bands see it; a score norm
    over the padded width: the accuracy property's hidden sizes that are not powers of two see it."""
    r = subprocess.run([sys.executable, "scripts/prove_fixes.py", "--mutants", "--cpu-only", "--out", str(tmp_path)],
                       cwd=ROOT, capture_output=True, text=True, timeout=1500)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    table = (tmp_path / "fixes.csv").read_text()
    assert "unmasked-load" in table and "NOT CAUGHT" not in r.stdout
    # survivors of the first mutation sample, each reached by a property now (docs/mutation.md)
    for fix in ("rope-query-heads-read-head-0", "split-the-tap-layer-not-its-consumer",
                "tap-owner-prefix-by-name-prefix", "tap-owner-final-one-past-the-last", "commit-window-one-past",
                "eager-mixture-xor", "watermark-key-at-the-sampled-position", "merged-column-rows-of-rank-0"):
        assert fix in table, fix
    # the masked-lane slip (ROCm's score norm over the padded BLOCK_D): caught on the CPU under ci (issue 38)
    assert "rocm-score-norm-block-d" in table
    # real code the adapter used to replace, now bound: every layer given layer 0's norm weight (issue 38)
    assert "layer0-norm-weight" in table
    # the same slip in TokenSpeed's write_context_kv, bound once the census (harness/census.py) listed it
    assert "layer0-context-write" in table
    # softmaxes without their max subtraction (SGLang's combine, vLLM's online softmax): exact at moderate scores,
    # caught by the scores past exp's range (properties/test_extreme_scores.py)
    assert "combine-softmax-without-max" in table and "online-softmax-without-max" in table
    # issue 57's plants of our own: a softmax maximum over the batch (batch composition, SGLang's eager mixture),
    # bank rows clamped to fp16's range (massive activations, ROCm's kernel)
    assert "eager-mixture-max-over-the-batch" in table and "rocm-bank-clamped-to-fp16" in table
    # a prefix-stream tap that is the running prefix itself: caught once the next layers change it in place
    assert "prefix-tap-aliases-the-running-prefix" in table
