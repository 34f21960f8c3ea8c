"""The harness's own tests under pytest-xdist (`pytest -n N tests`): the pytest runs these tests start must
not take themselves for xdist workers.

xdist puts PYTEST_XDIST_WORKER (and its siblings) in each worker's environment, and a child process
inherits it. The k3num plugin reads it when it is imported (harness/plugin.py `_WORKER`: a worker writes
a partial drift CSV and chooses its GPU), so a child pytest started from a worker would write a partial
file instead of the CSV its test reads. Once this worker's plugin has read them, they are dropped from
its environment; xdist itself reads its worker's identity from `config.workerinput`.
"""

from __future__ import annotations

import os

import pytest

XDIST_VARS = ("PYTEST_XDIST_WORKER", "PYTEST_XDIST_WORKER_COUNT", "PYTEST_XDIST_TESTRUNUID")


def pytest_configure(config: pytest.Config) -> None:
    if hasattr(config, "workerinput"):
        for name in XDIST_VARS:
            os.environ.pop(name, None)
