"""The main job over the pinned releases (harness/main_job.py): the default run, then one run per other pinned
release of a pin the default engines read, each writing its own CSV and leaving out/drift.csv to the default's."""

from __future__ import annotations

import dataclasses

import pytest

from k3num.harness import main_job
from k3num.supply import fetch


def test_the_main_job_runs_the_default_engines_then_each_other_pinned_release() -> None:
    plan = main_job.runs(["--drift-dir", "out", "--hypothesis-profile=ci"], stamp="T")
    assert plan[0] == ("default", ["--drift-dir", "out", "--hypothesis-profile=ci"])
    others = {label: args for label, args in plan[1:]}
    assert set(others) == {f"vllm-{v}" for v in fetch.releases("vllm") if v != fetch.PINS["vllm"].version}
    args = others["vllm-0.33.0"]
    assert args == ["--hypothesis-profile=ci", "--drift-csv", "out/runs/drift-T-vllm-0.33.0.csv",
                    "--engine", "vllm@0.33.0,vllm-rocm@0.33.0"]


def test_a_drift_csv_gets_a_sibling_per_release_and_chosen_engines_make_one_run() -> None:
    plan = main_job.runs(["--drift-csv=/tmp/x/d.csv", "-k", "attn_res"])
    assert plan[1][1] == ["-k", "attn_res", "--drift-csv", "/tmp/x/d-vllm-0.33.0.csv", "--engine",
                          "vllm@0.33.0,vllm-rocm@0.33.0"]
    for chosen in (["--engine", "mirror"], ["--engine=vllm"], ["--engine-src", "vllm=/tmp/t"]):
        assert main_job.runs(chosen) == [("default", chosen)]


def test_a_newly_pinned_release_adds_its_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """The runs come from the pins: a third vLLM release is a third run (sglang's second, a run of sglang)."""
    extra = dataclasses.replace(fetch.PINS["sglang"], version="9.9.9")
    monkeypatch.setitem(fetch.RELEASES, "sglang", (*fetch.RELEASES["sglang"], extra))
    labels = [label for label, _ in main_job.runs([], stamp="T")]
    assert labels == ["default", "vllm-0.33.0", "sglang-9.9.9"]
    assert main_job.runs([], stamp="T")[2][1] == ["--engine", "sglang@9.9.9"]


def test_the_jobs_last_next_line_names_the_default_runs_history_and_each_release_its_own() -> None:
    plan = main_job.runs(["--drift-dir", "out", "--hypothesis-profile=ci"], stamp="T")
    lines = main_job.next_lines(plan)
    assert lines[-1].endswith("report --history out/history --out out/report out/drift.csv"), lines
    for label, _ in plan[1:]:
        assert any(f"--history out/history-{label} " in ln and f"drift-T-{label}.csv" in ln for ln in lines), lines
    assert main_job.next_lines(main_job.runs(["--drift-csv=/tmp/x/d.csv"])) == []
