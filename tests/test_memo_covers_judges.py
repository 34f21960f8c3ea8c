"""The judges, the draft step and the properties' own oracle helpers reach the float64 oracle only through
harness/oracle.py's `current()`: a direct call of a refmodel entry point would bypass the oracle a caller
scoped (the pre-merge check's memo, harness/oracle_memo.py) and compute the oracle on both sides of a
`k3num check`."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from k3num.harness import oracle

ROOT = Path(__file__).resolve().parents[1]


def _refmodel_aliases(tree: ast.Module) -> set[str]:
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == "k3num.refmodel":
            out |= {a.asname or a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("k3num.refmodel."):
            out |= {a.asname or a.name for a in node.names if a.name in oracle.Oracle.entry_points()}
    return out


@pytest.mark.parametrize("path", ["harness/judges.py", "harness/draft_step.py", "properties/test_aux_tap.py"])
def test_every_oracle_call_goes_through_the_scoped_oracle(path: str) -> None:
    tree = ast.parse((ROOT / path).read_text())
    entries, refmodels = set(oracle.Oracle.entry_points()), _refmodel_aliases(tree)
    direct, scoped = [], []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        if isinstance(f, ast.Name) and f.id in refmodels & entries:
            direct.append(f"{f.id} (line {node.lineno})")
        if not (isinstance(f, ast.Attribute) and f.attr in entries):
            continue
        if isinstance(f.value, ast.Name) and f.value.id in refmodels:
            direct.append(f"{f.value.id}.{f.attr} (line {node.lineno})")
        elif (isinstance(f.value, ast.Call) and isinstance(f.value.func, ast.Attribute)
              and f.value.func.attr == "current"):
            scoped.append(f.attr)
    assert scoped, "no oracle call found through oracle.current(): the scan is broken"
    assert not direct, f"called directly, bypassing the scoped oracle: {direct}"
