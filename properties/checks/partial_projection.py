"""Checks shared by properties/test_partial_projection.py and the property modules that reuse them: no test module
imports another, so they live here (moved from test_partial_projection.py with their bodies unchanged; a name
another module uses is public)."""

from __future__ import annotations

import torch

from k3num.engines import base
from k3num.engines.mirror import projection as eager
from k3num.fixtures.builders import ProjectionInputs, projection_inputs
from k3num.fixtures.strategies import ProjectionCase
from k3num.harness import judges
from k3num.harness.judges import EPS
from k3num.oracles import budgets
from k3num.oracles.records import judge
from k3num.properties.support import LOW, call, report, subject, up

TRANSFER = {"bf16": torch.bfloat16, "fp32": torch.float32}


def sharded_call(engine, inp: ProjectionInputs, case: ProjectionCase, transfer: torch.dtype
             ) -> tuple[list[torch.Tensor], torch.Tensor]:
    partial = subject(engine, base.STAGE_PARTIAL)
    finalize = subject(engine, base.FINALIZE_PROJECTION)
    partials = [call(engine, partial, inp.taps, inp.fc, list(members)) for members in case.stages]
    return partials, call(engine, finalize, partials, inp.norm, EPS, transfer, list(case.order))


def _tap_products(inp: ProjectionInputs) -> list[torch.Tensor]:
    """p_i = taps[i] @ fc[:, block i]^T in float64, [N, H_out] each: the exact per-tap projections."""
    h = inp.taps.shape[2]
    return [up(inp.taps[i]) @ up(inp.fc[:, i * h : (i + 1) * h]).T for i in range(inp.taps.shape[0])]


def declared_rounding_terms(engine, products: list[torch.Tensor], acc_max: torch.Tensor
                            ) -> tuple[torch.Tensor | float, str]:
    """Pre-norm error terms [N, H_out] of roundings an engine declares inside its sharded path
    (extras["projection_roundings"]) that the stage partials it returns do not show:
    - "tap": each tap's projection p_i is rounded to that dtype before it is summed:
      u_tap * sum_i |p_i| (`products`: the exact p_i), which exceeds u * |sum| when the taps cancel;
    - "tap_accumulate": those are summed in that dtype inside the stage: gamma_K(u_acc) * sum_i |p_i|;
    - "pre_norm": the full sum is rounded to that dtype before the norm: u_pre * max|acc|."""
    declared = engine.extras.get("projection_roundings", {})
    if not declared:
        return 0.0, ""
    per_tap = sum(p.abs() for p in products)
    term: torch.Tensor | float = 0.0
    rule = ""
    if "tap" in declared:
        term = term + budgets.unit_roundoff(declared["tap"]) * per_tap
        rule += f"+u({declared['tap']})*sum|p_i|"
    if "tap_accumulate" in declared:
        term = term + budgets.gamma(len(products), budgets.unit_roundoff(declared["tap_accumulate"])) * per_tap
        rule += f"+gamma_K(u({declared['tap_accumulate']}))*sum|p_i|"
    if "pre_norm" in declared:
        term = term + budgets.unit_roundoff(declared["pre_norm"]) * acc_max
        rule += f"+u({declared['pre_norm']})*max|acc|"
    return term, rule.replace("torch.", "")


def check_sharded_within_budget_of_unsharded(engine, case: ProjectionCase, transfer: str, device: str,
                                             inp: ProjectionInputs | None = None, *, count_declared: bool = True,
                                             prop: str = "sharded_within_budget_of_unsharded") -> None:
    """The sharded projection (every stage's partial, summed in `case.order` in the transfer dtype,
    normed once) against the oracle, under the unsharded baseline's error plus what sharding adds
    (plus, with count_declared, the roundings the engine declares inside its path).
    `inp` replaces the seeded inputs of `case` (adversarial or hand-built inputs)."""
    inp = projection_inputs(case, LOW, device) if inp is None else inp
    partials, got = sharded_call(engine, inp, case, TRANSFER[transfer])
    baseline = eager.project_unsharded(inp.taps, inp.fc, inp.norm, EPS)
    want = judges.projection_oracle(inp.taps, inp.fc, inp.norm, EPS)
    base_err = (up(baseline) - want).abs().max().item()
    # What sharding adds by construction (a derived term on top of rule 1): each of the S partials is
    # rounded to its dtype (u_p |p_s|) and the S additions in the transfer dtype each round the running
    # sum (recursive summation, gamma_S(u_t) max|acc|); an error e in the pre-norm sum moves the normed
    # output by <= 2 e * gain (once directly, once through the row's rms).
    u_p = budgets.unit_roundoff(partials[0].dtype)
    u_t = budgets.unit_roundoff(TRANSFER[transfer])
    acc = torch.zeros_like(up(partials[0]))
    acc_max = torch.zeros_like(acc)
    for s in case.order:
        acc = acc + up(partials[s])
        acc_max = torch.maximum(acc_max, acc.abs())
    pre = u_p * sum(up(p).abs() for p in partials) + budgets.gamma(len(case.order), u_t) * acc_max  # [N, H_out]
    # plus the roundings the engine declares inside its path that the returned partials do not show
    products = _tap_products(inp)  # once: the gain's exact sum and the declared per-tap terms
    more, more_rule = declared_rounding_terms(engine, products, acc_max) if count_declared else (0.0, "")
    extra = (2 * (pre + more) * judges.row_gain(inp.taps, inp.fc, inp.norm, sum(products))).max().item()
    budget = budgets.baseline_rule(base_err, want.abs().max().item(), LOW, extra=extra,
                                   extra_rule=f"2*gain*(u_p*sum|p_s|+gamma_S(u_t)*max|acc|{more_rule})")
    report(judge(property=prop, engine=engine, subject=base.FINALIZE_PROJECTION,
                 actual=got, reference=want, budget=budget, seed=case.seed, reduction_len=case.reduction_len,
                 detail=f"transfer={transfer};stages={len(case.stages)};order={list(case.order)}"))
