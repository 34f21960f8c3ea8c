"""Shared plumbing of the property tests: subject lookup, reporting, device handling."""

from __future__ import annotations

import dis
import math
from typing import Any

import pytest
import torch

from k3num.engines.base import Engine, Subject, SubjectMissing
from k3num.fixtures import device
from k3num.harness import recording, run
from k3num.harness.judges import LOW, round_storage, up  # noqa: F401  (the properties' names for them)
from k3num.oracles.drift import COLLECTOR
from k3num.oracles.metrics import describe_mismatch
from k3num.oracles.records import FAIL, Record

_RUN = run.current()  # the run's context (harness/run.py), installed by the plugin before this is imported
DEVICE = device.resolve(_RUN.device)  # checked by the plugin before collection (--device)


# repro bundles (harness/repro.py): --repro-dir, --repro-all
# (each subject's last call and the worst ratio bundled so far: the run's Book, harness/recording.book(); the
# plugin scopes it per test and drops the test's recorded calls when it ends)
REPRO_DIR = _RUN.repro_dir
REPRO_ALL = _RUN.repro_all


def _clone(v: object) -> object:
    if isinstance(v, torch.Tensor):
        return v.detach().clone()
    if isinstance(v, list):
        return [_clone(x) for x in v]
    if isinstance(v, tuple):
        return tuple(_clone(x) for x in v)
    return v


def shardable(test: Any) -> Any:
    """Mark a property whose examples are costly (a repeat-call hunt): `--shards N` runs its example budget as N
    tests side by side (harness/plugin.py, harness/scaleout.Shard); without it the test is as it was."""
    return pytest.mark.usefixtures("shard")(pytest.mark.shardable(test))


def subject(engine: Engine, name: str) -> Subject:
    """The engine's subject, or a skip whose reason names engine, version and subject. Under
    --repro-dir each call's arguments are cloned before it runs (the subject may write them)."""
    try:
        fn = engine.subject(name)
    except SubjectMissing as e:
        pytest.skip(str(e))
    if not REPRO_DIR:
        return fn

    def recorded(*args: object, **kwargs: object) -> object:
        cargs, ckw = _clone(args), {k: _clone(v) for k, v in kwargs.items()}
        result = fn(*args, **kwargs)
        recording.book().last_calls[name] = (cargs, ckw, result, args, kwargs)
        return result

    return recorded


def _bundle(record: Record, tag: str) -> None:
    from pathlib import Path

    from k3num.harness import repro

    name = f"{record.property}-{record.engine}-{tag}.safetensors"
    meta = {k: getattr(record, k) for k in ("engine", "engine_version", "mode", "source_sha256", "subject",
                                            "property", "detail", "seed", "budget", "budget_rule", "max_abs",
                                            "ratio", "verdict", "ledger")}
    meta["node_id"] = COLLECTOR.node
    repro.write(Path(REPRO_DIR) / name, call=recording.book().last_calls.get(record.subject),
                actual=record.extra["actual"],
                reference=record.extra["reference"], meta=meta)


def report(record: Record, *, climb: bool = True) -> Record:
    """Collect the record for the drift CSV, steer hypothesis toward the worst ratio, assert the verdict."""
    if REPRO_DIR and "actual" in record.extra and recording.on_head():  # k3num check: the base's pass bundles nothing
        if record.verdict == FAIL:
            _bundle(record, str(record.seed))
        key, worst = (record.property, record.engine), recording.book().worst_bundled
        if REPRO_ALL and math.isfinite(record.ratio) and record.ratio > worst.get(key, -1.0):
            worst[key] = record.ratio
            _bundle(record, "worst")
    return recording.collect(record, climb=climb)


def assert_bitwise(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    """Exact contract check: same dtype, shape and bits (NaNs equal)."""
    same = actual.shape == expected.shape and actual.dtype == expected.dtype and (
        torch.equal(actual, expected)
        or (actual.is_floating_point() and bool(((actual == expected) | (actual.isnan() & expected.isnan())).all()))
    )
    assert same, f"{what}: not bitwise equal: {describe_mismatch(actual, expected)}"


def raised_deliberately(e: BaseException) -> bool:
    """Whether `e` left a Python `raise` (or `assert`) statement: a check of the code's own, refusing an input or
    a mode it does not have. An exception that a C++ operator threw leaves the call (torch's dispatcher:
    `"bitwise_xor_cpu" not implemented for 'Float'` is a NotImplementedError), and one the interpreter raised
    leaves its expression (an IndexError of a subscript, a TypeError of a call): accidents of the code on an
    input it accepted, failures. Read from the innermost frame's bytecode, not its source: the interpreter-mode
    kernels are exec'd with no source registered (engines/source.py says why)."""
    tb = e.__traceback__
    if tb is None:
        return False
    while tb.tb_next is not None:
        tb = tb.tb_next
    at = next((i.opname for i in dis.get_instructions(tb.tb_frame.f_code) if i.offset == tb.tb_lasti), "")
    return at in ("RAISE_VARARGS", "RERAISE")


def call(engine: Engine, fn: Subject, *args: object, **kwargs: object) -> object:
    """Call a subject; a NotImplementedError that the code raised (a mode the engine does not have) skips with
    its reason; one a torch operator threw (no kernel for the dtype or device the code asked for) is a failure."""
    try:
        return fn(*args, **kwargs)
    except NotImplementedError as e:
        if not raised_deliberately(e):
            raise
        pytest.skip(f"{engine.name} {engine.version}: {e}")
