"""The live properties' most expensive judgments, against a golden set's stored float64 outputs
(`--golden DIR`, written by `k3num golden write`; fixtures/golden.py) instead of the live oracle.

Each stored case is one test (its id is the case file). Same budgets as the live properties:
attn_res under `mixture_budget` (properties/test_attn_res.py), the fused context KV under the
baseline rule against the eager unfused path (computed live: it is bf16 and cheap). Without
`--golden` these skip, saying so. A set's stored outputs assume round-to-nearest storage: an
engine whose platform rounds otherwise (the Triton interpreter truncates) skips naming that.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from k3num.engines import base
from k3num.engines.mirror import context_kv as eager
from k3num.fixtures import golden
from k3num.harness import run
from k3num.harness.judges import EPS, OUT_EPS, mixture_budget
from k3num.oracles import budgets
from k3num.oracles.records import judge
from k3num.properties.support import DEVICE, LOW, report, subject, up
from k3num.refmodel import geometry


def _params(kind: str) -> list:
    root = run.current().golden
    skip = pytest.mark.skip(reason="no golden set: pass --golden DIR (a set written by `k3num golden write`)")
    if not root:
        return [pytest.param(None, None, marks=skip, id="no-golden-set")]
    manifest = golden.load_manifest(Path(root))  # verified again at collection (conftest refused a bad one)
    if manifest["kind"] != kind:
        why = f"the golden set {root} holds {manifest['kind']} cases ({manifest['preset']}), not {kind}"
        return [pytest.param(None, None, marks=pytest.mark.skip(reason=why), id="other-kind")]
    return [pytest.param(manifest["preset"], case, id=name) for name, case in golden.cases(Path(root))]


def _same_rounding(engine) -> None:
    if engine.rounding != "nearest":
        pytest.skip(f"{engine.name} rounds storage {engine.rounding} ({engine.mode}); the golden set's outputs assume "
                    "round-to-nearest: judge this engine live")


@pytest.mark.parametrize("preset, case", _params("attn_res"))
def test_golden_attn_res_within_rounding_budget_of_stored_oracle(engine, preset: str, case: golden.GoldenCase) -> None:
    fn = subject(engine, base.ATTN_RES)
    _same_rounding(engine)
    p = case.params
    i = {k: v.to(DEVICE) for k, v in case.inputs.items()}
    prefix, blocks = i["prefix"].clone(), i["blocks"].clone()
    out = fn(prefix, i.get("delta"), blocks, i["norm"], i["qk"], i.get("out_norm"), p["num_blocks"],
             p["block_write_idx"], EPS, OUT_EPS)
    want = case.outputs["want"].to(out.device)
    sources = torch.cat([case.outputs["new_blocks"][:, : p["num_blocks"]], case.outputs["new_prefix"][:, None]], 1)
    q = up(case.inputs["norm"]) * up(case.inputs["qk"])
    budget = mixture_budget(case.outputs["want"], sources, q, p["hidden"], engine.rounding)
    if p["with_output_norm"]:
        budget = budgets.with_output_norm(budget, LOW)
    report(judge(property="golden_attn_res_within_rounding_budget", engine=engine, subject=base.ATTN_RES, actual=out,
                 reference=want, budget=budget, seed=p["seed"], reduction_len=p["hidden"] * (p["num_blocks"] + 1),
                 detail=f"golden={preset};nb={p['num_blocks']};write={p['block_write_idx']}"), climb=False)


@pytest.mark.parametrize("preset, case", _params("context_kv"))
def test_golden_fused_context_kv_within_budget_of_unfused_baseline(engine, preset: str,
                                                                   case: golden.GoldenCase) -> None:
    fused = subject(engine, base.CONTEXT_KV_FUSED)
    _same_rounding(engine)
    g = geometry.preset(preset)
    assert isinstance(g, geometry.MLADraftGeometry)
    i = {k: v.to(DEVICE) for k, v in case.inputs.items()}
    kv_c, k_pe = fused(i["x"], i["kv_a"], i["norm"], i["positions"], g.rope, 1e-5)
    fused_w = golden.fused_qkv_a(case).to(DEVICE)
    b_c, b_pe = eager.context_kv_unfused(i["x"], fused_w, i["norm"], i["positions"], g.rope, 1e-5)
    for name, out, base_out in (("kv_c", kv_c, b_c), ("k_pe", k_pe, b_pe)):
        ref = case.outputs[name].to(out.device)
        budget = budgets.baseline_rule((up(base_out) - ref).abs().max().item(), ref.abs().max().item(), LOW)
        report(judge(property="golden_fused_within_budget_of_unfused", engine=engine, subject=base.CONTEXT_KV_FUSED,
                     actual=out, reference=ref, budget=budget, seed=case.params["seed"],
                     reduction_len=case.params["hidden"], detail=f"golden={preset};{name}"), climb=False)
