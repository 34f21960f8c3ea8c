"""The ledger's case rules in a run (harness/plugin.py applies them; harness/ledger_cases.py states
them): in a test a ledger entry covers, a failing case inside the entry's rule is the known divergence,
and any other failing case fails the test. Registered by harness/plugin.py (`pytest_plugins`)."""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import sys
from collections.abc import Iterator
from typing import Any

import pytest

from k3num.oracles import ledger, pairing, records
from k3num.oracles.drift import COLLECTOR

# the entry id of each failing case inside its rule, in the test running now (scoped by `counting`)
_KNOWN: contextvars.ContextVar[list[str] | None] = contextvars.ContextVar("k3num_known_cases", default=None)
# the failing cases inside a race entry's region its model does not explain, in the test running now: the test
# fails with them when hypothesis is done (raised at once, a replay the race spares makes hypothesis's
# FlakyFailure, which hides the model's verdict; GPU run 81)
_DEFERRED: contextvars.ContextVar[list[str] | None] = contextvars.ContextVar("k3num_deferred", default=None)


def _defer(inside: list[str], message: str) -> bool:
    """Keep `message` as the test's failure, to be raised after hypothesis ends, where every entry in `inside`
    is a race and a scope is open; False (raise it now) otherwise."""
    deferred = _DEFERRED.get()
    if deferred is None or not inside or not all(getattr(ledger.by_id(eid), "race", False) for eid in inside):
        return False
    deferred.append(message)
    return True


# the calls a property records itself, in the test body running now: an op behind a capability that no recorder
# wraps (K3N-014's compiled FP8 insert) hands its inputs and output to its entry's bug model through `observe`
_OBSERVED: contextvars.ContextVar[list | None] = contextvars.ContextVar("k3num_observed", default=None)


def observe(subject: str, args: tuple, out: Any, engine: Any = None) -> None:
    """Record one call a property made outside the engine's subjects (its inputs before the call, its output),
    for the bug models of the entries covering the running test; nothing where no ledgered body runs."""
    from k3num.harness.ledger_models import Call

    into = _OBSERVED.get()
    if into is not None:
        into.append(Call(subject, _cloned(args), {}, _cloned(out), engine))


@contextlib.contextmanager
def observing(into: list) -> Iterator[None]:
    """Scope `observe`: the calls a property observes while the body runs go to `into`."""
    token = _OBSERVED.set(into)
    try:
        yield
    finally:
        _OBSERVED.reset(token)


def _drawn_repr(drawn: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in drawn.items())[:400]


@contextlib.contextmanager
def counting() -> Iterator[list[str]]:
    """Scope a test's count of known cases: the list the ledgered bodies run inside it append to."""
    known: list[str] = []
    token = _KNOWN.set(known)
    try:
        yield known
    finally:
        _KNOWN.reset(token)


def ledgered(inner):
    """A ledger-covered test's body (`test.hypothesis.inner_test`): a failing case inside the entry's rule
    (harness/ledger_cases.py) is the known divergence, counted and let pass, so hypothesis goes on
    drawing; a failing case outside every entry's rule fails the test as any failure does.
    `_k3num_entries` maps the engine's registry name to its entries (one body serves every engine's
    parametrization; two races can share one test: K3N-005 and K3N-007 on ROCm's repeat property)."""
    if hasattr(inner, "_k3num_entries"):
        return inner
    from hypothesis.errors import HypothesisException

    from k3num.harness import ledger_cases, ledger_models

    entries: dict[str, list[ledger.Divergence]] = {}

    @functools.wraps(inner)
    def body(*args, **kwargs):
        filed = entries.get(getattr(kwargs.get("engine"), "name", None))
        if not filed:
            return inner(*args, **kwargs)
        calls: dict[str, Any] = {}  # subject -> the view of the last call the example made to it
        recorded: list[ledger_models.Call] = []  # the calls the filed entries' bug models read
        drawn = {k: v for k, v in kwargs.items() if k != "engine"}
        engine = record_calls(_recording(kwargs["engine"], calls), model_subjects(filed), recorded)
        try:
            with observing(recorded):
                return inner(*args, **{**kwargs, "engine": engine})
        except (pytest.skip.Exception, HypothesisException):
            raise
        except (pytest.fail.Exception, Exception) as e:  # an assertion, a refusal not raised, any error
            inside = [d.id for d in filed if ledger_cases.inside(d.id, drawn, calls)]
            if not inside:
                raise  # outside every entry's cases: a failure like any other
            # inside an entry's region, known only where the failure is the entry's (its signature: the exception
            # and the assertion) and its bug model explains what the engine computed
            unexplained = {eid: why_not(eid, inner.__name__, e, recorded) for eid in inside}
            covering = [eid for eid in inside if not unexplained[eid]]
            if not covering:
                note = ("; ".join(unexplained.values()) + ": inside the region of the ledger, but not its bug: "
                        "a new failure (harness/ledger_models.py)")
                first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
                if _defer(inside, f"{_drawn_repr(drawn)}: {first[:200]}; {note}"):
                    return None
                e.add_note(note)
                raise
            known = _KNOWN.get()
            if known is None:
                raise RuntimeError("a ledgered test body ran outside ledger_run.counting(): its known case "
                                   "would not be counted") from None
            known.append(covering[0])
            why = str(sys.exc_info()[1]).strip().splitlines()
            COLLECTOR.add(records.known_case(property=inner.__name__, engine=kwargs["engine"], ledger=covering[0],
                                             node=COLLECTOR.node, why=why[0] if why else ""))

    body._k3num_entries = entries  # type: ignore[attr-defined]
    return body


UNEXPLAINED = pairing.UNEXPLAINED  # oracles/pairing.py reads a head failure carrying it as new


def modelled(inner):
    """`k3num check`'s form of `ledgered`: nothing is let pass (the pairing tells known from new), but a
    failure inside an entry's region that its bug model does not explain is re-raised marked UNEXPLAINED, so
    the check counts it new even where the base fails the same example."""
    if hasattr(inner, "_k3num_model_entries"):
        return inner
    from hypothesis.errors import HypothesisException

    entries_of: dict[str, list[ledger.Divergence]] = {}  # engine name -> the entries filed for its test

    from k3num.harness import ledger_cases, ledger_models

    @functools.wraps(inner)
    def body(*args, **kwargs):
        filed = list(entries_of.get(getattr(kwargs.get("engine"), "name", None), ()))
        if not filed:
            return inner(*args, **kwargs)
        calls: dict[str, Any] = {}
        recorded: list[ledger_models.Call] = []
        drawn = {k: v for k, v in kwargs.items() if k != "engine"}
        engine = record_calls(_recording(kwargs["engine"], calls), model_subjects(filed), recorded)
        try:
            with observing(recorded):
                return inner(*args, **{**kwargs, "engine": engine})
        except (pytest.skip.Exception, HypothesisException):
            raise
        except (pytest.fail.Exception, Exception) as e:
            inside = [d.id for d in filed if ledger_cases.inside(d.id, drawn, calls)]
            why = [w for w in (why_not(eid, inner.__name__, e, recorded) for eid in inside) if w]
            if inside and len(why) == len(inside):
                first = str(e).strip().splitlines()[0] if str(e).strip() else ""
                # raised at once: the check's pairing catches each side's failure itself, per example
                raise AssertionError(f"{UNEXPLAINED} {type(e).__name__}: {first[:200]}; {'; '.join(why)}") from e
            raise

    body._k3num_model_entries = entries_of  # type: ignore[attr-defined]
    return body


class NotTheEntrysFailure(Exception):
    """A failure of a whole-test known divergence (a user's checkpoint inside an entry's checkpoint rule) that the
    entry's bug model does not explain: raised in its place, so the strict xfail, which expects the entry's own
    exceptions only, reports the test failed."""


def checkpoint_modelled(fn, entry_id: str):
    """A plain test (not hypothesis's) that is known as a whole, as the entry's (its checkpoint rule): its
    failure stays known only where the entry's signature and bug model explain it (why_not, over the calls the
    test observes); else NotTheEntrysFailure, naming why. Pytest calls it with the test's fixtures."""

    @functools.wraps(fn)
    def body(*args, **kwargs):
        recorded: list = []
        try:
            with observing(recorded):
                return fn(*args, **kwargs)
        except pytest.skip.Exception:
            raise
        except (pytest.fail.Exception, Exception) as e:
            why = why_not(entry_id, fn.__name__, e, recorded)
            if why:
                first = str(e).strip().splitlines()[0] if str(e).strip() else ""
                raise NotTheEntrysFailure(f"{UNEXPLAINED} {type(e).__name__}: {first[:200]}; {why}") from e
            raise

    return body


def why_not(entry_id: str, test: str, e: BaseException, recorded: list) -> str:
    """"" when the failure `e` of `test` is the entry's: it matches the entry's failure signature
    (ledger_cases.signature_mismatch) and the entry's bug model explains the recorded calls (those the
    properties observe included); else why not, naming the entry."""
    from k3num.harness import ledger_cases, ledger_models

    failure = ledger_cases.said(e)
    return ledger_cases.signature_mismatch(entry_id, test, failure) or ledger_models.explains(entry_id, recorded)


def model_subjects(entries) -> tuple[str, ...]:
    """The subjects whose calls the entries' bug models read (harness/ledger_models.py)."""
    from k3num.harness import ledger_models

    return tuple(dict.fromkeys(s for d in entries for s in getattr(ledger_models.MODELS.get(d.id), "subjects", ())))


def _cloned(x: Any) -> Any:
    """A recorded value with every tensor in it cloned (tensors, tuples and lists of them, plain values as they are)."""
    import torch

    tensor = torch.Tensor

    def clone(v: Any) -> Any:
        if isinstance(v, tensor):
            return v.detach().clone()
        if isinstance(v, (list, tuple)):
            return type(v)([clone(w) for w in v])
        return v

    return clone(x)


LIMIT = 64  # calls kept whatever their output (the repeat properties make 152 of one call)
DISTINCT = 256  # beyond LIMIT, calls kept while their output is new; past this many the model cannot judge


def _same(a: Any, b: Any) -> bool:
    """Bitwise equality of two recorded values (tensors, tuples of them, plain values)."""
    import torch

    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape
                and a.dtype == b.dtype and bool(torch.equal(a, b)))
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return a == b


def _tensors(x: Any) -> list:
    """The tensors of a recorded value (tensors, tuples or lists of them, dicts), in order."""
    import torch

    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (list, tuple)):
        return [t for v in x for t in _tensors(v)]
    if isinstance(x, dict):
        return [t for k in sorted(x, key=str) for t in _tensors(x[k])]
    return []


def _int_of() -> dict:
    import torch

    return {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _digest(*values: Any) -> tuple:
    """A fingerprint of each value, from one host transfer: per tensor its shape, dtype and three sums of its
    elements' bits read as integers (all, every second, every seventh: no copy is made), the rest of the
    value as its type. Equal values
    have equal fingerprints; unequal ones almost never do, and `_same` confirms a match bitwise, so a
    fingerprint only spares the comparisons (and their device syncs) that could not match."""
    import torch

    sums, meta = [], []
    for v in values:
        ts = _tensors(v)
        meta.append((tuple((tuple(t.shape), t.dtype) for t in ts), repr(v) if not ts else type(v).__name__))
        for t in ts:
            b = t.detach().contiguous().reshape(-1)
            b = b.view(_int_of()[b.element_size()]) if b.dtype != torch.bool else b.to(torch.uint8)
            sums.append(torch.stack([b.sum(dtype=torch.int64), b[1::2].sum(dtype=torch.int64),
                                     b[::7].sum(dtype=torch.int64)]))
    flat = torch.cat(sums).tolist() if sums else []
    return tuple(meta), tuple(flat)


def record_calls(engine: Any, subjects: tuple[str, ...], into: list) -> Any:
    """`engine` with each subject of `subjects` appending a ledger_models.Call to `into`: its inputs cloned
    before the call (a kernel may rewrite them in place) and its output. The first LIMIT calls are kept; after
    them a call is kept only where its inputs or its output differ from every kept call's (a race's new
    output, 152 calls into a repeat property), up to DISTINCT calls; past that a truncation mark
    (ledger_models.TRUNCATED) is kept, so no model calls an output it never saw explained. Kept calls are
    found by a fingerprint of their inputs and outputs (`_digest`) and confirmed bitwise: a repeat call costs
    one fingerprint, not a comparison with every kept call (bench/model_cost.py)."""
    from k3num.harness.ledger_models import TRUNCATED, Call

    watched = {name: fn for name, fn in getattr(engine, "subjects", {}).items() if name in subjects}
    if not watched:
        return engine
    # (subject, the inputs' fingerprint) -> the kept calls with those inputs, and their outputs' fingerprints
    kept: dict[tuple, list[tuple[Any, tuple]]] = {}

    def recorder(name: str, fn: Any) -> Any:
        @functools.wraps(fn)
        def call(*args, **kwargs):
            before = (_cloned(args), _cloned(kwargs))
            out = fn(*args, **kwargs)
            first = len(into) < LIMIT
            if first and len(into) < LIMIT - 1 and not kept:  # the common case: few calls, no fingerprint
                into.append(Call(name, before[0], before[1], _cloned(out), engine))
                return out
            key_in, key_out = _digest(before, out)
            if not kept:  # fingerprint the calls kept before the limit was in sight, once
                for c in into:
                    if c.subject != TRUNCATED:
                        k, o = _digest((c.args, c.kwargs), c.out)
                        kept.setdefault((c.subject, k), []).append((c, o))
            twins = [(c, o) for c, o in kept.get((name, key_in), ())
                     if _same(c.args, before[0]) and _same(c.kwargs, before[1])]
            if not first and any(o == key_out and _same(c.out, out) for c, o in twins):
                return out  # a repeat of a kept call: nothing new to judge
            if not first and len(into) >= DISTINCT:
                if not any(c.subject == TRUNCATED for c in into):
                    into.append(Call(TRUNCATED, (name,), {}, None, engine))
                return out
            twin = twins[0][0] if twins else None
            args_kept = twin.args if twin is not None else before[0]  # the same inputs are kept once
            kwargs_kept = twin.kwargs if twin is not None else before[1]
            c = Call(name, args_kept, kwargs_kept, _cloned(out), engine)
            into.append(c)
            kept.setdefault((name, key_in), []).append((c, key_out))
            return out

        return call

    return dataclasses.replace(engine, subjects={**engine.subjects,
                                                 **{n: recorder(n, f) for n, f in watched.items()}})


def _recording(engine: Any, calls: dict[str, Any]) -> Any:
    """`engine` with each subject a rule can read (ledger_cases.CALL_VIEWS) recording its last call's view
    into `calls` (shapes and flags, no tensor); the subjects themselves run unchanged."""
    from k3num.harness.ledger_cases import CALL_VIEWS

    watched = {name: fn for name, fn in getattr(engine, "subjects", {}).items() if name in CALL_VIEWS}
    if not watched:
        return engine

    def recorder(name: str, fn: Any) -> Any:
        @functools.wraps(fn)
        def call(*args, **kwargs):
            calls[name] = CALL_VIEWS[name](args, kwargs)
            return fn(*args, **kwargs)

        return call

    return dataclasses.replace(engine, subjects={**engine.subjects,
                                                 **{n: recorder(n, f) for n, f in watched.items()}})


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item):
    """A ledger-covered test whose only failures were cases inside its entry's rule: xfailed, naming the
    entry and the count (the run's account counts it known, as a strict xfail was). A test with a deferred
    failure (a race entry's region, not its bug) fails, naming the model's verdict, whatever else it saw."""
    deferred: list[str] = []
    token = _DEFERRED.set(deferred)
    try:
        with counting() as known:
            result = yield
    finally:
        _DEFERRED.reset(token)
    if deferred:
        head = deferred[0] if deferred[0].startswith(UNEXPLAINED) else f"{UNEXPLAINED} {deferred[0]}"
        pytest.fail(f"{head}\n" + "\n".join(f"  also: {d}" for d in deferred[1:5])
                    + f"\n{len(deferred)} failing case(s) inside a race entry's region that its bug model does not "
                    "explain: new (raised after hypothesis ended, as a race may spare the replay)", pytrace=False)
    if known:
        from k3num.harness import ledger_cases

        parts = []
        for eid in dict.fromkeys(known):
            entry = ledger.by_id(eid)
            parts.append(f"{eid} ({entry.upstream if entry else ''}): {known.count(eid)} failing case(s) inside "
                         f"its rule ({ledger_cases.CASES[eid].rule})")
        pytest.xfail("; ".join(parts) + "; every case outside was judged plainly and passed")
    return result


