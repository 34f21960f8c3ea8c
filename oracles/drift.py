"""The drift collector: every Record of a run, written to CSV with pandas.

A run's `DriftCollector` belongs to the run: the pytest plugin (k3num.harness.plugin) keeps it in its
config's stash and scopes it over each test (`collecting`, a context variable); `current()` is the one
scoped now (None outside a run). `COLLECTOR` is a stateless view of it for the code that adds records
inside a test (`COLLECTOR.add(record)`, `COLLECTOR.node`): it holds nothing itself. The plugin writes the
CSV (atomically: a temporary file in the target folder, then os.replace) after each test and when the
session ends, and prints the worst err/budget ratio per engine and subject. Schema: the fields of
oracles.records.Record, in order (documented in properties/README.md).
"""

from __future__ import annotations

import contextlib
import contextvars
import math
import os
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import fields, replace
from pathlib import Path

import pandas as pd

from k3num.oracles.records import FAIL, UNJUDGED, Record

COLUMNS = [f.name for f in fields(Record) if f.name != "extra"]
# the text columns (an empty one reads back as "", not as a float NaN)
TEXT_COLUMNS = [f.name for f in fields(Record) if f.name != "extra" and f.type in ("str", str)]


def read_csv(path: str | os.PathLike[str]) -> pd.DataFrame:
    """A drift CSV read back with its text columns as text ("" where empty) and the numbers as numbers."""
    df = pd.read_csv(path, dtype={c: str for c in TEXT_COLUMNS}, keep_default_na=False,
                     na_values={c: ["", "nan", "NaN"] for c in COLUMNS if c not in TEXT_COLUMNS})
    return df


class DriftCollector:
    def __init__(self) -> None:
        self.records: list[Record] = []
        self.ledger = ""  # set by the pytest plugin (k3num.harness.plugin) while a ledger-listed case runs
        self.node = ""  # the running test's node id, set by the pytest plugin (k3num.harness.plugin)

    def add(self, record: Record) -> Record:
        if self.ledger and not record.ledger:
            record = replace(record, ledger=self.ledger)
        if self.node and not record.node:
            record = replace(record, node=self.node)
        self.records.append(record)
        return record

    def frame(self) -> pd.DataFrame:
        return pd.DataFrame([r.row() for r in self.records], columns=COLUMNS)

    def write_csv(self, path: str | os.PathLike[str]) -> Path:
        return self.write_frame(self.frame(), path)

    @staticmethod
    def write_frame(df: pd.DataFrame, path: str | os.PathLike[str]) -> Path:
        """Write df to path atomically (a temporary file beside it, then os.replace), readable by all."""
        target = Path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
        try:
            with os.fdopen(fd, "w", newline="") as fh:
                df.to_csv(fh, index=False)
            umask = os.umask(0)
            os.umask(umask)
            os.chmod(tmp, 0o666 & ~umask)  # mkstemp's 0600 would hide the report from CI artifact readers
            os.replace(tmp, target)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        return target

    def summary(self) -> pd.DataFrame:
        """Worst ratio per (engine, subject): `summarize` of this session's records."""
        return summarize(self.frame())


SM100_NOTE = ("vllm attn_res rows: the Triton kernel; at hidden 7168 on SM100 vLLM runs the native "
              "ops.kimi_k3_attn_res (not covered)")


def covers_vllm_attn_res(df: pd.DataFrame) -> bool:
    """Whether a table holds vLLM attn_res rows (which then carry SM100_NOTE)."""
    return bool(((df["engine"] == "vllm") & (df["subject"] == "attn_res")).any())


def summarize(df: pd.DataFrame, keys: Sequence[str] = ("engine", "subject")) -> pd.DataFrame:
    """Worst ratio per group of judged records (verdict not info or not-run), with the record count, failures,
    and failures filed in the known-divergence ledger (counted apart); with the worst group's
    property when `keys` does not hold it. `worst_ratio` and `worst_property` are over the records no ledger
    entry files (a known divergence is out of budget by what it is: issue 41 saw vllm-rocm's aux tap at 1.19e+03
    next to 0 failures); `worst_known_ratio` is the ledger-filed records' (NaN where there are none);
    `median_roundings` the median rounding count (oracles/metrics.roundings_of) of the records no entry files."""
    if df.empty:
        return df
    judged = df[~df["verdict"].isin(UNJUDGED)]
    if judged.empty:
        return judged
    keys = list(keys)
    known = judged["ledger"].fillna("") != ""
    judged = judged.assign(_fail=(judged["verdict"] == FAIL) & ~known, _known=(judged["verdict"] == FAIL) & known,
                           _plain=judged["ratio"].where(~known), _filed=judged["ratio"].where(known))
    if "roundings" not in judged:
        judged = judged.assign(roundings=math.nan)
    judged = judged.assign(_rounds=pd.to_numeric(judged["roundings"], errors="coerce").where(~known))
    out = judged.groupby(keys, sort=True).agg(
        records=("ratio", "size"), worst_ratio=("_plain", "max"), median_rel_fro=("rel_fro", "median"),
        median_roundings=("_rounds", "median"), failures=("_fail", "sum"), known_divergences=("_known", "sum"),
        worst_known_ratio=("_filed", "max")).reset_index()
    if "property" in keys:
        return out
    plain = judged[~known]
    if plain.empty:
        return out.assign(worst_property="")
    worst_prop = plain.loc[plain.groupby(keys, sort=True)["ratio"].idxmax(), [*keys, "property"]]
    return out.merge(worst_prop.rename(columns={"property": "worst_property"}), on=keys, how="left").fillna(
        {"worst_property": ""})


_CURRENT: contextvars.ContextVar[DriftCollector | None] = contextvars.ContextVar("k3num_drift", default=None)


def current() -> DriftCollector | None:
    """The collector scoped over the running code (`collecting`), None outside a run."""
    return _CURRENT.get()


@contextlib.contextmanager
def collecting(collector: DriftCollector) -> Iterator[DriftCollector]:
    """Within the block, `current()` (and COLLECTOR) is `collector`."""
    token = _CURRENT.set(collector)
    try:
        yield collector
    finally:
        _CURRENT.reset(token)


class _Scoped:
    """COLLECTOR: the scoped collector's records, tags and `add`, read through; it keeps no state."""

    @staticmethod
    def _c() -> DriftCollector:
        c = _CURRENT.get()
        if c is None:
            raise RuntimeError("no drift collector: records are collected inside a k3num pytest run (the plugin "
                               "scopes its collector over each test) or inside drift.collecting(...)")
        return c

    def add(self, record: Record) -> Record:
        return self._c().add(record)

    @property
    def records(self) -> list[Record]:
        return self._c().records

    @property
    def node(self) -> str:
        return self._c().node

    @node.setter
    def node(self, value: str) -> None:
        self._c().node = value

    @property
    def ledger(self) -> str:
        return self._c().ledger

    @ledger.setter
    def ledger(self, value: str) -> None:
        self._c().ledger = value


COLLECTOR = _Scoped()
