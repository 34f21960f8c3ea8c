"""Judging around a known divergence (harness/around.py): vllm-rocm's token properties and `k3num impact` run once
more with K3N-001's fix applied, so a second bug planted on vllm-rocm fails there while the entry keeps the plain
engine's failures; its control (a comment in the same file) fails nothing."""

from __future__ import annotations

import io
import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from k3num.harness import around, fixes
from k3num.oracles import ledger
from k3num.supply import fetch

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "COLUMNS": "400"}  # the summary lines whole


@pytest.fixture(autouse=True)
def _fetched() -> None:
    if fetch.missing_files("vllm"):
        pytest.skip("vllm is not fetched here: run `k3num fetch vllm`")


def test_the_token_properties_of_vllm_rocm_run_around_k3n_001s_fix() -> None:
    assert around.variants(["vllm-rocm", "mirror"], "test_a_decided_token_never_flips") == ["vllm-rocm+fix-K3N-001"]
    assert around.variants(["vllm"], "test_a_decided_token_never_flips") == []
    assert around.variants(["vllm-rocm"], "test_branch3_non_final_stage_raises_when_configured_to") == []
    name, fix = around.split("vllm-rocm+fix-K3N-001")
    assert name == "vllm-rocm" and fix is not None and around.entry_ids(fix) == ("K3N-001", "K3N-002")
    assert around.split("vllm-rocm") == ("vllm-rocm", None)
    with pytest.raises(ValueError, match="no fix of K3N-999 runs around it on vllm-rocm"):
        around.split("vllm-rocm+fix-K3N-999")
    # the entries the fix edits do not apply on the variant; the others do
    entries = [ledger.by_id(i) for i in ("K3N-001", "K3N-003", "K3N-007")]
    assert [d.id for d in around.unfixed_entries(fix, entries)] == ["K3N-007"]


def test_the_fix_applies_to_every_pinned_release_and_on_top_of_a_tree(tmp_path: Path) -> None:
    fix = fixes.by_id("K3N-001/002")
    for spec in ("vllm", "vllm@0.34.0"):
        src = fetch.source_of(spec, {})
        if fetch.missing_files(src):
            continue
        tree = fixes.patched_copy(fix, src, tmp_path / spec)
        assert "k3num fix" in (tree / fixes.ROCM_LINEAR).read_text()
    planted = fixes.patched_tree(fixes.by_id("rocm-score-unnormalized"), tmp_path / "planted")
    both = fixes.patched_copy(fix, fetch.source_of("vllm", {"vllm": planted}), tmp_path / "both")
    assert "k3num planted" in (both / fixes.ROCM_ATTN_RES).read_text()
    assert "k3num fix" in (both / fixes.ROCM_LINEAR).read_text()


def test_a_tree_that_edits_the_entrys_files_is_not_judged_around_it(tmp_path: Path) -> None:
    tree = fixes.pinned_tree("vllm", tmp_path / "edited")
    with open(tree / fixes.ROCM_LINEAR, "a") as fh:
        fh.write("\n# a head's edit\n")
    with pytest.raises(around.Unavailable, match="K3N-001, K3N-002 do not apply to .* judged plainly there already"):
        around.engine("vllm-rocm+fix-K3N-001", {"vllm": tree}, "auto")


def _tokens(tree: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pytest", "properties/test_draft_tokens.py", "-p", "no:cacheprovider",
                           "--engine", "vllm-rocm", "--engine-src", f"vllm={tree}", "--hypothesis-profile", "ci",
                           "-k", "decided and dspark", "-rfEx", "-v"], cwd=ROOT, capture_output=True, text=True,
                          timeout=900, env=ENV)


def test_a_second_bug_on_vllm_rocm_fails_its_token_property_around_k3n_001(tmp_path: Path) -> None:
    """The planted score without the source's RMS (harness/fixes.py rocm-score-unnormalized): the plain vllm-rocm
    token property stays K3N-001's (its tap returns the prefix and never mixes), the variant fails; the control
    passes the variant."""
    planted = fixes.patched_tree(fixes.by_id("rocm-score-unnormalized"), tmp_path / "planted")
    r = _tokens(planted)
    out = r.stdout + r.stderr
    assert r.returncode == 1, out[-3000:]
    assert "FAILED properties/test_draft_tokens.py::test_a_decided_token_never_flips[vllm-rocm+fix-K3N-001-dspark]" \
        in out, out[-3000:]
    assert "XFAIL properties/test_draft_tokens.py::test_a_decided_token_never_flips[vllm-rocm-dspark]" in out
    control = fixes.patched_tree(fixes.by_id("rocm-attn-res-control"), tmp_path / "control")
    r = _tokens(control)
    out = r.stdout + r.stderr
    assert r.returncode == 0 and "1 passed, 6 deselected, 1 xfailed" in out, out[-3000:]
    version = fetch.PINS["vllm"].version
    assert f"vllm-rocm+fix-K3N-001 {version}+local: source-interpreter (K3N-001/002's fix applied" in out


def test_impact_sees_a_second_bug_on_vllm_rocm_around_k3n_001(tmp_path: Path) -> None:
    # 8 cases: with DSpark's Markov head (session 26) 4 drawn DSpark blocks under the fix flip no decided token
    # (the planted bug's logit error reaches 10x delta there: "decided tokens in reach"); 8 flip 5
    def impact(tree: Path) -> tuple[int, pd.DataFrame]:
        r = subprocess.run([sys.executable, "-m", "k3num.harness.cli", "impact", "--engine", "vllm-rocm",
                            "--engine-src", f"vllm={tree}", "--cases", "8", "--format", "csv"], cwd=ROOT,
                           capture_output=True, text=True, timeout=600, env=ENV)
        assert r.returncode in (0, 1), r.stderr[-2000:]
        return r.returncode, pd.read_csv(io.StringIO(r.stdout)).fillna({"ledger": ""})

    rc, rows = impact(fixes.patched_tree(fixes.by_id("rocm-score-unnormalized"), tmp_path / "planted"))
    plain, variant = rows[rows.engine == "vllm-rocm"], rows[rows.engine == "vllm-rocm+fix-K3N-001"]
    assert rc == 1 and len(plain) == 2 and len(variant) == 2, rows
    assert (plain.ledger == "K3N-001").all()  # the plain engine's flips are the entry's
    assert (variant.ledger == "").all() and (variant.severity == "changes decided tokens").all(), variant
    rc, rows = impact(fixes.patched_tree(fixes.by_id("rocm-attn-res-control"), tmp_path / "control"))
    variant = rows[rows.engine == "vllm-rocm+fix-K3N-001"]
    assert rc == 0 and len(variant) == 2 and (variant.diverged == 0).all(), rows
    assert variant.severity.isin(["no token changes", "near-ties only"]).all(), variant


def test_check_judges_a_second_bug_on_vllm_rocm_around_k3n_001_new(tmp_path: Path) -> None:
    """`k3num check` runs vllm-rocm's token property around K3N-001's fix on both sides (the head's tree with the
    fix against the base's with the same fix): the planted score without the source's RMS is new there, while
    the plain engine's failure stays K3N-001's (known by the pairing). Without the variant the check called every
    head failure of these properties known while the tap returns the prefix."""
    planted = fixes.patched_tree(fixes.by_id("rocm-score-unnormalized"), tmp_path / "planted")
    r = subprocess.run([sys.executable, "-m", "k3num.harness.cli", "check", "--engine", "vllm-rocm", "--head",
                        str(planted), "-k", "test_draft_tokens and decided and dspark", "--out", str(tmp_path / "out")],
                       cwd=ROOT, capture_output=True, text=True, timeout=1200, env=ENV)
    out = r.stdout + r.stderr
    assert r.returncode == 1, out[-3000:]
    assert "FAIL: 1 test(s) with new failures" in out and ", 1 known;" in out, out[-2000:]
    report = (tmp_path / "out" / "check.md").read_text()
    row = next(line for line in report.splitlines() if "[vllm-rocm+fix-K3N-001-dspark]" in line)
    assert "not K3N-001's bug" not in row, row  # the fixed entry is not judged on the variant at all
