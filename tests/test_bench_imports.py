"""Every benchmark imports: the benchmarks are run by hand and on the GPU box, never by the test command, so a
refactor that renames a helper they import (bench/context_kv_speed.py imported a `_copymedian_seconds` that no
longer existed, found only when a GPU run reached it) fails here, on the CPU, instead."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCHES = sorted(p.stem for p in (ROOT / "bench").glob("*.py") if p.stem != "__init__")


@pytest.mark.parametrize("name", BENCHES)
def test_each_benchmark_imports(name: str) -> None:
    importlib.import_module(f"bench.{name}")
