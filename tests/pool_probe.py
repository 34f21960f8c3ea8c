"""A pytest plugin for tests/test_literal_pool.py: writes hypothesis's local literal pool (the private
`_get_local_constants`, read only here, in a self-test) when collection ends and when the session ends, to
$K3NUM_POOL_PROBE (a JSON file)."""

from __future__ import annotations

import json
import os


def _pool() -> dict[str, list[str]]:
    from hypothesis.internal.conjecture.providers import _get_local_constants

    c = _get_local_constants()
    return {kind: sorted(repr(v) for v in c.set_for_type(kind))
            for kind in ("integer", "float", "bytes", "string")}


def pytest_collection_finish(session) -> None:
    session.config._k3num_pool_at_collection = _pool()


def pytest_sessionfinish(session) -> None:
    path = os.environ["K3NUM_POOL_PROBE"]
    with open(path, "w") as f:
        json.dump({"collection": getattr(session.config, "_k3num_pool_at_collection", None), "end": _pool()}, f)
