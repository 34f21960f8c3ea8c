"""The run's account says what happened (the k3-numerics block at the end of the log): a ledger
reproducer's expected failure counts as known, not failed, in the closing table of a run that exits 0; the
skip count equals pytest's; a reason line is cut at a word boundary and marked; the report's ledger table sees
an entry exercised when its test xfailed without a metric record (a refusal-type entry)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from k3num.harness import accounting
from k3num.supply import fetch

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    if fetch.missing_files("tokenspeed") or fetch.missing_files("vllm"):
        pytest.skip("tokenspeed and vllm must be fetched (k3num fetch)")
    out = tmp_path_factory.mktemp("account")
    r = subprocess.run([sys.executable, "-m", "pytest", "properties/test_ledger_reproducers.py",
                        "properties/test_off_path_shapes.py", "-k", "ledger_reproducer or bank_indices",
                        "--engine", "vllm,tokenspeed", "-p", "no:cacheprovider", "-q", "--hypothesis-profile=ci",
                        "--drift-csv", str(out / "drift.csv")], cwd=ROOT, capture_output=True, text=True, timeout=900)
    return r, out


def test_a_run_that_exits_0_shows_no_failure_in_its_closing_table(run) -> None:
    r, _ = run
    assert r.returncode == 0, r.stdout[-3000:]
    table = r.stdout.split("drift: worst err/budget ratio per engine, release and subject")[1].split("drift CSV:")[0]
    header, *lines = table.split("\n", 1)[1].strip().splitlines()  # past the title line's "(-v: ...)" note
    col = {name: i for i, name in enumerate(header.split())}  # the columns by name (the last may be empty)
    rows = [line.split() for line in lines if line.strip() and not line.startswith("vllm attn")]
    assert rows and all(row[col["fail"]] == "0" for row in rows), table
    # each row names its release: tokenspeed's finalize projection is 0.1.1's, with its one known divergence
    assert any(row[0] == "tokenspeed" and row[col["release"]] == "0.1.1"
               and row[col["subject"]] == "finalize_projection" and row[col["known"]] == "1" for row in rows), table
    assert all(len(line) <= 120 for line in table.strip().splitlines() if not line.startswith("vllm attn")), table


def test_the_skip_count_is_pytests(run) -> None:
    r, _ = run
    tally = accounting.tally(r.stdout)
    pytest_skips = int(re.search(r"(\d+) skipped", tally).group(1))
    ours = int(re.search(r"skipped, by reason \((\d+);", r.stdout).group(1))
    assert ours == pytest_skips, (ours, tally)


def test_the_report_sees_a_refusal_entry_exercised_by_its_xfail(run) -> None:
    from k3num.harness.nightly import report
    from k3num.oracles import history

    _, out = run
    df = history.read_run_csv(out / "drift.csv")
    assert ((df["ledger"] == "K3N-009") & (df["verdict"] == "known")).any()
    status = report.ledger_status(history.summarize_run(df, {}))
    k9 = status.loc[status["entry"] == "K3N-009", "status"].iloc[0]
    assert k9.startswith("still failing"), status.to_string()


def test_a_reason_line_is_cut_at_a_word_boundary_and_marked() -> None:
    text = "engine sglang 0.5.23 has no subject stage_partial: not in SGLang 0.5.23's bound files (the PP partial"
    cut = accounting.clip(text, 60)
    assert len(cut) <= 60 and cut.endswith(" ...") and text.startswith(cut[:-4]) and not cut[:-4].endswith(" ")
    assert text[len(cut) - 4] == " "  # the cut fell between two words
    assert accounting.clip("short", 60) == "short"


def test_a_run_without_the_engines_sources_says_last_that_they_were_not_tested(tmp_path) -> None:
    """With no engine cache (a failed or skipped `k3num fetch`) the run is green on the mirror alone; its last
    line names each real engine as not tested, so a green exit is never read as the engines judged."""
    r = subprocess.run([sys.executable, "-m", "pytest", "properties/test_aux_tap.py", "-k", "branch1",
                        "-p", "no:cacheprovider", "-q", "--drift-csv", str(tmp_path / "drift.csv")], cwd=ROOT,
                       capture_output=True, text=True, timeout=600,
                       env={**os.environ, "K3NUM_ENGINE_CACHE": str(tmp_path / "none")})
    assert r.returncode == 0, r.stdout[-2000:]
    last = r.stdout.strip().splitlines()[-1]
    assert last.startswith("NOT TESTED: vllm, vllm-rocm, tokenspeed, sglang"), r.stdout[-1500:]
