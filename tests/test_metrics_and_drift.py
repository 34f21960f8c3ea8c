"""The judging layer itself: metrics on known differences, budgets' closed forms, the CSV writer."""

from __future__ import annotations

import math
from pathlib import Path

import pandas as pd
import pytest
import torch

from k3num.oracles import budgets, metrics
from k3num.oracles.budgets import Budget
from k3num.oracles.drift import COLUMNS, DriftCollector
from k3num.oracles.metrics import compare
from k3num.oracles.records import FAIL, PASS, judge


class _Engine:
    name, version, mode, real_ops, source_sha256 = "toy", "1", "reference", "", {}


def test_metrics_of_a_known_difference() -> None:
    ref = torch.tensor([1.0, -2.0, 4.0, 0.5], dtype=torch.float64)
    act = ref.clone()
    act[2] = 4.0 + 2 * 2.0**-5  # two bf16 ulps at 4 (ulp = 2^-5 there)
    m = compare(act.to(torch.bfloat16), ref)
    assert m.max_abs == 2 * 2.0**-5 and m.worst[0] == (2,)
    assert m.max_ulp == 2.0
    assert math.isclose(m.rel_fro, 2 * 2.0**-5 / float(torch.linalg.vector_norm(ref)))
    assert m.nonfinite_mismatch == 0 and 0.999 < m.cosine <= 1.0


def test_nan_and_inf_disagreement_is_counted_not_hidden() -> None:
    ref = torch.tensor([1.0, float("nan"), float("inf"), 2.0], dtype=torch.float64)
    act = torch.tensor([1.0, float("nan"), 3.0, float("nan")], dtype=torch.float64)
    m = compare(act, ref)
    assert m.nonfinite_mismatch == 2 and m.max_abs == 0.0


def test_budget_closed_forms() -> None:
    assert budgets.gamma(10, 2.0**-8) == 10 * 2.0**-8 / (1 - 10 * 2.0**-8)
    assert budgets.gamma(300, 2.0**-8) == math.inf  # n u >= 1: no bound
    assert budgets.probabilistic(64, 2.0**-24) == 8.0 * 8 * 2.0**-24
    assert budgets.unit_roundoff(torch.bfloat16, "toward_zero") == 2 * budgets.unit_roundoff(torch.bfloat16)
    b = budgets.baseline_rule(0.01, 3.0, torch.bfloat16)
    assert b.value == 2 * 0.01 + 3.0 * 2.0**-8 and b.baseline_err == 0.01


def test_verdict_follows_the_budget_and_nan_fails() -> None:
    ref = torch.ones(3, dtype=torch.float64)
    ok = judge(property="p", engine=_Engine(), subject="s", actual=ref + 0.1, reference=ref,
               budget=Budget(0.1000001, "r"), seed=1)
    bad = judge(property="p", engine=_Engine(), subject="s", actual=ref + 0.1, reference=ref,
                budget=Budget(0.09, "r"), seed=1)
    nan = judge(property="p", engine=_Engine(), subject="s", actual=torch.full((3,), float("nan")), reference=ref,
                budget=Budget(1e9, "r"), seed=1)
    assert (ok.verdict, bad.verdict, nan.verdict) == (PASS, FAIL, FAIL)


def test_drift_csv_has_the_documented_columns_and_is_replaced_atomically(tmp_path: Path) -> None:
    c = DriftCollector()
    ref = torch.ones(2, dtype=torch.float64)
    for seed in range(3):
        c.add(judge(property="p", engine=_Engine(), subject="s", actual=ref, reference=ref,
                    budget=Budget(1.0, "r"), seed=seed))
    out = tmp_path / "sub" / "drift.csv"
    out.parent.mkdir()
    out.write_text("stale\n")
    c.write_csv(out)
    df = pd.read_csv(out)
    assert list(df.columns) == COLUMNS and len(df) == 3 and list(df.seed) == [0, 1, 2]
    assert [p.name for p in out.parent.iterdir()] == ["drift.csv"], "no temporary file left behind"
    s = c.summary()
    assert s.loc[0, "records"] == 3 and s.loc[0, "failures"] == 0


def test_records_go_to_the_collector_scoped_over_the_running_code_and_nowhere_outside_a_run() -> None:
    """The run's collector is scoped (drift.collecting); COLLECTOR reads through to it and keeps nothing; in a
    context no run scoped there is none, and COLLECTOR says so rather than keeping records in the module."""
    import contextvars

    from k3num.oracles import drift
    from k3num.oracles.records import not_run

    mine = drift.DriftCollector()
    with drift.collecting(mine):
        drift.COLLECTOR.node = "probe::node"
        drift.COLLECTOR.add(not_run(property="p", engine="mirror", node="", why="a probe"))
        assert drift.current() is mine and drift.COLLECTOR.records is mine.records
    assert [r.node for r in mine.records] == ["probe::node"]
    assert drift.current() is not mine  # the test's own run's collector again
    bare = contextvars.Context()
    assert bare.run(drift.current) is None
    with pytest.raises(RuntimeError, match="no drift collector"):
        bare.run(lambda: drift.COLLECTOR.records)


def test_the_drift_table_keeps_known_divergences_apart_from_worst_ratio() -> None:
    """issue 41: vllm-rocm's aux tap read `worst_ratio 1.19e+03` next to `failures 0`; a ledger-filed record's
    ratio is its own column, and the worst ratio and property are the records no entry files."""
    from k3num.oracles.drift import summarize

    df = pd.DataFrame([
        {"engine": "e", "subject": "s", "property": "p", "verdict": "pass", "ratio": 0.5, "rel_fro": 0.1, "ledger": ""},
        {"engine": "e", "subject": "s", "property": "q", "verdict": "fail", "ratio": 1190.0, "rel_fro": 1.0,
         "ledger": "K3N-001"},
        {"engine": "f", "subject": "s", "property": "q", "verdict": "fail", "ratio": 90.0, "rel_fro": 1.0,
         "ledger": "K3N-002"},
    ])
    t = summarize(df).set_index("engine")
    assert t.loc["e", ["worst_ratio", "worst_known_ratio", "worst_property", "failures", "known_divergences"]
                 ].tolist() == [0.5, 1190.0, "p", 0, 1]
    assert pd.isna(t.loc["f", "worst_ratio"]) and t.loc["f", "worst_known_ratio"] == 90.0


@pytest.mark.parametrize("extra", [0, 1, 2, 4])
def test_the_rounding_count_reads_the_roundings_planted(extra: int) -> None:
    """An output rounded once to bf16 from the exact value, then `extra` more times after adding a small
    term each (what one more bf16 rounding per tap does), reads 1 + extra roundings within 5% (200,000
    elements); the same values held in float32 are counted in bf16 roundings too, and an exact output reads 0."""
    g = torch.Generator().manual_seed(7 + extra)
    exact = torch.randn(200_000, dtype=torch.float64, generator=g)
    terms = [0.05 * torch.randn(200_000, dtype=torch.float64, generator=g) for _ in range(extra)]
    r = (exact - sum(terms, torch.zeros_like(exact))).to(torch.bfloat16)  # one rounding
    for t in terms:
        r = (r.double() + t).to(torch.bfloat16)  # one more per term
    m = metrics.compare(r, exact)
    assert abs(m.roundings - (1 + extra)) < 0.05 * (1 + extra), m.roundings
    assert abs(metrics.compare(r.float(), exact).roundings - m.roundings) < 1e-9
    assert metrics.compare(exact.clone(), exact).roundings == 0.0
