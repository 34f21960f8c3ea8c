"""What a run did per engine, and what it must not pretend: the summary's engine lines and skip groups.

The plugin (harness/plugin.py) notes one `Outcome` per test of ours from its reports (on an xdist
controller too: the workers' reports reach it) and, at the end, asks this module for:
- `engine_lines`: each engine (the mirror included) with its mode and how many of its tests ran, were
  skipped and were known divergences (ledger-filed strict xfails);
- `ran_nothing`: the engines the user named (`--engine`, or the pin of an `--engine-src`) that ran no
  test, each with why (the commonest skip reason, or that no selected test applies): a run that tested
  nothing of what it was asked to test does not pass;
- `skip_groups`: skip reasons with their counts, so that a run's skips take a line per reason instead
  of a line per test.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

_TALLY = re.compile(r"\b(?:passed|failed|errors?|skipped|xfailed|xpassed|deselected|no tests ran)\b.* in [0-9.]+s")


def tally(log: str) -> str:
    """pytest's own tally line ("3 passed, 1 skipped in 2.50s") of a run's output, "" when there is none:
    the line to parse now that the k3-numerics block follows it."""
    lines = [ln.strip(" =") for ln in log.splitlines() if _TALLY.search(ln)]
    return lines[-1] if lines else ""


@dataclass(frozen=True)
class Outcome:
    node: str
    engine: str  # the registry name of the test's engine ("" for a test without one)
    outcome: str  # "run" (passed, failed, xpassed), "skipped", "known" (a ledger-filed xfail), "error"
    reason: str = ""  # a skip's reason


def outcome_of(when: str, outcome: str, wasxfail: bool) -> str | None:
    """The test's outcome from one of its reports, or None when this report does not decide it."""
    if when == "setup" and outcome == "skipped":
        return "skipped"
    if when == "setup" and outcome == "failed":
        return "error"
    if when != "call":
        return None
    if wasxfail:
        return "known" if outcome == "skipped" else "run"  # xfailed / xpassed (strict: a failure)
    return "skipped" if outcome == "skipped" else "run"


def short_reason(reason: str) -> str:
    """A skip reason without pytest's 'Skipped: ' prefix and without notes hypothesis appended."""
    reason = reason.split("\nFailing explicit example", 1)[0].strip()
    return reason.removeprefix("Skipped: ")


def per_engine(outcomes: Iterable[Outcome]) -> dict[str, Counter]:
    out: dict[str, Counter] = {}
    for o in outcomes:
        out.setdefault(o.engine, Counter())[o.outcome] += 1
    return out


def engine_lines(outcomes: Sequence[Outcome], bound: dict[str, str], engines: Sequence[str],
                 width: int | None = None) -> list[str]:
    """One line per engine of the run: 'NAME: MODE: N run, N skipped, N known' (bound: name -> the
    'name version: mode (note)' line of a built engine; an engine never built says why not). With `width`
    each line fits it: a built engine's note becomes "(-v: how it was bound)", a reason is clipped."""
    counts = per_engine(outcomes)
    lines = []
    for name in engines:
        c = counts.get(name, Counter())
        tally = f"{c['run']} run, {c['skipped']} skipped, {c['known']} known" + (
            f", {c['error']} error" if c["error"] else "")
        head = bound.get(name)
        if head is None:
            why = _commonest(o.reason for o in outcomes if o.engine == name and o.outcome == "skipped")
            head = f"{name}: not built" + (f" ({why})" if why else "")
        lines.append(_fit(head, tally, width, built=name in bound))
    return lines


def _fit(head: str, tally: str, width: int | None, *, built: bool) -> str:
    """'HEAD: TALLY' within `width` (None: whole)."""
    line = f"{head}: {tally}"
    if width is None or len(line) <= width:
        return line
    cut = head.find(" (")
    if built and cut > 0:
        head = head[:cut] + " (-v: how it was bound)"
    room = width - len(tally) - 2
    return f"{clip(head, room) if len(head) > room else head}: {tally}"


def ran_nothing(outcomes: Sequence[Outcome], named: Sequence[str]) -> list[tuple[str, str]]:
    """(engine, why) for each named engine none of whose tests ran."""
    counts = per_engine(outcomes)
    out = []
    for name in named:
        c = counts.get(name, Counter())
        if c["run"] or c["known"] or c["error"]:
            continue
        why = _commonest(o.reason for o in outcomes if o.engine == name and o.outcome == "skipped")
        out.append((name, why or "no selected test applies to it"))
    return out


def skip_groups(outcomes: Sequence[Outcome]) -> list[tuple[int, str]]:
    """(count, reason) of the skips, most common first."""
    c = Counter(o.reason for o in outcomes if o.outcome == "skipped")
    return sorted(((n, r) for r, n in c.items()), key=lambda t: (-t[0], t[1]))


def _commonest(reasons: Iterable[str]) -> str:
    c = Counter(r for r in reasons if r)
    return c.most_common(1)[0][0] if c else ""


def clip(text: str, width: int) -> str:
    """`text` whole when it fits in `width` characters, else cut at the last word boundary before it and
    marked as cut ("..." at the end)."""
    if len(text) <= width:
        return text
    cut = text[: max(width - 4, 1)]
    space = cut.rfind(" ")
    return (cut[:space] if space > width // 2 else cut).rstrip(" ,;:") + " ..."
