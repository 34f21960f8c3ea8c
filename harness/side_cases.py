"""The head's drawn cases, handed to the base's process in a two-process check (harness/pairing_run.py).

    write(path, cases)   cases: [{"key": node key, "example": n, "given": {name: value}, "drawn": {name: [values]}}]
    read(path) -> {node key: [case, ...]} in example order

The file is `torch.save`'s (tensors, containers, numbers, strings) and is read with `weights_only=True`:
no code runs on loading. The only classes it may construct are the dataclasses and enums of this package
(`k3num.*`) that the cases hold, named in the sidecar PATH.types.json; a name outside the package, or one
that is not a dataclass or an enum, refuses the file.

Shapes: none.
"""

from __future__ import annotations

import dataclasses
import enum
import importlib
import json
from pathlib import Path
from typing import Any

import torch


class CasesError(ValueError):
    """A cases file that cannot be read as one."""


def _types(value: Any, found: set[type]) -> None:
    if isinstance(value, enum.Enum):
        found.add(type(value))
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        found.add(type(value))
        for f in dataclasses.fields(value):
            _types(getattr(value, f.name), found)
    elif isinstance(value, dict):
        for k, v in value.items():
            _types(k, found)
            _types(v, found)
    elif isinstance(value, (list, tuple, set, frozenset)):
        for v in value:
            _types(v, found)


def _sidecar(path: Path) -> Path:
    return path.with_name(path.name + ".types.json")


def write(path: str | Path, cases: list[dict]) -> Path:
    path = Path(path)
    found: set[type] = set()
    _types(cases, found)
    outside = sorted(f"{t.__module__}.{t.__qualname__}" for t in found if not t.__module__.startswith("k3num."))
    if outside:
        raise CasesError(f"the cases hold classes outside k3num ({', '.join(outside)}): the base could not load them")
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(cases, path)
    _sidecar(path).write_text(json.dumps(sorted(f"{t.__module__}:{t.__qualname__}" for t in found), indent=1))
    return path


def _allowed(name: str) -> type:
    module, _, qual = name.partition(":")
    if not module.startswith("k3num.") or not qual or "." in qual:
        raise CasesError(f"class {name!r}: not a top-level class of a k3num module")
    try:
        cls = getattr(importlib.import_module(module), qual)
    except (ImportError, AttributeError) as e:
        raise CasesError(f"class {name!r}: {e}") from e
    if not isinstance(cls, type) or not (dataclasses.is_dataclass(cls) or issubclass(cls, enum.Enum)):
        raise CasesError(f"class {name!r}: not a dataclass or an enum")
    return cls


def read(path: str | Path) -> dict[str, list[dict]]:
    path = Path(path)
    if not path.is_file() or not _sidecar(path).is_file():
        raise CasesError(f"{path}: no cases file (and {_sidecar(path).name}) there")
    try:
        names = json.loads(_sidecar(path).read_text())
    except ValueError as e:
        raise CasesError(f"{_sidecar(path)}: not JSON ({e})") from e
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise CasesError(f"{_sidecar(path)}: not a list of class names")
    allowed = [_allowed(n) for n in names]
    try:
        with torch.serialization.safe_globals(allowed):
            cases = torch.load(path, weights_only=True)
    except Exception as e:  # torch's unpickler refusing a global, or a damaged file
        raise CasesError(f"{path}: not a cases file this check wrote ({str(e).splitlines()[0][:200]})") from e
    if not isinstance(cases, list) or not all(isinstance(c, dict) and {"key", "example", "given", "drawn"} <= set(c)
                                              for c in cases):
        raise CasesError(f"{path}: not a list of cases")
    out: dict[str, list[dict]] = {}
    for c in sorted(cases, key=lambda c: (c["key"], c["example"])):
        out.setdefault(c["key"], []).append(c)
    return out
