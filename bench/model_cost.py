"""What judging a failure against its ledger entry's bug model costs, against the examples' own time.

A ledger-covered test with a bug model (harness/ledger_models.py MODELS) pays for the model twice:
- every example of it records the calls the model reads (harness/ledger_run.record_calls: each call's
  inputs cloned before the call, its output after, repeats compared bitwise): `record_s`, the recording
  wrappers' time less the subjects' own;
- a failing example inside the entry's region is matched against the model (ledger_models.explains):
  `explain_s`.
The bound (the ledger issue's performance line): matching costs under 10% of the example's time. Per test
this prints the examples it ran, the failing examples the model judged, the examples' total time and the
model's share of it (`share` = (record_s + explain_s) / examples_s), and for the failing examples alone
the median and the worst per-example share (`median_failing_share`, `worst_failing_share`: that example's
recording and matching over its own time, the example's time including both).

Usage:
    python bench/model_cost.py [--engine vllm-rocm,tokenspeed] [--device cpu|cuda] [--profile ci]
                               [--csv PATH] [-- PYTEST ARGS]

It runs pytest in this process on the properties, keeping only the tests whose ledger entry has a model
(the others are deselected), under the given hypothesis profile; the entries' races (K3N-007) fail only
on a GPU, so on a CPU their tests run without a failure to match. The wrappers are a pytest plugin in this
file; nothing in the harness changes. Exit 0 when it ran (a share over the bound is the finding), 2 when
no modelled test ran.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import pandas as pd
import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.timing import timed  # noqa: E402

BOUND = 0.10  # the ledger issue's bound: matching under 10% of the example's time


class _Example:
    """One example's accumulators (the recording wrappers and the model's match)."""

    def __init__(self) -> None:
        self.record_total = 0.0  # the recording wrappers' time, the subject's own included
        self.subject = 0.0  # the subject's own time inside them
        self.explain = 0.0
        self.explained = 0


class ModelCost:
    """The plugin: wraps each modelled test's hypothesis body after k3num's plugin has ledgered it, and the
    recorder and the model's match for the run."""

    def __init__(self) -> None:
        self.current: _Example | None = None
        self.rows: dict[str, list[tuple[float, _Example]]] = defaultdict(list)
        self.entry_of: dict[str, str] = {}
        self.node = ""  # the test running now

    # the wrappers -----------------------------------------------------------------------------------
    def _timed(self, fn: Any, attr: str) -> Any:
        def spent(seconds: float) -> None:
            if self.current is not None:
                setattr(self.current, attr, getattr(self.current, attr) + seconds)

        return timed(fn, spent)

    def _record_calls(self, engine: Any, subjects: tuple[str, ...], into: list) -> Any:
        watched = [n for n in getattr(engine, "subjects", {}) if n in subjects]
        if not watched:
            return self._orig_record(engine, subjects, into)
        inner = dataclasses.replace(engine, subjects={**engine.subjects, **{
            n: self._timed(engine.subjects[n], "subject") for n in watched}})
        rec = self._orig_record(inner, subjects, into)
        return dataclasses.replace(rec, subjects={**rec.subjects, **{
            n: self._timed(rec.subjects[n], "record_total") for n in watched}})

    def _explains(self, entry_id: str, calls: list) -> str:
        t0 = time.perf_counter()
        try:
            return self._orig_explains(entry_id, calls)
        finally:
            if self.current is not None:
                self.current.explain += time.perf_counter() - t0
                self.current.explained += 1

    def _example(self, inner: Any) -> Any:
        """The hypothesis body, timed per example and filed under the test running it (one body serves every
        parametrization of a test, so it is wrapped once)."""
        @functools.wraps(inner)
        def body(*args: Any, **kwargs: Any) -> Any:
            self.current = ex = _Example()
            t0 = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.rows[self.node].append((time.perf_counter() - t0, ex))
                self.current = None

        for attr in ("_k3num_entries", "_k3num_model_entries"):  # the plugin's per-engine tables stay reachable
            if hasattr(inner, attr):
                setattr(body, attr, getattr(inner, attr))
        body._model_cost_timed = True  # type: ignore[attr-defined]
        return body

    # pytest hooks ------------------------------------------------------------------------------------
    def pytest_configure(self, config: pytest.Config) -> None:
        from k3num.harness import ledger_models, ledger_run  # imported under pytest: its plugin is rewritten

        self._orig_record, self._orig_explains = ledger_run.record_calls, ledger_models.explains
        ledger_run.record_calls = self._record_calls  # type: ignore[assignment]
        ledger_models.explains = self._explains  # type: ignore[assignment]

    def pytest_unconfigure(self, config: pytest.Config) -> None:
        from k3num.harness import ledger_models, ledger_run

        ledger_run.record_calls = self._orig_record  # type: ignore[assignment]
        ledger_models.explains = self._orig_explains  # type: ignore[assignment]

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, config: pytest.Config, items: list[pytest.Item]) -> None:
        from k3num.harness import ledger_models

        keep, drop = [], []
        for item in items:
            entry = getattr(item, "k3num_ledger", "")
            h = getattr(getattr(item, "obj", None), "hypothesis", None)
            if entry in ledger_models.MODELS and h is not None and hasattr(h.inner_test, "_k3num_entries"):
                if not hasattr(h.inner_test, "_model_cost_timed"):
                    h.inner_test = self._example(h.inner_test)
                self.entry_of[item.nodeid] = entry
                keep.append(item)
            else:
                drop.append(item)
        if drop:
            config.hook.pytest_deselected(items=drop)
        items[:] = keep

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_call(self, item: pytest.Item) -> Any:
        self.node = item.nodeid
        yield
        self.node = ""

    def table(self) -> pd.DataFrame:
        out = []
        for node, examples in self.rows.items():
            total = sum(t for t, _ in examples)
            record = sum(e.record_total - e.subject for _, e in examples)
            explain = sum(e.explain for _, e in examples)
            failing = [(t, e) for t, e in examples if e.explained]
            shares = sorted((e.record_total - e.subject + e.explain) / t for t, e in failing if t > 0)
            worst = shares[-1] if shares else float("nan")
            median = shares[len(shares) // 2] if shares else float("nan")
            out.append({"test": node.split("::", 1)[-1], "entry": self.entry_of.get(node, ""),
                        "examples": len(examples), "failing_judged": len(failing), "examples_s": round(total, 3),
                        "record_s": round(record, 4), "explain_s": round(explain, 4),
                        "share": round((record + explain) / total, 4) if total else float("nan"),
                        "median_failing_share": round(median, 4), "worst_failing_share": round(worst, 4)})
        return pd.DataFrame(out).sort_values(["entry", "test"]).reset_index(drop=True) if out else pd.DataFrame()


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--engine", default="vllm-rocm,tokenspeed",
                   help="the engines whose modelled entries to time (default vllm-rocm,tokenspeed)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--profile", default="ci", help="the hypothesis profile (default ci)")
    p.add_argument("--csv", default=None)
    a = p.parse_args(argv)
    plugin = ModelCost()
    with tempfile.TemporaryDirectory() as tmp:
        args = [str(ROOT / "properties"), "--engine", a.engine, "--device", a.device, "-q", "-p", "no:cacheprovider",
                f"--hypothesis-profile={a.profile}", "--drift-csv", str(Path(tmp) / "drift.csv"),
                *extra]
        print(f"[model-cost] pytest {' '.join(args)}", flush=True)
        rc = pytest.main(args, plugins=[plugin])
    df = plugin.table()
    if df.empty:
        print(f"[model-cost] no modelled test ran (pytest exit {int(rc)})", file=sys.stderr)
        return 2
    with pd.option_context("display.width", 250, "display.max_columns", 20, "display.max_colwidth", 90):
        print(df.to_string(index=False))
    total = df["examples_s"].sum()
    spent = df["record_s"].sum() + df["explain_s"].sum()
    worst = df["worst_failing_share"].max()
    print(f"\n[model-cost] pytest exit {int(rc)}; {int(df['examples'].sum())} examples, "
          f"{int(df['failing_judged'].sum())} failing ones matched; the model's share of the examples' time "
          f"{spent / total:.2%} (worst test {df['share'].max():.2%}), of a failing example's: median "
          f"{df['median_failing_share'].max():.2%} in the worst test, worst single example {worst:.2%} "
          f"(bound {BOUND:.0%})")
    if a.csv:
        df.to_csv(a.csv, index=False)
        print(f"[model-cost] wrote {a.csv}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
