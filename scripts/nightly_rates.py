"""Examples per second of every test of a nightly run: what docs/gpu-run.md records for a `nightly` run.

Usage:
    python scripts/nightly_rates.py OUT_DIR [--csv PATH]

OUT_DIR is a `gpu_nightly.sh` output folder run with `--hypothesis-show-statistics`: its pytest.log
holds hypothesis's statistics block per test (the test cases each phase ran and why it stopped), its
junit.xml each test's wall time. A test is one row: its examples (passing + failing test cases over
every phase; invalid ones, which hypothesis discards, are shown apart), its seconds, examples/s, and
hypothesis's stop reason (`max_examples=10000` is a test that reached its budget). A test with
statistics and no junit time is said to be so (junit.xml is written at the run's end); a test in
junit.xml without statistics (a skip, or a test that is not a hypothesis test) is not listed. The last
line is the run's wall time as pytest printed it, and the sum of the tests' seconds.
"""

from __future__ import annotations

import argparse
import re
import sys
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

_HEADER = re.compile(r"^(\S+::\S+):\s*$")
_COUNTS = re.compile(r"^\s+- (\d+) passing, (\d+) failing, and (\d+) invalid test cases")
_STOPPED = re.compile(r"^\s+- Stopped because (.+)$")
_WALL = re.compile(r"\d+ (?:passed|failed)[^=]* in ([\d.]+)s(?: \([\d:]+\))?(?: =+)?\s*$")


@dataclass
class Stats:
    """One test's hypothesis statistics: cases over every phase and the stop reason."""

    passing: int = 0
    failing: int = 0
    invalid: int = 0
    stopped: str = ""

    @property
    def examples(self) -> int:
        return self.passing + self.failing


def statistics(log: str) -> dict[str, Stats]:
    """node id -> Stats, from the "Hypothesis Statistics" section of a pytest log."""
    out: dict[str, Stats] = {}
    current: Stats | None = None
    inside = False
    for line in log.splitlines():
        if "Hypothesis Statistics" in line:
            inside = True
            continue
        if not inside:
            continue
        if line.startswith("=") and "Hypothesis Statistics" not in line:
            inside, current = False, None
            continue
        if m := _HEADER.match(line):
            current = out.setdefault(m.group(1), Stats())
        elif current is not None and (m := _COUNTS.match(line)):
            current.passing += int(m.group(1))
            current.failing += int(m.group(2))
            current.invalid += int(m.group(3))
        elif current is not None and (m := _STOPPED.match(line)):
            current.stopped = m.group(1).replace("settings.", "")
    return out


def durations(junit: Path) -> dict[tuple[str, str], float]:
    """(classname, name) -> seconds, from a junit.xml."""
    return {(case.get("classname", ""), case.get("name", "")): float(case.get("time", "nan"))
            for case in ET.parse(junit).getroot().iter("testcase")}


def junit_key(node: str) -> tuple[str, str]:
    """A pytest node id as junit.xml names it: `a/test_x.py::Cls::name[p]` -> ("a.test_x.Cls", "name[p]")."""
    base, bracket, params = node.partition("[")  # a parameter id may itself hold "::"
    path, *rest = base.split("::")
    return ".".join([path.removesuffix(".py").replace("/", "."), *rest[:-1]]), rest[-1] + bracket + params


def table(out_dir: Path) -> tuple[list[dict[str, object]], str]:
    log = (out_dir / "pytest.log").read_text(errors="replace")
    stats = statistics(log)
    if not stats:
        raise SystemExit(f"{out_dir / 'pytest.log'}: no Hypothesis Statistics section (run with "
                         "--hypothesis-show-statistics)")
    junit = out_dir / "junit.xml"
    secs = durations(junit) if junit.exists() else {}
    rows: list[dict[str, object]] = []
    for node, s in stats.items():
        t = secs.get(junit_key(node))
        rows.append({"test": node, "examples": s.examples, "invalid": s.invalid,
                     "seconds": t, "examples/s": (s.examples / t) if t else None,
                     "stopped": s.stopped if t is not None else "no time in junit.xml (the run did not finish)"})
    rows.sort(key=lambda r: -(r["seconds"] if isinstance(r["seconds"], float) else float("inf")))
    walls = [m.group(1) for line in log.splitlines() if (m := _WALL.search(line))]
    busy = sum(r["seconds"] for r in rows if isinstance(r["seconds"], float))
    tail = (f"run wall time (pytest): {walls[-1] + ' s' if walls else 'not printed (cut off)'}; "
            f"the listed tests' seconds sum to {busy:.0f} s")
    return rows, tail


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out_dir", type=Path)
    ap.add_argument("--csv", type=Path, default=None)
    args = ap.parse_args()
    rows, tail = table(args.out_dir)
    print("| test | examples | invalid | seconds | examples/s | stopped because |")
    print("| --- | --- | --- | --- | --- | --- |")
    for r in rows:
        t, rate = r["seconds"], r["examples/s"]
        print(f"| {r['test']} | {r['examples']} | {r['invalid']} | {'-' if t is None else f'{t:.0f}'} | "
              f"{'-' if rate is None else f'{rate:.1f}'} | {r['stopped']} |")
    print(tail)
    if args.csv:
        import pandas as pd

        pd.DataFrame(rows).to_csv(args.csv, index=False)


if __name__ == "__main__":
    sys.exit(main())
