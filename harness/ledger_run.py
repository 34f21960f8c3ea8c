"""The ledger's case rules in a run (harness/plugin.py applies them; properties/ledger_cases.py states
them): in a test a ledger entry covers, a failing case inside the entry's rule is the known divergence,
and any other failing case fails the test. Registered by harness/plugin.py (`pytest_plugins`)."""

from __future__ import annotations

import functools

import pytest

from k3num.oracles import ledger
from k3num.oracles.drift import COLLECTOR

_KNOWN: dict[str, list[str]] = {}  # node id -> the entry id of each failing case inside its rule


def ledgered(inner):
    """A ledger-covered test's body (`test.hypothesis.inner_test`): a failing case inside the entry's rule
    (properties/ledger_cases.py) is the known divergence, counted and let pass, so hypothesis goes on
    drawing; a failing case outside it fails the test as any failure does. `_k3num_entries` maps the
    engine's registry name to its entry (one body serves every engine's parametrization)."""
    if hasattr(inner, "_k3num_entries"):
        return inner
    from hypothesis.errors import HypothesisException

    from k3num.properties import ledger_cases

    entries: dict[str, ledger.Divergence] = {}

    @functools.wraps(inner)
    def body(*args, **kwargs):
        entry = entries.get(getattr(kwargs.get("engine"), "name", None))
        if entry is None:
            return inner(*args, **kwargs)
        try:
            return inner(*args, **kwargs)
        except (pytest.skip.Exception, HypothesisException):
            raise
        except (pytest.fail.Exception, Exception):  # an assertion, a refusal not raised, any error
            drawn = {k: v for k, v in kwargs.items() if k != "engine"}
            if not ledger_cases.inside(entry.id, inner.__name__, drawn):
                raise  # outside the entry's cases: a failure like any other
            _KNOWN.setdefault(COLLECTOR.node, []).append(entry.id)

    body._k3num_entries = entries  # type: ignore[attr-defined]
    return body


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item):
    """A ledger-covered test whose only failures were cases inside its entry's rule: xfailed, naming the
    entry and the count (the run's account counts it known, as a strict xfail was)."""
    _KNOWN.pop(item.nodeid, None)
    result = yield
    known = _KNOWN.pop(item.nodeid, [])
    if known:
        from k3num.properties import ledger_cases

        entry = ledger.by_id(known[0])
        rule = ledger_cases.CASES[known[0]].rule
        pytest.xfail(f"{known[0]} ({entry.upstream if entry else ''}): {len(known)} failing case(s) inside its "
                     f"rule ({rule}); every case outside was judged plainly and passed")
    return result


