"""The nightly workflow and script agree with the harness: a matrix over known engines and GPU runners,
hypothesis's example database and the history kept between nights, the report uploaded."""

from __future__ import annotations

from pathlib import Path

import yaml

from k3num.engines import registry

ROOT = Path(__file__).resolve().parents[1]


def _job() -> dict:
    wf = yaml.safe_load((ROOT / ".github/workflows/nightly-gpu.yml").read_text())
    return wf["jobs"]["properties"]


def test_the_matrix_spans_known_engines_and_gpu_runners():
    m = _job()["strategy"]["matrix"]
    assert set(m["engine"]) <= set(registry.known()) and len(m["engine"]) >= 3
    assert len(m["gpus"]) >= 2
    assert "${{ matrix.gpus }}" in _job()["runs-on"]


def test_the_example_database_and_the_history_persist_between_nights():
    steps = _job()["steps"]
    cached = {s["with"]["path"] for s in steps if s.get("uses", "").startswith("actions/cache")}
    assert cached == {".hypothesis", "history"}
    env = _job()["env"]
    assert env["K3NUM_HISTORY"].startswith("history/") and env["K3NUM_GATE"] == "1"
    uploaded = next(s for s in steps if s.get("uses", "").startswith("actions/upload-artifact"))["with"]["path"]
    assert "out/nightly/" in uploaded and "history/" in uploaded


def test_the_script_reads_every_variable_the_workflow_sets():
    script = (ROOT / "scripts/gpu_nightly.sh").read_text()
    for var in _job()["env"]:
        assert var in script, var
