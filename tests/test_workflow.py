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


def test_the_vllm_cell_builds_the_compiled_ops_of_every_pinned_release():
    """Without `k3num build-ops` the nightly's vLLM cell would skip every compiled-op property (the context-KV
    ops, the MLA epilogues): one build for the default release, one per other pinned release from its tree."""
    from k3num.supply import fetch

    step = next(s for s in _job()["steps"] if "build-ops" in s.get("run", ""))
    assert step["if"] == "matrix.engine == 'vllm'"
    assert "k3num build-ops\n" in step["run"]
    for pin in fetch.SDIST_RELEASES["vllm"]:
        if pin is not fetch.SDISTS["vllm"]:
            assert f"vllm-{pin.version}" in step["run"], pin.version


def test_the_script_reads_every_variable_the_workflow_sets():
    script = (ROOT / "scripts/gpu_nightly.sh").read_text()
    for var in _job()["env"]:
        assert var in script, var


def _pr_job() -> tuple[dict, dict]:
    wf = yaml.safe_load((ROOT / "examples/engine-ci.yml").read_text())
    return wf, wf["jobs"]["check"]


def test_the_engine_repositorys_pull_request_job_runs_k3num_check_on_its_tree():
    wf, job = _pr_job()
    trigger = wf.get(True, wf.get("on"))  # YAML 1.1 reads the key `on` as True
    assert "pull_request" in trigger and "csrc/**" in trigger["pull_request"]["paths"]
    assert job["env"]["K3NUM_ENGINE"] in registry.known()
    runs = "\n".join(s.get("run", "") for s in job["steps"])
    assert 'k3num fetch "$K3NUM_ENGINE"' in runs
    assert 'k3num check --engine "$K3NUM_ENGINE" --head . --out out/check' in runs
    assert "torch==2.13.0" in runs and "--index-url https://download.pytorch.org/whl/cpu" in runs


def test_the_pull_request_job_posts_check_md_uploads_the_check_and_keeps_the_verdict():
    _, job = _pr_job()
    steps = job["steps"]
    names = [s.get("id") or s.get("name", "") for s in steps]
    post = next(s for s in steps if "gh pr comment" in s.get("run", ""))
    assert "--body-file out/check/check.md" in post["run"] and post["if"].startswith("always()")
    upload = next(s for s in steps if s.get("uses", "").startswith("actions/upload-artifact"))
    assert upload["with"]["path"] == "out/check/" and upload["if"] == "always()"
    # the check's exit code is kept past the comment and the upload, and decides the job last
    assert names.index("check") < steps.index(post) < steps.index(upload) < len(steps) - 1
    assert steps[-1]["run"] == 'exit "${{ steps.check.outputs.rc }}"'
    assert "set +e" in steps[names.index("check")]["run"]
