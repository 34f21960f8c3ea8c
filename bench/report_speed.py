"""`k3num report` over a long history: its time and peak memory.

Builds a history of RUNS runs of ROWS drift records each (GROUPS engine/subject/property groups,
ratios drawn per group, every drift-CSV column filled), each appended through the same code the
command uses (oracles.history.summarize_run, write_run), then times one `k3num report --gate` that
appends run RUNS + 1 (a ROWS-record CSV) and renders the report over all of them, in a child process
whose peak resident memory is read from the OS. Prints a table (and writes it as CSV with --csv).

Usage: python bench/report_speed.py [--runs 100] [--rows 100000] [--groups 50] [--csv PATH]
Issue 11's target: 100 runs of 100k rows in under 30 s and 2 GB on the 2-core CI machine.
"""

from __future__ import annotations

import argparse
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pandas as pd

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from k3num.oracles import history as hist  # noqa: E402
from k3num.oracles.drift import COLUMNS  # noqa: E402


def make_run(rows: int, groups: int, rng: np.random.Generator) -> pd.DataFrame:
    """A drift CSV's worth of records: `groups` groups (5 engines x 4 subjects x groups/20 properties, as
    in a real nightly, where 40 groups make 16 engine/subject plots), ratios Beta(2, 5), reduction lengths
    16..8192."""
    g = rng.integers(0, groups, rows)
    df = pd.DataFrame({c: "" for c in COLUMNS}, index=range(rows))
    df["engine"] = np.array(["vllm", "vllm-rocm", "sglang", "tokenspeed", "mirror"])[g % 5]
    # like a real nightly: every engine has a few subjects, each judged by a few properties
    df["subject"] = np.char.add("subject", ((g // 5) % 4).astype(str))
    df["property"] = np.char.add("property", (g // 20).astype(str))
    df["engine_version"], df["mode"], df["device"], df["dtype"] = "1.0", "source-gpu", "cuda:0", "bfloat16"
    df["shape"] = "64x7168"
    n = 2 ** rng.integers(4, 14, rows)
    df["reduction_len"] = n
    df["seed"] = rng.integers(0, 2**31, rows)
    df["budget"] = 1e-3 * np.sqrt(n)
    df["ratio"] = rng.beta(2, 5, rows)
    df["max_abs"] = df["ratio"] * df["budget"]
    for c in ("rel_fro", "max_ulp", "cosine", "baseline_err"):
        df[c] = rng.random(rows)
    df["nonfinite_mismatch"], df["over_budget"], df["numel"] = 0, 0, 458752
    df["calls"] = np.where(g % 7 == 0, 152, 0)
    df["distinct"] = np.where(g % 7 == 0, 1, 0)
    df["verdict"], df["budget_rule"] = "pass", "u*sqrt(n)"
    df["node"] = np.char.add("properties/test_x.py::test_", df["property"].to_numpy().astype(str))
    return df[COLUMNS]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=100)
    ap.add_argument("--rows", type=int, default=100_000)
    ap.add_argument("--groups", type=int, default=50)
    ap.add_argument("--csv", default=None)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory(prefix="k3num-report-bench-") as tmp:
        h = Path(tmp) / "history"
        t0 = time.perf_counter()
        for i in range(args.runs):
            run = hist.summarize_run(make_run(args.rows, args.groups, rng), {
                "date": f"2026-{1 + i // 28:02d}-{1 + i % 28:02d}T02:17:00Z", "profile": "nightly",
                "device_name": "NVIDIA H200", "harness_commit": f"{i:07x}"})
            hist.write_run(h, run)
            if (i + 1) % 10 == 0:
                print(f"[bench] history: {i + 1}/{args.runs} runs of {args.rows} records "
                      f"({time.perf_counter() - t0:.1f} s)", flush=True)
        setup = (time.perf_counter() - t0) / args.runs
        csv = Path(tmp) / "drift.csv"
        make_run(args.rows, args.groups, rng).to_csv(csv, index=False)
        hist.meta_path(csv).write_text('{"date": "2026-12-31T02:17:00Z", "profile": "nightly", '
                                       '"device_name": "NVIDIA H200", "harness_commit": "bench"}')
        before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
        t1 = time.perf_counter()
        r = subprocess.run([sys.executable, "-m", "k3num.harness.cli", "report", "--history", str(h), "--gate",
                            "--out", str(Path(tmp) / "report"), str(csv)], cwd=ROOT, capture_output=True, text=True)
        wall = time.perf_counter() - t1
        peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
        if r.returncode not in (0, 1):
            print(r.stdout[-2000:], r.stderr[-2000:])
            return 1
        pngs = len(list((Path(tmp) / "report").glob("*.png")))
        history_mib = sum(p.stat().st_size for p in h.glob("*.json")) / 2**20
    table = pd.DataFrame([{
        "runs": args.runs + 1, "rows_per_run": args.rows, "groups": args.groups,
        "append_s_per_run": round(setup, 2), "history_MiB": round(history_mib, 1),
        "report_wall_s": round(wall, 1), "report_peak_MiB": round(max(peak, before) / 1024, 0), "plots": pngs,
        "gate_exit": r.returncode}])
    print(table.to_string(index=False))
    if args.csv:
        table.to_csv(args.csv, index=False)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
