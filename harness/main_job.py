"""The main job over every pinned release: the property suite once on the default engines, then once per other
pinned release of a pin a default engine reads (each engine's default is its newest pin; an older one, such as
vLLM's, runs as `--engine vllm@VERSION,vllm-rocm@VERSION`), each release a run of its own (one tree per pin per
run: harness/run_scope.py).

    python -m k3num.harness.main_job [PYTEST ARGS...]     (scripts/run_properties.sh)

The default run writes where the arguments say (`--drift-dir out`: out/runs/drift-<UTC time>.csv, out/drift.csv
linked to it). Each other release's run writes its own CSV beside it, named for the release, and leaves the
link alone: under `--drift-dir D`, D/runs/drift-<UTC time>-<engine>-<version>.csv; under `--drift-csv PATH`,
PATH's stem with `-<engine>-<version>` added. Arguments that choose the engines (`--engine`, `--engine-src`)
make it one run, as asked. It ends with the `next:` lines, the default run's last: the command that appends
each run to its own history and writes its report. Exit: the worst of the runs' pytest exits (any failure fails
the job).
"""

from __future__ import annotations

import datetime
import subprocess
import sys
from pathlib import Path

CHOOSES_ENGINES = ("--engine", "--engine-src")


def _value(args: list[str], flag: str) -> str | None:
    for i, a in enumerate(args):
        if a == flag and i + 1 < len(args):
            return args[i + 1]
        if a.startswith(flag + "="):
            return a[len(flag) + 1:]
    return None


def _without(args: list[str], flag: str) -> list[str]:
    out, skip = [], False
    for a in args:
        if skip:
            skip = False
            continue
        if a == flag:
            skip = True
            continue
        if a.startswith(flag + "="):
            continue
        out.append(a)
    return out


def other_releases(engines: list[str]) -> list[tuple[str, str]]:
    """(label `<pin>-<version>`, the `--engine` value) for each pinned release other than the default of a pin
    that one of `engines` reads: the engines reading that pin, at that release."""
    from k3num.engines import registry
    from k3num.supply import fetch

    out = []
    for pin in dict.fromkeys(p for p in (registry.pin_of(n) for n in engines) if p is not None):
        readers = [n for n in engines if registry.pin_of(n) == pin]
        for version in fetch.releases(pin):
            if version != fetch.PINS[pin].version:
                out.append((f"{pin}-{version}", ",".join(f"{n}@{version}" for n in readers)))
    return out


def now_stamp() -> str:
    """A run's UTC stamp as the plugin names --drift-dir's files (harness/plugin.py), so every CSV of the job
    sorts by when its run started."""
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%S%fZ")


def runs(args: list[str], stamp: str | None = None) -> list[tuple[str, list[str]]]:
    """(label, pytest arguments) of every run of the job for the user's `args`: the default first."""
    from k3num.engines import registry

    if any(_value(args, f) is not None for f in CHOOSES_ENGINES):
        return [("default", args)]
    stamp = stamp or now_stamp()
    out = [("default", args)]
    for label, engines in other_releases(registry.defaults()):
        rest = _without(_without(args, "--drift-dir"), "--drift-csv")
        ddir, csv = _value(args, "--drift-dir"), _value(args, "--drift-csv")
        if csv is not None:
            p = Path(csv)
            rest += ["--drift-csv", str(p.with_name(f"{p.stem}-{label}{p.suffix or '.csv'}"))]
        elif ddir is not None:
            rest += ["--drift-csv", str(Path(ddir) / "runs" / f"drift-{stamp}-{label}.csv")]
        out.append((label, [*rest, "--engine", engines]))
    return out


def next_lines(plan: list[tuple[str, list[str]]]) -> list[str]:
    """The job's closing `next:` lines under --drift-dir, the default run's last: each release's runs go to a
    history of their own (DIR/history-<engine>-<version>; the default's DIR/history), so a night's report
    compares a release with its own past. None under --drift-csv (the user named the files)."""
    from k3num.harness.run_summary import k3num_command

    ddir = _value(plan[0][1], "--drift-dir")
    if ddir is None:
        return []
    home, k3num = Path(ddir), k3num_command()
    lines = [f"[main job] next ({label}): {k3num} report --history {home / f'history-{label}'} "
             f"--out {home / f'report-{label}'} {_value(args, '--drift-csv')}" for label, args in plan[1:]]
    return lines + [f"[main job] next: {k3num} report --history {home / 'history'} --out {home / 'report'} "
                    f"{home / 'drift.csv'}"]


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    plan = runs(args)
    worst = 0
    for i, (label, pytest_args) in enumerate(plan, 1):
        if label != "default":  # named when its run starts, like the default run's file
            pytest_args = runs(args, now_stamp())[i - 1][1]
            plan[i - 1] = (label, pytest_args)
        if len(plan) > 1:
            what = "the default engines" if label == "default" else f"{label} ({_value(pytest_args, '--engine')})"
            print(f"[main job] run {i} of {len(plan)}: {what}", flush=True)
        rc = subprocess.call([sys.executable, "-m", "pytest", "properties", *pytest_args])
        if len(plan) > 1:
            print(f"[main job] run {i} of {len(plan)} ({label}): pytest exit {rc}", flush=True)
        worst = max(worst, rc)
        if rc in (2, 3, 4, 5):  # interrupted, internal or usage error, nothing collected: the job stops there
            print(f"[main job] run {i} ({label}) could not run (pytest exit {rc}): the job stops", flush=True)
            return rc
    if len(plan) > 1:
        for line in next_lines(plan):
            print(line, flush=True)
    return worst


if __name__ == "__main__":
    sys.exit(main())
