"""The one way a judged record ends: collected for the drift CSV, hypothesis steered toward the worst ratio,
the verdict asserted. The property suite (properties/support.report, which first writes repro bundles) and
the API (k3num.api.assert_within_budget, for people's own tests) both end here.

Steering (`hypothesis.target`) happens inside a hypothesis test only, and under `k3num check` only on the
head's pass (harness/pairing_run.py `side()`): the base's pass and the confirming reruns replay the head's
draws and must not move the search.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import math
from collections.abc import Iterator
from typing import Any

from hypothesis import target
from hypothesis.control import currently_in_test_context

from k3num.harness import pairing_run
from k3num.oracles import drift
from k3num.oracles.records import FAIL, Record, failure_message

_BOOK: contextvars.ContextVar[Any] = contextvars.ContextVar("k3num_book", default=None)


@contextlib.contextmanager
def scoped(book: Any) -> Iterator[None]:
    """The run's Book (harness/session_state.py) for the test running inside: the plugin scopes each test's
    setup, call and teardown. Its last subject calls are dropped when the test ends."""
    token = _BOOK.set(book)
    try:
        yield
    finally:
        _BOOK.reset(token)
        book.last_calls.clear()


def book() -> Any:
    """The running test's Book; RuntimeError outside a k3num pytest run."""
    b = _BOOK.get()
    if b is None:
        raise RuntimeError("no k3num run: the property helpers' state lives in a pytest run with the k3num plugin")
    return b


def on_head() -> bool:
    """Whether this pass is the one that draws: always outside a check, the head's pass inside one."""
    return pairing_run.side() == "head"


def collect(record: Record, *, climb: bool = True) -> Record:
    """Collect the record (its kept tensors dropped), steer toward the worst ratio when `climb`, assert the
    verdict (AssertionError with the suite's small report). Returns the collected record."""
    if "actual" in record.extra:
        record = dataclasses.replace(record, extra={})
    collector = drift.current()  # the run's (none outside a k3num pytest run: the API then only judges)
    if collector is not None:
        collector.add(record)
    if climb and on_head() and math.isfinite(record.ratio) and (
            currently_in_test_context()):
        part = record.detail.split(";")[0]
        target(record.ratio, label=f"{record.property}:{record.subject}:{part}")
    assert record.verdict != FAIL, failure_message(record)
    return record
