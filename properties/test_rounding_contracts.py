"""Rounding contracts (issue 38): where an engine's code states where it rounds, its output is held to exactly
those roundings. The engine's output is compared with the float64 result of the same computation with those
roundings applied at those points, within the budget of what remains (float32 accumulation; a rounding whose
input lies within that accumulation error of a bf16 boundary may go either way), so one more bf16 rounding
anywhere fails by orders of magnitude where a worst-case budget (the accuracy properties', a quarter used on a
typical case) hides it in its margin.

    engine      subject                    contract, and the source lines it comes from
    tokenspeed  stage_partial              sum_i bf16(h_i W_i^T) in float32: project_target_tap returns
                                           `linear(hidden.to(weight.dtype), weight)` (one bf16 rounding per tap);
                                           add_capture: "float32 accumulation avoids rounding between taps"
                finalize_projection        bf16(sum of the partials) then the norm in float32, rounded once:
                                           finalize_target_projection `projected.to(self.context_norm.weight.dtype)`

K3N-006 owns the per-tap rounding (it is a known divergence where taps cancel): the contract includes it and
still fails on any other. The contract's arithmetic is the entry's bug model (harness/ledger_models.py): one
statement of what TokenSpeed computes, for the ledger and for this property. A contract whose source line is
gone (a changed release) is a contract error naming the line it expected, before any example runs.
"""

from __future__ import annotations

import re

import pytest
from hypothesis import given

from k3num.engines import base
from k3num.fixtures.builders import projection_inputs
from k3num.fixtures.strategies import ProjectionCase, projection_cases
from k3num.harness import ledger_models
from k3num.harness.judges import EPS
from k3num.properties.checks.partial_projection import TRANSFER
from k3num.properties.checks.partial_projection import sharded_call as _sharded
from k3num.properties.support import DEVICE, LOW

TOKENSPEED_MODEL = "tokenspeed/runtime/models/kimi_k3_dspark.py"
TOKENSPEED_CONTEXT = "tokenspeed/runtime/execution/dspark_context.py"
# engine -> the lines (file, regex) its contract comes from; each must be in the engine's file as read
CONTRACT_LINES: dict[str, tuple[tuple[str, str], ...]] = {
    "tokenspeed": (
        (TOKENSPEED_MODEL, r"return torch\.nn\.functional\.linear\(hidden\.to\(weight\.dtype\), weight\)"),
        (TOKENSPEED_CONTEXT, r"float32 accumulation avoids rounding between taps"),
        (TOKENSPEED_CONTEXT, r"projected\.\w+\(.*self\.model\.project_target_tap\(capture_idx, hidden\)"),
        (TOKENSPEED_MODEL, r"return self\.context_norm\(projected\.to\(self\.context_norm\.weight\.dtype\)\)"),
    ),
}


class ContractError(AssertionError):
    """A contract names a rounding point the engine's file does not have."""


def contract_lines_missing(root, lines: tuple[tuple[str, str], ...]) -> list[str]:
    """The contract lines not found in the tree at `root` (a pathlib.Path), one message each."""
    out = []
    for rel, pattern in lines:
        path = root / rel
        text = path.read_text() if path.is_file() else ""
        if not re.search(pattern, text):
            out.append(f"contract error: {rel}: expected a line matching /{pattern}/ (the rounding point the contract "
                       "names); the file changed: restate the contract for this release")
    return out


def contract(engine) -> tuple[tuple[str, str], ...]:
    """The engine's contract lines, checked against its files as read (a skip where it states none)."""
    from k3num.harness import run

    lines = CONTRACT_LINES.get(engine.name)
    if lines is None:
        pytest.skip(f"{engine.name} states no rounding contract for its sharded projection (properties/"
                    "test_rounding_contracts.py CONTRACT_LINES)")
    missing = contract_lines_missing(run.current().source(engine.name.split("-")[0]).root, lines)
    if missing:
        raise ContractError("; ".join(missing))
    return lines


@given(case=projection_cases(min_taps=2))
def test_sharded_projection_rounds_only_where_its_code_says(engine, case: ProjectionCase) -> None:
    contract(engine)
    inp = projection_inputs(case, LOW, DEVICE)
    partials, got = _sharded(engine, inp, case, TRANSFER["fp32"])
    calls = [ledger_models.Call(base.STAGE_PARTIAL, (inp.taps, inp.fc, list(m)), {}, p)
             for m, p in zip(case.stages, partials)]
    calls.append(ledger_models.Call(base.FINALIZE_PROJECTION, (partials, inp.norm, EPS, None, list(case.order)), {},
                                    got))
    why = ledger_models.tap_projections_rounded_to_bf16(calls)
    assert not why, (f"{engine.name} {engine.version} {case}: the sharded projection rounds where its code does not "
                     f"say it does: {why}")
