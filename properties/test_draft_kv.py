"""Properties of the DFlash draft context K/V (the follow-on of the projected taps)."""

from __future__ import annotations

from hypothesis import given

from k3num.engines import base
from k3num.fixtures.builders import draft_kv_inputs
from k3num.fixtures.strategies import DraftKVCase, draft_kv_cases
from k3num.oracles import budgets
from k3num.oracles.records import judge
from k3num.properties.support import DEVICE, LOW, report, subject, up
from k3num.refmodel import partial_projection as ref
from k3num.refmodel import rope

EPS = 1e-5


@given(case=draft_kv_cases())
def test_draft_context_kv_within_rounding_budget_of_oracle(engine, case: DraftKVCase) -> None:
    check_draft_kv_within_rounding_budget(engine, case, DEVICE)


def check_draft_kv_within_rounding_budget(engine, case: DraftKVCase, device: str) -> None:
    """Draft context K (norm + rope) and V of every layer against the oracle, each within its budget."""
    draft = subject(engine, base.DRAFT_CONTEXT_KV)
    inp = draft_kv_inputs(case, LOW, device)
    k, v = draft(inp.ctx, inp.k_weight, inp.v_weight, inp.k_norm, inp.positions, case.rope, EPS)
    want_k, want_v = ref.draft_context_kv(up(inp.ctx), up(inp.k_weight), up(inp.v_weight), up(inp.k_norm),
                                          inp.positions, case.rope, EPS)
    absdot = max((up(inp.ctx).abs() @ up(w).abs().transpose(1, 2)).max().item() for w in (inp.k_weight, inp.v_weight))
    theta = float(inp.positions.max()) * float(rope.inv_freq(case.rope).max())
    kn = up(inp.k_norm).abs().max().item()
    pre_k = (up(inp.ctx) @ up(inp.k_weight).transpose(1, 2)).unflatten(-1, (case.kv_heads, case.head_dim))
    gain = kn / max(pre_k.square().mean(-1).sqrt().min().item(), 1e-300)
    acc = budgets.probabilistic(case.hidden, budgets.U32) * absdot
    # V: the GEMM output rounding (1). K: GEMM rounding (1), the rms of rounded values (1), the norm's
    # output rounding (1), carried through the rotation (a pair's error norm is preserved, so an
    # element's error is <= sqrt(2) times 3u: 5), plus the output rounding (1) -> 6, plus the fp32
    # accumulation through the norm's gain and the fp32 angle error of the rope cache.
    for name, out, want, roundings, term in (
        ("k", k, want_k, 6, 2 * acc * gain + budgets.fp32_angle_rope_rtol(theta) * want_k.abs().max().item()),
        ("v", v, want_v, 1, acc),
    ):
        budget = budgets.theory_rule(want.abs().max().item(), LOW, roundings, acc_term=term,
                                     acc_rule="fp32 acc+angle")
        report(judge(property="draft_kv_within_rounding_budget", engine=engine, subject=base.DRAFT_CONTEXT_KV,
                     actual=out, reference=want, budget=budget, seed=case.seed, reduction_len=case.hidden,
                     detail=name))
