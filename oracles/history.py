"""The nightly's memory: one summary file per run, and the regression gate over them.

A run is one drift CSV (oracles.drift; its schema is checked, `SchemaError` names what is missing)
plus its sidecar `<csv stem>.meta.json` (the plugin, k3num.harness.plugin: date, harness commit, profile, device name,
command, examples per test). `summarize_run` reduces it to what the report and the gate read, per
group (engine, subject, property, mode, device):

- the err/budget ratio distribution as 101 quantiles (`GRID`) of the records not filed in the ledger,
  with their count, failures, known divergences, engine version and source sha256;
- the error and budget per reduction length (the report's log-log plot);
- repeat counts: records with calls > 0 and how many gave more than one distinct output;
- the group's worst record (the report's worst-case table), and the ledger entries seen.

`write_run` stores that as one JSON file per run (tables as pandas records); `load_history` reads a
directory of them and reports a file it cannot parse by name instead of losing the history.

The gate (`gate`) asks, per group, whether the new run's ratios are worse than the group's history
beyond the noise the history itself shows; its statistic and thresholds are derived beside it.
Shapes: a run's ratios are a 1-D sample of n >= 1 values per group; quantile grids are [101].
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

from k3num.oracles.drift import COLUMNS, read_csv
from k3num.oracles.records import UNJUDGED

SCHEMA = 1
GRID = np.linspace(0.0, 1.0, 101)  # the quantile levels a run keeps of each group's ratios
GROUP = ["engine", "subject", "property", "mode", "device"]
RATIO_CAP = 1e6  # an inf ratio (a NaN/Inf disagreement, an exact contract broken) is kept as this
# the gate's constants (derivation in `gate`)
Z_ALARM = 3.5
MIN_EFFECT = 0.05
WINDOW = 10
SLACK = 0.05  # the report's budget-slack line: a worst ratio that stays below it catches nothing


class SchemaError(ValueError):
    """A drift CSV this harness's schema does not describe."""


class HistoryError(ValueError):
    """A history directory or gate request that cannot be used (with the reason)."""


def check_schema(df: pd.DataFrame, name: str) -> None:
    """Refuse a CSV that lacks any of the drift schema's columns, naming them."""
    missing = [c for c in COLUMNS if c not in df.columns]
    if missing:
        raise SchemaError(f"{name}: not a drift CSV of this schema: missing columns {missing}")


def read_run_csv(path: str | os.PathLike[str]) -> pd.DataFrame:
    """A drift CSV, schema-checked."""
    p = Path(path)
    try:
        df = read_csv(p)
    except (OSError, ValueError, pd.errors.ParserError) as e:
        raise SchemaError(f"{p}: cannot be read as CSV: {e}") from e
    check_schema(df, str(p))
    return df


def read_meta(csv: str | os.PathLike[str]) -> dict:
    """The run sidecar the pytest plugin (k3num.harness.plugin) writes beside a drift CSV ({} when there is none)."""
    p = meta_path(csv)
    if not p.exists():
        return {}
    try:
        return json.loads(p.read_text())
    except (OSError, ValueError) as e:
        raise SchemaError(f"{p}: the run's metadata does not parse: {e}") from e


def meta_path(csv: str | os.PathLike[str]) -> Path:
    """out/drift.csv -> out/drift.meta.json."""
    c = Path(csv)
    return c.with_name(f"{c.stem}.meta.json")


def quantiles(ratios: np.ndarray) -> list[float]:
    """The 101 quantiles (GRID) of a group's ratios, infinities capped at RATIO_CAP."""
    r = np.nan_to_num(np.asarray(ratios, dtype=np.float64), nan=RATIO_CAP, posinf=RATIO_CAP, neginf=0.0)
    return [float(v) for v in np.quantile(np.minimum(r, RATIO_CAP), GRID)]


def summarize_run(df: pd.DataFrame, meta: dict) -> dict:
    """One run as the history keeps it: {"schema", "meta", "groups", "by_len", "worst", "ledger"}."""
    judged = df[~df["verdict"].isin(UNJUDGED)]
    groups, by_len, worst = [], [], []
    for key, g in judged.groupby(GROUP, sort=True):
        row = dict(zip(GROUP, key))
        known = g["ledger"] != ""
        # the distribution the gate compares leaves out the ledger's cases: a known divergence's records stop
        # at its first failure (a strict xfail), so their count and ratios say nothing about drift
        plain = g[~known] if (~known).any() else g
        ratios = plain["ratio"].to_numpy(dtype=np.float64)
        # the rounding count (oracles/metrics.roundings_of) where the CSV has it (older CSVs do not)
        rounds = (pd.to_numeric(plain["roundings"], errors="coerce").to_numpy(dtype=np.float64)
                  if "roundings" in plain else np.array([]))
        rounds = rounds[np.isfinite(rounds)]
        rep = g[g["calls"] > 0]
        groups.append({
            **row,
            "engine_version": ";".join(sorted(set(g["engine_version"]))),
            "source_sha256": ";".join(sorted(set(s for s in g["source_sha256"] if s))),
            "records": int(len(plain)),
            "ledger_records": int(known.sum()),
            "only_ledger": bool(known.all()),
            "failures": int(((g["verdict"] == "fail") & ~known).sum()),
            "known_divergences": int(((g["verdict"] == "fail") & known).sum()),
            "exact": bool((g["budget"] == 0).all()),
            "worst_ratio": float(min(np.nanmax(np.nan_to_num(ratios, nan=RATIO_CAP)), RATIO_CAP)),
            "q": quantiles(ratios),
            "rq": quantiles(rounds) if len(rounds) else [],
            "median_roundings": float(np.median(rounds)) if len(rounds) else None,  # JSON: no NaN
            "repeat_records": int(len(rep)),
            "nondeterministic": int((rep["distinct"] > 1).sum()),
            "max_distinct": int(rep["distinct"].max()) if len(rep) else 0,
        })
        w = g.loc[g["ratio"].fillna(RATIO_CAP).idxmax()]
        kept = ("seed", "shape", "ratio", "max_abs", "budget", "budget_rule", "worst", "detail", "ledger", "dtype",
                "reduction_len", "node")
        worst.append({**row, **{c: _plain(w[c]) for c in kept}})
        if (g["reduction_len"] > 0).any() and not (g["budget"] == 0).all():
            for n, h in g[g["reduction_len"] > 0].groupby("reduction_len"):
                by_len.append({**row, "reduction_len": int(n), "n": int(len(h)),
                               "err_median": float(h["max_abs"].median()), "err_max": float(h["max_abs"].max()),
                               "budget_median": float(h["budget"].median())})
    led = df[df["ledger"] != ""]
    ledger = [{"ledger": k, "records": int(len(h)), "failing": int(h["verdict"].isin(("fail", "known")).sum())}
              for k, h in led.groupby("ledger")]
    return {"schema": SCHEMA, "meta": meta, "groups": groups, "by_len": by_len, "worst": worst, "ledger": ledger,
            "tokens": token_summary(df)}


# ---- token-level records (properties/test_draft_tokens.py; their `detail` fields: properties/README.md) ----

TOKEN_FIELDS = ("positions", "decided", "identical", "tie_break", "diverged", "agreement", "noise_agreement",
                "min_gap_over_delta")
MAX_POINTS = 2000  # per group: the blocks the report's flips-against-gap plot keeps (the first ones, in CSV order)


def token_fields(detail: str) -> dict[str, float] | None:
    """The numeric token fields of a record's detail, or None when it is not a token-level record."""
    head = detail.split(";paths=", 1)[0]
    kv = dict(part.split("=", 1) for part in head.split(";") if "=" in part)
    if not all(k in kv for k in TOKEN_FIELDS):
        return None
    try:
        return {k: float(kv[k]) for k in TOKEN_FIELDS}
    except ValueError:
        return None


def token_summary(df: pd.DataFrame) -> list[dict]:
    """Per group (GROUP) of token-level records: blocks, positions, decided, identical, tie_break, diverged
    (outside the ledger) and diverged_known (records filed under an entry, with their ids in `ledger`), the
    mean agreement length and the noise floor's, `d`: per block outside the ledger, agreement minus the
    noise floor's (the gate's sample), and `points`: [min gap / delta, tie_break + diverged] per block."""
    rows = df[df["subject"].astype(str).str.startswith("draft_step:")]
    out = []
    for key, g in rows.groupby(GROUP, sort=True):
        parsed: list[tuple[dict[str, float], str]] = []
        for d, led in zip(g["detail"], g["ledger"]):
            f = token_fields(str(d))
            if f is not None:
                parsed.append((f, str(led)))
        if not parsed:
            continue
        plain = [f for f, led in parsed if not led]
        known = [f for f, led in parsed if led]
        every = [f for f, _ in parsed]
        out.append({
            **dict(zip(GROUP, key)), "blocks": len(every),
            **{k: int(sum(f[k] for f in every)) for k in ("positions", "decided", "identical", "tie_break")},
            "diverged": int(sum(f["diverged"] for f in plain)),
            "diverged_known": int(sum(f["diverged"] for f in known)),
            "ledger": ",".join(sorted({led for _, led in parsed if led})),
            "agreement": float(np.mean([f["agreement"] for f in every])),
            "noise_agreement": float(np.mean([f["noise_agreement"] for f in every])),
            "d": [f["agreement"] - f["noise_agreement"] for f in plain],
            "points": [[f["min_gap_over_delta"], f["tie_break"] + f["diverged"]] for f in every[:MAX_POINTS]],
        })
    return out


def _plain(v: object) -> object:
    if isinstance(v, (np.integer,)):
        return int(v)
    if isinstance(v, (np.floating,)):
        return float(v) if math.isfinite(float(v)) else str(float(v))
    return v


def run_id(meta: dict) -> str:
    """A sortable file name: the run's UTC start and the harness commit."""
    date = str(meta.get("date", "")).replace(":", "").replace("-", "")
    commit = str(meta.get("harness_commit", "") or "nocommit")[:10]
    return f"{date or 'undated'}-{commit}"


def check_writable(history: str | os.PathLike[str]) -> Path:
    """The history directory, created if need be; refused (HistoryError) when it cannot be written."""
    d = Path(history)
    try:
        d.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise HistoryError(f"history directory {d}: cannot be created: {e}") from e
    if not d.is_dir():
        raise HistoryError(f"history directory {d}: not a directory")
    probe = d / f".k3num-write-probe-{os.getpid()}"
    try:
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        raise HistoryError(f"history directory {d}: not writable: {e}") from e
    return d


def could_write(history: str | os.PathLike[str]) -> None:
    """HistoryError when the history directory could not be made or written, judged without making anything:
    an existing directory must be writable, a missing one's nearest existing ancestor a writable directory (a
    bad run's CSV then leaves no empty history folder behind; `check_writable` makes it)."""
    d = Path(history)
    if d.exists():
        if not d.is_dir():
            raise HistoryError(f"history directory {d}: not a directory")
        if not os.access(d, os.W_OK | os.X_OK):
            raise HistoryError(f"history directory {d}: not writable")
        return
    up = d.parent
    while not up.exists() and up != up.parent:
        up = up.parent
    if not up.is_dir() or not os.access(up, os.W_OK | os.X_OK):
        raise HistoryError(f"history directory {d}: cannot be created: {up} is not a writable directory")


def write_run(history: str | os.PathLike[str], run: dict) -> Path:
    """Store a run as DIR/<run id>.json (a second run of the same second and commit gets a suffix)."""
    d = check_writable(history)
    base = run_id(run["meta"])
    target, k = d / f"{base}.json", 1
    while target.exists():
        k += 1
        target = d / f"{base}-{k}.json"
    tmp = target.with_name(f".{target.name}.tmp")
    tmp.write_text(json.dumps(run, allow_nan=False, default=str))
    os.replace(tmp, target)
    return target


@dataclass
class History:
    runs: list[dict] = field(default_factory=list)  # oldest first, each with "file"
    bad: list[tuple[str, str]] = field(default_factory=list)  # (file, why) for files skipped


def load_history(history: str | os.PathLike[str]) -> History:
    """Every run file of DIR, oldest first; a file that does not parse is named in `bad` and skipped."""
    d = Path(history)
    h = History()
    if not d.is_dir():
        return h
    for p in sorted(d.glob("*.json")):
        try:
            run = json.loads(p.read_text())
            if not isinstance(run, dict) or run.get("schema") != SCHEMA:
                raise ValueError(f"schema {run.get('schema') if isinstance(run, dict) else '?'} "
                                 f"(this harness reads {SCHEMA})")
            for k in ("meta", "groups", "by_len", "worst", "ledger"):
                if k not in run:
                    raise ValueError(f"no {k!r} table")
            for g in run["groups"]:
                if len(g.get("q", [])) != len(GRID):
                    raise ValueError(f"group {g.get('engine')}/{g.get('subject')}: {len(g.get('q', []))} quantiles, "
                                     f"not {len(GRID)}")
        except (OSError, ValueError) as e:
            h.bad.append((str(p), str(e)))
            continue
        run["file"] = p.name
        h.runs.append(run)
    h.runs.sort(key=lambda r: (str(r["meta"].get("date", "")), r["file"]))
    return h


def groups_frame(runs: Sequence[dict]) -> pd.DataFrame:
    """Every run's groups as one table (columns GROUP, run, date, profile, device_name, ... and q)."""
    rows = []
    for i, r in enumerate(runs):
        m = r["meta"]
        for g in r["groups"]:
            rows.append({**g, "run": i, "run_file": r.get("file", ""), "date": m.get("date", ""),
                         "profile": m.get("profile", ""), "device_name": m.get("device_name", ""),
                         "commit": m.get("harness_commit", "")})
    return pd.DataFrame(rows)


# ---- the regression gate ------------------------------------------------------------------------
#
# Statistic. For a group (engine, subject, property, mode, device) gated under one hypothesis profile
# and device name, let F be the ratio distribution of its history: the last WINDOW earlier runs,
# pooled by averaging their quantile functions (each run weighs the same, whatever its size). The new
# run's shift is
#     A = mean over the new run's ratios r of F_mid(r) - 1/2,
# where F_mid(x) = (P(X < x) + P(X <= x)) / 2. A is the Mann-Whitney statistic in its "probability of
# superiority" form: the chance that a new ratio exceeds a historical one, minus a half. It is 0 when
# the new run is distributed like the history, +1/2 when every new ratio is above every old one; it
# sees a shift anywhere in the distribution (a drift that moves only the upper half of the ratios, as
# an extra rounding under one flag does, moves A by about half that half's shift in rank), and it is
# one-sided: only ratios going up are worse. Here every run is represented by its 101 quantiles, so A
# is computed as the mean of F_mid over the new run's quantile grid (the trapezoid rule on its quantile
# function; exact to the grid's 1% resolution).
#
# Noise. Two sources: (1) sampling: under "same distribution" and independent draws, A has mean 0 and
# variance (n + m + 1) / (12 n m) for n new and m historical ratios (Mann-Whitney's variance divided
# by (n m)^2); (2) run to run: hypothesis does not draw independently (explicit examples, boundary
# targeting), and a GPU run may not repeat itself. The second is measured from the history: for every
# earlier run whose engine source (version and sha256) matches another earlier run's, its own A
# against the other runs of that source (leave one out); those A hold sampling noise too, so
# sigma_runs^2 = mean(A_loo^2) - mean(sigma_samp,loo^2), the variance sampling does not explain
# (floored at 0; 0 where no source has two runs, and the verdict then says the noise is sampling alone).
#
# Threshold. Alarm when A > Z_ALARM * sqrt(sigma_samp^2 + sigma_runs^2) and A > MIN_EFFECT.
# Z_ALARM = 3.5: a nightly gates about 50 groups; with a one-sided normal tail, 3.5 sigma is a
# 2.3e-4 false-alarm chance per group, about 1% per night for 50 groups (Bonferroni). MIN_EFFECT =
# 0.05: with 10^5 ratios a run's sigma_samp is 0.001, and a shift of a few thousandths in the chance
# of exceeding is real but too small to be worth a red nightly; 0.05 is "a new ratio exceeds an old
# one 55% of the time". The gate fires whether or not any example failed: failures are the
# properties' business, drift within budget is the gate's.


def _cdf_mid(q: np.ndarray, x: np.ndarray) -> np.ndarray:
    """F_mid at x of the distribution whose quantile function is q (nondecreasing, on GRID): the middle
    of a tie's probability on a flat stretch of q, linear in between, 0 below q[0] and 1 above q[-1]."""
    x = np.asarray(x, dtype=np.float64)
    uq, first = np.unique(q, return_index=True)
    last = np.r_[first[1:] - 1, len(q) - 1]
    pf, pl = GRID[first], GRID[last]
    i = np.searchsorted(uq, x, side="left")  # uq[i - 1] < x <= uq[i]
    ic = np.minimum(i, len(uq) - 1)
    on = (i < len(uq)) & (uq[ic] == x)
    lo = np.maximum(i - 1, 0)
    width = np.where(uq[ic] > uq[lo], uq[ic] - uq[lo], 1.0)
    between = pl[lo] + (x - uq[lo]) / width * (pf[ic] - pl[lo])
    f = np.where(on, (pf[ic] + pl[ic]) / 2, between)
    f = np.where(x < uq[0], 0.0, f)
    return np.where(x > uq[-1], 1.0, f)


def shift(new_q: Sequence[float], ref_qs: Sequence[Sequence[float]]) -> float:
    """A: the new run's probability of superiority over the reference runs, minus 1/2."""
    ref = np.mean(np.asarray(ref_qs, dtype=np.float64), axis=0)
    ref = np.maximum.accumulate(ref)
    new = np.asarray(new_q, dtype=np.float64)
    f = _cdf_mid(ref, new)
    return float(np.sum((f[1:] + f[:-1]) / 2 * np.diff(GRID)) - 0.5)  # the trapezoid rule over GRID


def sampling_sd(n: int, m: int) -> float:
    """Mann-Whitney's standard deviation of A for n new and m reference ratios."""
    return math.sqrt((n + m + 1) / (12.0 * n * m))


def _source(g: dict) -> str:
    return f"{g['engine_version']}|{g['source_sha256']}"


def group_label(g: dict) -> str:
    """engine/subject/property/mode/device: how a group is named on the command line (--allow-missing)."""
    return "/".join(str(g[k]) for k in GROUP)


def allowed(label: str, patterns: Sequence[str]) -> bool:
    """Whether --allow-missing names this group: a pattern is the label's leading components
    ("sglang", "sglang/attn_res_mix", ... up to the whole label)."""
    parts = label.split("/")
    return any(parts[: len(p.split("/"))] == p.split("/") for p in patterns)


def gate(runs: Sequence[dict], new: dict, *, z: float = Z_ALARM, min_effect: float = MIN_EFFECT,
         window: int = WINDOW, allow_missing: Sequence[str] = ()) -> pd.DataFrame:
    """The gate's verdict per group of `new` against the earlier `runs` (oldest first): columns GROUP,
    history (runs compared), shift, sigma_samp, sigma_runs, threshold, verdict (alarm, ok, no history,
    exact, ledger, missing, allowed missing) and note. A group the history holds (same profile and
    device) that the run lacks is `missing`, a failure, unless `allow_missing` names it. Raises
    HistoryError when `runs` is empty (a gate without history cannot pass) or when the run judged
    nothing (a gate on nothing does not pass either)."""
    if not runs:
        raise HistoryError("--gate: the history holds no earlier run to compare with; a gate without history "
                           "does not pass")
    if not new["groups"]:
        raise HistoryError("--gate: the run holds no judged record; a gate on an empty run does not pass")
    m = new["meta"]
    prof, dev = m.get("profile", ""), m.get("device_name", "")
    earlier = [r for r in runs if r["meta"].get("profile", "") == prof and r["meta"].get("device_name", "") == dev]
    have = {tuple(g[k] for k in GROUP) for g in new["groups"]}
    lacking: dict[tuple, dict] = {}
    for r in earlier[-window:]:
        for pg in r["groups"]:
            key = tuple(pg[k] for k in GROUP)
            if key not in have:
                lacking[key] = pg
    rows = []
    for key, pg in sorted(lacking.items()):
        label = group_label(pg)
        ok = allowed(label, allow_missing)
        rows.append({**{k: pg[k] for k in GROUP}, "records": 0, "history": 0,
                     "verdict": "allowed missing" if ok else "missing",
                     "note": "named by --allow-missing" if ok else f"in the history, not in this run "
                                                                    f"(--allow-missing {label} if on purpose)"})
    for g in new["groups"]:
        key = tuple(g[k] for k in GROUP)
        past = [pg for r in earlier for pg in r["groups"] if tuple(pg[k] for k in GROUP) == key][-window:]
        row = {**{k: g[k] for k in GROUP}, "records": g["records"], "history": len(past)}
        if g["exact"]:
            rows.append({**row, "verdict": "exact", "note": "budget 0: an exact contract, judged by its property"})
            continue
        if g.get("only_ledger"):
            rows.append({**row, "verdict": "ledger", "note": "only known divergences (oracles/ledger.py) ran here"})
            continue
        if not past:
            rows.append({**row, "verdict": "no history",
                         "note": f"no earlier run of this group under profile {prof!r} on {dev!r}"})
            continue
        a, s_samp, s_runs, thr, loo = _shifted(g, past, "q", z, min_effect)
        note = (f"run-to-run noise from {loo} earlier runs sharing a source" if loo
                else "noise: sampling alone (no two earlier runs share an engine source)")
        out = {**row, "shift": a, "sigma_samp": s_samp, "sigma_runs": s_runs, "threshold": thr,
               "verdict": "alarm" if a > thr else "ok", "note": note}
        # the rounding count's distribution, judged the same way: one more storage rounding per output moves
        # it by about one where a worst-case budget's ratio hides it in its margin
        with_rq = [p for p in past if p.get("rq")]
        if g.get("rq") and with_rq:
            ra, _, _, rthr, _ = _shifted(g, with_rq, "rq", z, min_effect)
            out.update(rounding_shift=ra, rounding_threshold=rthr)
            if ra > rthr:
                old_med = float(np.median([p.get("median_roundings") or math.nan for p in with_rq]))
                out.update(verdict="alarm", note=f"{note}; the rounding count grew: median "
                           f"{g.get('median_roundings') or math.nan:.3g} against {old_med:.3g}")
        rows.append(out)
    rows += token_gate(new, z=z)
    cols = [*GROUP, "records", "history", "shift", "sigma_samp", "sigma_runs", "threshold", "rounding_shift",
            "rounding_threshold", "verdict", "note"]
    return pd.DataFrame(rows).reindex(columns=cols)


def _shifted(g: dict, past: Sequence[dict], key: str, z: float, min_effect: float
             ) -> tuple[float, float, float, float, int]:
    """(shift, sigma_samp, sigma_runs, threshold, same-source comparisons) of group `g`'s quantiles `key`
    ("q" the ratios, "rq" the rounding counts) against the same group's `past` runs (derivation above)."""
    a = shift(g[key], [p[key] for p in past])
    s_samp = sampling_sd(g["records"], sum(p["records"] for p in past))
    loo, loo_samp = [], []
    by_src: dict[str, list[dict]] = {}
    for p in past:
        by_src.setdefault(_source(p), []).append(p)
    for same in by_src.values():
        if len(same) < 2:
            continue
        for i, p in enumerate(same):
            others = [o for j, o in enumerate(same) if j != i]
            loo.append(shift(p[key], [o[key] for o in others]))
            loo_samp.append(sampling_sd(p["records"], sum(o["records"] for o in others)))
    # the run-to-run variance beyond what sampling alone explains in those same-source comparisons
    s_runs = math.sqrt(max(0.0, float(np.mean(np.square(loo)) - np.mean(np.square(loo_samp))))) if loo else 0.0
    return a, s_samp, s_runs, max(z * math.sqrt(s_samp**2 + s_runs**2), min_effect), len(loo)


AGREEMENT_EFFECT = 0.5  # positions per block: a smaller loss of agreement against the noise floor is not an alarm


def token_gate(new: dict, *, z: float = Z_ALARM, min_effect: float = AGREEMENT_EFFECT) -> list[dict]:
    """The gate's rows for the run's token-level groups (property suffixed " [tokens]"): an alarm when a decided
    token flipped outside the ledger (DIVERGED; the token property fails on it too), or when the engine's
    agreement length falls below the noise floor's on the same blocks: shift = the mean over blocks of (agreement
    - the noise floor's agreement), an alarm when it is below -max(z * its standard error, min_effect).

    The comparison needs no history: the noise floor (every K3 path through the bf16 mirror) runs on the same
    blocks in the same run, so the case draws cancel; z is the ratio gate's (Z_ALARM) and the standard error is
    the blocks' sample one. min_effect: half a position per block, so that a run whose differences are all
    equal (standard error 0) does not alarm on a rounding's worth; a greedy verifier accepts whole positions,
    and the properties' blocks are 4-8 positions long."""
    rows = []
    for t in new.get("tokens", []):
        row = {**{k: t[k] for k in GROUP}, "property": f"{t['property']} [tokens]", "records": t["blocks"],
               "history": 0}
        d = np.asarray(t["d"], dtype=np.float64)
        if not len(d):
            rows.append({**row, "verdict": "ledger", "note": f"only known divergences ({t['ledger']}) ran here"})
            continue
        mean = float(d.mean())
        se = float(d.std(ddof=1) / math.sqrt(len(d))) if len(d) > 1 else 0.0
        thr = max(z * se, min_effect)
        why = []
        if t["diverged"]:
            why.append(f"{t['diverged']} decided token(s) flipped outside the ledger")
        if mean < -thr:
            why.append(f"agreement {t['agreement']:.2f} against the noise floor's {t['noise_agreement']:.2f}: "
                       f"{mean:.2f} positions per block (threshold {-thr:.2f})")
        rows.append({**row, "shift": mean, "sigma_samp": se, "sigma_runs": 0.0, "threshold": thr,
                     "verdict": "alarm" if why else "ok",
                     "note": "; ".join(why) or (f"agreement {t['agreement']:.2f}, the noise floor's "
                                               f"{t['noise_agreement']:.2f}; no decided token flipped")})
    return rows
