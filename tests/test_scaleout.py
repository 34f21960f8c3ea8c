"""pytest-xdist spreading: each worker's GPU, `-n auto`, and the one drift CSV the controller merges."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from k3num.harness import scaleout
from k3num.oracles.drift import COLUMNS, read_csv

ROOT = Path(__file__).resolve().parents[1]


def test_visible_gpus_follow_cuda_visible_devices_else_the_device_count():
    assert scaleout.visible_gpus("3, 5", 8) == ["3", "5"]
    assert scaleout.visible_gpus("", 2) == ["0", "1"]
    assert scaleout.visible_gpus(None, 0) == []


def test_workers_take_the_gpus_round_robin():
    gpus = ["0", "1"]
    assert [scaleout.gpu_for_worker(f"gw{i}", gpus) for i in range(5)] == ["0", "1", "0", "1", "0"]
    with pytest.raises(ValueError, match="not a pytest-xdist worker id"):
        scaleout.gpu_for_worker("master", gpus)
    with pytest.raises(ValueError, match="lists no GPU"):
        scaleout.gpu_for_worker("gw0", [])


def test_auto_workers_is_one_per_gpu_times_the_per_gpu_count():
    assert scaleout.auto_workers(2, None) == 2
    assert scaleout.auto_workers(2, "4") == 8
    assert scaleout.auto_workers(0, "4") is None  # no GPU: xdist's own default
    for bad in ("0", "two"):
        with pytest.raises(ValueError, match=scaleout.PER_GPU_ENV):
            scaleout.auto_workers(1, bad)


def test_a_worker_shares_its_gpu_when_more_workers_than_gpus_run(monkeypatch):
    """Then it hands its cached CUDA memory back after each test (run_isolation; GPU run 63's OOM). A worker's
    name and count come from xdist's workerinput, not from a variable a child process would inherit."""
    import types

    from k3num.harness import run_scope

    def worker(n: int, count: int):
        return types.SimpleNamespace(workerinput={"workerid": f"gw{n}", "workercount": count})

    monkeypatch.setenv("K3NUM_GPUS", "0,1")
    assert run_scope.shares_its_gpu(worker(3, 8)) and run_scope.shares_its_gpu(worker(0, 3))
    assert not run_scope.shares_its_gpu(worker(1, 2)) and not run_scope.shares_its_gpu(types.SimpleNamespace())
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw5")  # inherited by a child pytest: no worker for that
    assert run_scope.worker_id(types.SimpleNamespace()) == ""
    monkeypatch.delenv("K3NUM_GPUS")  # a CPU run: no GPU to share
    assert not run_scope.shares_its_gpu(worker(3, 8))


def test_partial_files_sit_beside_the_csv_in_worker_order(tmp_path):
    csv = tmp_path / "drift.csv"
    for w in ("gw10", "gw2", "gw0"):
        scaleout.partial_path(csv, w).write_text("x")
    (tmp_path / "other.gw1.part.csv").write_text("x")
    assert [p.name for p in scaleout.partial_paths(csv)] == [
        "drift.gw0.part.csv", "drift.gw2.part.csv", "drift.gw10.part.csv"]


def _pytest(tmp_path: Path, csv: Path, *extra: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "pytest", "properties/test_partial_projection.py", "--engine", "mirror",
           "-p", "no:cacheprovider", "-q", "--hypothesis-profile=ci", "--drift-csv", str(csv), *extra]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env={**os.environ, **(env or {})},
                          timeout=600)


def _sorted(df: pd.DataFrame) -> pd.DataFrame:
    return df.sort_values(COLUMNS).reset_index(drop=True)


def test_xdist_run_writes_one_csv_equal_to_the_serial_runs(tmp_path):
    serial, spread = tmp_path / "serial.csv", tmp_path / "spread.csv"
    stale = scaleout.partial_path(spread, "gw5")  # a partial file left by an earlier, killed run
    pd.DataFrame([{c: "stale" for c in COLUMNS}]).to_csv(stale, index=False)
    r1 = _pytest(tmp_path, serial)
    r2 = _pytest(tmp_path, spread, "-n", "2", env={scaleout.GPUS_ENV: "5,7"})
    assert r1.returncode == 0, r1.stdout[-2000:]
    assert r2.returncode == 0, r2.stdout[-2000:]
    a, b = read_csv(serial), read_csv(spread)
    assert len(a) > 0 and list(b.columns) == COLUMNS
    # derandomized profile: the same cases, whichever worker ran them; the stale file is not merged
    pd.testing.assert_frame_equal(_sorted(a), _sorted(b))
    assert scaleout.partial_paths(spread) == []  # the controller removed the workers' files
    assert f"drift CSV: {spread} ({len(b)} records)" in r2.stdout
    # each worker saw one GPU of K3NUM_GPUS, round robin
    assert "xdist workers on GPUs: gw0 -> GPU 5, gw1 -> GPU 7" in r2.stdout


def test_auto_workers_refuses_a_bad_per_gpu_count(tmp_path):
    r = _pytest(tmp_path, tmp_path / "d.csv", "-n", "auto",
                env={scaleout.GPUS_ENV: "0", scaleout.PER_GPU_ENV: "none"})
    assert r.returncode != 0
    assert f"{scaleout.PER_GPU_ENV}='none': not a whole number" in r.stdout + r.stderr


def test_a_shard_is_its_part_of_the_budget_rounded_up():
    assert [scaleout.Shard(i, 3).id for i in range(3)] == ["shard1of3", "shard2of3", "shard3of3"]
    assert scaleout.Shard(0, 3).examples(10_000) == 3334 and scaleout.Shard().examples(10_000) == 10_000
    for bad in ((3, 3), (-1, 2), (0, 0)):
        with pytest.raises(ValueError, match="expected 0 <= index < count"):
            scaleout.Shard(*bad)


SHARDED = ["properties/test_determinism.py", "-k", "repeated_calls_on_identical and attn_res_mix_eager"]


def _run(tmp_path: Path, csv: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pytest", *SHARDED, "--engine", "mirror", "-p", "no:cacheprovider",
                           "-q", "--drift-csv", str(csv), *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=600, env={**os.environ, **(env or {})})


def test_shards_split_a_shardable_propertys_examples_and_leave_it_whole_without(tmp_path):
    """--shards 2 under a random profile: two tests, each half the examples (dev: 50 -> 25 each); without
    it the node id and the count are the test's own; a derandomized profile is refused."""
    whole, split = tmp_path / "whole.csv", tmp_path / "split.csv"
    r1 = _run(tmp_path, whole, "--hypothesis-profile=dev")
    r2 = _run(tmp_path, split, "--hypothesis-profile=dev", env={scaleout.SHARDS_ENV: "2"})
    assert r1.returncode == 0 and r2.returncode == 0, r1.stdout[-2000:] + r2.stdout[-2000:]
    a, b = read_csv(whole), read_csv(split)
    node = "properties/test_determinism.py::test_repeated_calls_on_identical_inputs_are_bitwise_identical"
    assert a.groupby("node").size().to_dict() == {f"{node}[mirror-attn_res_mix_eager]": 50}
    assert b.groupby("node").size().to_dict() == {f"{node}[mirror-shard{i}of2-attn_res_mix_eager]": 25 for i in (1, 2)}
    # each shard drew its own examples: its sequence of drawn cases is not the other's. (Counting distinct
    # seeds cannot say it: hypothesis draws small and repeated integers often, and 50 random draws have
    # come out with only 25 distinct seeds.)
    drawn = {n: list(zip(g["seed"], g["shape"], g["detail"])) for n, g in b.groupby("node", sort=True)}
    one, two = drawn.values()
    assert one != two, one
    r3 = _run(tmp_path, tmp_path / "ci.csv", "--hypothesis-profile=ci", "--shards", "2")
    assert r3.returncode != 0 and "the hypothesis profile is derandomized" in r3.stdout + r3.stderr
    assert "usage error" in r3.stdout and "xdist" not in r3.stdout  # not blamed on crashed workers


def _nightly_rates():
    import importlib.util

    spec = importlib.util.spec_from_file_location("nightly_rates", ROOT / "scripts" / "nightly_rates.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["nightly_rates"] = mod  # its dataclass looks its module up there
    spec.loader.exec_module(mod)
    return mod


def test_nightly_rates_count_every_phases_cases_and_time_each_sharded_test(tmp_path):
    """scripts/nightly_rates.py on a real xdist run of two shards: each row has its shard's examples (25 of
    dev's 50), its junit seconds and the stop reason; every phase's cases are summed."""
    out = tmp_path / "night"
    out.mkdir()
    r = _run(tmp_path, out / "drift.csv", "--hypothesis-profile=dev", "--hypothesis-show-statistics", "-n", "2",
             "--junitxml", str(out / "junit.xml"), env={scaleout.SHARDS_ENV: "2"})
    assert r.returncode == 0, r.stdout[-2000:]
    (out / "pytest.log").write_text(r.stdout)
    rows, tail = _nightly_rates().table(out)
    node = "properties/test_determinism.py::test_repeated_calls_on_identical_inputs_are_bitwise_identical"
    assert sorted(row["test"] for row in rows) == [f"{node}[mirror-shard{i}of2-attn_res_mix_eager]" for i in (1, 2)]
    assert all(row["examples"] == 25 and row["stopped"] == "max_examples=25" and row["seconds"] > 0 for row in rows)
    assert tail.startswith("run wall time (pytest): ") and " s;" in tail
    log = ("== Hypothesis Statistics ==\nt.py::test_a:\n  - during explicit phase (0.1 seconds):\n"
           "    - 2 passing, 0 failing, and 0 invalid test cases\n  - during generate phase (1.0 seconds):\n"
           "    - 7 passing, 1 failing, and 3 invalid test cases\n  - Stopped because nothing left to do\n== end ==\n")
    assert _nightly_rates().junit_key("a/test_x.py::Cls::test_b[p::q]") == ("a.test_x.Cls", "test_b[p::q]")
    s = _nightly_rates().statistics(log)["t.py::test_a"]
    assert (s.examples, s.invalid, s.stopped) == (10, 3, "nothing left to do")


def test_shards_split_through_hypothesiss_public_decorator_and_refuse_a_propertys_own_settings():
    """Under --shards 2 a shardable property runs half its profile's examples, through hypothesis's public
    settings decorator; one that carries its own @settings is a usage error naming it (its budget would
    otherwise be replaced without a word)."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from k3num.harness import plugin, run

    class _Config:
        stash = {plugin.RUN: run.RunContext(shards=2)}

    class _Item:
        def __init__(self, fn):
            self.obj, self.originalname = fn, fn.__name__

        def get_closest_marker(self, name):
            return object() if name == "shardable" else None

    calls = []

    @given(st.integers())
    def plain(x):
        calls.append(x)

    @settings(max_examples=5)
    @given(st.integers())
    def own(x):
        pass

    before = settings.get_current_profile_name()
    settings.register_profile("k3num-test-shards", parent=settings.get_profile("dev"), database=None)
    settings.load_profile("k3num-test-shards")
    try:
        plugin._split_budgets(_Config(), [_Item(plain)])
        plain()
        assert len(calls) == 25  # dev's 50 examples, halved
        with pytest.raises(pytest.UsageError, match="own is shardable but carries its own @settings"):
            plugin._split_budgets(_Config(), [_Item(own)])
    finally:
        settings.load_profile(before)
