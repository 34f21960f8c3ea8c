"""A run whose xdist workers all die before a test runs says what each died of (its last lines) and exits with
the harness's own verdict (exit 1, never ran), where xdist alone ended with "INTERNALERROR RuntimeError:
Unexpectedly no active workers available", "no tests ran", exit 3 (issue 37)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_every_worker_dead_before_a_test_is_said_with_what_each_died_of() -> None:
    r = subprocess.run([sys.executable, "-m", "pytest", "properties/test_tap_owner.py", "-p", "tests.dying_worker",
                        "-n", "2", "-p", "no:cacheprovider", "--hypothesis-profile=ci", "--max-worker-restart", "1"],
                       cwd=ROOT, capture_output=True, text=True, timeout=600)
    out = r.stdout + r.stderr
    assert r.returncode == 1, out[-3000:]
    block = out.split("k3-numerics ==")[-1]
    assert "ERROR: no test ran: every xdist worker died before running one" in block, out[-3000:]
    assert "RuntimeError: planted death of gw" in block and "CUDA error: out of memory" in block, block
