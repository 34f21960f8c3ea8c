"""The product reads the environment in one boundary module only (supply/env.py), and each variable only
where VARS says it may (issue 30): a run's settings are arguments (harness/run.py's RunContext), the
environment carries them only across a process boundary.

Read in the source, so a new module or a new read is held too."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from k3num.supply import env

ROOT = Path(__file__).resolve().parents[1]
PRODUCT = ("refmodel", "oracles", "engines", "supply", "harness", "fixtures", "properties", "k3num")
BOUNDARY = "supply/env.py"
CALLS = {"get": "readers", "put": "writers", "put_default": "writers"}


def _modules() -> list[Path]:
    """The product's modules (k3num/ holds links to the folders, and api.py)."""
    out = [p for folder in PRODUCT[:-1] for p in sorted((ROOT / folder).rglob("*.py"))]
    return out + [p for p in sorted((ROOT / "k3num").glob("*.py")) if not p.is_symlink()]


def _env_names(tree: ast.AST) -> set[str]:
    """The names `supply.env` is bound to in a module (`from k3num.supply import env`, `... as e`)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == "k3num.supply":
            names |= {a.asname or a.name for a in node.names if a.name == "env"}
    return names


def test_no_product_module_but_the_boundary_touches_os_environ() -> None:
    bad = []
    for path in _modules():
        rel = str(path.relative_to(ROOT))
        if rel == BOUNDARY:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "os"
                    and node.attr in ("environ", "getenv", "putenv", "unsetenv")):
                bad.append(f"{rel}:{node.lineno}: os.{node.attr}")
            elif isinstance(node, ast.ImportFrom) and node.module == "os" and any(
                    a.name in ("environ", "getenv", "putenv") for a in node.names):
                bad.append(f"{rel}:{node.lineno}: from os import ...")
    assert not bad, "read or write the environment through supply/env.py (its VARS):\n" + "\n".join(bad)


def test_each_variable_is_read_and_written_only_where_vars_says() -> None:
    bad, used = [], set()
    for path in _modules():
        rel = str(path.relative_to(ROOT))
        tree = ast.parse(path.read_text())
        names = _env_names(tree)
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and isinstance(node.func.value, ast.Name) and node.func.value.id in names):
                continue
            if node.func.attr == "child":
                continue  # a child's settings: checked by name in env.child itself
            role = CALLS.get(node.func.attr)
            if role is None:
                continue
            arg = node.args[0] if node.args else None
            if not (isinstance(arg, ast.Constant) and isinstance(arg.value, str)):
                bad.append(f"{rel}:{node.lineno}: env.{node.func.attr} of a non-literal name (write the name out)")
                continue
            var = env.VARS.get(arg.value)
            used.add(arg.value)
            if var is None:
                bad.append(f"{rel}:{node.lineno}: {arg.value} is not in supply/env.py's VARS")
            elif rel not in getattr(var, role):
                bad.append(f"{rel}:{node.lineno}: env.{node.func.attr}({arg.value!r}): {rel} is not among its {role} "
                           f"{getattr(var, role)}")
    assert not bad, "\n".join(bad)
    assert used == set(env.VARS), f"listed in VARS and never read or written: {sorted(set(env.VARS) - used)}"


def test_the_run_context_crosses_a_process_boundary_whole(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """What `to_env` writes, `from_env` reads back (the variables a started process is given)."""
    from k3num.harness.run import RunContext

    ctx = RunContext(sources={"vllm": tmp_path.resolve()}, engine_mode="source", device="cpu", repro_dir="/r",
                     repro_all=True, checkpoint="/c", golden="/g")
    for name, value in ctx.to_env().items():
        monkeypatch.setenv(name, value)
    assert RunContext.from_env() == ctx


def test_an_unknown_variable_is_refused_by_name() -> None:
    with pytest.raises(KeyError, match="K3NUM_NOPE"):
        env.get("K3NUM_NOPE")
    with pytest.raises(KeyError, match="K3NUM_NOPE"):
        env.child({"K3NUM_NOPE": "1"})
