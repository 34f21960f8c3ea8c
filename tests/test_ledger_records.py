"""One record per known divergence: its facts in the ledger (oracles/ledger.py) and everything else in its own
module (harness/ledger_entries/k3n_NNN.py), and no other module of the package names an entry."""

from __future__ import annotations

import ast
import re
import types
from pathlib import Path

import pytest

from k3num.harness import fixes, ledger_cases, ledger_entries, ledger_models
from k3num.oracles import ledger

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ("harness", "oracles", "engines", "fixtures", "properties", "supply", "refmodel")
ID = re.compile(r"K3N[-_]\d{3}")
# where an entry may be named in code: the ledger's facts, and each entry's own module
OWNERS = ("oracles/ledger.py", "harness/ledger_entries/")


def ids_in_code(source: str) -> list[tuple[int, str]]:
    """(line, text) of each string constant (docstrings aside) and each name holding an entry id in `source`.
    Comments are not code: a comment may cite an entry."""
    tree = ast.parse(source)
    docs = {id(n.body[0].value) for n in ast.walk(tree)
            if isinstance(n, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and n.body
            and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
    out = []
    for node in ast.walk(tree):
        text = (node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs
                else node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute)
                else f"{node.name} {node.asname or ''}" if isinstance(node, ast.alias) else "")
        if ID.search(text):
            out.append((getattr(node, "lineno", 0), text[:80]))
    return out


def test_every_ledger_entry_has_its_own_module_and_every_module_an_entry():
    records = ledger_entries.records()
    assert list(records) == [d.id for d in sorted(ledger.LEDGER, key=lambda d: d.id)]
    for eid, r in records.items():
        assert r.facts is ledger.by_id(eid) and r.case is ledger_cases.CASES[eid]
        assert (r.model is not None) == (eid in ledger_models.MODELS)
        assert r.fix is None or r.fix in fixes.FIXES


def test_no_module_of_the_package_names_an_entry_outside_the_ledger_and_the_entrys_own_module():
    found = []
    for folder in PACKAGE:
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = str(path.relative_to(ROOT))
            if rel.startswith(OWNERS):
                continue
            found += [f"{rel}:{line}: {text!r}" for line, text in ids_in_code(path.read_text())]
    assert not found, "\n".join(found)


def test_the_scan_sees_an_id_in_a_string_or_a_name_and_not_in_a_comment_or_docstring():
    """The plant: a module that dispatches on an id is seen, wherever the id is in code."""
    planted = '"""Cites K3N-006 in its docstring."""\nx = 1  # K3N-006 in a comment\n'
    assert ids_in_code(planted) == []
    assert ids_in_code(planted + 'if eid == "K3N-006":\n    pass\n') == [(3, "K3N-006")]
    assert ids_in_code(planted + "K3N_004 = None\n") == [(3, "K3N_004")]
    assert ids_in_code(planted + "from m import K3N_004 as race\n") == [(3, "K3N_004 race")]


def _module(case=None, **kw) -> types.ModuleType:
    m = types.ModuleType("planted")
    if case is not None:
        m.ENTRY = ledger_entries.Entry(case=case, **kw)
    return m


def test_an_entry_module_that_is_misnamed_lacks_its_entry_or_is_not_in_the_ledger_is_named():
    case = ledger_cases.CASES["K3N-003"]
    assert list(ledger_entries.join([("k3n_003", _module(case))])) == ["K3N-003"]
    with pytest.raises(ValueError, match="k3n_three.py: an entry module is named k3n_NNN"):
        ledger_entries.join([("k3n_three", _module(case))])
    with pytest.raises(TypeError, match="k3n_003.py defines no ENTRY"):
        ledger_entries.join([("k3n_003", _module())])
    with pytest.raises(LookupError, match="k3n_999.py: K3N-999 is not in the ledger"):
        ledger_entries.join([("k3n_999", _module(case))])


def test_a_fix_and_the_bugs_planted_around_it_are_found_by_their_ids_through_the_entries():
    assert fixes.by_id("K3N-004/005") is ledger_entries.records()["K3N-004"].fix
    planted = fixes.by_id("rocm-score-unnormalized")
    assert planted in ledger_entries.records()["K3N-001"].plants
    assert planted.engines == ("vllm-rocm+fix-K3N-001",)
