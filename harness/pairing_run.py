"""The pre-merge check's run (`k3num check`, harness/check.py): every hypothesis example of every
selected property runs through the head engine and then through the base engine, on the same drawn
case, in one process. Registered by harness/plugin.py (`pytest_plugins`); active only with
--check-base.

- The head is the engine the `engine` fixture gives (`--engine NAME --engine-src PIN=HEAD`); the base
  is the same registry name built from the pinned cache (`--check-base pinned`), from another tree
  (`--check-base PATH`), or another registered engine (`--check-base engine:NAME`, the self-tests'
  mirror against its mutants).
- An example's body is called twice: `test.hypothesis.inner_test` is wrapped. Values drawn inside the
  body (`st.data()`) are recorded on the head's pass and replayed on the base's, so both see the same
  inputs. Neither side's failure fails the example: hypothesis goes on drawing, and each side's outcome
  (pass / fail / skip, and why) and its oracle comparisons are kept. Only the head's pass steers
  hypothesis (`target`) and writes repro bundles. A case only the head failed is run on the base
  CONFIRM more times, then the head (their records are not kept): a race that fails some calls is then
  known (the base failed too) or flaky (the head passed too), not new.
- The ledger's strict xfails are off: the check itself tells known from new (oracles/pairing.py), and
  names the entry filed for the test on the pinned release.
- At the end: DIR/examples.csv and DIR/records.csv (oracles/pairing.py's two tables).

Shapes: none; this module moves records, it computes nothing.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pandas as pd
import pytest
from hypothesis.errors import HypothesisException

from k3num.engines import registry
from k3num.engines.base import Engine
from k3num.oracles import pairing
from k3num.oracles.drift import COLLECTOR
from k3num.supply import fetch

CONFIRM = 3  # reruns of the base on a case only the head failed (below)
SIDE = {"side": "head"}  # read by properties/support.py: the base's pass neither climbs nor bundles
_EXAMPLES: list[dict[str, Any]] = []
_RECORDS: list[dict[str, Any]] = []
_COUNT: dict[str, int] = {}
_BASES: dict[str, Engine] = {}
_LEDGER: dict[str, str] = {}  # node id -> the ledger entry filed for its test on the pinned release


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("k3-numerics")
    group.addoption("--check-base", default=None, metavar="pinned|PATH|engine:NAME",
                    help="pair every example with a base engine (what `k3num check` runs): the pinned release, "
                         "a tree, or a registered engine; the head is --engine (with its --engine-src)")
    group.addoption("--check-out", default=None, metavar="DIR",
                    help="with --check-base: write DIR/examples.csv and DIR/records.csv")


def active(config: pytest.Config) -> bool:
    return bool(config.getoption("--check-base", None))


def pytest_configure(config: pytest.Config) -> None:
    if not active(config):
        return
    if not config.getoption("--check-out", None):
        raise pytest.UsageError("--check-base: needs --check-out DIR")
    if getattr(config.option, "dist", "no") != "no" or hasattr(config, "workerinput"):
        raise pytest.UsageError("--check-base: runs in one process (drop -n/--dist)")
    spec = config.getoption("--check-base")
    if spec != "pinned" and not spec.startswith("engine:") and not Path(spec).is_dir():
        raise pytest.UsageError(f"--check-base {spec}: not 'pinned', 'engine:NAME' or a directory")


@contextlib.contextmanager
def _source(pin: str, tree: str | None) -> Iterator[None]:
    """K3NUM_ENGINE_SRC with `pin` read from `tree` (None: the pinned cache), restored afterwards."""
    before = os.environ.get(fetch.ENGINE_SRC_ENV)
    items = [i for i in (before or "").split(",") if i.strip() and i.partition("=")[0].strip() != pin]
    if tree is not None:
        items.append(f"{pin}={tree}")
    os.environ[fetch.ENGINE_SRC_ENV] = ",".join(items)
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(fetch.ENGINE_SRC_ENV, None)
        else:
            os.environ[fetch.ENGINE_SRC_ENV] = before


def base_for(config: pytest.Config, head: Engine) -> Engine:
    """The base engine paired with `head` (built once); a base that cannot be built skips the test."""
    if head.name in _BASES:
        return _BASES[head.name]
    spec = config.getoption("--check-base")
    try:
        if spec.startswith("engine:"):
            built = registry.build(spec.split(":", 1)[1])
        else:
            with _source(head.name.split("-")[0], None if spec == "pinned" else str(Path(spec).resolve())):
                built = registry.build(head.name)
    except registry.EngineUnavailable as e:
        pytest.skip(f"base of {head.name} unavailable: {e}")
    if "+ops" in built.mode or built.mode == "import":
        pytest.exit(f"--check-base: {head.name}'s base runs in mode {built.mode}: one process cannot hold two builds "
                    "of the same compiled op names; run the check in source mode (--engine-mode source)", returncode=4)
    _BASES[head.name] = built
    return built


class _Recorder:
    """Stands in for hypothesis' `data` on the head's pass: draws through it, keeping each value."""

    def __init__(self, data: Any) -> None:
        self._data, self.values = data, []

    def draw(self, strategy: Any, label: Any = None) -> Any:
        value = self._data.draw(strategy, label=label)
        self.values.append(copy.deepcopy(value))
        return value


class _Replay:
    """Stands in for hypothesis' `data` on the base's pass: the head's draws, in order."""

    def __init__(self, values: list) -> None:
        self._values = list(values)

    def draw(self, strategy: Any, label: Any = None) -> Any:
        if not self._values:
            raise RuntimeError("the base's pass drew more values than the head's: the property's draws depend on "
                               "the engine, so the two sides cannot be paired")
        return copy.deepcopy(self._values.pop(0))


def _run_side(inner, args, kwargs, side: str) -> tuple[str, str, list]:
    """One pass of the example body: (outcome, why, the records it made)."""
    n0 = len(COLLECTOR.records)
    SIDE["side"] = side
    try:
        inner(*args, **kwargs)
        outcome, why = pairing.PASS, ""
    except pytest.skip.Exception as e:
        outcome, why = pairing.SKIP, str(e)
    except HypothesisException:
        raise  # hypothesis' own control flow (a rejected draw) and its usage errors are not outcomes
    except (pytest.fail.Exception, Exception) as e:  # an assertion, a refusal not raised, any error
        outcome, why = pairing.FAIL, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]
    finally:
        SIDE["side"] = "head"
    return outcome, why, COLLECTOR.records[n0:]


def _paired(inner, config: pytest.Config):
    if getattr(inner, "_k3num_paired", False):
        return inner

    @functools.wraps(inner)
    def body(*args, **kwargs):
        head = kwargs.get("engine")
        if not isinstance(head, Engine):
            return inner(*args, **kwargs)
        base = base_for(config, head)
        node = COLLECTOR.node
        example = _COUNT[node] = _COUNT.get(node, 0) + 1
        data_keys = [k for k, v in kwargs.items() if hasattr(v, "draw") and type(v).__name__ == "DataObject"]
        head_kwargs, recorders = dict(kwargs), {}
        for k in data_keys:
            recorders[k] = head_kwargs[k] = _Recorder(kwargs[k])
        h, h_why, h_recs = _run_side(inner, args, head_kwargs, "head")
        def base_pass():
            base_kwargs = {**kwargs, "engine": base, **{k: _Replay(r.values) for k, r in recorders.items()}}
            return _run_side(inner, args, base_kwargs, "base")

        b, b_why, b_recs = base_pass()
        if h == pairing.SKIP and b == pairing.SKIP:
            pytest.skip(h_why)
        # a head failure the base passed is confirmed: a race (K3N-004/005/007 on a GPU) fails only some
        # calls. The base runs the same case CONFIRM more times (failing once: the failure is the base's
        # too), then the head does (passing once: the head's failure is flaky, not a new deterministic one)
        if (h, b) == (pairing.FAIL, pairing.PASS):
            for _ in range(CONFIRM):
                again, again_why, _recs = base_pass()
                if again == pairing.FAIL:
                    b, b_why = again, f"{again_why} (on a rerun of the same case)"
                    break
            else:
                for _ in range(CONFIRM):
                    again, _why, _recs = _run_side(inner, args, {**kwargs, **{
                        k: _Replay(r.values) for k, r in recorders.items()}}, "rerun")
                    if again == pairing.PASS:
                        h = pairing.FLAKY
                        break
        _EXAMPLES.append({"node": node, "example": example, "head": h, "base": b, "head_why": h_why,
                          "base_why": b_why, "ledger": _LEDGER.get(node, "")})
        for side, recs in (("head", h_recs), ("base", b_recs)):
            for i, r in enumerate(recs):
                _RECORDS.append({"node": node, "example": example, "side": side, "index": i, "property": r.property,
                                 "subject": r.subject, "detail": r.detail, "verdict": r.verdict,
                                 "max_abs": r.max_abs, "budget": r.budget, "ratio": r.ratio, "seed": r.seed,
                                 "shape": r.shape, "engine_version": r.engine_version})

    body._k3num_paired = True  # type: ignore[attr-defined]
    return body


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not active(config):
        return
    for item in items:
        h = getattr(getattr(item, "obj", None), "hypothesis", None)
        if h is not None and hasattr(h, "inner_test"):
            h.inner_test = _paired(h.inner_test, config)
        entry = getattr(item, "k3num_check_ledger", "")
        if entry:
            _LEDGER[item.nodeid] = entry


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem: pytest.Function):
    """A property test without hypothesis (one fixed case) is paired the same way."""
    if not active(pyfuncitem.config) or hasattr(pyfuncitem.obj, "hypothesis"):
        return None
    funcargs = {a: pyfuncitem.funcargs[a] for a in pyfuncitem._fixtureinfo.argnames}
    if not isinstance(funcargs.get("engine"), Engine):
        return None
    _paired(pyfuncitem.obj, pyfuncitem.config)(**funcargs)
    return True


def pytest_sessionfinish(session: pytest.Session) -> None:
    if not active(session.config):
        return
    out = Path(session.config.getoption("--check-out"))
    out.mkdir(parents=True, exist_ok=True)
    pd.DataFrame(_EXAMPLES, columns=list(pairing.EXAMPLE_COLUMNS)).to_csv(out / "examples.csv", index=False)
    pd.DataFrame(_RECORDS, columns=[*pairing.RECORD_COLUMNS, "engine_version"]).to_csv(out / "records.csv",
                                                                                       index=False)
