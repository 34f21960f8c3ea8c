"""Shared plumbing of the property tests: subject lookup, reporting, device handling."""

from __future__ import annotations

import math
import os

import pytest
import torch
from hypothesis import target
from hypothesis.control import currently_in_test_context

from engines.base import Engine, Subject, SubjectMissing
from oracles.drift import COLLECTOR
from oracles.metrics import describe_mismatch
from oracles.records import FAIL, Record, failure_message

LOW = torch.bfloat16  # the production storage dtype of every path here


def _device() -> str:
    """The device the small-shape properties put their tensors on: K3NUM_DEVICE (set by the root
    conftest from --device), default cuda where CUDA is available (the engines' Triton kernels then
    run natively and need CUDA tensors), else cpu. The K3-shape properties always use cuda."""
    name = os.environ.get("K3NUM_DEVICE") or ("cuda" if torch.cuda.is_available() else "cpu")
    try:
        kind = torch.device(name).type
    except RuntimeError as e:
        raise ValueError(f"K3NUM_DEVICE={name!r} is not a torch device ({e})") from e
    if kind not in ("cpu", "cuda"):
        raise ValueError(f"K3NUM_DEVICE={name!r}: the properties run on cpu or cuda")
    if kind == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"K3NUM_DEVICE={name!r}: torch.cuda.is_available() is False on this machine")
    if kind == "cpu" and torch.cuda.is_available():
        raise ValueError(f"K3NUM_DEVICE={name!r} on a CUDA machine: the engines' Triton kernels run natively "
                         "here and need CUDA tensors (the interpreter is chosen only where CUDA is absent)")
    return name


DEVICE = _device()


def subject(engine: Engine, name: str) -> Subject:
    """The engine's subject, or a skip whose reason names engine, version and subject."""
    try:
        return engine.subject(name)
    except SubjectMissing as e:
        pytest.skip(str(e))


def report(record: Record, *, climb: bool = True) -> Record:
    """Collect the record for the drift CSV, steer hypothesis toward the worst ratio, assert the verdict."""
    COLLECTOR.add(record)
    if climb and math.isfinite(record.ratio) and currently_in_test_context():
        part = record.detail.split(";")[0]
        target(record.ratio, label=f"{record.property}:{record.subject}:{part}")
    assert record.verdict != FAIL, failure_message(record)
    return record


def assert_bitwise(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    """Exact contract check: same dtype, shape and bits (NaNs equal)."""
    same = actual.shape == expected.shape and actual.dtype == expected.dtype and (
        torch.equal(actual, expected)
        or (actual.is_floating_point() and bool(((actual == expected) | (actual.isnan() & expected.isnan())).all()))
    )
    assert same, f"{what}: not bitwise equal: {describe_mismatch(actual, expected)}"


def up(t: torch.Tensor) -> torch.Tensor:
    """The float64 value the subject actually saw (or returned)."""
    return t.detach().to(torch.float64)


def round_storage(engine: Engine, x32: torch.Tensor) -> torch.Tensor:
    """fp32 -> storage dtype with the engine platform's rounding (round-to-nearest unless declared)."""
    return engine.storage_rounding(x32) if engine.storage_rounding is not None else x32.to(LOW)


def call(engine: Engine, fn: Subject, *args: object, **kwargs: object) -> object:
    """Call a subject; a NotImplementedError (a mode the engine does not have) skips with its reason."""
    try:
        return fn(*args, **kwargs)
    except NotImplementedError as e:
        pytest.skip(f"{engine.name} {engine.version}: {e}")
