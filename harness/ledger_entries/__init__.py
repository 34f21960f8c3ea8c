"""One module per known divergence: `k3n_NNN.py` is entry K3N-NNN's own record beside its facts in the ledger
(oracles/ledger.py: engine, releases, files, what, upstream, token case class).

Each module defines `ENTRY`, an `Entry`: the entry's case rule and reproducer (harness/ledger_cases.LedgerCase),
its bug model (harness/ledger_models.BugModel; an entry without one states why in the rule's `no_model`), its
rule for a user's checkpoint, its fix (harness/fixes.Fix) and the bugs planted to be judged around that fix.
The machinery reads them here: `ledger_cases.CASES`, `ledger_models.MODELS`, `ledger_cases.CHECKPOINT_RULES`,
`fixes.FIXES`. No other product module names an entry: an entry's id is its module's name (k3n_006 is
K3N-006), and the ledger's facts are joined to the module by it (`records`).

Adding an entry: its facts in oracles/ledger.py and `ENTRY` in a new module here (tests/test_ledger_records.py
refuses a ledger entry without a module, a module without a ledger entry, and an id named elsewhere).
"""

from __future__ import annotations

import functools
import importlib
import pkgutil
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from k3num.oracles import ledger

MODULE = re.compile(r"k3n_(\d{3})")  # an entry module's name; its entry id is the name upper-cased, '-' for '_'


@dataclass(frozen=True)
class Entry:
    """What an entry's own module states (its facts are the ledger's)."""

    case: Any  # ledger_cases.LedgerCase: the region rule, the reproducer, its signature, why no model (if none)
    model: Any = None  # ledger_models.BugModel, or None (the case's `no_model` says why)
    checkpoint: Any = None  # ledger_cases.CheckpointRule: where the finding reaches a user's checkpoint
    fix: Any = None  # fixes.Fix, where the entry has one (a fix may cover two entries: its id names both)
    plants: tuple = ()  # fixes.Fix: bugs planted in the entry's region, judged around its fix (harness/around.py)


@dataclass(frozen=True)
class Record:
    """One known divergence: the ledger's facts and the entry module's rule, model, checkpoint rule and fix."""

    id: str
    facts: ledger.Divergence
    case: Any
    model: Any
    checkpoint: Any
    fix: Any
    plants: tuple


def entry_id(module_name: str) -> str:
    """k3n_006 -> K3N-006 (ValueError: not an entry module's name)."""
    if not MODULE.fullmatch(module_name):
        raise ValueError(f"harness/ledger_entries/{module_name}.py: an entry module is named k3n_NNN")
    return module_name.upper().replace("_", "-")


def join(modules: Iterable[tuple[str, Any]]) -> dict[str, Record]:
    """(module name, module) pairs -> every entry's record by id, in the order given: each module joined to its
    ledger entry. A module not named k3n_NNN, without `ENTRY`, or whose id is not in the ledger is an error
    naming it."""
    out: dict[str, Record] = {}
    for name, module in modules:
        eid = entry_id(name)
        entry = getattr(module, "ENTRY", None)
        if not isinstance(entry, Entry):
            raise TypeError(f"harness/ledger_entries/{name}.py defines no ENTRY (an Entry)")
        facts = ledger.by_id(eid)
        if facts is None:
            raise LookupError(f"harness/ledger_entries/{name}.py: {eid} is not in the ledger (oracles/ledger.py)")
        out[eid] = Record(eid, facts, entry.case, entry.model, entry.checkpoint, entry.fix, tuple(entry.plants))
    return out


@functools.cache
def records() -> dict[str, Record]:
    """Every entry's record, by id, in id order: the modules of this package (`join`)."""
    names = sorted(m.name for m in pkgutil.iter_modules(__path__))
    return join((name, importlib.import_module(f"{__name__}.{name}")) for name in names)


@functools.cache
def rules() -> dict[str, Any]:
    """entry id -> its case rule (ledger_cases.CASES)."""
    return {eid: r.case for eid, r in records().items()}


@functools.cache
def models() -> dict[str, Any]:
    """entry id -> its bug model, for the entries that have one (ledger_models.MODELS)."""
    return {eid: r.model for eid, r in records().items() if r.model is not None}


@functools.cache
def checkpoint_rules() -> dict[str, Any]:
    """entry id -> its rule for a user's checkpoint, for the entries that reach one (ledger_cases.CHECKPOINT_RULES)."""
    return {eid: r.checkpoint for eid, r in records().items() if r.checkpoint is not None}


@functools.cache
def fixes() -> tuple:
    """The entries' fixes in entry order (fixes.FIXES)."""
    return tuple(r.fix for r in records().values() if r.fix is not None)


@functools.cache
def plants() -> tuple:
    """The bugs planted around the entries' fixes (fixes.by_id finds them)."""
    return tuple(p for r in records().values() for p in r.plants)
