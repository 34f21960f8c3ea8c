"""scripts/gpu_nightly.sh end to end on the CPU (K3NUM_NIGHTLY_DEVICE=cpu): xdist workers, the merged CSV
and its metadata, the history check before the run, the report after it, and the gate's exit status."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from k3num.oracles import history as hist

ROOT = Path(__file__).resolve().parents[1]
SUITE = "properties/test_partial_projection.py"


def _nightly(out: Path, history: Path, *extra: str, **env: str) -> subprocess.CompletedProcess:
    base = {"K3NUM_NIGHTLY_DEVICE": "cpu", "K3NUM_ENGINES": "mirror", "K3NUM_PROFILE": "ci",
            "K3NUM_SUITE": SUITE, "K3NUM_HISTORY": str(history), "K3NUM_WORKERS": "2"}
    return subprocess.run(["bash", "scripts/gpu_nightly.sh", str(out), *extra], cwd=ROOT, capture_output=True,
                          text=True, env={**os.environ, **base, **env}, timeout=900)


def test_the_nightly_loop_appends_reports_and_gates(tmp_path):
    h = tmp_path / "history"
    first = _nightly(tmp_path / "n1", h, K3NUM_IMPACT_CASES="1")
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-2000:]
    for name in ("drift.csv", "drift.meta.json", "summary.md", "report/report.md", "report/report.html",
                 "impact-ledger.csv"):
        assert (tmp_path / "n1" / name).exists(), name
    # the ledger table gives each entry's token severity from `k3num impact --ledger` (K3N-001: the ROCm tap)
    assert "| K3N-001 | vllm-rocm |" in (tmp_path / "n1" / "report" / "report.md").read_text()
    assert "changes decided tokens" in (tmp_path / "n1" / "report" / "report.md").read_text()
    assert "created: 2/2 workers" in (tmp_path / "n1" / "pytest.log").read_text()  # xdist ran it
    second = _nightly(tmp_path / "n2", h, K3NUM_GATE="1")
    assert second.returncode == 0, second.stdout[-3000:]
    assert "Regression gate: 0 alarm(s)" in (tmp_path / "n2" / "report" / "report.md").read_text()
    # the same cases (ci is derandomized) through tests.mutants' within-budget drift: every property passes,
    # the gate stops the job
    drift = _nightly(tmp_path / "n3", h, "-p", "tests.mutants", K3NUM_GATE="1", K3NUM_DRIFT="unsharded_norm_rounded")
    assert "11 passed" in drift.stdout, drift.stdout[-3000:]
    assert drift.returncode == 1
    assert "GATE: 1 group(s) drifted" in drift.stdout + drift.stderr
    runs = hist.load_history(h).runs
    assert len(runs) == 3 and runs[-1]["meta"]["profile"] == "ci"


def test_an_unusable_history_stops_the_nightly_before_pytest_runs(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    r = _nightly(tmp_path / "n", blocker / "history")
    assert r.returncode == 2 and "cannot be created" in r.stderr
    assert not (tmp_path / "n" / "pytest.log").exists()


def test_an_unknown_nightly_device_is_refused(tmp_path):
    r = _nightly(tmp_path / "n", tmp_path / "h", K3NUM_NIGHTLY_DEVICE="tpu")
    assert r.returncode == 2 and "K3NUM_NIGHTLY_DEVICE=tpu: cuda or cpu" in r.stdout
