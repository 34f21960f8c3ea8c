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
  hypothesis (`target`) and writes repro bundles. A case only the head failed is run on the head HEAD_CONFIRM
  more times (their records are not kept): passing once, it is flaky (a known race only where the test's entry
  is one); failing every time, it is new, whatever a racy base would do on reruns.
- The ledger's strict xfails are off: the check itself tells known from new (oracles/pairing.py), and
  names the entry filed for the test on the pinned release.
- The float64 oracle runs once per case: the base's passes take the head's answers where their inputs are
  the same bits (harness/oracle_memo.py); examples.csv counts, per example, the oracle calls computed,
  reused and computed again because the inputs differed.
- At the end: DIR/examples.csv and DIR/records.csv (oracles/pairing.py's two tables).

Shapes: none; this module moves records, it computes nothing.
"""

from __future__ import annotations

import contextvars
import copy
import functools
import hashlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd
import pytest
from hypothesis.errors import HypothesisException

from k3num.engines import registry
from k3num.engines.base import Engine
from k3num.harness import around, oracle_memo, side_cases
from k3num.oracles import pairing
from k3num.oracles.drift import COLLECTOR
from k3num.supply import fetch

CONFIRM = 3  # reruns of a side's failing case that tell a flaky failure from a repeated one
# reruns of the head's failing case the base passed: a deterministic head failure fails all 1 + 6 runs, which a
# race at K3N-005's rate (64 of 200 calls, the highest measured: oracles/hunt.py) does with 0.32^6 = 0.1%
HEAD_CONFIRM = 6
# the pass running now, scoped by _run_side (read by harness/recording.py and properties/support.py: only the
# head's pass steers hypothesis and writes bundles); outside a check every pass is the head's
_SIDE: contextvars.ContextVar[str] = contextvars.ContextVar("k3num_check_side", default="head")


def side() -> str:
    """The check's pass running now: "head", "base" or "rerun" (outside a check: "head")."""
    return _SIDE.get()


@dataclass
class CheckState:
    """What one check run keeps between its hooks (config.stash[CHECK])."""

    memo: oracle_memo.Memo = field(default_factory=oracle_memo.Memo)
    examples: list[dict[str, Any]] = field(default_factory=list)  # examples.csv's rows
    records: list[dict[str, Any]] = field(default_factory=list)  # records.csv's rows
    count: dict[str, int] = field(default_factory=dict)  # node id -> examples so far
    bases: dict[str, Engine] = field(default_factory=dict)  # head engine name -> its base
    cases: list[dict[str, Any]] = field(default_factory=list)  # the head's cases in a two-process check
    replay: dict[str, list[dict[str, Any]]] = field(default_factory=dict)  # the base's: node key -> head's cases
    fixtures: dict[str, tuple[str, ...]] = field(default_factory=dict)  # node id -> its fixture arguments
    ledger: dict[str, str] = field(default_factory=dict)  # node id -> the entry filed for its test (pinned)


CHECK = pytest.StashKey[CheckState]()


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("k3-numerics")
    group.addoption("--check-base", default=None, metavar="pinned|PATH|engine:NAME",
                    help="pair every example with a base engine (what `k3num check` runs): the pinned release, "
                         "a tree, or a registered engine; the head is --engine (with its --engine-src)")
    group.addoption("--check-out", default=None, metavar="DIR",
                    help="with --check-base: write DIR/examples.csv and DIR/records.csv")
    group.addoption("--check-side", default=None, choices=("head", "base"),
                    help="one side of a two-process check (`k3num check` where a side runs compiled ops): the head "
                         "draws as hypothesis does, each failure kept, not raised, and writes DIR/cases.pt; the base "
                         "runs exactly those cases (--check-replay); DIR/examples.csv and DIR/records.csv are joined "
                         "(oracles/pairing.join_sides)")
    group.addoption("--check-replay", default=None, metavar="FILE",
                    help="with --check-side base: the head's cases.pt")
    group.addoption("--check-moves-to", default=None, metavar="STAGE=FINAL",
                    help="`k3num check` moves this run's files from the folder STAGE to FINAL when it ends: the log's "
                         "closing lines name the files where they will be kept")


def active(config: pytest.Config) -> bool:
    return bool(config.getoption("--check-base", None)) or solo(config) is not None


def shown(config: pytest.Config, path: str | Path) -> Path:
    """Where a file this run writes will be kept (`--check-moves-to`: under FINAL, where the check moves it)."""
    spec = config.getoption("--check-moves-to", None)
    p = Path(path)
    if not spec or "=" not in spec:
        return p
    stage, final = (Path(x) for x in spec.split("=", 1))
    try:
        return final / p.resolve().relative_to(stage.resolve())
    except ValueError:
        return p


def solo(config: pytest.Config) -> str | None:
    """The side of a two-process check this process runs, or None."""
    return config.getoption("--check-side", None)


def pytest_configure(config: pytest.Config) -> None:
    if not active(config):
        return
    flag = "--check-side" if solo(config) else "--check-base"
    if not config.getoption("--check-out", None):
        raise pytest.UsageError(f"{flag}: needs --check-out DIR")
    if solo(config) and config.getoption("--check-base", None):
        raise pytest.UsageError("--check-side runs one side alone: drop --check-base")
    if getattr(config.option, "dist", "no") != "no" or hasattr(config, "workerinput"):
        raise pytest.UsageError(f"{flag}: runs in one process (drop -n/--dist)")
    if solo(config):
        if (solo(config) == "base") != bool(config.getoption("--check-replay", None)):
            raise pytest.UsageError("--check-side base replays the head's cases: it needs --check-replay FILE "
                                    "(the head's cases.pt), and the head takes none")
        config.stash[CHECK] = CheckState()
        return
    spec = config.getoption("--check-base")
    if spec != "pinned" and not spec.startswith("engine:") and not Path(spec).is_dir():
        raise pytest.UsageError(f"--check-base {spec}: not 'pinned', 'engine:NAME' or a directory")
    config.stash[CHECK] = CheckState()


def base_tree(pin: str, head: fetch.Source) -> Path | None:
    """The tree `--check-base pinned` reads for a head: the cache of the pinned release the head is judged as
    (None: the engine's default release)."""
    release = head.pin
    return None if release is fetch.PINS[pin] else fetch.release_root(fetch.spec_of(release))


def base_for(config: pytest.Config, head: Engine) -> Engine:
    """The base engine paired with `head` (built once); a base that cannot be built skips the test."""
    bases = config.stash[CHECK].bases
    if head.name in bases:
        return bases[head.name]
    spec = config.getoption("--check-base")
    try:
        if spec.startswith("engine:"):
            built = registry.build(spec.split(":", 1)[1])
        else:
            from k3num.harness.session_state import RUN

            pin = head.name.split("-")[0]
            ctx = config.stash[RUN]
            ctx = ctx.with_source(pin, base_tree(pin, ctx.source(pin)) if spec == "pinned" else Path(spec).resolve())
            if around.SEP in head.name:  # a variant around a known divergence: the base tree with the same fix
                built = around.engine(head.name, ctx.sources, ctx.engine_mode)
            else:
                built = registry.build(head.name, ctx.sources, ctx.engine_mode)
    except (registry.EngineUnavailable, around.Unavailable) as e:
        pytest.skip(f"base of {head.name} unavailable: {e}")
    if "+ops" in built.mode or built.mode == "import":
        pytest.exit(f"--check-base: {head.name}'s base runs in mode {built.mode}: one process cannot hold two builds "
                    "of the same compiled op names; `k3num check` runs one process per side there (--check-side)",
                    returncode=4)
    bases[head.name] = built
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


def _run_side(state: CheckState, inner, args, kwargs, side: str) -> tuple[str, str, list]:
    """One pass of the example body: (outcome, why, the records it made)."""
    n0 = len(COLLECTOR.records)
    token = _SIDE.set(side)
    try:
        with state.memo.passing(recording=side == "head"):
            inner(*args, **kwargs)
        outcome, why = pairing.PASS, ""
    except pytest.skip.Exception as e:
        outcome, why = pairing.SKIP, str(e)
    except HypothesisException:
        raise  # hypothesis' own control flow (a rejected draw) and its usage errors are not outcomes
    except (pytest.fail.Exception, Exception) as e:  # an assertion, a refusal not raised, any error
        outcome, why = pairing.FAIL, failure_why(e)
    finally:
        _SIDE.reset(token)
    return outcome, why, COLLECTOR.records[n0:]


def failure_why(e: BaseException) -> str:
    """A failure as the check keeps it: the exception's type and its whole message, lines joined by " / "
    (check.md wraps it; nothing is cut)."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    return f"{type(e).__name__}: {' / '.join(lines)}"


def _recording(kwargs: dict) -> tuple[dict, dict[str, _Recorder]]:
    """The head's kwargs, each `st.data()` object wrapped to record its draws, and the recorders."""
    data_keys = [k for k, v in kwargs.items() if hasattr(v, "draw") and type(v).__name__ == "DataObject"]
    head_kwargs, recorders = dict(kwargs), {}
    for k in data_keys:
        recorders[k] = head_kwargs[k] = _Recorder(kwargs[k])
    return head_kwargs, recorders


def _replayed(kwargs: dict, recorders: dict[str, _Recorder], **extra) -> dict:
    return {**kwargs, **extra, **{k: _Replay(r.values) for k, r in recorders.items()}}


def _head_passes_again(state: CheckState, inner, args, kwargs: dict, recorders: dict[str, _Recorder],
                       times: int = 0) -> bool:
    """The head's failing case run `times` (default CONFIRM) more times: True as soon as one passes (the failure
    is flaky)."""
    return any(_run_side(state, inner, args, _replayed(kwargs, recorders), "rerun")[0] == pairing.PASS
               for _ in range(times or CONFIRM))


def _paired(inner, config: pytest.Config):
    if getattr(inner, "_k3num_paired", False):
        return inner

    @functools.wraps(inner)
    def body(*args, **kwargs):
        head = kwargs.get("engine")
        if not isinstance(head, Engine):
            return inner(*args, **kwargs)
        base = base_for(config, head)
        state = config.stash[CHECK]
        node = COLLECTOR.node
        example = state.count[node] = state.count.get(node, 0) + 1
        head_kwargs, recorders = _recording(kwargs)
        state.memo.new_example()
        before = dict(state.memo.stats)
        h, h_why, h_recs = _run_side(state, inner, args, head_kwargs, "head")

        b, b_why, b_recs = _run_side(state, inner, args, _replayed(kwargs, recorders, engine=base), "base")
        if h == pairing.SKIP and b == pairing.SKIP:
            pytest.skip(h_why)
        # a head failure the base passed is confirmed on the head: a race (K3N-004/005/007 on a GPU) fails only
        # some calls. The head runs the same case HEAD_CONFIRM more times: passing once, its failure is flaky
        # (a known race only where the test's entry is a race: oracles/pairing.exit_code); failing every time,
        # it is deterministic, so new, whatever a racy base does on reruns of its own (a base that fails 1 call
        # in 3 would otherwise file a deterministic head bug under its race most of the time)
        if (h, b) == (pairing.FAIL, pairing.PASS):
            if _head_passes_again(state, inner, args, kwargs, recorders, HEAD_CONFIRM):
                h = pairing.FLAKY
        state.examples.append({"node": node, "example": example, "head": h, "base": b, "head_why": h_why,
                               "base_why": b_why, "ledger": state.ledger.get(node, ""),
                               **{f"oracle_{k}": v - before[k] for k, v in state.memo.stats.items()}})
        state.memo.new_example()
        for side, recs in (("head", h_recs), ("base", b_recs)):
            _keep(state, node, example, side, recs)

    body._k3num_paired = True  # type: ignore[attr-defined]
    return body


def record_fixed_case(config: pytest.Config, node: str, entry_id: str, head: Engine, attempt) -> None:
    """A test with one fixed case and no `engine` argument (a ledger entry's reproducer) paired by hand:
    `attempt(engine) -> (outcome, why)` on the head and, in one process, on the base; the rows join the
    check's examples as any example's do, the entry id in `ledger` (oracles/pairing.py reads a reproducer's
    rows for "fixed")."""
    state = config.stash[CHECK]
    token = _SIDE.set("head")
    try:
        h, h_why = attempt(head)
    finally:
        _SIDE.reset(token)
    if solo(config):
        state.examples.append({"node": node, "example": 1, "side": solo(config), "engine": head.name,
                               "outcome": h, "why": h_why, "ledger": entry_id,
                               "case": case_key({"entry": entry_id}, {})})
        return
    base = base_for(config, head)
    token = _SIDE.set("base")
    try:
        b, b_why = attempt(base)
    finally:
        _SIDE.reset(token)
    state.examples.append({"node": node, "example": 1, "head": h, "base": b, "head_why": h_why, "base_why": b_why,
                           "ledger": entry_id})


def case_key(kwargs: dict, drawn: dict) -> str:
    """What a two-process check joins an example's sides by, beside (node, example): a digest of the
    example's arguments (the engine left out) and of the values it drew inside its body."""
    args = {k: v for k, v in kwargs.items() if not isinstance(v, Engine) and k not in drawn}
    text = repr(sorted((k, repr(v)) for k, v in args.items())) + repr(sorted((k, repr(v)) for k, v in drawn.items()))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _solo(inner, state: CheckState):
    """The head's side of a two-process check: the example once, its outcome and case kept (a failure is
    run CONFIRM more times on the same case: passing once, flaky), for the base to replay."""
    if getattr(inner, "_k3num_paired", False):
        return inner

    @functools.wraps(inner)
    def body(*args, **kwargs):
        engine = kwargs.get("engine")
        if not isinstance(engine, Engine):
            return inner(*args, **kwargs)
        node = COLLECTOR.node
        first, recorders = _recording(kwargs)
        given = copy.deepcopy({k: v for k, v in kwargs.items()
                               if k not in state.fixtures.get(node, ("engine",)) and k not in recorders})
        outcome, why, recs = _run_side(state, inner, args, first, "head")  # a rejected draw raises through
        example = state.count[node] = state.count.get(node, 0) + 1
        drawn = {k: r.values for k, r in recorders.items()}
        state.cases.append({"key": pairing.node_key(node, engine.name), "example": example, "given": given,
                            "drawn": drawn})
        if outcome == pairing.FAIL and _head_passes_again(state, inner, args, kwargs, recorders):
            outcome = pairing.FLAKY
        state.examples.append({"node": node, "example": example, "side": "head", "engine": engine.name,
                               "outcome": outcome, "why": why, "ledger": state.ledger.get(node, ""),
                               "case": case_key(given, drawn)})
        _keep(state, node, example, "head", recs)
        if outcome == pairing.SKIP:
            pytest.skip(why)

    body._k3num_paired = True  # type: ignore[attr-defined]
    return body


def _replay_base(item: pytest.Function) -> None:
    """The base's side: exactly the head's cases of this test, in order, on the base engine (no hypothesis
    generation: the base's process cannot be relied on to draw what the head's did)."""
    state = item.config.stash[CHECK]
    funcargs = {a: item.funcargs[a] for a in item._fixtureinfo.argnames}
    engine = funcargs["engine"]
    h = getattr(item.obj, "hypothesis", None)
    inner = h.inner_test if h is not None else item.obj
    node = item.nodeid
    cases = state.replay.get(pairing.node_key(node, engine.name))
    if not cases:
        pytest.skip("the head's run drew no case of this test (it did not run there)")
    outcomes = []
    for c in cases:
        kwargs = {**funcargs, **copy.deepcopy(c["given"]), **{k: _Replay(v) for k, v in c["drawn"].items()}}
        try:
            outcome, why, recs = _run_side(state, inner, (), kwargs, "base")
        except HypothesisException as e:  # the base rejected (assume) a case the head accepted
            outcome, why, recs = pairing.SKIP, f"rejected on the base: {type(e).__name__}", []
        state.examples.append({"node": node, "example": c["example"], "side": "base", "engine": engine.name,
                               "outcome": outcome, "why": why, "ledger": state.ledger.get(node, ""),
                               "case": case_key(c["given"], c["drawn"])})
        _keep(state, node, c["example"], "base", recs)
        outcomes.append((outcome, why))
    if all(o == pairing.SKIP for o, _ in outcomes):
        pytest.skip(outcomes[0][1])


def _keep(state: CheckState, node: str, example: int, side: str, recs: list) -> None:
    for i, r in enumerate(recs):
        state.records.append({"node": node, "example": example, "side": side, "index": i, "property": r.property,
                         "subject": r.subject, "detail": r.detail, "verdict": r.verdict,
                         "max_abs": r.max_abs, "budget": r.budget, "ratio": r.ratio, "seed": r.seed,
                         "shape": r.shape, "engine_version": r.engine_version})


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not active(config):
        return
    state = config.stash[CHECK]
    for item in items:
        state.fixtures[item.nodeid] = tuple(getattr(getattr(item, "_fixtureinfo", None), "argnames", ()))
    if solo(config) == "base":
        try:
            state.replay.update(side_cases.read(config.getoption("--check-replay")))
        except side_cases.CasesError as e:
            raise pytest.UsageError(f"--check-replay: {e}") from None
    wrap = functools.partial(_solo, state=state) if solo(config) else functools.partial(_paired, config=config)
    for item in items:
        entry = getattr(item, "k3num_check_ledger", "")
        if entry:
            state.ledger[item.nodeid] = entry
        h = getattr(getattr(item, "obj", None), "hypothesis", None)
        # the base of two processes replays the head's cases (pytest_pyfunc_call): hypothesis does not draw
        if h is not None and hasattr(h, "inner_test") and solo(config) != "base":
            h.inner_test = wrap(h.inner_test)


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem: pytest.Function):
    """A property test without hypothesis (one fixed case) is paired the same way; the base's side of a
    two-process check replays the head's cases of every test."""
    if not active(pyfuncitem.config):
        return None
    if solo(pyfuncitem.config) == "base" and isinstance(pyfuncitem.funcargs.get("engine"), Engine):
        _replay_base(pyfuncitem)
        return True
    if hasattr(pyfuncitem.obj, "hypothesis"):
        return None
    funcargs = {a: pyfuncitem.funcargs[a] for a in pyfuncitem._fixtureinfo.argnames}
    if not isinstance(funcargs.get("engine"), Engine):
        return None
    config = pyfuncitem.config
    (_solo(pyfuncitem.obj, config.stash[CHECK]) if solo(config) else _paired(pyfuncitem.obj, config))(**funcargs)
    return True


def pytest_sessionfinish(session: pytest.Session) -> None:
    if not active(session.config):
        return
    state = session.config.stash[CHECK]
    out = Path(session.config.getoption("--check-out"))
    out.mkdir(parents=True, exist_ok=True)
    if solo(session.config) == "head":
        side_cases.write(out / "cases.pt", state.cases)
    memo = [f"oracle_{k}" for k in state.memo.stats]
    columns = pairing.SIDE_COLUMNS if solo(session.config) else (*pairing.EXAMPLE_COLUMNS, *memo)
    pd.DataFrame(state.examples, columns=list(columns)).to_csv(out / "examples.csv", index=False)
    pd.DataFrame(state.records, columns=[*pairing.RECORD_COLUMNS, "engine_version"]).to_csv(out / "records.csv",
                                                                                            index=False)
