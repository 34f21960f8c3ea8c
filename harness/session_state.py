"""What one pytest session keeps between its hooks: the keys of `config.stash` (and `item.stash`) that the
plugin's modules share (harness/plugin.py, run_summary.py, run_isolation.py), instead of attributes set on
pytest's objects."""

from __future__ import annotations

import datetime
from typing import Any

import pytest

STARTED = pytest.StashKey[datetime.datetime]()  # when pytest_configure ran (UTC)
DRIFT = pytest.StashKey[Any]()  # the run's oracles.drift.DriftCollector (scoped over each test by the plugin)
WRITTEN = pytest.StashKey[int]()  # records the drift CSV held at its last write
FRAME = pytest.StashKey[Any]()  # the drift CSV's frame as last written (pandas.DataFrame)
CSV = pytest.StashKey[tuple[int, int]]()  # (records before this write, records after)
LATEST = pytest.StashKey[str]()  # --drift-dir's drift.csv link
BOUND = pytest.StashKey[dict]()  # engine -> how it was bound (merged from xdist workers)
EXAMPLES = pytest.StashKey[dict]()  # test -> examples run (merged from xdist workers)
GPUS = pytest.StashKey[dict]()  # xdist worker -> its GPU
LOST = pytest.StashKey[tuple[str, str]]()  # (node, why) of the test after which the CUDA context was lost
EMPTY = pytest.StashKey[list]()  # engines asked for that ran no test
NEVER = pytest.StashKey[list]()  # tests collected and never run
SESSION = pytest.StashKey[Any]()  # the pytest session (pytest.Session)
TERMINAL = pytest.StashKey[Any]()  # the terminal reporter
OUTCOME = pytest.StashKey[str]()  # item.stash: the call phase's outcome
