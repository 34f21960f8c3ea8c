"""The nightly's report over its history: report.md (a GitHub job summary), a self-contained report.html,
and PNG plots (matplotlib, Agg), from the run files oracles.history keeps.

Per engine and subject:
- `ratio-<engine>-<subject>.png`: the err/budget ratio distribution per run over time, one box per run
  (box: quartiles; whiskers: 5th and 95th percentiles; tick: median; dot: the worst), one panel per property;
- `err-vs-len-<engine>-<subject>.png`: the error against the reduction length on log-log axes, the
  latest run's median and worst error per length, with the budget's median per length and its fitted
  slope drawn;
`nondeterminism.png`: per group that repeats calls (the hygiene properties), the records with more
than one distinct output per run; and, when the runs hold token-level records, `token-flips.png` (flips
against the oracle's margin) and `token-agreement.png` (the agreement length per engine over the history).

Tables: the latest run (meta, examples per test), the gate's verdicts, the worst cases with the
command that replays each, the token-level groups, the ledger's status with each entry's token severity, and
budget slack.
"""

from __future__ import annotations

import base64
import html
import math
import re
import shlex
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pandas as pd

from k3num.oracles import history as hist
from k3num.oracles import ledger as ledger_mod


def md_table(df: pd.DataFrame, floats: str = "{:.3g}") -> str:
    """A GitHub-flavoured markdown table (no tabulate needed)."""
    if df.empty:
        return "_(none)_\n"

    def cell(v: object) -> str:
        if isinstance(v, float):
            return floats.format(v) if math.isfinite(v) else str(v)
        return str(v).replace("|", "\\|").replace("\n", " ")

    cols = list(df.columns)
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in df.itertuples(index=False)]
    return "\n".join(lines) + "\n"


def _slug(*parts: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", "-".join(parts))


def _label(run: dict) -> str:
    m = run["meta"]
    return f"{str(m.get('date', ''))[:10]} {str(m.get('harness_commit', ''))[:7]}".strip() or run.get("file", "?")


# ---- tables -------------------------------------------------------------------------------------


def worst_cases(run: dict, top: int = 15) -> pd.DataFrame:
    """The latest run's worst comparisons, each with the command that replays it: the repro bundle where
    the run wrote one (`--repro-all`), else the pytest node with --repro-dir, then `k3num replay`."""
    w = pd.DataFrame(run["worst"])
    if w.empty:
        return w
    w["ratio"] = pd.to_numeric(w["ratio"], errors="coerce").fillna(math.inf)
    w = w.sort_values("ratio", ascending=False).head(top)
    repro = str(run["meta"].get("repro_dir", "") or "")

    def command(r: pd.Series) -> str:
        # the history is a file a user may receive: every value it puts into a command is shell-quoted,
        # so a copied command runs the harness on that node and nothing else
        q = shlex.quote
        bundle = f"{r['property']}-{r['engine']}-worst.safetensors"
        if repro and (Path(repro) / bundle).exists():
            return f"k3num replay {q(str(Path(repro) / bundle))}"
        node = str(r.get("node", "") or "")
        select = q(node) if node else f"properties -k {q(str(r['property']))}"
        return (f"python -m pytest {select} --engine {q(str(r['engine']))} --repro-dir R --repro-all; "
                f"k3num replay {q('R/' + bundle)}")

    w["replay"] = w.apply(command, axis=1)
    w = w.assign(release=w["engine_version"] if "engine_version" in w else "")
    return w[["engine", "release", "subject", "property", "ratio", "max_abs", "budget", "shape", "seed", "ledger",
              "replay"]]


def ledger_status(run: dict) -> pd.DataFrame:
    """Every ledger entry against the latest run's records: still failing, fixed (the entry must go: its
    case passed), or not exercised by this run (its engine, mode or test did not run here)."""
    seen = {x["ledger"]: x for x in run["ledger"]}
    rows = []
    for d in ledger_mod.LEDGER:
        x = seen.get(d.id)
        if x is None:
            status = "not exercised in this run"
        elif x["failing"] > 0:
            status = f"still failing ({x['failing']} of {x['records']} records)"
        else:
            status = f"FIXED: {x['records']} records, none failing; remove the entry"
        rows.append({"entry": d.id, "engine": d.engine, "test": d.test, "status": status,
                     "severity": token_severity(run, d.id)})
    return pd.DataFrame(rows)


UNMEASURED = "not measured (k3num impact --ledger; k3num report --impact CSV)"


def token_severity(run: dict, entry: str) -> str:
    """What the entry does to the draft's tokens: from `k3num impact --ledger` given to the report (--impact,
    kept in the run's meta), else from this run's token records filed under the entry, else UNMEASURED."""
    from k3num.harness import impact

    given = run["meta"].get("impact", {}).get(entry)
    if given:
        from k3num.harness.accounting import clip

        if given.startswith(impact.NOT_THE_STEP):  # the reason up to its first clause; the CSV has it whole
            return "not reached by the draft step: " + clip(given[len(impact.NOT_THE_STEP):].split(";")[0], 90)
        return given
    filed = [t for t in run.get("tokens", []) if entry in t["ledger"].split(",")]
    if not filed:
        return UNMEASURED
    flipped = sum(t["diverged_known"] for t in filed)
    return impact.CHANGES + " (the token properties)" if flipped else UNMEASURED


def token_table(run: dict) -> pd.DataFrame:
    """The run's token-level groups: blocks and positions judged, the decided share, the IDENTICAL /
    TIE-BREAK / DIVERGED counts (diverged outside the ledger and inside it apart), the agreement lengths."""
    t = pd.DataFrame(run.get("tokens", []))
    if t.empty:
        return t
    t["decided_share"] = t["decided"] / t["positions"].where(t["positions"] > 0)
    return t[["engine", "subject", "property", "blocks", "positions", "decided_share", "identical", "tie_break",
              "diverged", "diverged_known", "ledger", "agreement", "noise_agreement"]]


def budget_slack(runs: Sequence[dict], slack: float = hist.SLACK) -> pd.DataFrame:
    """Groups whose worst ratio stayed below `slack` in every run of the history: a budget that loose
    catches nothing."""
    g = hist.groups_frame(runs)
    if g.empty:
        return g
    g = g[~g["exact"]]
    keys = ["engine", "subject", "property"]
    t = g.groupby(keys).agg(runs=("run", "nunique"), worst_over_history=("worst_ratio", "max")).reset_index()
    return t[t["worst_over_history"] < slack].sort_values("worst_over_history").reset_index(drop=True)


def verdict_line(run: dict, gate: pd.DataFrame | None) -> str:
    """The report's first line: the latest run's failures outside the ledger, the gate's alarms, the known
    divergences seen, as one verdict (FAIL where either of the first two is nonzero)."""
    g = pd.DataFrame(run["groups"])
    failures = int(g["failures"].sum()) if "failures" in g else 0
    known = int(g["known_divergences"].sum()) if "known_divergences" in g else 0
    alarms = int((gate["verdict"].isin(("alarm", "missing"))).sum()) if gate is not None else 0
    verdict = "FAIL" if failures or alarms else "PASS"
    gate_part = f"{alarms} regression-gate alarm(s)" if gate is not None else "no gate run"
    return (f"**Verdict: {verdict}**: {failures} failing record(s) outside the ledger, {gate_part}, {known} known "
            f"divergence record(s) (the ledger's, apart), {len(g)} groups.")


def latest_summary(run: dict) -> pd.DataFrame:
    g = pd.DataFrame(run["groups"])
    if g.empty:
        return g
    g["median_ratio"] = g["q"].map(lambda q: q[50])
    if "median_roundings" not in g:
        g["median_roundings"] = float("nan")  # a history file from before the rounding count
    g["release"] = g["engine_version"] if "engine_version" in g else ""  # a history file from before it: blank
    return g[["engine", "release", "subject", "property", "mode", "device", "records", "median_ratio", "worst_ratio",
              "median_roundings", "failures", "known_divergences", "nondeterministic"]]


# ---- plots --------------------------------------------------------------------------------------


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: Path) -> Path:
    # bbox_inches="tight": the canvas grows to hold what sits outside the axes (the legends), so nothing
    # covers the data and nothing is cut off
    fig.savefig(path, dpi=90, bbox_inches="tight")
    _plt().close(fig)
    return path


LEGEND_FONT = 8  # points: read at the figure's saved size (dpi 90) without zooming


def _legend_outside(ax, entries: int) -> None:
    """The legend to the right of the plotting area, in columns of at most 14 entries."""
    ax.legend(fontsize=LEGEND_FONT, loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0.0,
              ncol=max(1, math.ceil(entries / 14)))


def _colours(n: int) -> list:
    """n distinct colours: tab10 up to 10 series, tab20 up to 20, evenly spaced hues beyond."""
    plt = _plt()
    if n <= 10:
        return [plt.get_cmap("tab10")(i) for i in range(n)]
    if n <= 20:
        return [plt.get_cmap("tab20")(i) for i in range(n)]
    return [plt.get_cmap("hsv")(i / n) for i in range(n)]


def _floor(*series: pd.Series) -> float:
    """Where a zero is drawn on a log axis: the power of ten a decade below the smallest positive value
    (1e-20 when there is none)."""
    pos = [float(s[s > 0].min()) for s in series if (s > 0).any()]
    return 10.0 ** (math.floor(math.log10(min(pos))) - 1) if pos else 1e-20


def _at_floor(s: pd.Series, floor: float) -> pd.Series:
    return s.where(s > 0, floor)


def plot_ratios(runs: Sequence[dict], out: Path, max_runs: int = 60) -> list[Path]:
    """One PNG per (engine, subject): a box per run of each property's ratio distribution."""
    plt = _plt()
    g = hist.groups_frame(runs[-max_runs:])
    paths = []
    if g.empty:
        return paths
    labels = [_label(r) for r in runs[-max_runs:]]
    for (engine, subject), gs in g.groupby(["engine", "subject"], sort=True):
        props = sorted(gs["property"].unique())
        # one x axis for every panel (the runs), labelled under the last: rotated run labels never reach the
        # next panel's title
        fig, axes = plt.subplots(len(props), 1, figsize=(max(6, 0.35 * len(labels) + 3), 2.4 * len(props)),
                                 squeeze=False, sharex=True)
        for ax, prop in zip(axes[:, 0], props):
            gp = gs[gs["property"] == prop].sort_values("run")
            q = np.array(gp["q"].tolist())  # [runs, 101]
            x = np.arange(1, len(q) + 1)
            # a box per run drawn as 4 collections (whiskers, box, median, worst) rather than bxp's ~6 artists
            # per box: with 60 runs a plot costs a tenth of the time
            ax.vlines(x, q[:, 5], q[:, 95], color="tab:blue", lw=0.8)
            ax.vlines(x, q[:, 25], q[:, 75], color="tab:blue", lw=5, alpha=0.55)
            ax.scatter(x, q[:, 50], marker="_", s=60, color="k", lw=1.2, zorder=3)
            ax.scatter(x, q[:, 100], marker="o", s=6, color="tab:orange", zorder=3)
            ax.axhline(1.0, color="tab:red", lw=0.8, ls="--")
            ax.axhline(hist.SLACK, color="tab:gray", lw=0.6, ls=":")
            # the lines say what they are on the plot, and a known divergence's ratios in the thousands keep the
            # budget line readable: linear up to the slack line, logarithmic above it
            if float(np.nanmax(q)) > 20:
                ax.set_yscale("symlog", linthresh=hist.SLACK, linscale=0.5)
            ax.text(0.01, 1.0, "budget", transform=ax.get_yaxis_transform(), color="tab:red", fontsize=6,
                    va="bottom")
            ax.text(0.01, hist.SLACK, f"{hist.SLACK}: a worst ratio below catches nothing",
                    transform=ax.get_yaxis_transform(), color="tab:gray", fontsize=6, va="bottom")
            ax.set_xlim(0.3, len(q) + 0.7)
            ax.set_ylabel("err / budget", fontsize=8)
            only = "only_ledger" in gp and bool(gp["only_ledger"].fillna(False).iloc[-1])
            known = " known divergences only (the ledger)," if only else ""
            ax.set_title(f"{engine} {subject}: {prop} ({known} box: quartiles, whiskers: 5-95%, dot: worst)",
                         fontsize=8)
            # at most 12 run labels per axis: text layout is most of a plot's cost
            names = [labels[r] for r in gp["run"]]
            step = max(1, math.ceil(len(names) / 12))
            # upright labels: a slanted one reaches left under the y axis' lowest tick label
            ax.set_xticks(x[::step], names[::step], rotation=90, fontsize=7, ha="center")
            ax.tick_params(axis="x", labelbottom=ax is axes[-1, 0])
        # fixed margins instead of tight_layout, which measures every label (most of the time of a report)
        fig.subplots_adjust(left=0.1, right=0.98, top=1 - 0.3 / len(props), bottom=0.75 / (2.4 * len(props)) + 0.1,
                            hspace=0.35)
        paths.append(_save(fig, out / f"ratio-{_slug(engine, subject)}.png"))
    return paths


def plot_err_vs_len(runs: Sequence[dict], out: Path) -> list[Path]:
    """One PNG per (engine, subject) with reduction lengths: the latest run's error per length (median and
    worst), the earlier runs' medians faint, the budget's median per length and its log-log slope."""
    plt = _plt()
    rows = [{**b, "run": i} for i, r in enumerate(runs) for b in r["by_len"]]
    paths: list[Path] = []
    if not rows:
        return paths
    df = pd.DataFrame(rows)
    last = len(runs) - 1
    for (engine, subject), gs in df.groupby(["engine", "subject"], sort=True):
        fig, ax = plt.subplots(figsize=(6.5, 4.2))
        # an error of exactly 0 has no place on a log axis: it is drawn on a labelled floor line
        floor = _floor(gs["err_median"], gs["err_max"], gs["budget_median"])
        entries = 0
        props = [p for p, gp in gs.groupby("property") if (gp["run"] == last).any()]
        # one colour per series: a property's median, worst and budget are three series
        colour = iter(_colours(3 * len(props)))
        for prop, gp in gs.groupby("property"):
            old = gp[gp["run"] != last]
            if not old.empty:
                ax.scatter(old["reduction_len"], _at_floor(old["err_median"], floor), s=6, alpha=0.2, color="gray")
            now = gp[gp["run"] == last].sort_values("reduction_len")
            if now.empty:
                continue
            ax.plot(now["reduction_len"], _at_floor(now["err_median"], floor), "o-", ms=3, color=next(colour),
                    label=f"{prop}: median err")
            ax.plot(now["reduction_len"], _at_floor(now["err_max"], floor), "^", ms=3, color=next(colour),
                    label=f"{prop}: worst err", ls="none")
            entries += 2
            # the budget at each length is the median over the shapes of that length: drawn as marks, not as a
            # line, which would join different shapes into one curve
            b = now[(now["budget_median"] > 0) & (now["reduction_len"] > 0)]
            slope = (f" (log-log slope {np.polyfit(np.log(b['reduction_len']), np.log(b['budget_median']), 1)[0]:.2f})"
                     if len(b) >= 2 else "")
            c = next(colour)
            if len(b):
                ax.plot(b["reduction_len"], b["budget_median"], "_", ms=12, mew=2, ls="none", color=c,
                        label=f"{prop}: budget{slope}")
                entries += 1
        if (gs[["err_median", "err_max"]] <= 0).any().any():
            ax.axhline(floor, color="tab:gray", lw=0.6, ls=":", label=f"0 (drawn at {floor:.0e})")
            entries += 1
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_ylim(bottom=floor / 2)
        ax.set_xlabel("reduction length")
        ax.set_ylabel("max |err|")
        ax.set_title(f"{engine} {subject}: error against reduction length (latest run)", fontsize=9)
        _legend_outside(ax, entries)
        fig.subplots_adjust(left=0.12, right=0.98, top=0.92, bottom=0.12)
        paths.append(_save(fig, out / f"err-vs-len-{_slug(engine, subject)}.png"))
    return paths


def plot_nondeterminism(runs: Sequence[dict], out: Path) -> list[Path]:
    """Records with more than one bitwise-distinct output, per run, for the groups that repeat calls."""
    plt = _plt()
    g = hist.groups_frame(runs)
    if g.empty or "repeat_records" not in g or not (g["repeat_records"] > 0).any():
        return []
    g = g[g["repeat_records"] > 0]
    keys = list(g.groupby(["engine", "subject", "property"]))
    if g["run"].nunique() == 1:  # one run: no history to draw, a bar per group says what the run saw
        counts = sorted(((int(gk["nondeterministic"].sum()), "/".join(key)) for key, gk in keys), reverse=True)
        fig, ax = plt.subplots(figsize=(7, max(2.5, 0.22 * len(counts) + 1.2)))
        y = np.arange(len(counts))
        ax.barh(y, [c for c, _ in counts], color="tab:blue")
        ax.set_yticks(y, [k for _, k in counts], fontsize=7)
        ax.invert_yaxis()
        ax.set_xlabel("records with > 1 distinct output (of the repeat properties' records)")
        ax.set_title("nondeterminism in the one run of this history, per (engine, subject, property)", fontsize=9)
        ax.set_xlim(0, max(1, max(c for c, _ in counts)) * 1.1)
        fig.subplots_adjust(left=0.45, right=0.98, top=0.92, bottom=0.12)
        return [_save(fig, out / "nondeterminism.png")]
    fig, ax = plt.subplots(figsize=(7, 3.8))
    for (key, gk), c in zip(keys, _colours(len(keys))):
        gk = gk.sort_values("run")
        ax.plot(gk["run"], gk["nondeterministic"], "o-", ms=3, color=c, label="/".join(key))
    ax.set_xlabel("run (oldest first)")
    ax.set_ylabel("records with > 1 distinct output")
    ax.set_title("nondeterminism (repeat properties)", fontsize=9)
    _legend_outside(ax, len(keys))
    fig.subplots_adjust(left=0.1, right=0.98, top=0.9, bottom=0.14)
    return [_save(fig, out / "nondeterminism.png")]


def plot_tokens(runs: Sequence[dict], out: Path) -> list[Path]:
    """`token-flips.png`: per block of the latest run, the positions that flipped (TIE-BREAK + DIVERGED)
    against the block's smallest top-two gap over delta (log x; left of 1 a flip is a tie-break, right of it
    a decided token), one colour per engine; `token-agreement.png`: per engine and drafter, the mean
    agreement length per run over the history (solid) beside the noise floor's (dashed). None when no run
    holds token-level records."""
    latest = runs[-1].get("tokens", [])
    history = [(i, t) for i, r in enumerate(runs) for t in r.get("tokens", [])]
    if not history:
        return []
    plt = _plt()
    paths = []
    if latest:
        engines = sorted({t["engine"] for t in latest})
        fig, ax = plt.subplots(figsize=(7, 3.8))
        floor = 1e-3
        for engine, c in zip(engines, _colours(len(engines))):
            pts = np.asarray([p for t in latest if t["engine"] == engine for p in t["points"]], dtype=np.float64)
            if not len(pts):
                continue
            x = np.maximum(pts[:, 0], floor)
            ax.scatter(x, pts[:, 1] + (engines.index(engine) - len(engines) / 2) * 0.04, s=8, color=c, alpha=0.6,
                       label=engine)
        ax.axvline(1.0, color="k", lw=0.8, ls=":")
        ax.set_xscale("log")
        ax.set_xlabel("the block's smallest top-two gap / delta (log; 1e-3 at or below)")
        ax.set_ylabel("positions flipped in the block")
        ax.set_title("token flips against the oracle's margin (latest run)", fontsize=9)
        _legend_outside(ax, len(engines))
        fig.subplots_adjust(left=0.1, right=0.98, top=0.9, bottom=0.14)
        paths.append(_save(fig, out / "token-flips.png"))
    frame = pd.DataFrame([{"run": i, "series": f"{t['engine']}/{t['subject'].split(':')[-1]}",
                           "blocks": t["blocks"], "agreement": t["agreement"] * t["blocks"],
                           "noise": t["noise_agreement"] * t["blocks"]} for i, t in history])
    per = frame.groupby(["series", "run"]).sum().reset_index()
    series = sorted(per["series"].unique())
    fig, ax = plt.subplots(figsize=(7, 3.8))
    for name, c in zip(series, _colours(len(series))):
        s = per[per["series"] == name].sort_values("run")
        ax.plot(s["run"], s["agreement"] / s["blocks"], "o-", ms=3, color=c, label=name)
        # a marker on each point: one run is one point, which a dashed line alone does not draw
        ax.plot(s["run"], s["noise"] / s["blocks"], "x--", ms=4, lw=0.8, color=c)
    ax.set_xlabel("run (oldest first)")
    ax.xaxis.set_major_locator(_plt().MaxNLocator(integer=True))
    if per["run"].nunique() == 1:  # one run: one x position, not an axis of +-0.05 around it
        only = int(per["run"].iloc[0])
        ax.set_xlim(only - 1, only + 1)
        ax.set_xticks([only], [_label(runs[only])], fontsize=7)
    ax.set_ylabel("mean agreement length (positions)")
    ax.set_title("agreement with the float64 draft step (dashed: the noise floor)", fontsize=9)
    _legend_outside(ax, len(series))
    fig.subplots_adjust(left=0.1, right=0.98, top=0.9, bottom=0.14)
    paths.append(_save(fig, out / "token-agreement.png"))
    return paths


# ---- the report ---------------------------------------------------------------------------------


def render(runs: Sequence[dict], out: Path, gate: pd.DataFrame | None = None,
           skipped: Sequence[tuple[str, str]] = ()) -> tuple[Path, Path]:
    """Write report.md, report.html and the PNGs into `out` for the history `runs` (oldest first, the
    latest last). Returns (report.md, report.html)."""
    out.mkdir(parents=True, exist_ok=True)
    latest = runs[-1]
    m = latest["meta"]
    pngs = [*plot_ratios(runs, out), *plot_err_vs_len(runs, out), *plot_nondeterminism(runs, out),
            *plot_tokens(runs, out)]
    sections: list[tuple[str, str, pd.DataFrame | None]] = []
    head = verdict_line(latest, gate) + "\n\n" + (
            f"History: {len(runs)} runs ({_label(runs[0])} to {_label(latest)}). Latest run: {m.get('date', '?')}, "
            f"harness {m.get('harness_commit', '?')}, profile {m.get('profile', '?')}, device "
            f"{m.get('device_name', '?')}, torch {m.get('torch', '?')}.\n\nCommand: `{m.get('command', '?')}`\n")
    if skipped:
        head += "\nHistory files skipped (they do not parse):\n" + "".join(f"- `{f}`: {why}\n" for f, why in skipped)
    if gate is not None:
        alarms = gate[gate["verdict"] == "alarm"]
        sections.append((f"Regression gate: {len(alarms)} alarm(s) in {len(gate)} groups",
                         "Shift: the chance that a ratio of this run exceeds one of the history, minus 1/2 "
                         "(oracles/history.py derives the threshold).", gate))
    sections.append(("Latest run", "", latest_summary(latest)))
    sections.append(("Worst cases (latest run)", "", worst_cases(latest)))
    tokens = token_table(latest)
    if not tokens.empty:
        sections.append(("Tokens (latest run)", "Per block of the draft step against the float64 one "
                         "(properties/test_draft_tokens.py): TIE-BREAK a flip where the oracle's top-two gap is "
                         "below delta, DIVERGED a decided token flipped (diverged_known: filed in the ledger); "
                         "agreement: leading positions equal to the oracle's proposal, noise_agreement the same "
                         "for the noise floor.", tokens))
    sections.append(("Ledger status (latest run)", "severity: what the entry does to the draft's tokens "
                     "(k3num impact --ledger).", ledger_status(latest)))
    sections.append((f"Budget slack: worst ratio below {hist.SLACK} in every run", "A budget this loose catches "
                     "nothing: tighten it (oracles/budgets.py) or say why it must be loose.", budget_slack(runs)))
    ex = m.get("examples", {})
    if ex:
        sections.append(("Examples per test (latest run)", "", pd.DataFrame(
            {"test": list(ex), "examples": list(ex.values())})))
    md = ["# k3-numerics nightly report\n", head]
    for title, note, df in sections:
        md += [f"\n## {title}\n", (note + "\n\n") if note else "", md_table(df) if df is not None else ""]
    md.append("\n## Plots\n")
    md += [f"- `{p.name}`\n" for p in pngs]
    md_path = out / "report.md"
    md_path.write_text("".join(md))
    parts = ["<!doctype html><html><head><meta charset='utf-8'><title>k3-numerics nightly report</title>",
             "<style>body{font-family:sans-serif;max-width:1200px;margin:auto}table{border-collapse:collapse;"
             "font-size:12px}td,th{border:1px solid #ccc;padding:2px 6px}</style></head><body>",
             "<h1>k3-numerics nightly report</h1>", f"<pre>{html.escape(head)}</pre>"]
    for title, note, df in sections:
        parts += [f"<h2>{html.escape(title)}</h2>", f"<p>{html.escape(note)}</p>" if note else "",
                  df.to_html(index=False, float_format=lambda v: f"{v:.3g}", na_rep="") if df is not None else ""]
    parts.append("<h2>Plots</h2>")
    for p in pngs:
        data = base64.b64encode(p.read_bytes()).decode()
        name = html.escape(p.name)
        parts.append(f"<h3>{name}</h3><img alt='{name}' src='data:image/png;base64,{data}'>")
    parts.append("</body></html>")
    html_path = out / "report.html"
    html_path.write_text("\n".join(parts))
    return md_path, html_path
