"""What `pip install` puts into site-packages: the harness's packages, not its self-tests (a top-level
`tests` package would shadow or be shadowed by every other project's)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_wheel_holds_no_top_level_tests_package(tmp_path: Path) -> None:
    # built from a copy: setuptools writes build/ and *.egg-info next to the sources
    src = tmp_path / "src"
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(".git", ".venv", "engine-cache", "out", "build",
                                                            "*.egg-info", "__pycache__", ".hypothesis"))
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path), str(src)],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    wheel = next(tmp_path.glob("*.whl"))
    tops = {name.split("/", 1)[0] for name in zipfile.ZipFile(wheel).namelist()}
    assert "tests" not in tops, sorted(tops)
    assert {"refmodel", "oracles", "engines", "fixtures", "properties"} <= tops, sorted(tops)
