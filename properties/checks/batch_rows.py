"""Batch composition of the row-independent subjects other than attn_res (properties/test_batch_composition.py):
each subject's call on chosen rows of one drawn batch, and the check that a row alone, at another position and
inside its batch gives the same bits (or stays within the stated bound where the engine declares otherwise).

A subject's rows are independent in exact arithmetic when row i of every output depends only on row i of the
row-indexed inputs (the token's states, its position, its cache slot). For those, `RowCall.call(index)` makes
the subject's call on the rows `index` of the drawn batch (fresh inputs, a fresh copy of any cache it writes)
and returns each output with its row dimension first:

    context_kv_fused    kv_c [n, L, kv_lora], k_pe [n, L, rope], cache [n, L, W(+pad)] (the rows at its slots)
    context_kv_unfused  kv_c [n, L, kv_lora], k_pe [n, L, rope]
    draft_context_kv    k, v [n, L, KVH, D]
    stage_partial       partial [n, H_out] (of each stage's taps)
    finalize_projection ctx [n, H_out] (the batch's own partials, row-indexed)
    project_unsharded   ctx [n, H_out]
    attn_res_mix*       mixture [n, H]
    attn_res_residual   mixture [n, H] (normed)
    aux_capture         tap [n, H] (branch 1: a later layer of the stage mixes with the next layer's weights)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from k3num.engines import base
from k3num.fixtures.builders import (
    context_kv_inputs,
    draft_kv_inputs,
    paged_caches,
    projection_inputs,
    tap_inputs,
    upcast_weights,
)
from k3num.fixtures.tensors import Draw
from k3num.harness import judges, oracle
from k3num.harness.judges import EPS
from k3num.oracles import budgets as rules
from k3num.oracles.budgets import Budget
from k3num.oracles.records import judge
from k3num.properties.checks.partial_projection import _tap_products
from k3num.properties.support import LOW, call, report, up
from k3num.refmodel import attn_res as ref

Outputs = dict[str, torch.Tensor]


@dataclasses.dataclass(frozen=True)
class RowCall:
    """One drawn batch of a subject: `call(index [n])` -> output name -> [n, ...]; `budgets()` -> output name ->
    the accuracy budget of the whole batch's call against the oracle (only read where the engine declares its
    rows batch-variant); `tokens` rows, `reduction_len` for the record."""
    call: Callable[[torch.Tensor], Outputs]
    budgets: Callable[[], dict[str, Budget]]
    tokens: int
    reduction_len: int
    seed: int
    detail: str


def _context_kv_fused(engine, fn, case, device: str) -> RowCall:
    inp = context_kv_inputs(case, LOW, device)
    gen = torch.Generator().manual_seed(case.seed)
    layout = ("stacked", "scattered")[case.seed % 2]
    caches, buf = paged_caches(case.num_layers, -(-2 * case.tokens // 4), 4, case.width, layout, gen, LOW, device)
    slots = torch.randperm(buf.shape[1] * 4, generator=gen)[: case.tokens].to(device)
    flat = buf.shape[0], buf.shape[1] * buf.shape[2], buf.shape[3]

    def rows(index: torch.Tensor) -> Outputs:
        fresh = buf.clone()
        if layout == "stacked":
            c: Any = fresh
        else:  # the same views of the fresh buffer as the template's (layer l lives at buf[offset // one layer])
            c = [fresh[t.storage_offset() // buf[0].numel(), :, :, :case.width] for t in caches]
        kv_c, k_pe = call(engine, fn, inp.x[index].clone(), inp.kv_a, inp.norm, inp.positions[index].clone(),
                          case.rope, EPS, c, slots[index].clone())
        return {"kv_c": kv_c.transpose(0, 1), "k_pe": k_pe.transpose(0, 1),
                "cache": fresh.view(flat)[:, slots[index]].transpose(0, 1)}

    def budgets() -> dict[str, Budget]:
        got = judges._fused_call(engine, base.CONTEXT_KV_FUSED, [inp.x, inp.kv_a, inp.norm, inp.positions,
                                                                 case.rope, EPS], {}, f"q_lora={case.q_lora}")
        kv_c, k_pe = got["result.0"].budget, got["result.1"].budget
        return {"kv_c": kv_c, "k_pe": k_pe, "cache": max(kv_c, k_pe, key=lambda b: b.value)}

    return RowCall(rows, budgets, case.tokens, case.hidden, case.seed,
                   f"layers={case.num_layers};hidden={case.hidden};layout={layout}")


def _context_kv_unfused(engine, fn, case, device: str) -> RowCall:
    inp = context_kv_inputs(case, LOW, device)

    def rows(index: torch.Tensor) -> Outputs:
        kv_c, k_pe = call(engine, fn, inp.x[index].clone(), inp.fused_qkv_a, inp.norm, inp.positions[index].clone(),
                          case.rope, EPS)
        return {"kv_c": kv_c.transpose(0, 1), "k_pe": k_pe.transpose(0, 1)}

    def budgets() -> dict[str, Budget]:
        got = judges._unfused_call(engine, base.CONTEXT_KV_UNFUSED,
                                   [inp.x, inp.fused_qkv_a, inp.norm, inp.positions, case.rope, EPS], {}, "")
        return {"kv_c": got["result.0"].budget, "k_pe": got["result.1"].budget}

    return RowCall(rows, budgets, case.tokens, case.hidden, case.seed,
                   f"layers={case.num_layers};hidden={case.hidden}")


def _draft_context_kv(engine, fn, case, device: str) -> RowCall:
    inp = draft_kv_inputs(case, LOW, device)

    def rows(index: torch.Tensor) -> Outputs:
        k, v = call(engine, fn, inp.ctx[index].clone(), inp.k_weight, inp.v_weight, inp.k_norm,
                    inp.positions[index].clone(), case.rope, EPS)
        return {"k": k.transpose(0, 1), "v": v.transpose(0, 1)}

    def budgets() -> dict[str, Budget]:
        got = judges._draft_call(engine, base.DRAFT_CONTEXT_KV, [inp.ctx, inp.k_weight, inp.v_weight, inp.k_norm,
                                                                 inp.positions, case.rope, EPS], {}, "")
        return {"k": got["result.0"].budget, "v": got["result.1"].budget}

    return RowCall(rows, budgets, case.tokens, case.hidden, case.seed,
                   f"layers={case.num_layers};kv_heads={case.kv_heads};head_dim={case.head_dim}")


def _projection(name: str) -> Callable[..., RowCall]:
    def make(engine, fn, case, device: str) -> RowCall:
        inp = projection_inputs(case, LOW, device)
        partial = engine.subject(base.STAGE_PARTIAL) if name == base.FINALIZE_PROJECTION else None
        partials = ([call(engine, partial, inp.taps, inp.fc, list(m)) for m in case.stages]
                    if partial is not None else [])

        def rows(index: torch.Tensor) -> Outputs:
            taps = inp.taps[:, index].clone()
            if name == base.PROJECT_UNSHARDED:
                return {"ctx": call(engine, fn, taps, inp.fc, inp.norm, EPS)}
            if name == base.STAGE_PARTIAL:
                return {f"partial{s}": call(engine, fn, taps, inp.fc, list(m)) for s, m in enumerate(case.stages)}
            return {"ctx": call(engine, fn, [p[index].clone() for p in partials], inp.norm, EPS, torch.float32,
                                list(case.order))}

        def budgets() -> dict[str, Budget]:
            want = judges.unsharded_projection(inp.taps, inp.fc, inp.norm, EPS)
            if name != base.STAGE_PARTIAL:
                return {"ctx": want.budget}
            # a stage's partial is its taps' share of the pre-norm sum: the float32 accumulation of its K_s * H
            # products, rounded once to the partial's dtype
            out: dict[str, Budget] = {}
            products = _tap_products(inp)  # the exact per-tap projections
            h = inp.taps.shape[2]
            for s, m in enumerate(case.stages):
                exact = sum((products[i] for i in m), torch.zeros_like(products[0]))
                mags = sum((up(inp.taps[i]).abs() @ up(inp.fc[:, i * h:(i + 1) * h]).abs().T for i in m),
                           torch.zeros_like(exact))
                acc = rules.gamma(max(1, len(m) * h), rules.unit_roundoff(torch.float32)) * float(mags.max())
                out[f"partial{s}"] = rules.theory_rule(float(exact.abs().max()), LOW, 1, acc_term=acc,
                                                       acc_rule="gamma_KH(fp32)*max(|x||w|)")
            return out

        return RowCall(rows, budgets, case.tokens, case.reduction_len, case.seed,
                       f"taps={case.taps};stages={len(case.stages)};hidden_out={case.hidden_out}")
    return make


def _mixture(name: str) -> Callable[..., RowCall]:
    def make(engine, fn, case: tuple[int, int, int, int], device: str) -> RowCall:
        tokens, hidden, nvb, seed = case
        d = Draw.for_device(seed, device)
        prefix, bank = d.normal((tokens, hidden)).to(LOW), d.normal((tokens, 8, hidden)).to(LOW)
        norm, proj = d.positive((hidden,)).to(LOW), d.normal((hidden,), hidden**-0.5).to(LOW)
        out_norm = [d.positive((hidden,)).to(LOW)] if name == base.ATTN_RES_RESIDUAL else []

        def rows(index: torch.Tensor) -> Outputs:
            return {"mixture": call(engine, fn, prefix[index].clone(), bank[index].clone(), nvb, norm, proj,
                                    *out_norm, EPS)}

        def budgets() -> dict[str, Budget]:
            if name == base.ATTN_RES_RESIDUAL:
                return {"mixture": judges.residual_mixture(engine, prefix, bank, nvb, norm, proj, *out_norm, EPS)[1]}
            return {"mixture": judges.read_only_mixture(engine, name, prefix, bank, nvb, norm, proj, EPS)[1]}

        return RowCall(rows, budgets, tokens, hidden, seed, f"nvb={nvb};hidden={hidden}")
    return make


def _aux_capture(engine, fn, case, device: str) -> RowCall:
    inp = tap_inputs(case, LOW, device)
    kw = dict(enabled=True, weights=inp.weights, block_size=case.block_size, end_layer=case.stage_end,
              num_layers=case.num_layers, is_last_rank=True, eps=EPS)

    def rows(index: torch.Tensor) -> Outputs:
        return {"tap": call(engine, fn, case.layer_idx, inp.prefix_sum[index].clone(), inp.pending[index].clone(),
                            inp.bank[index].clone(), **kw)}

    def budgets() -> dict[str, Budget]:
        prefix = up(inp.prefix_sum + inp.pending)
        want = oracle.current().capture_aux_stream(case.layer_idx, prefix, None, up(inp.bank),
                                                   **{**kw, "weights": upcast_weights(inp.weights)})
        nxt = case.layer_idx + 1
        nbl = ref.LayerWiring(nxt, case.block_size).prev_valid_blocks
        sources = torch.cat([up(inp.bank[:, :nbl]), prefix[:, None]], 1)
        q = up(inp.weights.attn_res_norm[nxt]) * up(inp.weights.attn_res_proj[nxt])
        return {"tap": judges.mixture_budget(want, sources, q, case.hidden, engine.rounding)}

    return RowCall(rows, budgets, case.tokens, case.hidden, case.seed,
                   f"layer={case.layer_idx};S={case.block_size};end={case.stage_end}")


# subject -> the RowCall of one drawn case (the cases: properties/test_batch_composition.py ROW_CASES)
ROW_CALLS: dict[str, Callable[..., RowCall]] = {
    base.CONTEXT_KV_FUSED: _context_kv_fused,
    base.CONTEXT_KV_UNFUSED: _context_kv_unfused,
    base.DRAFT_CONTEXT_KV: _draft_context_kv,
    base.STAGE_PARTIAL: _projection(base.STAGE_PARTIAL),
    base.FINALIZE_PROJECTION: _projection(base.FINALIZE_PROJECTION),
    base.PROJECT_UNSHARDED: _projection(base.PROJECT_UNSHARDED),
    base.ATTN_RES_MIX: _mixture(base.ATTN_RES_MIX),
    base.ATTN_RES_MIX_TRITON: _mixture(base.ATTN_RES_MIX_TRITON),
    base.ATTN_RES_MIX_EAGER: _mixture(base.ATTN_RES_MIX_EAGER),
    base.ATTN_RES_RESIDUAL: _mixture(base.ATTN_RES_RESIDUAL),
    base.AUX_CAPTURE: _aux_capture,
}


def bound(engine, name: str, rc: RowCall, output: str, tokens: int, accuracy: dict[str, Budget] | None) -> Budget:
    """Bitwise, unless the engine declares the subject's rows batch-variant between a call of `tokens` rows and
    the batch's (extras["batch_variant"][name]: (tokens, batch tokens) -> the reason, or "" where the two calls
    take one code path); then twice the accuracy budget of the batch's call (each output within it of the same
    oracle; `accuracy`: rc.budgets(), computed once per batch by the caller), the reason in the rule."""
    variant = (engine.extras.get("batch_variant") or {}).get(name)
    why = variant(tokens, rc.tokens) if variant is not None else ""
    if not why:
        return Budget(0.0, "bitwise: the row alone, in its batch and at another position (rows independent)")
    b = (accuracy if accuracy is not None else rc.budgets())[output]
    return Budget(2.0 * b.value, f"2 x ({b.rule}): {why}")


def check_rows_batch_invariant(engine, name: str, rc: RowCall) -> None:
    """Every row of the batch computed at another position (the batch reversed), and its first and last row computed
    alone, equal those rows in the batch: one `batch_invariance` record per output and comparison."""
    t = rc.tokens
    variant = (engine.extras.get("batch_variant") or {}).get(name)
    accuracy = rc.budgets() if variant is not None else None  # the oracle once per batch, where a bound needs it
    batched = rc.call(torch.arange(t))
    reverse = torch.arange(t - 1, -1, -1)
    reversed_out = {k: v[reverse] for k, v in rc.call(reverse).items()}
    ends = [0, t - 1]  # alone: the batch's first and last row (the reversed batch moves every row)
    alone_parts = [rc.call(torch.tensor([r])) for r in ends]
    alone = {k: torch.cat([p[k] for p in alone_parts]) for k in batched}
    for what, got, n, rows in (("at another position of the batch", reversed_out, t, list(range(t))),
                               ("alone", alone, 1, ends)):
        for k, full in batched.items():
            want = full[rows]
            report(judge(property="batch_invariance", engine=engine, subject=name, actual=got[k], reference=up(want),
                         budget=bound(engine, name, rc, k, n, accuracy), seed=rc.seed, reduction_len=rc.reduction_len,
                         detail=f"{k}: rows {rows} {what} against the batch of {t};{rc.detail}"))
