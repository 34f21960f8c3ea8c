"""The repository's floors: each folder imports only the folders on floors below it (LAYOUT in README's
tour), so data and imports flow one way and a newcomer finds the runner without reading the adapters."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# what users run, the runner, the adapters and their inputs, where engine code comes from, the oracle
# and the judge
FLOORS = {"properties": 4, "harness": 3, "engines": 2, "fixtures": 2, "supply": 1, "refmodel": 0, "oracles": 0}


def _imports(path: Path) -> list[tuple[int, str]]:
    out = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            mods = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
        elif isinstance(node, ast.Import):
            mods = [a.name for a in node.names]
        else:
            continue
        out += [(node.lineno, m.split(".")[1]) for m in mods if m.startswith("k3num.") and m.split(".")[1] in FLOORS]
    return out


def test_each_folder_imports_only_folders_on_lower_floors() -> None:
    bad = []
    for folder, floor in FLOORS.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            for line, other in _imports(path):
                if other != folder and FLOORS[other] >= floor:
                    bad.append(f"{path.relative_to(ROOT)}:{line}: {folder} (floor {floor}) imports {other} "
                               f"(floor {FLOORS[other]})")
    assert not bad, "\n".join(bad)


def test_engines_holds_adapters_and_their_helpers_only() -> None:
    """The harness's machinery (CLI, fetch, builds, bundles, fixes, scale-out) lives in supply/ and harness/."""
    machinery = {"cli.py", "fetch.py", "cuda_ops.py", "installed.py", "repro.py", "fixes.py", "scaleout.py"}
    found = sorted(p.name for p in (ROOT / "engines").rglob("*.py") if p.name in machinery)
    assert not found, found


def test_no_module_imports_a_test_module() -> None:
    """Shared checks live in properties/checks/ and helpers in tests/ modules not named test_*: a test module
    imported by another runs its @given tests' collection twice and invites hypothesis's nested-@given trap."""
    bad = []
    for folder in ("properties", "tests", "scripts", "bench", "harness", "examples"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
                names = ([node.module] if isinstance(node, ast.ImportFrom) and node.module else
                         [a.name for a in node.names] if isinstance(node, ast.Import) else [])
                for name in names:
                    last = name.split(".")[-1]
                    if last.startswith("test_") and name.split(".")[0] in ("k3num", "properties", "tests"):
                        bad.append(f"{path.relative_to(ROOT)}:{node.lineno}: imports {name}")
    assert not bad, "\n".join(bad)
