"""Judging around a known divergence: the tests an entry's region covers run once more on the engine with the
entry's fix applied (its module in harness/ledger_entries), so a second bug in the same engine is judged plainly
there.

A known divergence xfails (or files as known) every failure of its region: vllm-rocm's aux tap returns the
prefix sum (K3N-001), so both token properties on vllm-rocm are the entry's, and a second bug in ROCm's AttnRes
kernel could never show in them. A fix that lists tests in `around` makes the suite parametrise those tests with
one more engine, `NAME+fix-ENTRY` (e.g. `vllm-rocm+fix-K3N-001`): the run's own tree for that engine (the pinned
release, `--engine-src`, `vllm@0.34.0`) copied, the fix applied to the copy, the engine built from it. The
entries whose files the fix edits do not apply there; every other entry applies as on the plain engine.

Where the run's tree already edits the entry's files (a patch, a checkout), the entry does not apply to the
plain engine either, so the variant skips saying so. Under `k3num check` the variant runs on both sides: the
head's tree with the fix against the base's tree with the same fix (harness/pairing_run.base_for), so a head
failure there is paired as any other and a second bug is new, not the entry's.
"""

from __future__ import annotations

import dataclasses
import tempfile
from pathlib import Path
from typing import Any

from k3num.harness import fixes
from k3num.oracles import ledger
from k3num.supply import fetch

SEP = "+fix-"

_BUILT: dict[tuple[str, str, str], Any] = {}  # (variant, the tree it was copied from, mode) -> Engine
_TREES: list[tempfile.TemporaryDirectory] = []


def key(fix: fixes.Fix) -> str:
    """The fix's first entry id ("K3N-001" of "K3N-001/002"): the variant's suffix."""
    return fix.id.split("/")[0]


def aroundable() -> tuple[fixes.Fix, ...]:
    """The fixes whose entries' regions run around them."""
    return tuple(f for f in fixes.FIXES if f.around)


def variants(engines: list[str], test: str) -> list[str]:
    """The variant names test function `test` also runs on, for the run's engines `engines`."""
    return [f"{name}{SEP}{key(f)}" for f in aroundable() if test in f.around for name in f.engines if name in engines]


def split(param: str) -> tuple[str, fixes.Fix | None]:
    """(the engine's registry name, the fix) of a variant name; (param, None) for a plain engine name."""
    name, sep, entry = param.partition(SEP)
    if not sep:
        return param, None
    fix = next((f for f in aroundable() if key(f) == entry and name in f.engines), None)
    if fix is None:
        raise ValueError(f"{param}: no fix of {entry} runs around it on {name} (an entry module's fix with `around`: "
                         "harness/ledger_entries)")
    return name, fix


def entry_ids(fix: fixes.Fix) -> tuple[str, ...]:
    """The ledger ids a fix's id names ("K3N-001/002" -> K3N-001, K3N-002)."""
    first, *rest = fix.id.split("/")
    stem = first.rsplit("-", 1)[0]
    return (first, *(f"{stem}-{r}" for r in rest))


def edited_files(fix: fixes.Fix) -> set[str]:
    return {rel for rel, _ in fix.edits}


def unfixed_entries(fix: fixes.Fix, found: list[ledger.Divergence]) -> list[ledger.Divergence]:
    """The entries of `found` that still apply on the variant: those whose files the fix does not edit."""
    return [d for d in found if not set(d.files) & edited_files(fix)]


class Unavailable(RuntimeError):
    """The variant cannot be built here (the reason is the skip's)."""


def engine(param: str, sources: dict[str, Path], mode: str) -> Any:
    """The engine of variant `param`, built once per tree and mode from a copy of the run's tree with the fix
    applied (its name is the variant's, its version the tree's). Unavailable says why it cannot be built."""
    from k3num.engines import registry

    name, fix = split(param)
    if fix is None:
        raise ValueError(f"{param} is not a variant (NAME{SEP}ENTRY)")
    src = fetch.source_of(fix.engine, dict(sources))
    cache_key = (param, str(src.root), mode)
    if cache_key in _BUILT:
        return _BUILT[cache_key]
    ids = entry_ids(fix)
    entries = [d for d in (ledger.by_id(i) for i in ids) if d is not None]
    if not all(fetch.pinned_files(src, d.files) for d in entries):
        raise Unavailable(f"{', '.join(ids)} do not apply to {src.root} (it edits their files), so {name} is judged "
                          "plainly there already")
    try:
        plain = registry.get(name, sources, mode)
    except registry.EngineUnavailable as e:
        raise Unavailable(f"{name} unavailable: {e}") from e
    holder = tempfile.TemporaryDirectory(prefix=f"k3num-around-{key(fix)}-")
    _TREES.append(holder)  # removed when the process ends
    tree = Path(holder.name) / "tree"
    try:
        fixes.patched_copy(fix, src, tree)
        fixed = registry.build(name, {**sources, fix.engine: tree}, mode)
    except (fixes.FixError, registry.EngineUnavailable) as e:
        raise Unavailable(f"{fix.id}'s fix does not apply to {src.root}: {e}") from e
    note = f"{fix.id}'s fix applied (harness/ledger_entries)"
    built = dataclasses.replace(fixed, name=param, version=plain.version,
                                mode_note="; ".join(filter(None, [note, fixed.mode_note])))
    _BUILT[cache_key] = built
    return built


def built() -> list[Any]:
    """The variant engines this process built."""
    return list(_BUILT.values())
