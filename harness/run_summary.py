"""The k3num plugin's account of the run (harness/accounting.py says what it decides): per engine the
tests run, skipped and known; a named engine that ran nothing, and tests collected and never run, fail
the run; and the block that ends the log. Registered by harness/plugin.py (`pytest_plugins`)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from k3num.engines import registry
from k3num.harness import accounting, around, scaleout
from k3num.harness import session_state as state
from k3num.harness.run_scope import bound_engines, engine_names, is_controller, ours, own_path
from k3num.oracles.drift import SM100_NOTE, covers_vllm_attn_res, summarize
from k3num.oracles.records import NOT_RUN

if TYPE_CHECKING:
    import pandas as pd


class _Reports:
    """Each report's part in the run's account (harness/accounting.py). An object registered per config
    (pytest_configure), since pytest hands `pytest_runtest_logreport` the report and not the config."""

    def __init__(self, book: state.Book) -> None:
        self.book = book

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        b = self.book
        if report.when in ("setup", "call"):
            b.reported.add(report.nodeid)
        tags = dict(p for p in report.user_properties if isinstance(p, tuple) and len(p) == 2)
        decided = accounting.outcome_of(report.when, report.outcome, bool(getattr(report, "wasxfail", "")))
        skip_reason = (accounting.short_reason(str(report.longrepr[2])) if decided == "skipped"
                       and isinstance(report.longrepr, tuple) and len(report.longrepr) == 3 else None)
        if "k3num_engine" not in tags:  # a test of ours without an engine: its skip still counts
            if skip_reason is not None and report.nodeid in b.collected:
                b.untagged_skips[report.nodeid] = skip_reason
            return
        entry = b.account.setdefault(report.nodeid, {"engine": str(tags["k3num_engine"])})
        if decided is not None:
            entry["outcome"] = decided
            if skip_reason is not None:
                entry["reason"] = skip_reason


def pytest_configure(config: pytest.Config) -> None:
    config.pluginmanager.register(_Reports(state.book(config)), f"k3num-reports-{id(config)}")


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_node_collection_finished(node, ids: list[str]) -> None:
    root = str(node.config.rootpath)
    state.book(node.config).collected.update(i for i in ids if own_path(os.path.join(root, i.split("::")[0])))


def pytest_collection_finish(session: pytest.Session) -> None:
    """What this run means to run of ours: the items left after deselection (-k, -m)."""
    if not hasattr(session.config, "workerinput") and not is_controller(session.config):
        state.book(session.config).collected.update(item.nodeid for item in session.items if ours(item))
    if session.config.getoption("collectonly", False) and not hasattr(session.config, "workerinput"):
        _warn_unbindable_sources(session.config)


def _warn_unbindable_sources(config: pytest.Config) -> None:
    """--collect-only runs no test, so the run's "engine X was asked for and ran no test" cannot come: an
    --engine-src tree that lacks the engine's bound files is said here instead (issue 41: it exited 0 silently)."""
    from k3num.supply import fetch

    tr = config.pluginmanager.get_plugin("terminalreporter")
    for pin, tree in sorted(config.stash[state.RUN].sources.items()):
        missing = fetch.missing_in(pin, Path(tree)) if pin in fetch.PINS else []
        if missing and tr is not None:
            names = [n for n in registry.known() if n.split("-")[0] == pin]
            tr.write_line(f"WARNING: --engine-src {pin}={tree} lacks the bound file(s) {', '.join(missing[:3])}"
                          f"{' ...' if len(missing) > 3 else ''}: {', '.join(names)} would run no test (a run of these "
                          "tests fails naming it)", yellow=True)


def _outcomes(config: pytest.Config) -> list[accounting.Outcome]:
    return [accounting.Outcome(node, s["engine"], s.get("outcome", "run"), s.get("reason", ""))
            for node, s in state.book(config).account.items()]


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    _judge_the_account(session)


def _named_engines(config: pytest.Config) -> list[str]:
    """The engines the user asked for by name: --engine's list, else the engines an --engine-src feeds."""
    if config.getoption("--engine"):
        return engine_names(config)  # NAME@VERSION is engine NAME
    pins = set(config.stash[state.RUN].sources)
    return [n for n in registry.known() if n.split("-")[0] in pins]


def _judge_the_account(session: pytest.Session) -> None:
    """A named engine that ran no test makes the run fail, naming why (harness/accounting.py)."""
    config = session.config
    if hasattr(config, "workerinput"):
        return
    # (only where tests of ours took an engine: a foreign suite that names an engine through
    # K3NUM_ENGINE_SRC for k3num.api.engine is not judged by this rule)
    book = state.book(config)
    empty = accounting.ran_nothing(_outcomes(config), _named_engines(config)) if book.account else []
    if session.exitstatus == pytest.ExitCode.INTERRUPTED:  # not "no test applies": none got its turn
        empty = [(name, "the run was interrupted before any of its tests ran" if why.startswith("no selected")
                  else why) for name, why in empty]
    config.stash[state.EMPTY] = empty
    # collected and never reported: a test xdist dropped (its restart limit reached after crashed
    # workers) or a run cut short; said by name, and a run that meant to run them does not pass
    # --collect-only runs nothing by design: nothing is owed
    never = [] if config.getoption("collectonly", False) else sorted(book.collected - book.reported)
    config.stash[state.NEVER] = never
    stopped = session.shouldstop or session.shouldfail or session.exitstatus == pytest.ExitCode.INTERRUPTED
    if (empty or (never and not stopped)) and session.exitstatus == 0:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
    if book.deaths and not book.reported and not stopped:
        # every xdist worker died before a test ran (xdist: "Unexpectedly no active workers available", exit 3):
        # the harness's own verdict, never ran, with what each worker died of (pytest_unconfigure prints it)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def session_of(config: pytest.Config) -> pytest.Session | None:
    return config.stash.get(state.SESSION, None)


def pytest_sessionstart(session: pytest.Session) -> None:
    session.config.stash[state.SESSION] = session


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    """Keep pytest's terminal reporter for the block printed last (pytest_unconfigure)."""
    config.stash[state.TERMINAL] = terminalreporter


def pytest_unconfigure(config: pytest.Config) -> None:
    """The last lines of the log, in this order: skips grouped by reason, the engines (each with its mode
    and its tests run, skipped and known), the named engines that ran nothing, the drift table, the CSV's
    path, the command to run next, and last, the real engines that were never built (not tested)."""
    if hasattr(config, "workerinput"):
        return
    # an internal error (every xdist worker lost) skips pytest_terminal_summary: the reporter itself, then
    if state.TERMINAL not in config.stash and config.pluginmanager.get_plugin("terminalreporter") is not None:
        config.stash[state.TERMINAL] = config.pluginmanager.get_plugin("terminalreporter")
    if state.TERMINAL not in config.stash:
        return
    book = state.book(config)
    if not (book.account or config.stash.get(state.NEVER, []) or book.replaced or config.stash.get(state.LOST, None)
            or book.deaths):
        return
    tw = config.stash[state.TERMINAL]._tw
    outcomes = _outcomes(config)
    tw.sep("=", "k3-numerics")
    groups = accounting.skip_groups(outcomes + [accounting.Outcome(node, "", "skipped", why)
                                                for node, why in book.untagged_skips.items()])
    if groups and not _asks_skips(config):
        tw.line(f"skipped, by reason ({sum(n for n, _ in groups)}; -rs lists each):")
        for n, reason in groups[:12]:
            tw.line(f"  {n:5d}  {accounting.clip(reason, 160)}")
        if len(groups) > 12:
            tw.line(f"  ... and {len(groups) - 12} more reasons ({sum(n for n, _ in groups[12:])} skips)")
    gpus = config.stash.get(state.GPUS, None)
    if gpus and any(g != "-" for g in gpus.values()):
        tw.line("xdist workers on GPUs: " + ", ".join(f"{w} -> GPU {gpus[w]}" for w in sorted(
            gpus, key=scaleout.worker_index)))
    lost = config.stash.get(state.LOST, None)
    if lost:
        n = sum(r.verdict == NOT_RUN for r in config.stash[state.DRIFT].records)
        tw.line(f"CUDA context lost after {lost[0]} ({lost[1]}): {n} later test(s) not run, counted apart from "
                "failures and skips")
    for worker, node, why in book.replaced:
        tw.line(f"xdist worker {worker} lost its CUDA context after {node} ({why}): replaced, its queue went to "
                "the other workers")
    bound = config.stash.get(state.BOUND, {}) if is_controller(config) else bound_engines()
    if book.account:
        tw.line("engines (how each was bound: tests run, skipped, known divergences):")
        listed = engine_names(config) + sorted(n for n in bound if around.SEP in n)  # the variants built (around.py)
        width = None if config.getoption("verbose", 0) > 0 else WIDTH
        for line in accounting.engine_lines(outcomes, bound, listed, width and width - 2):
            tw.line(f"  {line}")
    for name, why in config.stash.get(state.EMPTY, []):
        tw.line(f"ERROR: engine {name} was asked for and ran no test: {why}", red=True)
    if book.deaths and not book.reported:
        tw.line(f"ERROR: no test ran: every xdist worker died before running one ({len(book.deaths)} deaths; "
                "exit 1, never ran); what each died of, last lines:", red=True)
        for worker, why in book.deaths[:16]:
            tw.line(f"  {worker}: {why}", red=True)
    never = config.stash.get(state.NEVER, [])
    if never:
        tw.line(f"ERROR: {len(never)} collected test(s) never ran ({_why_never(config)}): {', '.join(never[:5])}"
                f"{' ...' if len(never) > 5 else ''}", red=True)
    frame = config.stash.get(state.FRAME, None)
    summary = summarize(frame if frame is not None else config.stash[state.DRIFT].frame(),
                        keys=("engine", "engine_version", "subject"))
    if not summary.empty:
        tw.line("drift: worst err/budget ratio per engine, release and subject"
                + ("" if config.getoption("verbose", 0) > 0 else " (-v: every column)"))
        tw.line(terminal_table(summary, verbose=config.getoption("verbose", 0) > 0))
        if covers_vllm_attn_res(summary):
            tw.line(SM100_NOTE)
    written = config.stash.get(state.CSV, None)
    if written:
        from k3num.harness.pairing_run import shown

        latest = config.stash.get(state.LATEST, None)
        csv = shown(config, written[0])
        tw.line(f"drift CSV: {csv} ({written[1]} records)" + (f"; latest: {shown(config, latest)}" if latest else ""))
        home = shown(config, Path(latest).parent if latest else Path(written[0]).parent)
        tw.line(f"next: {k3num_command()} report --history {home / 'history'} --out {home / 'report'} {csv}")
    if book.account:
        untested = [n for n in engine_names(config) if n not in bound and n != "mirror"]
        if untested:  # the last line: a green run that never built a real engine judged the mirror alone
            tw.line(f"NOT TESTED: {', '.join(untested)} (not built: `k3num fetch` gets their pinned sources); this run "
                    "judged the engines listed as built above, and the real engines named here not at all", red=True)


WIDTH = 120  # the closing block's lines fit this many columns without -v


def terminal_table(summary: pd.DataFrame, *, verbose: bool) -> str:
    """The drift table as the log ends with it: every column under -v, else the ones a reader acts on, with
    short headers, within WIDTH columns."""
    fmt = lambda v: f"{v:.3g}"  # noqa: E731
    if verbose:
        return summary.to_string(index=False, float_format=fmt)
    short = {"engine": "engine", "engine_version": "release", "subject": "subject", "records": "records",
             "worst_ratio": "worst", "failures": "fail", "known_divergences": "known", "worst_property": "property"}
    table = summary[[c for c in short if c in summary]].rename(columns=short)
    if "property" in table:
        table["property"] = table["property"].astype(str).map(lambda p: accounting.clip(p, 44))
    return table.to_string(index=False, float_format=fmt)


def k3num_command() -> str:
    """How to call the `k3num` command from the user's shell: `k3num` where it is on PATH as this interpreter's,
    else the interpreter's module form (a venv that is not activated)."""
    import shutil
    import sys

    found = shutil.which("k3num")
    mine = Path(sys.executable).parent / "k3num"
    if found and Path(found).resolve() == mine.resolve():
        return "k3num"
    return f"{sys.executable} -m k3num.harness.cli" if not mine.exists() else str(mine)


def _why_never(config: pytest.Config) -> str:
    """Why collected tests never ran, from what the session knows: a usage error, -x/--maxfail, an
    interruption (at --run-limit when a wrapper gave one: gpu_nightly.sh's K3NUM_TIMEOUT), else xdist's
    dropped tests after its worker restarts ran out."""
    session = session_of(config)
    status = getattr(session, "exitstatus", None)
    if status == pytest.ExitCode.USAGE_ERROR:
        return "the run stopped at the usage error printed below, before any test ran"
    if getattr(config.option, "maxfail", 0) and getattr(session, "testsfailed", 0) >= config.option.maxfail:
        return f"the run stopped after {config.option.maxfail} failure(s), -x/--maxfail"
    if status == pytest.ExitCode.INTERRUPTED:
        limit = config.getoption("--run-limit", None)
        return (f"the run was interrupted at its time limit of {limit:g} s (--run-limit; gpu_nightly.sh's "
                "K3NUM_TIMEOUT): a run cut short, no worker crashed" if limit else
                "the run was interrupted (SIGINT or Ctrl-C): a run cut short")
    return "xdist stops replacing crashed workers after --max-worker-restart; a run cut short"


def _asks_skips(config: pytest.Config) -> bool:
    """Whether -r asks pytest to list skips itself (s, a or A)."""
    return any(c in (config.getoption("reportchars", "") or "") for c in "saA")
