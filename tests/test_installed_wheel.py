"""Installed, it runs anywhere: the wheel of this repository, installed non-editable into a fresh venv,
runs the property suite and an engine repository's own test file from a directory outside the checkout.

What an engine's CI does: `pip install k3-numerics`, then `pytest --pyargs k3num.properties --engine vllm
--engine-src vllm=.` in its checkout, or its own tests written against `k3num.api` (here the
example that ships in examples/, against the pinned vLLM files and against a planted bug, which it must
fail). The venv sees nothing of this checkout: no editable install, no PYTHONPATH, another directory.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from k3num.harness import accounting, fixes
from k3num.supply import fetch

ROOT = Path(__file__).resolve().parents[1]


def _run(cmd: list[str], cwd: Path, timeout: int = 900, **env: str) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "K3NUM_ENGINE_SRC")}
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout, env={**clean, **env})


@pytest.fixture(scope="module")
def venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh venv holding the wheel of this checkout (not editable), torch's CPU build and triton."""
    if fetch.missing_files("vllm"):
        pytest.skip("vllm is not fetched here (k3num fetch vllm)")
    base = tmp_path_factory.mktemp("wheel")
    src = base / "src"
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(".git", ".venv", "engine-cache", "out", "build",
                                                            "*.egg-info", "__pycache__", ".hypothesis"))
    r = _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(base), str(src)], base)
    assert r.returncode == 0, r.stderr[-2000:]
    wheel = next(base.glob("k3_numerics-*.whl"))
    v = base / "venv"
    python = getattr(sys, "_base_executable", sys.executable)
    assert _run([python, "-m", "venv", str(v)], base).returncode == 0
    pip = [str(v / "bin" / "python"), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    # torch first, the CPU build (as scripts/env.sh does), so that the wheel's torch>=2.4 pulls no CUDA build
    r = _run([*pip, "torch==2.13.0"], base)
    if r.returncode != 0:
        r = _run([*pip, "torch==2.13.0", "--index-url", "https://download.pytorch.org/whl/cpu"], base)
    assert r.returncode == 0, r.stderr[-2000:]
    r = _run([*pip, str(wheel), "triton==3.6.0"], base)
    assert r.returncode == 0, r.stderr[-2000:]
    return v


def test_the_installed_package_claims_one_import_name_and_brings_its_plugin(venv: Path, tmp_path: Path) -> None:
    code = ("import importlib.metadata as m, k3num, k3num.api; d = m.distribution('k3-numerics'); "
            "tops = sorted({f.parts[0] for f in d.files if f.suffix == '.py'}); "
            "eps = sorted(f'{e.group}:{e.name}={e.value}' for e in d.entry_points); print(tops, eps, k3num.__file__)")
    r = _run([str(venv / "bin" / "python"), "-c", code], tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "['k3num']" in r.stdout and "pytest11:k3num=k3num.harness.plugin" in r.stdout, r.stdout
    assert str(ROOT) not in r.stdout and "site-packages" in r.stdout, r.stdout  # not the checkout's files
    r = _run([str(venv / "bin" / "k3num"), "--help"], tmp_path)
    assert r.returncode == 0 and "build-ops" in r.stdout and "replay" in r.stdout and "check" in r.stdout


def test_the_property_suite_runs_from_an_install_in_any_directory(venv: Path, tmp_path: Path) -> None:
    r = _run([str(venv / "bin" / "python"), "-m", "pytest", "--pyargs", "k3num.properties", "--engine", "vllm",
              "--engine-src", f"vllm={fetch.Source('vllm').root}", "-k", "attn_res_within_rounding_budget_of_oracle",
              "-q", "-p", "no:cacheprovider", "--hypothesis-profile=ci", "--drift-csv", str(tmp_path / "d.csv")],
             tmp_path)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    assert "1 passed" in accounting.tally(r.stdout), r.stdout[-3000:]
    # the cache tree named as a local tree is that pinned release (supply/fetch.py Source)
    assert f"vllm {fetch.PINS['vllm'].version}: source-interpreter" in r.stdout and (tmp_path / "d.csv").exists()


def test_an_engine_repositorys_own_test_file_passes_the_release_and_fails_a_planted_bug(venv: Path,
                                                                                       tmp_path: Path) -> None:
    repo = tmp_path / "engine-repo"
    (repo / "tests").mkdir(parents=True)
    shutil.copy(ROOT / "examples" / "test_k3_kernels.py", repo / "tests" / "test_k3_kernels.py")
    cmd = [str(venv / "bin" / "python"), "-m", "pytest", "tests/test_k3_kernels.py", "-q", "-p", "no:cacheprovider"]
    good = _run(cmd, repo, K3NUM_ENGINE_SRC=f"vllm={fetch.Source('vllm').root}")
    assert good.returncode == 0, good.stdout[-3000:] + good.stderr[-2000:]
    tree = fixes.patched_tree(fixes.by_id("mixture-scaled"), tmp_path / "mutant")
    bad = _run(cmd, repo, K3NUM_ENGINE_SRC=f"vllm={tree}")
    assert bad.returncode == 1, bad.stdout[-3000:]
    assert "elements over budget" in bad.stdout and "example_attn_res_within_rounding_budget" in bad.stdout


def test_k3num_check_runs_from_an_install_and_fails_a_planted_bug_as_new(venv: Path, tmp_path: Path) -> None:
    """The pull-request job of docs/engine-ci.md: `k3num check --head .` in the engine's checkout."""
    head = fixes.patched_tree(fixes.by_id("mixture-scaled"), tmp_path / "vllm-checkout")
    r = _run([str(venv / "bin" / "k3num"), "check", "--engine", "vllm", "--head", ".", "-k",
              "test_attn_res_within_rounding_budget_of_oracle", "--out", "out/check"], head)
    assert r.returncode == 1, r.stdout[-3000:] + r.stderr[-2000:]
    md = (head / "out" / "check" / "check.md").read_text()
    assert "# k3num check: FAIL" in md
    assert "test_attn_res_within_rounding_budget_of_oracle[vllm]" in md.split("## New failures")[1].split("##")[0]
