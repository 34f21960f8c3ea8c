"""The nightly's history, report and regression gate (oracles/history.py, harness/nightly/report.py,
`k3num report`): proven both ways on real runs of the property suite and on synthetic histories."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from k3num.harness import cli, fixes
from k3num.oracles import history as hist
from k3num.oracles.drift import COLUMNS
from k3num.supply import fetch

ROOT = Path(__file__).resolve().parents[1]
PROPERTY = "properties/test_partial_projection.py::test_unsharded_projection_within_rounding_budget_of_oracle"


# ---- synthetic histories ------------------------------------------------------------------------


def _frame(ratios: np.ndarray, *, engine="mirror", subject="s", prop="p", version="1", ledger="", verdict=None,
           budget=1.0, calls=0, distinct=0) -> pd.DataFrame:
    n = len(ratios)
    row = {c: "" for c in COLUMNS}
    row.update(engine=engine, engine_version=version, mode="reference", subject=subject, property=prop,
               device="cpu", dtype="bfloat16", shape="4x16", reduction_len=64, seed=0, max_abs=0.0, rel_fro=0.0,
               max_ulp=0.0, cosine=1.0, nonfinite_mismatch=0, baseline_err=float("nan"), budget=budget,
               budget_rule="r", ratio=0.0, verdict="pass", ledger=ledger, calls=calls, distinct=distinct,
               over_budget=0, numel=64)
    df = pd.DataFrame([row] * n)
    df["ratio"] = ratios
    df["max_abs"] = ratios * budget
    df["seed"] = np.arange(n)
    if verdict is not None:
        df["verdict"] = verdict
    return df


def _run(df: pd.DataFrame, i: int, profile="p", device="cpu x") -> dict:
    return hist.summarize_run(df, {"date": f"2026-11-{i + 1:02d}T00:00:00Z", "profile": profile,
                                   "device_name": device, "harness_commit": f"c{i}"})


def test_gate_is_quiet_on_a_history_of_one_distribution_and_fires_on_an_injected_shift():
    rng = np.random.default_rng(7)
    draw = lambda n: rng.beta(2, 5, n)  # noqa: E731  ratios in (0, 1), median ~0.26
    past = [_run(_frame(draw(400)), i) for i in range(6)]
    same = hist.gate(past, _run(_frame(draw(400)), 6))
    assert list(same["verdict"]) == ["ok"], same
    shifted = hist.gate(past, _run(_frame(np.minimum(draw(400) * 1.4, 0.99)), 6))  # every case passes
    assert list(shifted["verdict"]) == ["alarm"], shifted
    assert shifted["shift"].iloc[0] > shifted["threshold"].iloc[0]


def test_gate_fires_when_the_rounding_count_grows_though_every_ratio_stays_where_it_was():
    """One more storage rounding per output (the count from 1.2 to 2.2, as the planted accumulator rounding
    reads) with the err/budget ratios drawn from the history's own distribution: the ratio shift is quiet,
    the rounding count's fires and the note gives both medians; a run with the history's counts is ok."""
    rng = np.random.default_rng(11)

    def frame(extra: float) -> pd.DataFrame:
        df = _frame(rng.beta(2, 5, 400))
        df["roundings"] = rng.gamma(8.0, 1.2 / 8.0, 400) + extra
        return df

    past = [_run(frame(0.0), i) for i in range(6)]
    same = hist.gate(past, _run(frame(0.0), 6))
    assert list(same["verdict"]) == ["ok"], same
    grown = hist.gate(past, _run(frame(1.0), 6))
    assert list(grown["verdict"]) == ["alarm"], grown
    assert grown["shift"].iloc[0] < grown["threshold"].iloc[0]
    assert grown["rounding_shift"].iloc[0] > grown["rounding_threshold"].iloc[0]
    assert re.search(r"the rounding count grew: median 2\.\d+ against 1\.\d+", grown["note"].iloc[0]), grown["note"]


def test_gate_noise_grows_with_the_spread_between_runs_of_one_source():
    rng = np.random.default_rng(3)
    # runs that differ more than sampling says (each its own scale): the gate must widen, not alarm
    past = [_run(_frame(rng.beta(2, 5, 300) * s, version="1"), i) for i, s in enumerate((0.8, 1.0, 1.2, 0.9, 1.1))]
    v = hist.gate(past, _run(_frame(rng.beta(2, 5, 300) * 1.15), 5))
    assert v["sigma_runs"].iloc[0] > v["sigma_samp"].iloc[0]
    assert list(v["verdict"]) == ["ok"], v


def test_gate_without_history_does_not_pass():
    with pytest.raises(hist.HistoryError, match="no earlier run"):
        hist.gate([], _run(_frame(np.full(10, 0.5)), 0))


def test_gate_leaves_exact_contracts_to_their_properties_and_says_when_a_group_is_new():
    past = [_run(_frame(np.full(20, 0.3), subject="a"), 0)]
    new = _run(pd.concat([_frame(np.full(20, 0.3), subject="a"), _frame(np.zeros(20), subject="b", budget=0.0),
                          _frame(np.full(20, 0.3), subject="c")]), 1)
    v = hist.gate(past, new).set_index("subject")["verdict"]
    assert v.to_dict() == {"a": "ok", "b": "exact", "c": "no history"}


def test_gate_judges_drift_without_the_ledgers_known_divergences():
    """A strict xfail's records stop at its first failure, so their ratios come and go: they are not drift."""
    plain = np.full(40, 0.3)
    past = [_run(pd.concat([_frame(plain), _frame(np.array([5.0]), ledger="K3N-004", verdict="fail")]), 0),
            _run(_frame(np.full(3, 9.0), subject="k", ledger="K3N-004", verdict="fail"), 1)]
    new = _run(pd.concat([_frame(plain), _frame(np.array([0.9, 80.0, 300.0]), ledger="K3N-004", verdict="fail"),
                          _frame(np.full(3, 90.0), subject="k", ledger="K3N-004", verdict="fail")]), 2)
    v = hist.gate(past, new).set_index("subject")
    assert v.loc["s", "verdict"] == "ok" and v.loc["s", "records"] == 40
    assert v.loc["k", "verdict"] == "ledger"


def test_gate_compares_only_runs_of_the_same_profile_and_device():
    past = [_run(_frame(np.full(50, 0.1)), 0, profile="ci"), _run(_frame(np.full(50, 0.1)), 1, device="gpu")]
    v = hist.gate(past, _run(_frame(np.full(50, 0.9)), 2, profile="nightly"))
    assert list(v["verdict"]) == ["no history"]


# ---- the run files ------------------------------------------------------------------------------


def _csv(tmp: Path, name: str, df: pd.DataFrame, meta: dict | None = None) -> Path:
    p = tmp / f"{name}.csv"
    df.to_csv(p, index=False)
    if meta is not None:
        hist.meta_path(p).write_text(json.dumps(meta))
    return p


def test_a_csv_of_another_schema_is_refused_naming_its_missing_columns(tmp_path, capsys):
    old = _frame(np.full(5, 0.2)).drop(columns=["node", "over_budget"])
    rc = cli.main(["report", "--history", str(tmp_path / "h"), str(_csv(tmp_path, "old", old))])
    assert rc == 2
    assert "missing columns ['over_budget', 'node']" in capsys.readouterr().err
    assert list((tmp_path / "h").glob("*.json")) == []


def test_an_unparsable_history_file_is_named_and_skipped(tmp_path, capsys):
    h = tmp_path / "h"
    assert cli.main(["report", "--history", str(h), str(_csv(tmp_path, "a", _frame(np.full(5, 0.2)),
                                                               {"date": "2026-11-01T00:00:00Z"}))]) == 0
    (h / "20261102T000000Z-broken.json").write_text("{ not json")
    assert cli.main(["report", "--history", str(h), str(_csv(tmp_path, "b", _frame(np.full(5, 0.2)),
                                                               {"date": "2026-11-03T00:00:00Z"}))]) == 0
    err = capsys.readouterr().err
    assert "history file" in err and "20261102T000000Z-broken.json skipped" in err
    assert len(hist.load_history(h).runs) == 2  # the good ones are kept


def test_a_history_directory_that_cannot_be_created_is_refused_before_anything_is_read(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("")
    rc = cli.main(["report", "--history", str(blocker / "h"), str(tmp_path / "missing.csv")])
    assert rc == 2 and "cannot be created" in capsys.readouterr().err


def test_a_read_only_history_directory_is_refused_before_anything_is_read(tmp_path, capsys):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    try:
        if os.access(ro, os.W_OK):  # root ignores the mode bits: the created-path case above still holds
            pytest.skip("running as root: a read-only mode does not stop writes")
        # refused before the CSV (which does not even exist) is read
        rc = cli.main(["report", "--history", str(ro), str(tmp_path / "missing.csv")])
        assert rc == 2 and "not writable" in capsys.readouterr().err
    finally:
        ro.chmod(0o755)


def test_report_writes_markdown_html_and_plots_with_ledger_and_slack_tables(tmp_path):
    h, out = tmp_path / "h", tmp_path / "r"
    for i, scale in enumerate((1.0, 1.0, 1.0)):
        df = pd.concat([
            _frame(np.linspace(0.1, 0.8, 30) * scale, subject="wide"),
            _frame(np.full(30, 0.01), subject="loose"),
            _frame(np.array([3.0, 0.2]), subject="known", ledger="K3N-006", verdict=["fail", "pass"]),
            _frame(np.array([0.2, 0.3]), subject="fixed", ledger="K3N-001"),
            _frame(np.zeros(4), subject="repeat", budget=0.0, calls=152, distinct=1 + i % 2),
        ])
        rc = cli.main(["report", "--history", str(h), "--out", str(out), str(_csv(
            tmp_path, f"run{i}", df, {"date": f"2026-11-0{i + 1}T00:00:00Z", "profile": "p", "device_name": "d"}))])
        assert rc == 0
    md = (out / "report.md").read_text()
    assert md.splitlines()[1].startswith("**Verdict: PASS**: 0 failing record(s) outside the ledger, no gate run, "
                                         "1 known"), md[:400]  # the verdict first, under the title
    assert "History: 3 runs" in md
    assert "| K3N-006 | tokenspeed |" in md and "still failing (1 of 2 records)" in md
    assert "FIXED: 2 records, none failing; remove the entry" in md  # K3N-001's records all pass
    slack = md.split("## Budget slack")[1].split("##")[0]
    assert "loose" in slack and "wide" not in slack
    assert (out / "ratio-mirror-wide.png").stat().st_size > 0
    assert (out / "err-vs-len-mirror-wide.png").stat().st_size > 0
    assert (out / "nondeterminism.png").stat().st_size > 0
    page = (out / "report.html").read_text()
    assert page.count("src='data:image/png;base64,") == len(list(out.glob("*.png")))  # self-contained
    assert "http" not in page.split("<body>")[1]


# ---- real runs: the property suite, twice on one source and once drifting -----------------------


def _suite(csv: Path, seed: int, drift: str = "", engine: str = "mirror", *extra: str) -> subprocess.CompletedProcess:
    """One run of the property: fresh draws (gate-proof is not derandomized), from a stated seed so that CI
    sees the same five runs every time."""
    env = {**os.environ, "K3NUM_DRIFT": drift}
    return subprocess.run([sys.executable, "-m", "pytest", PROPERTY, "-p", "tests.mutants", "--engine", engine,
                           "-p", "no:cacheprovider", "-q", "--hypothesis-profile=gate-proof",
                           f"--hypothesis-seed={seed}", "--drift-csv", str(csv), *extra],
                          cwd=ROOT, capture_output=True, text=True, env=env, timeout=600)


def test_gate_on_real_runs_is_quiet_for_one_source_and_fires_on_a_drift_within_budget(tmp_path):
    h = tmp_path / "h"
    for i in range(3):  # the history: three runs of the mirror, fresh random draws each (gate-proof)
        r = _suite(tmp_path / f"m{i}.csv", seed=i + 1)
        assert r.returncode == 0, r.stdout[-2000:]
        assert cli.main(["report", "--history", str(h), str(tmp_path / f"m{i}.csv")]) == 0
    same = _suite(tmp_path / "same.csv", seed=4)
    assert same.returncode == 0
    assert cli.main(["report", "--history", str(h), "--gate", str(tmp_path / "same.csv")]) == 0
    # tests.mutants' drift: two extra bf16 roundings in the norm, within budget (every example passes)
    drift = _suite(tmp_path / "drift.csv", 5, "unsharded_norm_rounded", "mirror", "--hypothesis-show-statistics")
    assert drift.returncode == 0, drift.stdout[-2000:]
    records = hist.read_run_csv(tmp_path / "drift.csv")
    assert (records["verdict"] == "pass").all()
    assert cli.main(["report", "--history", str(h), "--gate", str(tmp_path / "drift.csv")]) == 1
    last = hist.load_history(h).runs[-1]
    assert last["meta"]["profile"] == "gate-proof"
    # the metadata counts the examples hypothesis ran, one record each here. Hypothesis decides when to
    # stop (CI once saw this run stop at 195 of 300, on a machine where it ran 300 here): its statistics
    # say why, so a failure prints them
    stats = drift.stdout[drift.stdout.find("Hypothesis Statistics"):][:1500]
    assert last["meta"]["examples"] == {f"{PROPERTY}[mirror]": len(records)}, stats
    assert len(records) >= 150, f"too few examples for the gate's proof:\n{stats}"


def test_gate_on_real_engine_runs_fires_on_a_drifting_tokenspeed_tree(tmp_path):
    """The same proof on TokenSpeed 0.1.1's own project_target_hidden: the pinned files seven times (the
    history) and once more (no alarm); then the tree of harness.fixes' split-context-projection drift
    through --engine-src (two bf16 GEMMs over the halves of the taps; every example passes), one run of
    three seeds: alarm.

    The drift moves the ratio distribution by a probability shift of about 0.2; the gate's threshold
    is 3.5 sd of the sampling noise plus the run-to-run spread it estimates from the earlier runs. With
    four earlier runs that estimate was noisy enough to miss the drift in 12 of 40 resamplings of 8
    pinned and 8 drifted runs (which examples hypothesis draws moves with unrelated code: the set of
    test cases changed when supply/fetch.py grew); with seven earlier runs and a three-seed drift run it
    fired in 40 of 40, and the pinned run never alarmed (0 of 40)."""
    if not fetch.verified_manifest("tokenspeed"):
        pytest.skip("tokenspeed is not fetched (k3num fetch tokenspeed)")
    h = tmp_path / "h"
    tree = fixes.patched_tree(fixes.by_id("split-context-projection"), tmp_path / "tree")
    pinned = [(tmp_path / f"t{i}.csv", i + 1, ()) for i in range(8)]
    drift = [(tmp_path / f"drift{i}.csv", 11 + i, ("--engine-src", f"tokenspeed={tree}")) for i in range(3)]
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(2) as pool:  # independent runs, one CSV each
        runs = list(pool.map(lambda r: _suite(r[0], r[1], "", "tokenspeed", *r[2]), pinned + drift))
    for r in runs:
        assert r.returncode == 0, r.stdout[-2000:]
    for i, (csv, _, _) in enumerate(pinned):
        gate = ["--gate"] if i == 7 else []  # the eighth run of the pinned source is gated: no alarm
        assert cli.main(["report", "--history", str(h), *gate, str(csv)]) == 0
    df = pd.concat([hist.read_run_csv(c) for c, _, _ in drift])
    assert (df["verdict"] == "pass").all() and set(df["engine_version"]) == {"0.1.1+local"}
    assert cli.main(["report", "--history", str(h), "--gate", *(str(c) for c, _, _ in drift)]) == 1


def test_the_drift_mutant_stays_within_budget_under_the_ci_profile_too():
    """The drift is not a bug the suite must catch: it passes the property it moves."""
    r = subprocess.run([sys.executable, "-m", "pytest", PROPERTY, "-p", "tests.mutants", "--engine", "mirror",
                        "-p", "no:cacheprovider", "-q", "--hypothesis-profile=ci"], cwd=ROOT, capture_output=True,
                       text=True, env={**os.environ, "K3NUM_DRIFT": "unsharded_norm_rounded"}, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:]


# ---- the token-level records (properties/test_draft_tokens.py) -----------------------------------------


def _token_frame(blocks: list[tuple[int, int, int, int]], *, engine="vllm", ledger="") -> pd.DataFrame:
    """Token records, one per block: (tie_break, diverged, agreement, noise_agreement) with 6 positions."""
    df = _frame(np.full(len(blocks), 0.3), engine=engine, subject="draft_step:dspark",
                prop="draft_decided_tokens_never_flip", ledger=ledger)
    df["detail"] = [f"kind=dspark;positions=6;decided=5;identical={6 - t - d};tie_break={t};diverged={d};"
                    f"agreement={a};noise_agreement={n};noise_diverged=0;kl=0.01;min_gap_over_delta=0.5;"
                    f"paths=aux_capture=engine;project_unsharded=mirror" for t, d, a, n in blocks]
    return df


def test_the_token_gate_passes_an_engine_that_agrees_like_the_noise_floor():
    blocks = [(0, 0, 6, 6), (1, 0, 3, 3), (0, 0, 5, 6), (0, 0, 6, 5)] * 10
    rows = hist.token_gate(_run(_token_frame(blocks), 0))
    assert [r["verdict"] for r in rows] == ["ok"] and rows[0]["property"].endswith("[tokens]")


def test_the_token_gate_fires_on_a_decided_token_flipped_outside_the_ledger():
    blocks = [(0, 0, 6, 6)] * 39 + [(0, 1, 6, 6)]
    (row,) = hist.token_gate(_run(_token_frame(blocks), 0))
    assert row["verdict"] == "alarm" and "1 decided token(s) flipped outside the ledger" in row["note"]


def test_the_token_gate_fires_on_agreement_lost_against_the_noise_floor_without_a_flip():
    """Tie-breaks only (no DIVERGED), but the engine's proposals stop agreeing two positions early: the
    properties pass, the gate does not."""
    blocks = [(1, 0, 4, 6)] * 40
    (row,) = hist.token_gate(_run(_token_frame(blocks), 0))
    assert row["verdict"] == "alarm" and "agreement 4.00 against the noise floor's 6.00" in row["note"]
    small = [(1, 0, 5, 6), (0, 0, 6, 6), (0, 0, 6, 6), (0, 0, 6, 6)] * 10  # a quarter position: below the effect
    assert [r["verdict"] for r in hist.token_gate(_run(_token_frame(small), 0))] == ["ok"]


def test_the_token_gate_leaves_the_ledgers_blocks_out():
    (row,) = hist.token_gate(_run(_token_frame([(0, 3, 1, 6)] * 10, ledger="K3N-001"), 0))
    assert row["verdict"] == "ledger" and "K3N-001" in row["note"]
    run = _run(pd.concat([_token_frame([(0, 3, 1, 6)] * 10, ledger="K3N-001"), _token_frame([(0, 0, 6, 6)] * 10)]), 0)
    (row,) = hist.token_gate(run)
    assert row["verdict"] == "ok" and run["tokens"][0]["diverged_known"] == 30


def test_report_shows_the_token_table_and_each_entrys_severity_from_impact(tmp_path, capsys):
    csv = tmp_path / "drift.csv"
    _token_frame([(0, 0, 6, 6), (1, 0, 5, 5)] * 5).to_csv(csv, index=False)
    impact_csv = tmp_path / "impact.csv"
    pd.DataFrame([{"entry": "K3N-006", "role": "case", "severity": "near-ties only"},
                  {"entry": "K3N-006", "role": "case", "severity": "changes decided tokens"},
                  {"entry": "K3N-006", "role": "control", "severity": "no token changes"},
                  {"entry": "K3N-009", "role": "case", "severity": "not exercised by the draft step: a reason; more"}]
                 ).to_csv(impact_csv, index=False)
    assert cli.main(["report", "--history", str(tmp_path / "h"), "--impact", str(impact_csv), str(csv)]) == 0
    md = (tmp_path / "h" / "report" / "report.md").read_text()
    assert "## Tokens (latest run)" in md and "| vllm | draft_step:dspark |" in md
    assert "| K3N-006 | tokenspeed |" in md and "| changes decided tokens |" in md
    assert "not reached by the draft step: a reason |" in md
    assert "not measured (k3num impact --ledger" in md  # an entry the CSV does not name
    assert (tmp_path / "h" / "report" / "token-flips.png").exists()
    bad = tmp_path / "bad.csv"
    bad.write_text("entry,severity\nK3N-001,x\n")
    assert cli.main(["report", "--history", str(tmp_path / "h2"), "--impact", str(bad), str(csv)]) == 2
    assert "no column role" in capsys.readouterr().err


def test_a_bad_csv_is_refused_before_the_history_directory_is_made(tmp_path, capsys):
    rc = cli.main(["report", "--history", str(tmp_path / "h"), str(tmp_path / "missing.csv")])
    assert rc == 2 and "cannot be read as CSV" in capsys.readouterr().err
    assert not (tmp_path / "h").exists()
