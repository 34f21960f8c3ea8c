"""A verdict that holds on a bad night (issue 20): nothing passes on nothing, bad input stops before the
run in one line, and the log ends with what a user reads: the engines, the drift table, the CSV, the
next command."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from k3num.harness import cli, fixes
from k3num.oracles import history as hist
from k3num.oracles.drift import COLUMNS
from k3num.supply import fetch

ROOT = Path(__file__).resolve().parents[1]
PROP = "properties/test_tap_owner.py"  # fast on every engine that has the rule, skipped on the others


def _pytest(*args: str, timeout: int = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pytest", *args, "-q", "-p", "no:cacheprovider",
                           "--hypothesis-profile=ci"], cwd=ROOT, capture_output=True, text=True, timeout=timeout)


# --- nothing passes on nothing ---------------------------------------------------------------------


def test_an_engine_src_without_the_engines_files_is_refused_before_the_run_naming_why(tmp_path: Path) -> None:
    r = _pytest(PROP, "--engine-src", f"vllm={tmp_path}", "--drift-dir", str(tmp_path / "out"))
    assert r.returncode == 4, r.stdout[-3000:] + r.stderr[-3000:]
    assert f"--engine-src vllm={tmp_path}: {tmp_path}: holds none of vllm's bound files" in r.stderr, r.stderr[-3000:]
    # nothing ran, so nothing was written and no latest link points at the refused run
    assert not (tmp_path / "out" / "drift.csv").exists() and not list((tmp_path / "out").glob("runs/*.csv"))


def test_a_tree_missing_one_of_its_releases_files_is_refused_naming_the_file(tmp_path: Path) -> None:
    tree = fixes.pinned_tree("vllm@0.33.0", tmp_path / "t")
    gone = fetch.release_pin("vllm@0.33.0").files[-1]
    (tree / gone).unlink()
    r = _pytest(PROP, "--engine", "vllm", "--engine-src", f"vllm={tree}")
    assert r.returncode == 4 and "says vllm 0.33.0 and lacks 1 of 0.33.0's" in r.stderr, r.stderr[-3000:]
    assert gone in r.stderr


def test_default_engines_may_skip_but_each_says_so_in_one_line() -> None:
    r = _pytest(PROP)
    assert r.returncode == 0, r.stdout[-3000:]
    block = r.stdout.split("= k3-numerics =")[-1]
    for name in ("mirror", "vllm", "vllm-rocm", "tokenspeed", "sglang"):
        assert re.search(rf"^  {name}[ :].*: \d+ run, \d+ skipped, \d+ known", block, re.M), (name, block)


def _frame(subject: str, n: int = 20) -> pd.DataFrame:
    rng = np.random.default_rng(0)
    df = pd.DataFrame({c: "" for c in COLUMNS}, index=range(n))
    num = ["reduction_len", "seed", "max_abs", "rel_fro", "max_ulp", "cosine", "nonfinite_mismatch", "baseline_err",
           "budget", "ratio", "calls", "distinct", "over_budget", "numel"]
    for c in num:
        df[c] = 0.0
    df["ratio"] = rng.uniform(0.1, 0.5, n)
    df["budget"], df["max_abs"] = 1.0, df["ratio"]
    df["engine"], df["engine_version"], df["mode"], df["device"] = subject.split(":")[0], "1", "m", "cpu"
    df["subject"], df["property"], df["verdict"] = subject.split(":")[1], "p", "pass"
    return df


def _csv(tmp_path: Path, name: str, df: pd.DataFrame, date: str) -> Path:
    p = tmp_path / f"{name}.csv"
    df[COLUMNS].to_csv(p, index=False)
    hist.meta_path(p).write_text(json.dumps({"date": date, "profile": "ci", "device_name": "d"}))
    return p


def test_the_gate_fails_on_an_empty_run(tmp_path: Path, capsys) -> None:
    h = tmp_path / "h"
    assert cli.main(["report", "--history", str(h), str(_csv(tmp_path, "a", _frame("mirror:s"), "2026-11-01"))]) == 0
    empty = _csv(tmp_path, "empty", _frame("mirror:s").iloc[:0], "2026-11-02")
    assert cli.main(["report", "--history", str(h), "--gate", str(empty)]) == 2
    assert "a gate on an empty run does not pass" in capsys.readouterr().err


def test_the_gate_fails_on_every_group_of_the_history_the_run_lacks_unless_allowed(tmp_path: Path, capsys) -> None:
    h = tmp_path / "h"
    both = pd.concat([_frame("mirror:s"), _frame("sglang:attn_res_mix")], ignore_index=True)
    for i in range(3):
        assert cli.main(["report", "--history", str(h), str(_csv(tmp_path, f"r{i}", both, f"2026-11-0{i + 1}"))]) == 0
    only_mirror = _csv(tmp_path, "m", _frame("mirror:s"), "2026-11-05")
    capsys.readouterr()
    assert cli.main(["report", "--history", str(h), "--gate", str(only_mirror)]) == 1
    err = capsys.readouterr().err
    assert "GATE: missing from this run: sglang/attn_res_mix/p/m/cpu" in err, err
    again = _csv(tmp_path, "m2", _frame("mirror:s"), "2026-11-06")
    assert cli.main(["report", "--history", str(h), "--gate", str(again), "--allow-missing", "sglang"]) == 0


def test_a_gate_without_history_still_writes_the_report_then_exits_2(tmp_path: Path, capsys) -> None:
    out = tmp_path / "report"
    rc = cli.main(["report", "--history", str(tmp_path / "h"), "--out", str(out), "--gate",
                   str(_csv(tmp_path, "a", _frame("mirror:s"), "2026-11-01"))])
    assert rc == 2 and (out / "report.md").exists() and (out / "report.html").exists()


def test_reporting_one_run_twice_appends_it_once(tmp_path: Path, capsys) -> None:
    h, csv = tmp_path / "h", _csv(tmp_path, "a", _frame("mirror:s"), "2026-11-01")
    assert cli.main(["report", "--history", str(h), str(csv)]) == 0
    assert cli.main(["report", "--history", str(h), str(csv)]) == 0
    assert "already in the history" in capsys.readouterr().out
    assert len(hist.load_history(h).runs) == 1


# --- bad input stops before the run ------------------------------------------------------------------


@pytest.mark.parametrize("args, message", [
    (("--drift-csv", "/proc/x.csv"), r"^ERROR: --drift-csv /proc/x.csv: cannot write there \(.*\); give a path"),
    (("--hypothesis-profile", "nightlyy"),
     r"^ERROR: --hypothesis-profile nightlyy: not a registered profile; the suite.s: .*\bnightly\b"),
    (("--engine", "vlm"), r"^ERROR: --engine vlm: unknown engine\(s\) vlm; known: mirror, sglang, tokenspeed, vllm"),
])
def test_bad_input_is_a_usage_error_of_one_line_before_anything_runs(args: tuple, message: str) -> None:
    r = subprocess.run([sys.executable, "-m", "pytest", PROP, *args, "-q", "-p", "no:cacheprovider"], cwd=ROOT,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 4, (r.returncode, r.stdout[-2000:], r.stderr[-2000:])
    lines = [ln for ln in (r.stdout + r.stderr).splitlines() if ln.strip()]
    assert len(lines) == 1 and re.match(message, lines[0]), lines
    assert "passed" not in r.stdout and "INTERNALERROR" not in r.stdout + r.stderr


def test_fetch_refuses_an_unknown_target_listing_every_valid_one(capsys) -> None:
    assert cli.main(["fetch", "bogus"]) == 2
    err = capsys.readouterr().err
    assert ("unknown target(s) bogus; valid: sglang, tokenspeed, vllm, vllm@0.33.0, vllm@0.33.0-csrc, vllm-csrc, "
            "tokenspeed-bin") in err


# --- the log ----------------------------------------------------------------------------------------


def test_the_log_ends_with_the_engines_the_drift_table_the_csv_and_the_next_command(tmp_path: Path) -> None:
    r = _pytest("properties/test_attn_res.py", "--engine", "mirror,sglang", "--drift-dir", str(tmp_path))
    assert r.returncode == 1, r.stdout[-3000:]  # sglang has no attn_res subject: asked for, ran nothing
    lines = r.stdout.rstrip().splitlines()
    at = {key: max(i for i, ln in enumerate(lines) if ln.startswith(key)) for key in (
        "engines (how each was bound", "  mirror", "  sglang", "drift: worst", "drift CSV:", "next: k3num report")}
    assert at["engines (how each was bound"] < at["  mirror"] < at["drift: worst"] < at["drift CSV:"] \
        < at["next: k3num report"] == len(lines) - 1, r.stdout[-3000:]
    assert "Failing explicit example" not in r.stdout  # a skip raised inside an @example is a skip
    assert "SKIPPED" not in r.stdout  # grouped by reason in the block, not a line per test
    assert re.search(r"^\s+7\s+engine sglang 0\.5\.23 has no subject attn_res", r.stdout, re.M), r.stdout[-3000:]


def test_each_run_writes_its_own_csv_and_the_latest_link_follows(tmp_path: Path) -> None:
    for _ in range(2):
        r = _pytest(PROP, "--engine", "mirror", "--drift-dir", str(tmp_path))
        assert r.returncode == 0, r.stdout[-3000:]
    runs = sorted((tmp_path / "runs").glob("drift-*.csv"))
    assert len(runs) == 2
    assert (tmp_path / "drift.csv").resolve() == runs[-1].resolve()
    assert (tmp_path / "drift.meta.json").resolve() == hist.meta_path(runs[-1]).resolve()


def test_collect_only_with_an_engine_src_lacking_its_files_is_refused_as_a_run_is(tmp_path: Path) -> None:
    """`pytest --co --engine-src vllm=<empty dir>` once exited 0 silently: it is refused like a run."""
    r = _pytest(PROP, "--co", "--engine-src", f"vllm={tmp_path}")
    assert r.returncode == 4 and "holds none of vllm's bound files" in r.stderr, r.stdout[-3000:] + r.stderr[-3000:]
