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


# Module-level containers of the runner that are mutated after import, each with why it is not the run's
# state (a per-process cache of values that do not depend on the run, or the process's installed context).
_PROCESS_STATE = {
    "harness/run.py:_PROCESS": "the context the plugin installed in this process (run.install, once per process)",
    "harness/around.py:_BUILT": "the variant engines built in this process, keyed by (variant, tree, mode) as "
                                "engines/registry.py's engine cache is: a run with another tree or mode builds its own",
    "harness/around.py:_TREES": "the fixed copies those engines read, held so they live until the process ends",
}
_MUTATORS = ("append", "add", "update", "setdefault", "pop", "popitem", "clear", "extend", "insert", "remove",
             "discard", "__setitem__")


def _module_containers(path: Path) -> list[tuple[int, str]]:
    out = []
    for node in ast.parse(path.read_text(), filename=str(path)).body:
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
            node, ast.AnnAssign) and node.value is not None else []
        value = getattr(node, "value", None)
        container = isinstance(value, (ast.Dict, ast.List, ast.Set, ast.DictComp, ast.ListComp, ast.SetComp)) or (
            isinstance(value, ast.Call) and isinstance(value.func, ast.Name)
            and value.func.id in ("dict", "list", "set", "defaultdict", "OrderedDict", "Counter", "deque"))
        if container:
            out += [(node.lineno, t.id) for t in targets if isinstance(t, ast.Name)]
    return out


def _mutations(tree: ast.AST, name: str) -> list[int]:
    """Lines where `name` (bare, or as an attribute `x.name`) is mutated: item assignment or deletion, augmented
    assignment, a mutating method call, or a `global name` rebinding."""
    def is_name(n: ast.AST) -> bool:
        return (isinstance(n, ast.Name) and n.id == name) or (isinstance(n, ast.Attribute) and n.attr == name)

    lines = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Assign, ast.AugAssign, ast.Delete)):
            for t in (node.targets if isinstance(node, (ast.Assign, ast.Delete)) else [node.target]):
                if isinstance(t, ast.Subscript) and is_name(t.value) or isinstance(node, ast.AugAssign) and is_name(t):
                    lines.append(node.lineno)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in _MUTATORS \
                and is_name(node.func.value):
            lines.append(node.lineno)
        elif isinstance(node, ast.Global) and name in node.names:
            lines.append(node.lineno)
    return lines


def test_no_runner_module_keeps_the_runs_state_in_a_module_global() -> None:
    """Issue 30: a run's state lives in the run (config.stash: harness/session_state.Book, the drift collector,
    the check's state), scoped per test where a hook has no config, so a second run in one process starts
    from its own. A module-level container of harness/ or properties/ (its helpers; the test modules' own
    fixtures aside) that anything mutates after import must be declared above with why it is not run state."""
    files = sorted((ROOT / "harness").rglob("*.py")) + [p for p in sorted((ROOT / "properties").rglob("*.py"))
                                                         if not p.name.startswith("test_")]
    trees = {p: ast.parse(p.read_text(), filename=str(p)) for p in files}
    bad = []
    for path in files:
        rel = str(path.relative_to(ROOT))
        for line, name in _module_containers(path):
            hits = [f"{p.relative_to(ROOT)}:{n}" for p, tree in trees.items() for n in _mutations(tree, name)
                    if p == path or len(name) > 3]  # a short name elsewhere is someone else's
            if hits and f"{rel}:{name}" not in _PROCESS_STATE:
                bad.append(f"{rel}:{line}: {name}, mutated at {', '.join(hits[:4])}")
    assert not bad, "module-level state of the runner (move it into the run, or declare why it is not):\n" + \
        "\n".join(bad)
    for key in _PROCESS_STATE:  # every declaration still names a container that is there
        rel, name = key.split(":")
        assert name in [n for _, n in _module_containers(ROOT / rel)], f"{key}: declared, but no longer there"


def test_the_plugins_halves_import_no_private_name_of_another_module() -> None:
    """Issue 30: plugin.py's halves (run_summary, run_isolation, ledger_run, pairing_run) once imported the
    plugin's private helpers back; what they share is public in harness/run_scope.py and session_state.py."""
    bad = []
    for path in sorted((ROOT / "harness").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("k3num.") and node.level == 0:
                private = [a.name for a in node.names if a.name.startswith("_")]
                if private:
                    bad.append(f"{path.relative_to(ROOT)}:{node.lineno}: {node.module} {', '.join(private)}")
    assert not bad, "\n".join(bad)
