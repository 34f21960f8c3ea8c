"""A pytest plugin for tests/test_worker_deaths.py: every xdist worker dies in pytest_configure with a planted
CUDA-like error, before it can run a test (issue 37: a nightly whose workers all died said nothing)."""

from __future__ import annotations


def pytest_configure(config) -> None:
    if hasattr(config, "workerinput"):
        raise RuntimeError(f"planted death of {config.workerinput['workerid']}: CUDA error: out of memory")
