"""bench/suite_profile.py: on the CPU, one small property through the profiler: the examples are counted,
the phases' shares cover the test's wall time, and the plain run gives examples/s."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pandas as pd

ROOT = Path(__file__).resolve().parents[1]


def test_the_profile_counts_examples_and_its_shares_cover_the_wall_time(tmp_path: Path) -> None:
    csv = tmp_path / "profile.csv"
    proc = subprocess.run([sys.executable, "bench/suite_profile.py", "--file", "properties/test_attn_res.py",
                           "--jobs", "mirror:test_attn_res_within_rounding_budget_of_oracle", "--examples", "8",
                           "--csv", str(csv), "--out", str(tmp_path / "runs")],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    (row,) = pd.read_csv(csv).to_dict("records")
    assert row["rc"] == 0 and row["plain_rc"] == 0
    assert row["examples"] >= 8 and row["plain_examples"] >= 8 and row["examples_per_s"] > 0
    shares = sum(row[f"{c}_%"] for c in ("case", "subject", "oracle", "judge", "records", "sync"))
    assert 99.0 <= shares <= 101.0, row
    assert row["subject_%"] > 0 and row["oracle_%"] > 0 and row["judge_%"] > 0
