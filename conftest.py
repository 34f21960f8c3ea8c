"""Root pytest configuration: hypothesis profiles, markers' behaviour, harness options.

Profiles (pick with --hypothesis-profile NAME; default "dev"):
- dev: quick local runs (50 examples per property).
- ci: derandomized, no example database, print_blob; the budget CI and the
  mutant self-tests run under (40 examples per property).
- nightly: >= 10,000 examples per property, for the scheduled GPU job.
All have deadline=None: oracle and kernel timings vary too much for deadlines.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, settings

_COMMON = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.register_profile("dev", max_examples=50, **_COMMON)
settings.register_profile("ci", max_examples=40, derandomize=True, database=None, print_blob=True, **_COMMON)
settings.register_profile("nightly", max_examples=10_000, print_blob=True, **_COMMON)
settings.load_profile("dev")


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("k3-numerics")
    group.addoption(
        "--engine",
        default=None,
        help="comma-separated engines to test (default: every engine available)",
    )
    group.addoption(
        "--drift-csv",
        default=None,
        metavar="PATH",
        help="write every oracle comparison record of the session to PATH (CSV)",
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device; torch.cuda.is_available() is False here")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
