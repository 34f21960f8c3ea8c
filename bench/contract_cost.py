"""What the rounding contracts and the rounding count cost the main job (issue 38's bound: under 15%).

The main job's default run (`python -m pytest properties --hypothesis-profile=ci`, the default engines) in this
process, with a plugin that times:
- every test's call phase (pytest's own durations), the rounding-contract tests
  (properties/test_rounding_contracts.py) summed apart;
- every call of the rounding count (oracles/metrics.roundings_of: it runs inside each comparison's metrics).

It prints one table: the run's test time, the contracts' and the rounding count's seconds and their shares of it,
and the two together against the bound. Exit 0 when it ran (a share over the bound is the finding), 2 when
pytest collected nothing.

Usage:
    python bench/contract_cost.py [--csv PATH] [-- PYTEST ARGS]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import pandas as pd
import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.timing import timed  # noqa: E402

BOUND = 0.15  # issue 38: the contracts and the rounding count add under 15% to the main job
CONTRACTS = "test_rounding_contracts.py"


class Cost:
    """The plugin: per-test call durations, and the rounding count's time (wrapped at configure)."""

    def __init__(self) -> None:
        self.calls: dict[str, float] = {}
        self.roundings_s = 0.0
        self.roundings_n = 0

    def _spent(self, seconds: float) -> None:
        self.roundings_s += seconds
        self.roundings_n += 1

    def pytest_configure(self, config: pytest.Config) -> None:
        from k3num.oracles import metrics

        self._orig = metrics.roundings_of
        metrics.roundings_of = timed(metrics.roundings_of, self._spent)  # type: ignore[assignment]

    def pytest_unconfigure(self, config: pytest.Config) -> None:
        from k3num.oracles import metrics

        metrics.roundings_of = self._orig  # type: ignore[assignment]

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if report.when in ("setup", "call", "teardown"):
            self.calls[report.nodeid] = self.calls.get(report.nodeid, 0.0) + report.duration


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--csv", default=None)
    a = p.parse_args(argv)
    cost = Cost()
    with tempfile.TemporaryDirectory() as tmp:
        args = [str(ROOT / "properties"), "-q", "-p", "no:cacheprovider", "--hypothesis-profile=ci",
                "--drift-csv", str(Path(tmp) / "drift.csv"), *extra]
        print(f"[contract-cost] pytest {' '.join(args)}", flush=True)
        rc = pytest.main(args, plugins=[cost])
    if not cost.calls:
        print(f"[contract-cost] no test ran (pytest exit {int(rc)})", file=sys.stderr)
        return 2
    total = sum(cost.calls.values())
    contracts = sum(s for n, s in cost.calls.items() if CONTRACTS in n)
    row = {"tests_s": round(total, 1), "contracts_s": round(contracts, 1),
           "contracts_share": round(contracts / total, 4), "roundings_calls": cost.roundings_n,
           "roundings_s": round(cost.roundings_s, 2), "roundings_share": round(cost.roundings_s / total, 4),
           "together_share": round((contracts + cost.roundings_s) / total, 4), "bound": BOUND}
    df = pd.DataFrame([row])
    with pd.option_context("display.width", 200, "display.max_columns", 20):
        print(df.to_string(index=False))
    print(f"[contract-cost] pytest exit {int(rc)}; the contracts and the rounding count take "
          f"{row['together_share']:.1%} of the tests' time (bound {BOUND:.0%})")
    if a.csv:
        df.to_csv(a.csv, index=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
