"""A pytest plugin for tests/test_ledger_resolution.py (`-p tests.ledger_probe`, with `--collect-only`):
after the k3num plugin has filed the ledger's entries on the collected items, write which entries each
node carries to the JSON file K3NUM_LEDGER_PROBE names.

The engines' mode is taken as K3NUM_LEDGER_PROBE_MODE (the GPU's `source-gpu` on this CPU machine), so
that entries seen on the GPU only (the races) are filed here as they are on the H200.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

PROBE_ENV = "K3NUM_LEDGER_PROBE"
MODE_ENV = "K3NUM_LEDGER_PROBE_MODE"


def pytest_configure(config: pytest.Config) -> None:
    mode = os.environ.get(MODE_ENV)
    if mode:
        from k3num.supply import installed

        installed.expected_mode = lambda src, requested: mode  # read by the plugin at collection, per engine


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    nodes = {}
    for item in items:
        callspec = getattr(item, "callspec", None)
        engine = callspec.params.get("engine") if callspec else None
        if engine is None:
            continue
        inner = getattr(getattr(getattr(item, "obj", None), "hypothesis", None), "inner_test", None)
        by_rule = [d.id for d in getattr(inner, "_k3num_entries", {}).get(engine, [])]
        strict = [m.kwargs.get("reason", "").split(" ", 1)[0] for m in item.iter_markers("xfail")]
        nodes[item.nodeid] = {"test": getattr(item, "originalname", item.name), "engine": engine,
                              "by_rule": by_rule, "strict": strict,
                              "shard": getattr(callspec.params.get("shard"), "id", "")}
    Path(os.environ[PROBE_ENV]).write_text(json.dumps(nodes, indent=1))
