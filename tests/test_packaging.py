"""What `pip install` puts into site-packages: one import name, `k3num`, holding every harness folder of
the repository (not its self-tests), the `k3num` command and the pytest plugin's entry point."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# the repository's folders the wheel installs as k3num.<folder>
PACKAGED = ("refmodel", "oracles", "engines", "supply", "harness", "fixtures", "properties")


def _build_wheel(tmp_path: Path) -> Path:
    # built from a copy: setuptools writes build/ and *.egg-info next to the sources
    src = tmp_path / "src"
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(".git", ".venv", "engine-cache", "out", "build",
                                                            "*.egg-info", "__pycache__", ".hypothesis"))
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path), str(src)],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    return next(tmp_path.glob("*.whl"))


def test_the_wheel_claims_one_import_name_and_holds_every_harness_module(tmp_path: Path) -> None:
    wheel = _build_wheel(tmp_path)
    names = zipfile.ZipFile(wheel).namelist()
    tops = {name.split("/", 1)[0] for name in names}
    assert tops == {"k3num", "k3_numerics-0.1.0.dist-info"}, sorted(tops)
    want = {f"k3num/{p.relative_to(ROOT).as_posix()}" for folder in PACKAGED for p in (ROOT / folder).rglob("*.py")}
    assert want <= set(names), sorted(want - set(names))
    entry = zipfile.ZipFile(wheel).read("k3_numerics-0.1.0.dist-info/entry_points.txt").decode()
    assert "k3num = k3num.harness.cli:main" in entry and "[pytest11]\nk3num = k3num.harness.plugin" in entry, entry


def test_the_link_folder_links_every_packaged_folder_and_nothing_else() -> None:
    own = {"__init__.py", "api.py", "__pycache__"}  # the namespace's own modules
    links = {p.name: p for p in (ROOT / "k3num").iterdir() if p.name not in own}
    assert set(links) == set(PACKAGED), sorted(links)
    for name, link in links.items():
        assert link.is_symlink() and link.resolve() == (ROOT / name).resolve(), f"k3num/{name} must link to ../{name}"


def _bare_imports(path: Path) -> list[str]:
    """`import refmodel` / `from oracles import x`: a harness folder imported under its bare name, which in a
    checkout would load a second copy of the module beside k3num.<folder>."""
    bad = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        mods = [a.name for a in node.names] if isinstance(node, ast.Import) else (
            [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module else [])
        bare = (*PACKAGED, "nightly")
        bad += [f"{path.relative_to(ROOT)}:{node.lineno}: {m}" for m in mods if m.split(".")[0] in bare]
    return bad


def test_no_module_imports_a_harness_folder_by_its_bare_name() -> None:
    files = [p for d in (*PACKAGED, "tests", "bench", "scripts") for p in (ROOT / d).rglob("*.py")]
    files.append(ROOT / "conftest.py")
    bad = [b for f in files for b in _bare_imports(f)]
    assert not bad, "import these as k3num.<folder>:\n" + "\n".join(bad)
