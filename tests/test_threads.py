"""One torch CPU thread per process the harness starts, unless the user says otherwise (issue 41): the run
context's `threads` (harness/run.py), set in the main process, carried to xdist's workers and a test's
subprocesses, and overridden by --threads, K3NUM_THREADS or OMP_NUM_THREADS."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from k3num.harness import run

ROOT = Path(__file__).resolve().parents[1]

PROBE = '''
import os, pathlib, torch
def test_threads():
    name = os.environ.get("PYTEST_XDIST_WORKER", "main")
    pathlib.Path(__file__).with_name(f"threads-{name}.txt").write_text(
        f"THREADS {torch.get_num_threads()} {os.environ.get('K3NUM_THREADS')}")
'''


def _probe(tmp_path: Path, *args: str, **env: str | None) -> list[str]:
    test = tmp_path / "test_probe_threads.py"
    test.write_text(PROBE)
    base = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "K3NUM_THREADS")}
    base.update({k: v for k, v in env.items() if v is not None})
    r = subprocess.run([sys.executable, "-m", "pytest", str(test), "-p", "no:cacheprovider",
                        "--rootdir", str(tmp_path), *args], cwd=tmp_path,
                       capture_output=True, text=True, timeout=300, env=base)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    return ([p.read_text() for p in sorted(tmp_path.glob("threads-*.txt"))]
            + [line for line in r.stdout.splitlines() if "CPU threads" in line])


def test_a_run_uses_one_torch_thread_per_process_by_default(tmp_path: Path) -> None:
    lines = _probe(tmp_path)
    assert "THREADS 1 1" in lines, lines
    assert any("torch CPU threads per process: 1" in line for line in lines), lines


def test_threads_option_and_variable_override_the_default(tmp_path: Path) -> None:
    assert "THREADS 2 2" in _probe(tmp_path, "--threads", "2")
    assert "THREADS 2 2" in _probe(tmp_path, K3NUM_THREADS="2")


def test_omp_num_threads_leaves_torchs_choice(tmp_path: Path) -> None:
    lines = _probe(tmp_path, OMP_NUM_THREADS="2")
    assert "THREADS 2 None" in lines or "THREADS 2 " in lines, lines
    assert any("torch's own choice" in line for line in lines), lines


def test_xdist_workers_get_the_controllers_threads(tmp_path: Path) -> None:
    lines = _probe(tmp_path, "-n", "2")
    assert any(line == "THREADS 1 1" for line in lines) and not any(line.startswith("THREADS 2") for line in lines), \
        lines


@pytest.mark.parametrize("bad", ["0", "-1", "two"])
def test_a_bad_thread_count_is_refused_naming_the_option(bad: str) -> None:
    with pytest.raises(ValueError, match="--threads"):
        run.parse_threads(bad, "--threads")


def test_threads_cross_the_process_boundary() -> None:
    ctx = run.RunContext(threads=3)
    assert ctx.to_env()["K3NUM_THREADS"] == "3"
