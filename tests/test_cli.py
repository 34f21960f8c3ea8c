"""`k3num`: one module (harness/cli.py), one function per subcommand, all listed by --help."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_help_lists_every_subcommand() -> None:
    r = subprocess.run([sys.executable, "-m", "k3num.harness.cli", "--help"], cwd=ROOT, capture_output=True,
                          text=True)
    assert r.returncode == 0
    for cmd in ("fetch", "build-ops", "golden", "replay", "repro", "report", "bisect"):
        assert cmd in r.stdout, (cmd, r.stdout)


def test_an_unknown_subcommand_is_refused_with_the_list() -> None:
    r = subprocess.run([sys.executable, "-m", "k3num.harness.cli", "frobnicate"], cwd=ROOT, capture_output=True,
                          text=True)
    assert r.returncode == 2 and "invalid choice: 'frobnicate'" in r.stderr
