"""`source scripts/env.sh` is safe in a user's interactive shell (issue 41): it leaves the caller's shell
options as they were, so a command that fails afterwards does not close the shell, and a step of its own
that fails returns non-zero instead of exiting."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OPTIONS = ("errexit", "nounset", "pipefail")


def _interactive(script: str, **env: str) -> subprocess.CompletedProcess[str]:
    # this test's own interpreter's venv stands in for .venv (its stamp may be older: K3NUM_VENV points at a
    # venv whose stamp matches, else the source would reinstall)
    return subprocess.run(["bash", "-i", "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={**os.environ, **env}, stdin=subprocess.DEVNULL)


def _venv_with_stamp(tmp_path: Path) -> Path:
    """A venv folder whose python is this interpreter and whose stamp matches pyproject.toml (no install)."""
    import hashlib

    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").symlink_to(sys.executable)
    (venv / "bin" / "activate").write_text(f'export PATH="{Path(sys.executable).parent}:$PATH"\n')
    want = hashlib.sha256((ROOT / "pyproject.toml").read_bytes()).hexdigest()
    (venv / ".k3num-installed").write_text(want + "\n")
    return venv


def test_sourcing_env_sh_leaves_the_callers_shell_options_and_a_failing_command_keeps_the_shell(tmp_path):
    venv = _venv_with_stamp(tmp_path)
    r = _interactive("source scripts/env.sh; echo sourced=$?; false; echo alive=$?; set -o", K3NUM_VENV=str(venv))
    assert "sourced=0" in r.stdout and "alive=1" in r.stdout, r.stdout + r.stderr
    for opt in OPTIONS:
        assert any(line.split() == [opt, "off"] for line in r.stdout.splitlines()), (opt, r.stdout)


def test_a_failing_env_step_returns_nonzero_without_closing_the_shell(tmp_path):
    blocked = tmp_path / "file"
    blocked.write_text("not a folder")
    r = _interactive("source scripts/env.sh; echo sourced=$?; echo alive", K3NUM_VENV=str(blocked / "venv"))
    assert "alive" in r.stdout, r.stdout + r.stderr
    assert "sourced=0" not in r.stdout and "[env] ERROR" in r.stderr, r.stdout + r.stderr


def test_a_strict_caller_keeps_its_own_options(tmp_path):
    venv = _venv_with_stamp(tmp_path)
    r = subprocess.run(["bash", "-c", "set -euo pipefail; source scripts/env.sh; set -o"], cwd=ROOT,
                       capture_output=True, text=True, timeout=600, env={**os.environ, "K3NUM_VENV": str(venv)})
    assert r.returncode == 0, r.stderr
    for opt in OPTIONS:
        assert any(line.split() == [opt, "on"] for line in r.stdout.splitlines()), (opt, r.stdout)
