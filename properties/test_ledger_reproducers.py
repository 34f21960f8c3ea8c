"""Each ledger entry's reproducer, run strictly: on the pinned release it must still fail with the entry's
own signature (reported xfailed, naming the entry); if it passes there, the finding is gone and the entry
must go (this test fails); if it fails some other way (an adapter that breaks, a changed message), this
test fails naming the exception: nothing but the entry's bug reproduces it. The signature is a regex on
"<Exception>: <message>" (harness/ledger_cases.py) and, where the entry has one, its bug model
(harness/ledger_models.py) over the calls the reproducer made.

Where the entry's files are not the pinned bytes (a fix, a patch: `--engine-src`), the same case is judged
plainly and must pass. Under `k3num check` it never fails the run: it runs on the head and on the base and
joins the check's tables ("still reproduces" on both: known; passing on the head: fixed; failing the head
some other way: new)."""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import re

import pytest

from k3num import properties
from k3num.engines import registry
from k3num.harness import ledger_cases, ledger_models, ledger_run, pairing_run
from k3num.harness.ledger_cases import CASES
from k3num.harness.run_scope import engine_names as _engine_names
from k3num.oracles import ledger, pairing, records
from k3num.oracles.drift import COLLECTOR
from k3num.supply import fetch, installed

REPRODUCED, PASSED, OTHER = "reproduced", "passed", "other"


def _test_function(name: str):
    for mod in pkgutil.iter_modules(properties.__path__):
        if mod.name.startswith("test_") and mod.name != "test_ledger_reproducers":
            fn = getattr(importlib.import_module(f"k3num.properties.{mod.name}"), name, None)
            if fn is not None:
                return fn
    raise LookupError(f"no property test named {name}")


def attempt(entry_id: str, engine) -> tuple[str, str]:
    """The reproducer through its test's bare body on `engine`: (REPRODUCED, message) when it fails with the
    entry's signature and its model explains the calls, (PASSED, "") when it passes, (OTHER, why) else."""
    rule = CASES[entry_id]
    # the bare body: not the run's wrappers (the ledger's own would let the reproducer's failure pass)
    body = inspect.unwrap(_test_function(rule.test).hypothesis.inner_test)
    recorded: list[ledger_models.Call] = []
    watched = ledger_run.record_calls(engine, ledger_run.model_subjects([ledger.by_id(entry_id)]), recorded)
    try:
        with ledger_run.observing(recorded):
            body(engine=watched, **rule.reproducer)
    except (pytest.fail.Exception, Exception) as e:  # the failure the entry describes, or another
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        said = f"{type(e).__name__}: {first}"
        if not re.search(rule.signature, said):
            return OTHER, f"failed without {entry_id}'s signature /{rule.signature}/: {said[:300]}"
        # the signature every failure inside the region must have holds for the reproducer's too
        why = ledger_cases.signature_mismatch(entry_id, rule.test, ledger_cases.said(e))
        if why:
            return OTHER, why
        why = ledger_models.explains(entry_id, recorded)
        return (OTHER, f"{why}; {said[:200]}") if why else (REPRODUCED, said)
    return PASSED, ""


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
    if pairing_run.active(request.config):  # k3num check: both sides' verdicts join its tables, nothing raised
        outcome = {REPRODUCED: pairing.FAIL, PASSED: pairing.PASS}

        def side(e) -> tuple[str, str]:
            got, why = attempt(entry_id, e)
            if got == OTHER:
                return pairing.FAIL, f"{pairing.UNEXPLAINED} {why}"
            return outcome[got], f"still reproduces {entry_id}: {why}" if got == REPRODUCED else ""

        pairing_run.record_fixed_case(request.config, request.node.nodeid, entry_id, engine, side)
        return
    pinned = fetch.pinned_files(src, entry.files)
    if src.local is None and src.pin.version not in entry.releases:  # a pinned release it is not confirmed on
        got, why = attempt(entry_id, engine)
        if got == REPRODUCED:
            pytest.fail(f"{entry_id} reproduces on {entry.engine} {src.pin.version}, a release it is not confirmed "
                        f"on ({', '.join(entry.releases)}): add {src.pin.version} to its also_releases "
                        f"(oracles/ledger.py): {why[:200]}", pytrace=False)
        if got == OTHER:
            pytest.fail(f"{entry_id}'s reproducer ({rule.test}) failed on {src.pin.version}, but not as {entry_id}: "
                        f"{why}", pytrace=False)
        return  # gone on this release, where the entry does not apply
    if pinned:  # its records are the known divergence's: the run's tables count them known, not failed
        COLLECTOR.ledger = entry_id
    got, why = attempt(entry_id, engine)
    if got == OTHER:
        pytest.fail(f"{entry_id}'s reproducer ({rule.test}) failed, but not as {entry_id}: {why}", pytrace=False)
    if got == REPRODUCED:
        if not pinned:  # a fixed (or patched) tree: its reproducer is judged plainly
            pytest.fail(f"{entry_id} still reproduces on the edited files ({', '.join(entry.files)}): {why}",
                        pytrace=False)
        COLLECTOR.add(records.known_case(property=rule.test, engine=engine, ledger=entry_id, node=COLLECTOR.node,
                                         why=why))
        pytest.xfail(f"{entry_id} reproduced ({rule.test}): {why[:200]}")
    if pinned:
        pytest.fail(f"{entry_id}'s reproducer passed on the pinned bytes of {', '.join(entry.files)}: the finding is "
                    "gone (an upstream fix?); remove the entry from oracles/ledger.py and its rule from "
                    "harness/ledger_cases.py", pytrace=False)
