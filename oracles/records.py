"""One record per oracle comparison: what was compared, how far apart, against which budget, verdict.

The record is the unit of the drift report: every property that compares a
subject with the oracle builds one with `judge`, and the session collector
(oracles.drift) writes them all to CSV.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from k3num.oracles.budgets import Budget
from k3num.oracles.metrics import compare

PASS, FAIL, INFO = "pass", "fail", "info"
# a test that never ran because the process could not run it (its CUDA context was lost): neither a
# pass nor a failure, counted apart
NOT_RUN = "not-run"
KNOWN = "known"  # a failing case inside a ledger entry's rule, recorded as such (no metric: the test judged none)
UNJUDGED = (INFO, NOT_RUN, KNOWN)  # verdicts no ratio statistic takes in
# under --repro-dir the plugin scopes each test in `keeping_tensors()`: each record then carries the compared
# tensors in `extra` ("actual", "reference") until the bundle is written (they never reach the CSV)
_KEEP_TENSORS: contextvars.ContextVar[bool] = contextvars.ContextVar("k3num_keep_tensors", default=False)


@contextlib.contextmanager
def keeping_tensors(keep: bool = True) -> Iterator[None]:
    """Records judged inside keep their compared tensors in `extra` when `keep`."""
    token = _KEEP_TENSORS.set(keep)
    try:
        yield
    finally:
        _KEEP_TENSORS.reset(token)


@dataclass(frozen=True)
class Record:
    property: str
    engine: str
    engine_version: str
    mode: str
    real_ops: str
    source_sha256: str
    subject: str
    device: str
    dtype: str
    shape: str
    reduction_len: int
    seed: int
    max_abs: float
    rel_fro: float
    max_ulp: float
    cosine: float
    nonfinite_mismatch: int
    worst: str
    baseline_err: float
    budget: float
    budget_rule: str
    ratio: float
    verdict: str
    detail: str = ""
    ledger: str = ""  # the known-divergence entry (oracles/ledger.py) this case is filed under, if any
    # repeat properties (oracles.hunt): calls made on bitwise-identical inputs, and how many
    # bitwise-distinct results they gave (0, 0 for a single comparison)
    calls: int = 0
    distinct: int = 0
    # elements over the budget (NaN/Inf disagreements included) and of how many: a failure that
    # is one element and one that is every element read differently
    over_budget: int = 0
    numel: int = 0
    # the storage roundings the output carries, estimated (oracles/metrics.roundings_of: its squared error over
    # the expected squared error of one rounding of the oracle's value, in bf16 units or the output's coarser)
    roundings: float = math.nan
    # the pytest node id of the test that made the record (set by the session collector): what reruns it
    node: str = ""
    extra: dict[str, object] = field(default_factory=dict)

    def row(self) -> dict[str, object]:
        d = asdict(self)
        d.pop("extra")
        return d


def judge(
    *,
    property: str,
    engine: object,
    subject: str,
    actual: torch.Tensor,
    reference: torch.Tensor,
    budget: Budget,
    seed: int,
    reduction_len: int = 0,
    detail: str = "",
    verdict: str | None = None,
) -> Record:
    """Compare actual (the subject's output, any dtype) with reference (float64) against budget.

    `engine` is an engines.base.Engine (duck-typed to keep oracles free of engine imports).
    The verdict is `fail` on any NaN/Inf disagreement or max_abs > budget; pass `verdict=INFO`
    for a measurement that is reported but not judged.
    """
    m = compare(actual, reference, over=budget.value)
    if budget.value > 0:
        ratio = m.max_abs / budget.value
    else:
        ratio = 0.0 if m.max_abs == 0 else math.inf
    if verdict is None:
        verdict = PASS if m.nonfinite_mismatch == 0 and m.max_abs <= budget.value else FAIL
    sha = getattr(engine, "source_sha256", {}).get(subject, "")
    return Record(
        property=property,
        engine=getattr(engine, "name"),
        engine_version=getattr(engine, "version"),
        mode=getattr(engine, "mode"),
        real_ops=getattr(engine, "real_ops", ""),
        source_sha256=sha,
        subject=subject,
        device=str(actual.device),
        dtype=str(actual.dtype).replace("torch.", ""),
        shape="x".join(map(str, actual.shape)),
        reduction_len=reduction_len,
        seed=seed,
        max_abs=m.max_abs,
        rel_fro=m.rel_fro,
        max_ulp=m.max_ulp,
        cosine=m.cosine,
        nonfinite_mismatch=m.nonfinite_mismatch,
        worst=";".join(",".join(map(str, w)) for w in m.worst),
        baseline_err=budget.baseline_err,
        budget=budget.value,
        budget_rule=budget.rule,
        ratio=ratio,
        verdict=verdict,
        detail=detail,
        over_budget=m.over,
        numel=m.numel,
        roundings=m.roundings,
        extra={"actual": actual, "reference": reference} if _KEEP_TENSORS.get() else {},
    )


def not_run(*, property: str, engine: str, node: str, why: str) -> Record:
    """The record of a test that was not run (verdict NOT_RUN): which, on what engine, and why."""
    nan = math.nan
    return Record(property=property, engine=engine, engine_version="", mode="", real_ops="", source_sha256="",
                  subject="", device="", dtype="", shape="", reduction_len=0, seed=0, max_abs=nan, rel_fro=nan,
                  max_ulp=nan, cosine=nan, nonfinite_mismatch=0, worst="", baseline_err=nan, budget=nan,
                  budget_rule="", ratio=nan, verdict=NOT_RUN, detail=why[:400], node=node)


def known_case(*, property: str, engine: Any, ledger: str, node: str, why: str) -> Record:
    """The record of a failing case inside ledger entry `ledger`'s rule (verdict KNOWN): a test that judges by
    an exact contract or a refusal leaves no metric record of its own, and the run must still show that the
    entry was exercised and still fails."""
    nan = math.nan
    return Record(property=property, engine=engine.name, engine_version=engine.version, mode=engine.mode,
                  real_ops=engine.real_ops, source_sha256="", subject="", device="", dtype="", shape="",
                  reduction_len=0, seed=0, max_abs=nan, rel_fro=nan, max_ulp=nan, cosine=nan, nonfinite_mismatch=0,
                  worst="", baseline_err=nan, budget=nan, budget_rule="", ratio=nan, verdict=KNOWN,
                  detail=why[:400], ledger=ledger, node=node)


def failure_message(r: Record) -> str:
    # a rule with no baseline says so by leaving baseline_err NaN: the message then names none
    baseline = f"; baseline err {r.baseline_err:.3e}" if math.isfinite(r.baseline_err) else ""
    corrupt = ("" if math.isfinite(r.budget) else
               " (the budget is not finite: the oracle's reference or the budget's inputs hold NaN/Inf; a kernel "
               "under test may have written over the harness's state)")
    return (
        f"{r.property} [{r.engine} {r.engine_version}, {r.mode}] {r.subject} {r.dtype} {r.shape} seed={r.seed}: "
        f"{r.over_budget} of {r.numel} elements over budget ({_fraction(r.over_budget, r.numel)}); "
        f"max_abs {r.max_abs:.3e} vs budget {r.budget:.3e}{corrupt} ({r.budget_rule}{baseline}); ratio {r.ratio:.2f}; "
        f"rel_fro {r.rel_fro:.3e}; max_ulp {r.max_ulp:.1f}; "
        f"cosine {r.cosine:.6f}; NaN/Inf mismatches {r.nonfinite_mismatch}; worst at {r.worst or '-'}"
        + (f"; {r.detail}" if r.detail else "")
    )


def _fraction(k: int, n: int) -> str:
    return f"{100.0 * k / n:.3g}%" if n else "-"
