"""Each ledger entry's reproducer, run strictly: on the pinned release it must still fail (reported
xfailed, naming the entry); if it passes there, the finding is gone and the entry must go (this test
fails). Where the entry's files are not the pinned bytes (a fix, a patch: `--engine-src`), the same
case is judged plainly and must pass. The case and the test whose body runs it are in
harness/ledger_cases.py; the entries in oracles/ledger.py."""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import pytest

from k3num import properties
from k3num.engines import registry
from k3num.harness.ledger_cases import CASES
from k3num.harness.run_scope import engine_names as _engine_names
from k3num.oracles import ledger, records
from k3num.oracles.drift import COLLECTOR
from k3num.supply import fetch, installed


def _test_function(name: str):
    for mod in pkgutil.iter_modules(properties.__path__):
        if mod.name.startswith("test_") and mod.name != "test_ledger_reproducers":
            fn = getattr(importlib.import_module(f"k3num.properties.{mod.name}"), name, None)
            if fn is not None:
                return fn
    raise LookupError(f"no property test named {name}")


@pytest.mark.parametrize("entry_id", [d.id for d in ledger.LEDGER])
def test_each_ledger_reproducer_still_fails_on_the_pinned_release(entry_id: str, request: pytest.FixtureRequest,
                                                                  k3num_run):
    entry = ledger.by_id(entry_id)
    assert entry is not None
    rule = CASES[entry_id]
    if entry.engine not in _engine_names(request.config):
        pytest.skip(f"{entry_id}: engine {entry.engine} not selected (--engine)")
    pin = fetch.PINS[entry.engine.split("-")[0]]
    src = k3num_run.source(pin.engine)
    mode = installed.expected_mode(src, k3num_run.engine_mode)
    if entry.modes and mode not in entry.modes and mode.split("+", 1)[0] not in entry.modes:
        pytest.skip(f"{entry_id} is seen in modes {', '.join(entry.modes)} only; {entry.engine} runs {mode} here")
    try:
        engine = registry.get(entry.engine, k3num_run.sources, k3num_run.engine_mode)
    except registry.EngineUnavailable as e:
        pytest.skip(f"engine {entry.engine} unavailable: {e}")
    # the bare body: not the run's wrappers (the ledger's own would let the reproducer's failure pass)
    body = inspect.unwrap(_test_function(rule.test).hypothesis.inner_test)
    pinned = fetch.pinned_files(src, entry.files)
    if pinned:  # its records are the known divergence's: the run's tables count them known, not failed
        COLLECTOR.ledger = entry_id
    try:
        body(engine=engine, **rule.reproducer)
    except (pytest.fail.Exception, Exception) as e:  # the failure the entry describes, or another
        if not pinned:
            raise  # a fixed (or patched) tree: its reproducer is judged plainly
        COLLECTOR.add(records.known_case(property=rule.test, engine=engine, ledger=entry_id, node=COLLECTOR.node,
                                         why=str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__))
        pytest.xfail(f"{entry_id} reproduced ({rule.test}): {type(e).__name__}: {str(e).splitlines()[0][:200]}")
    if pinned:
        pytest.fail(f"{entry_id}'s reproducer passed on the pinned bytes of {', '.join(entry.files)}: the finding is "
                    "gone (an upstream fix?); remove the entry from oracles/ledger.py and its rule from "
                    "harness/ledger_cases.py", pytrace=False)
