"""Where a K3-shape property's time goes: examples/s, and the share of wall time in each phase.

Usage:
    python bench/suite_profile.py [--examples N] [--jobs ENGINE:TEST[:PARAM],...] [--file PROPERTIES]
                                  [--csv PATH] [--no-plain]

Default jobs: one K3-shape property per subject (`properties/test_k3_shapes.py`, GPU only), each on the
engine that binds it. Each job runs in a process of its own, three times through pytest on the same
derandomized examples: a warm-up (Triton compiles each new specialization on its first call; not
reported), plainly (its examples/s, what the suite pays once warm), then instrumented (the shares).
All under a profile derived from `nightly-1k` with max_examples N.

How the shares are measured (the instrumented run; a pytest plugin in this file wraps functions in
place for the run, nothing else changes):
- every wrapped call is timed on the host (perf_counter) and its time is attributed to the innermost
  wrapped category (exclusive time: an oracle called inside a judge is the oracle's);
- `subject`: the engine's subjects and the extras the properties call;
- `oracle`: the float64 reference (k3num.refmodel's public functions);
- `judge`: k3num.harness.judges (budget derivation, less the oracle inside it) and
  k3num.oracles.records.judge (the metrics);
- `records`: the drift collector and report() (the CSV itself is written once, after the run: its time
  is the `csv` column, outside the per-example shares);
- `case`: k3num.fixtures (tensor building), plus whatever of the test's wall time no category holds
  (hypothesis' own drawing and shrinking bookkeeping, the test body's glue): `case_rest` says how much;
- `sync`: on CUDA, every wrapper ends with torch.cuda.synchronize() and the wait goes here, so each
  category's time is its host time and the GPU work it launched is waited for at its end (implicit
  syncs inside a category, such as .item(), stay in it). The instrumented run is therefore slower than
  the plain one: the shares describe it, examples/s comes from the plain run.
- `subject_gpu_ms`: CUDA events around each subject call (the kernels' own time per example).
examples_per_s is the plain run's examples over its test calls' wall time (pytest's start-up and
collection, and the drift CSV written at the end, are outside it: `csv_and_setup_s` of the instrumented
run shows their size).
"""

from __future__ import annotations

import argparse
import functools
import inspect
import json
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import pandas as pd
import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

K3 = "properties/test_k3_shapes.py"
DEFAULT_JOBS = (
    "vllm:test_k3_fused_context_kv_within_budget_of_unfused_baseline",
    "vllm:test_k3_attn_res_within_rounding_budget_of_oracle",
    "sglang:test_k3_read_only_mixture_within_rounding_budget_of_oracle:attn_res_mix_triton",
    "sglang:test_k3_draft_context_kv_within_rounding_budget_of_oracle",
    "tokenspeed:test_k3_sharded_within_budget_of_unsharded:fp32",
    "vllm:test_k3_attn_res_repeated_calls_are_bitwise_identical",
)
CATEGORIES = ("case", "subject", "oracle", "judge", "records", "sync")


class Clock:
    """The plain run's plugin: the test calls' wall time and the examples run, nothing wrapped."""

    def __init__(self) -> None:
        self.wall, self.examples = 0.0, 0

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_call(self, item: pytest.Item) -> Any:
        _count_examples(item, self)
        t0 = time.perf_counter()
        yield
        self.wall += time.perf_counter() - t0


_COUNTER: list[Any] = [None]  # the plugin of the run in progress (the test functions outlive a session)


def _count_examples(item: pytest.Item, counter: Any) -> None:
    """Count the hypothesis examples of `item` into counter.examples (its inner test, wrapped once)."""
    _COUNTER[0] = counter
    inner = getattr(getattr(item, "obj", None), "hypothesis", None)
    if inner is None or getattr(inner.inner_test, "_k3num_counted", False):
        return
    real = inner.inner_test

    @functools.wraps(real)
    def counted(*a: Any, **k: Any) -> Any:
        _COUNTER[0].examples += 1
        return real(*a, **k)

    counted._k3num_counted = True  # type: ignore[attr-defined]
    inner.inner_test = counted


class Profiler:
    """The pytest plugin of the instrumented run (see the module docstring)."""

    def __init__(self) -> None:
        self.totals: dict[str, float] = defaultdict(float)
        self.stack: list[str] = []
        self.mark = 0.0
        self.examples = 0
        self.wall = 0.0
        self.gpu_ms = 0.0
        self.cuda = torch.cuda.is_available()
        self._wrapped_engines: set[int] = set()

    # -- exclusive-time accounting ---------------------------------------------------------------
    def _switch(self, now: float) -> None:
        self.totals[self.stack[-1] if self.stack else "case"] += now - self.mark
        self.mark = now

    def wrap(self, fn: Any, category: str, gpu: bool = False) -> Any:
        if getattr(fn, "_k3num_profiled", False) or not callable(fn):
            return fn
        prof = self

        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            prof._switch(time.perf_counter())
            prof.stack.append(category)
            ev = None
            if gpu and prof.cuda:
                ev = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                ev[0].record()
            try:
                return fn(*args, **kwargs)
            finally:
                if ev is not None:
                    ev[1].record()
                prof._switch(time.perf_counter())
                prof.stack.pop()
                if prof.cuda:
                    prof.stack.append("sync")
                    torch.cuda.synchronize()
                    prof._switch(time.perf_counter())
                    prof.stack.pop()
                if ev is not None:
                    prof.gpu_ms += ev[0].elapsed_time(ev[1])

        timed._k3num_profiled = True  # type: ignore[attr-defined]
        return timed

    def patch_module(self, module: Any, names: list[str], category: str) -> None:
        for name in names:
            fn = getattr(module, name, None)
            if inspect.isfunction(fn):
                setattr(module, name, self.wrap(fn, category))

    # -- pytest hooks ------------------------------------------------------------------------------
    def pytest_collection_finish(self, session: pytest.Session) -> None:
        import k3num.fixtures.builders as builders
        import k3num.fixtures.tensors as tensors
        import k3num.harness.judges as judges
        import k3num.oracles.records as records
        import k3num.properties.support as support
        from k3num.oracles.drift import COLLECTOR
        from k3num.refmodel import attn_res, mla, partial_projection, rmsnorm, rope

        public = lambda m: [n for n, v in vars(m).items() if inspect.isfunction(v) and not n.startswith("_")  # noqa: E731
                            and v.__module__ == m.__name__]
        for m in (attn_res, mla, partial_projection, rmsnorm, rope):
            self.patch_module(m, public(m), "oracle")
        self.patch_module(judges, public(judges), "judge")
        self.patch_module(records, ["judge"], "judge")
        self.patch_module(builders, public(builders), "case")
        self.patch_module(support, ["report"], "records")
        COLLECTOR.add = self.wrap(COLLECTOR.add, "records")  # type: ignore[method-assign]
        for cls in (tensors.Draw,):
            for name, fn in list(vars(cls).items()):
                if inspect.isfunction(fn) and not name.startswith("_"):
                    setattr(cls, name, self.wrap(fn, "case"))
        # the property modules imported these names directly: rebind theirs too
        for mod in list(sys.modules.values()):
            if getattr(mod, "__name__", "").startswith("k3num.properties."):
                for src in (attn_res, mla, partial_projection, judges, records, builders, support):
                    for name in public(src) + ["judge", "report"]:
                        fn = getattr(mod, name, None)
                        wrapped = getattr(src, name, None)
                        if fn is not None and wrapped is not None and getattr(fn, "__wrapped__", None) is None \
                                and getattr(wrapped, "__wrapped__", None) is fn:
                            setattr(mod, name, wrapped)

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_call(self, item: pytest.Item) -> Any:
        engine = getattr(item, "funcargs", {}).get("engine")
        if engine is not None and id(engine) not in self._wrapped_engines:
            self._wrapped_engines.add(id(engine))
            for name, fn in list(engine.subjects.items()):
                engine.subjects[name] = self.wrap(fn, "subject", gpu=True)
        _count_examples(item, self)
        self.mark = t0 = time.perf_counter()
        yield
        self._switch(time.perf_counter())
        self.wall += time.perf_counter() - t0


def _args(job: str, examples: int, csv: Path, file: str) -> list[str]:
    engine, test, *param = job.split(":")
    k = f"{test} and {param[0]}" if param else test
    return [file, "--engine", engine, "-k", k, "-p", "no:cacheprovider", "-q", "--no-header",
            f"--hypothesis-profile=suite-profile-{examples}", "--drift-csv", str(csv)]


def _register(examples: int) -> None:
    from hypothesis import settings

    import k3num.harness.plugin  # noqa: F401  (registers the suite's profiles)
    # derandomized, no database: the warm-up, plain and instrumented passes draw the same examples (a
    # random draw per pass lets Triton's compiles of new specializations fall into the timed passes)
    settings.register_profile(f"suite-profile-{examples}", parent=settings.get_profile("nightly-1k"),
                              max_examples=examples, derandomize=True, database=None)


def run_job(job: str, examples: int, out: Path, plain: bool, file: str = K3) -> dict[str, Any]:
    _register(examples)
    row: dict[str, Any] = {"job": job}
    # a warm-up pass first (the same derandomized examples): Triton compiles each new specialization on
    # its first call, which would otherwise fall into whichever timed pass comes first
    pytest.main(_args(job, examples, out / "warmup.csv", file), plugins=[])
    if plain:
        clock = Clock()
        rc = pytest.main(_args(job, examples, out / "plain.csv", file), plugins=[clock])
        row.update(plain_rc=int(rc), plain_examples=clock.examples, plain_s=round(clock.wall, 2),
                   examples_per_s=round(clock.examples / clock.wall, 1) if clock.wall else 0.0)
    prof = Profiler()
    t0 = time.perf_counter()
    rc = pytest.main(_args(job, examples, out / "profiled.csv", file), plugins=[prof])
    total = time.perf_counter() - t0
    row.update(rc=int(rc), examples=prof.examples, wall_s=round(prof.wall, 2),
               csv_and_setup_s=round(total - prof.wall, 2))
    for c in CATEGORIES:
        row[f"{c}_%"] = round(100 * prof.totals.get(c, 0.0) / prof.wall, 1) if prof.wall else 0.0
    row["subject_gpu_ms"] = round(prof.gpu_ms / max(prof.examples, 1), 3)
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--examples", type=int, default=200)
    ap.add_argument("--jobs", default=",".join(DEFAULT_JOBS))
    ap.add_argument("--file", default=K3, help="the property file the jobs' tests are in")
    ap.add_argument("--csv")
    ap.add_argument("--no-plain", action="store_true", help="skip the plain run (no examples/s)")
    ap.add_argument("--out", default="/tmp/k3num-suite-profile")
    ap.add_argument("--one", help=argparse.SUPPRESS)  # a job in this process (each job gets a fresh one)
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.one:
        print("K3NUM-ROW " + json.dumps(run_job(args.one, args.examples, out, not args.no_plain, args.file)))
        return 0
    rows = []
    jobs = [j for j in args.jobs.split(",") if j]
    for i, job in enumerate(jobs):
        print(f"[suite_profile] {i + 1}/{len(jobs)} {job} ({args.examples} examples)", file=sys.stderr, flush=True)
        cmd = [sys.executable, __file__, "--one", job, "--examples", str(args.examples), "--file", args.file,
               "--out", str(out / f"job{i}"), *(["--no-plain"] if args.no_plain else [])]
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
        found = [ln for ln in proc.stdout.splitlines() if ln.startswith("K3NUM-ROW ")]
        if not found:
            print(f"[suite_profile] {job}: no result (exit {proc.returncode}): {proc.stderr[-800:]}", file=sys.stderr)
            rows.append({"job": job, "rc": proc.returncode})
            continue
        rows.append(json.loads(found[-1].removeprefix("K3NUM-ROW ")))
    table = pd.DataFrame(rows)
    print(table.to_string(index=False))
    if args.csv:
        table.to_csv(args.csv, index=False)
    return 0 if all(r.get("rc") in (0, 5) for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
