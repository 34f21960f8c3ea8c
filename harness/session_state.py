"""What one pytest session keeps between its hooks: the keys of `config.stash` (and `item.stash`) that the
plugin's modules share (harness/plugin.py, run_summary.py, run_isolation.py), instead of attributes set on
pytest's objects or module globals: a second run in the same process (pytester, `pytest.main` twice)
starts from its own."""

from __future__ import annotations

import datetime
from dataclasses import dataclass, field
from typing import Any

import pytest

from k3num.harness import run

RUN = pytest.StashKey[run.RunContext]()  # the run's context (harness/run.py), built in pytest_configure

@dataclass
class Book:
    """The plugin's per-run bookkeeping, one per config (`book(config)`): this process's view, merged on an
    xdist controller where the workers send theirs."""

    account: dict[str, dict[str, str]] = field(default_factory=dict)  # node -> engine, outcome, reason
    untagged_skips: dict[str, str] = field(default_factory=dict)  # node -> skip reason of a test of ours
    #                                                              that takes no engine
    collected: set[str] = field(default_factory=set)  # every test of ours collected (controller: every worker's)
    reported: set[str] = field(default_factory=set)  # every test a report arrived for
    examples: dict[str, int] = field(default_factory=dict)  # node -> hypothesis examples run
    replaced: list[tuple[str, str, str]] = field(default_factory=list)  # controller: (worker, node, why) of
    #                                                                    each worker replaced after a lost context
    deaths: list[tuple[str, str]] = field(default_factory=list)  # controller: (worker, its last lines) of each
    #                                                             worker that went down with an error
    # under --repro-dir (properties/support.py): each subject's last call in the running test, as (cloned args,
    # cloned kwargs, result, args, kwargs), dropped when the test ends; the worst ratio bundled so far per
    # (property, engine) in the run (--repro-all)
    last_calls: dict[str, tuple] = field(default_factory=dict)
    worst_bundled: dict[tuple[str, str], float] = field(default_factory=dict)


BOOK = pytest.StashKey[Book]()


def book(config: pytest.Config) -> Book:
    """The run's Book, made at the first hook that asks for it."""
    if BOOK not in config.stash:
        config.stash[BOOK] = Book()
    return config.stash[BOOK]


STARTED = pytest.StashKey[datetime.datetime]()  # when pytest_configure ran (UTC)
DRIFT = pytest.StashKey[Any]()  # the run's oracles.drift.DriftCollector (scoped over each test by the plugin)
WRITTEN = pytest.StashKey[int]()  # records the drift CSV held at its last write
POOL_FAILED = pytest.StashKey[list]()  # modules harness/literal_pool.py could not import (printed in the header)
FRAME = pytest.StashKey[Any]()  # the drift CSV's frame as last written (pandas.DataFrame)
CSV = pytest.StashKey[tuple[int, int]]()  # (records before this write, records after)
LATEST = pytest.StashKey[str]()  # --drift-dir's drift.csv link
BOUND = pytest.StashKey[dict]()  # engine -> how it was bound (merged from xdist workers)
DEFAULT_LOADED = pytest.StashKey[bool]()  # the plugin loaded its default hypothesis profile (no --hypothesis-profile)
EXAMPLES = pytest.StashKey[dict]()  # test -> examples run (merged from xdist workers)
GPUS = pytest.StashKey[dict]()  # xdist worker -> its GPU
LOST = pytest.StashKey[tuple[str, str]]()  # (node, why) of the test after which the CUDA context was lost
EMPTY = pytest.StashKey[list]()  # engines asked for that ran no test
NEVER = pytest.StashKey[list]()  # tests collected and never run
SESSION = pytest.StashKey[Any]()  # the pytest session (pytest.Session)
TERMINAL = pytest.StashKey[Any]()  # the terminal reporter
OUTCOME = pytest.StashKey[str]()  # item.stash: the call phase's outcome
