"""Checks shared by properties/test_quantized_loading.py and the property modules that reuse them: no test module
imports another, so they live here (moved from test_quantized_loading.py with their bodies unchanged; a name
another module uses is public)."""

from __future__ import annotations

import math

from k3num.oracles.drift import COLLECTOR
from k3num.oracles.records import INFO, Record


def refused(engine, detail: str, e: BaseException) -> None:
    COLLECTOR.add(Record(
        property="quantized_load_refused", engine=engine.name, engine_version=engine.version, mode=engine.mode,
        real_ops="", source_sha256="", subject="block_fp8_loading", device="cpu", dtype="float8_e4m3fn", shape="",
        reduction_len=0, seed=0, max_abs=math.nan, rel_fro=math.nan, max_ulp=math.nan, cosine=math.nan,
        nonfinite_mismatch=0, worst="", baseline_err=math.nan, budget=math.nan, budget_rule="a refusal", ratio=0.0,
        verdict=INFO, detail=f"{detail};{type(e).__name__}: {e}"[:400]))
