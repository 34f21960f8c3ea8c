"""The main job over every pinned release: the property suite once on the default engines, then once per other
pinned release of a pin a default engine reads (vLLM 0.34.0 beside the default 0.33.0: `--engine
vllm@0.34.0,vllm-rocm@0.34.0`), each release a run of its own (one tree per pin per run: harness/run_scope.py).

    python -m k3num.harness.main_job [PYTEST ARGS...]     (scripts/run_properties.sh)

The default run writes where the arguments say (`--drift-dir out`: out/runs/drift-<UTC time>.csv, out/drift.csv
linked to it). Each other release's run writes its own CSV beside it, named for the release, and leaves the
link alone: under `--drift-dir D`, D/runs/drift-<UTC time>-<engine>-<version>.csv; under `--drift-csv PATH`,
PATH's stem with `-<engine>-<version>` added. Arguments that choose the engines (`--engine`, `--engine-src`)
make it one run, as asked. Exit: the worst of the runs' pytest exits (any failure fails the job).
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


def runs(args: list[str], stamp: str | None = None) -> list[tuple[str, list[str]]]:
    """(label, pytest arguments) of every run of the job for the user's `args`: the default first."""
    from k3num.engines import registry

    if any(_value(args, f) is not None for f in CHOOSES_ENGINES):
        return [("default", args)]
    stamp = stamp or datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
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


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    plan = runs(args)
    worst = 0
    for i, (label, pytest_args) in enumerate(plan, 1):
        if len(plan) > 1:
            what = "the default engines" if label == "default" else f"{label} ({_value(pytest_args, '--engine')})"
            print(f"[main job] run {i} of {len(plan)}: {what}", flush=True)
        rc = subprocess.call([sys.executable, "-m", "pytest", "properties", *pytest_args])
        if len(plan) > 1:
            print(f"[main job] run {i} of {len(plan)} ({label}): pytest exit {rc}", flush=True)
        worst = max(worst, rc)
    return worst


if __name__ == "__main__":
    sys.exit(main())
