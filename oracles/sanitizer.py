"""Reading compute-sanitizer's text reports into rows: tool, subject, kernel, hazard count, first report.

compute-sanitizer prefixes every line it prints with "========= ". A report starts at a prefixed
line that is not indented after the prefix (an error, a race, a barrier error, a host API error) and
takes the indented lines after it; the kernel is the first `at NAME+0x...` / `at NAME(...)` /
`in function NAME` of the report (host-side reports have none: "(host)"). racecheck's analysis
reports carry their hazard count in brackets ("[128 hazards]"); every other report counts one. The
program under the sanitizer (scripts/sanitize_subjects.py) prints a marker line before each subject
it runs, so each report is attributed to the subject whose marker came last. The summary lines
("ERROR SUMMARY: N errors", "RACECHECK SUMMARY: ...") are kept as the tool's own total.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

TOOLS = ("memcheck", "racecheck", "initcheck", "synccheck")
PREFIX = "========= "
MARKER = "K3NUM-SUBJECT "  # + "engine subject case" (printed by scripts/sanitize_subjects.py)
_NOT_REPORTS = ("COMPUTE-SANITIZER", "ERROR SUMMARY", "RACECHECK SUMMARY", "LEAK SUMMARY", "Target application",
                "Saved host backtrace", "Internal Sanitizer", "Unable to find", "Note:")
_AT = re.compile(r"\bat (.+?)\+0x[0-9a-fA-F]+")  # "at NAME+0x1b0 in file.py:130", NAME possibly templated
_KERNEL = (re.compile(r"\bin function ([A-Za-z_]\w*)"), re.compile(r"\bat ([A-Za-z_]\w*)\("))


def kernel_name(report: str) -> str:
    """The kernel a report names: `void ns::kernel<...>(...)+0x..` -> `ns::kernel`; "(host)" if none."""
    m = _AT.search(report)
    if m:
        name = m.group(1).strip()
        name = name[5:] if name.startswith("void ") else name
        return re.split(r"[<(]", name, maxsplit=1)[0].strip() or name
    for rx in _KERNEL:
        m = rx.search(report)
        if m:
            return m.group(1)
    return "(host)"
_HAZARDS = re.compile(r"\[(\d+) hazards?\]")
_TOTAL = re.compile(r"ERROR SUMMARY: (\d+) errors?|RACECHECK SUMMARY: \d+ hazards? displayed \((\d+) errors?")


def check_tools(names: str | list[str]) -> list[str]:
    """The requested tools, or ValueError naming the valid ones."""
    tools = [t.strip() for t in (names.split(",") if isinstance(names, str) else names) if t.strip()]
    bad = [t for t in tools if t not in TOOLS]
    if bad or not tools:
        raise ValueError(f"--sanitize: unknown tool(s) {bad or names!r}; valid: {','.join(TOOLS)}")
    return tools


@dataclass
class Finding:
    tool: str
    subject: str  # "engine subject case" of the marker in force, or "" before any marker
    kernel: str
    hazards: int = 0
    reports: int = 0
    first_report: str = ""
    lines: list[str] = field(default_factory=list, repr=False)


def parse(tool: str, text: str) -> tuple[list[Finding], int | None]:
    """(findings grouped by (subject, kernel), the tool's ERROR SUMMARY total or None)."""
    found: dict[tuple[str, str], Finding] = {}
    subject, total = "", None
    current: list[str] | None = None

    def close() -> None:
        if not current:
            return
        body = " ".join(current)
        kernel = kernel_name(body)
        hz = _HAZARDS.search(body)
        key = (subject, kernel)
        f = found.setdefault(key, Finding(tool=tool, subject=subject, kernel=kernel))
        f.hazards += int(hz.group(1)) if hz else 1
        f.reports += 1
        if not f.first_report:
            f.first_report = " | ".join(s.strip() for s in current)[:500]

    for raw in text.splitlines():
        line = raw.rstrip()
        if MARKER in line and not line.startswith(PREFIX):
            close()
            current = None
            subject = line.split(MARKER, 1)[1].strip()
            continue
        if not line.startswith(PREFIX.rstrip()):
            continue
        body = line[len(PREFIX):] if line.startswith(PREFIX) else ""
        m = _TOTAL.search(body)
        if m:
            close()
            current = None
            total = int(m.group(1) or m.group(2))
            continue
        if not body.strip():
            continue
        if body.startswith(" "):  # a detail line of the report in progress
            if current is not None:
                current.append(body)
            continue
        close()
        current = None if body.startswith(_NOT_REPORTS) else [body]
    close()
    return list(found.values()), total
