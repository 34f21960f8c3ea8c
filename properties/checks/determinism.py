"""Checks shared by properties/test_determinism.py and the property modules that reuse them: no test module
imports another, so they live here (moved from test_determinism.py with their bodies unchanged; a name
another module uses is public)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
from hypothesis import given
from hypothesis import strategies as st

from k3num.engines import base
from k3num.fixtures.builders import (
    attn_res_inputs,
    context_kv_inputs,
    draft_kv_inputs,
    paged_caches,
    projection_inputs,
    tap_inputs,
)
from k3num.fixtures.strategies import (
    AttnResCase,
    context_kv_cases,
    draft_kv_cases,
    projection_cases,
    seeds,
    tap_cases,
)
from k3num.fixtures.tensors import Draw
from k3num.oracles import hunt
from k3num.oracles.budgets import Budget
from k3num.oracles.records import judge
from k3num.properties.support import DEVICE, LOW, call, report, shardable, subject, up

EPS, OUT_EPS = 1e-5, 1e-6
Outputs = tuple[tuple[torch.Tensor, ...], tuple[str, ...]]


def attn_res_call(engine, fn, case: AttnResCase, device: str) -> Callable[[], Outputs]:
    def once() -> Outputs:
        inp = attn_res_inputs(case, LOW, device)
        out = fn(inp.prefix, inp.delta, inp.blocks, inp.norm, inp.qk, inp.out_norm, case.num_blocks,
                 case.block_write_idx, EPS, OUT_EPS)
        return (out, inp.prefix, inp.blocks), ("output", "prefix", "bank")
    return once


def attn_res_cloned(engine, fn, case: AttnResCase, device: str) -> Callable[[], Outputs]:
    """As attn_res_call, but the inputs are built once and cloned for each call (K3 shapes: drawing a
    7168-wide bank 152 times costs more than the calls)."""
    tpl = attn_res_inputs(case, LOW, device)

    def once() -> Outputs:
        prefix, blocks = tpl.prefix.clone(), tpl.blocks.clone()
        out = fn(prefix, tpl.delta, blocks, tpl.norm, tpl.qk, tpl.out_norm, case.num_blocks, case.block_write_idx,
                 EPS, OUT_EPS)
        return (out, prefix, blocks), ("output", "prefix", "bank")
    return once


def _aux(engine, fn, case, device: str) -> Callable[[], Outputs]:
    def once() -> Outputs:
        inp = tap_inputs(case, LOW, device)
        out = fn(case.layer_idx, inp.prefix_sum, inp.pending, inp.bank, enabled=True, weights=inp.weights,
                 block_size=case.block_size, end_layer=case.stage_end, num_layers=case.num_layers, is_last_rank=True,
                 eps=EPS)
        return (out, inp.prefix_sum, inp.bank), ("tap", "prefix_sum", "bank")
    return once


def _context_kv(engine, fn, case, device: str) -> Callable[[], Outputs]:
    def once() -> Outputs:
        inp = context_kv_inputs(case, LOW, device)
        gen = torch.Generator().manual_seed(case.seed)
        caches, buf = paged_caches(case.num_layers, -(-2 * case.tokens // 4), 4, case.width,
                                   ("stacked", "scattered")[case.seed % 2], gen, LOW, device)
        slots = torch.randperm(buf.shape[1] * 4, generator=gen)[: case.tokens].to(device)
        kv_c, k_pe = fn(inp.x, inp.kv_a, inp.norm, inp.positions, case.rope, EPS, caches, slots)
        return (kv_c, k_pe, buf), ("kv_c", "k_pe", "caches")
    return once


def _unfused(engine, fn, case, device: str) -> Callable[[], Outputs]:
    def once() -> Outputs:
        inp = context_kv_inputs(case, LOW, device)
        return tuple(fn(inp.x, inp.fused_qkv_a, inp.norm, inp.positions, case.rope, EPS)), ("kv_c", "k_pe")
    return once


def _mix(engine, fn, case: tuple[int, int, int, int], device: str, *, out_norm: bool = False
         ) -> Callable[[], Outputs]:
    tokens, hidden, nvb, seed = case

    def once() -> Outputs:
        d = Draw.for_device(seed, device)
        prefix, bank = d.normal((tokens, hidden)).to(LOW), d.normal((tokens, 8, hidden)).to(LOW)
        norm, proj = d.positive((hidden,)).to(LOW), d.normal((hidden,), hidden**-0.5).to(LOW)
        args = [prefix, bank, nvb, norm, proj] + ([d.positive((hidden,)).to(LOW)] if out_norm else []) + [EPS]
        out = call(engine, fn, *args)
        return (out, prefix, bank), ("mixture", "prefix", "bank")
    return once


def draft_kv_call(engine, fn, case, device: str) -> Callable[[], Outputs]:
    def once() -> Outputs:
        inp = draft_kv_inputs(case, LOW, device)
        return tuple(fn(inp.ctx, inp.k_weight, inp.v_weight, inp.k_norm, inp.positions, case.rope, EPS)), ("k", "v")
    return once


def _projection(name: str) -> Callable:
    def make(engine, fn, case, device: str) -> Callable[[], Outputs]:
        def once() -> Outputs:
            inp = projection_inputs(case, LOW, device)
            if name == base.PROJECT_UNSHARDED:
                return (fn(inp.taps, inp.fc, inp.norm, EPS),), ("ctx",)
            partials = [call(engine, engine.subject(base.STAGE_PARTIAL), inp.taps, inp.fc, list(m))
                        for m in case.stages]
            if name == base.STAGE_PARTIAL:
                return tuple(partials), tuple(f"partial{s}" for s in range(len(partials)))
            return (call(engine, fn, partials, inp.norm, EPS, torch.float32, list(case.order)),), ("ctx",)
        return once
    return make


_MIX_CASES = st.tuples(st.integers(1, 4), st.sampled_from([64, 1024]), st.integers(0, 8), seeds)


# subject -> (case strategy, invoker factory)
KERNEL_SUBJECTS: dict[str, tuple[st.SearchStrategy, Callable]] = {
    base.AUX_CAPTURE: (tap_cases(position="inner"), _aux),
    base.CONTEXT_KV_FUSED: (context_kv_cases(), _context_kv),
    base.CONTEXT_KV_UNFUSED: (context_kv_cases(), _unfused),
    base.ATTN_RES_MIX: (_MIX_CASES, _mix),
    base.ATTN_RES_MIX_TRITON: (st.tuples(st.integers(1, 4), st.just(1024), st.integers(0, 8), seeds), _mix),
    base.ATTN_RES_MIX_EAGER: (_MIX_CASES, _mix),
    base.ATTN_RES_RESIDUAL: (st.tuples(st.integers(1, 4), st.just(1024), st.integers(0, 7), seeds),
                             lambda e, f, c, d: _mix(e, f, c, d, out_norm=True)),
    base.DRAFT_CONTEXT_KV: (draft_kv_cases(), draft_kv_call),
    base.STAGE_PARTIAL: (projection_cases(), _projection(base.STAGE_PARTIAL)),
    base.FINALIZE_PROJECTION: (projection_cases(), _projection(base.FINALIZE_PROJECTION)),
    base.PROJECT_UNSHARDED: (projection_cases(), _projection(base.PROJECT_UNSHARDED)),
}


def deterministic_across_calls(name: str, cases: st.SearchStrategy, make: Callable) -> Callable:
    """A subject's determinism property, declared in its own property module (a subject added after this table:
    `test_<subject>_is_deterministic_across_calls = deterministic_across_calls(NAME, cases, make)`), so a new
    subject's cases and call live beside its property and this module is not edited. `make(engine, fn, case,
    device)` returns the call (as the invokers above); a case is a tuple ending in its seed or has `.seed`.
    properties/test_determinism.py requires every subject to have KERNEL_SUBJECTS' entry or one such
    declaration (harness/coverage.py `determinism_declared` reads them from the modules' source)."""

    @shardable
    @given(case=cases)
    def test(engine, case) -> None:
        fn = subject(engine, name)
        seed = case[-1] if isinstance(case, tuple) else case.seed
        check_deterministic(engine, name, make(engine, fn, case, DEVICE), hunt.repeats_for(DEVICE), seed,
                            detail=repr(case).replace(" ", ""))

    test.__doc__ = f"{name}: repeated calls on bitwise-identical fresh inputs are bitwise identical (outputs and " \
                   "side effects), under poisoned allocations."
    return test


def without_determinism(declared: dict[str, str]) -> str:
    """What is wrong with the subjects' determinism properties ("" when nothing): a subject with neither a
    KERNEL_SUBJECTS entry nor a declaration (`declared`: harness/coverage.py `determinism_declared`; attn_res has
    its own test in properties/test_determinism.py), or with both (its cases would run twice)."""
    missing = set(base.SUBJECTS) - set(KERNEL_SUBJECTS) - {base.ATTN_RES} - set(declared)
    twice = set(declared) & (set(KERNEL_SUBJECTS) | {base.ATTN_RES})
    return "; ".join(filter(None, [missing and f"no determinism property for {sorted(missing)}",
                                   twice and f"declared beside KERNEL_SUBJECTS' own: {sorted(twice)}"]))


def check_deterministic(engine, name: str, once: Callable[[], Outputs], calls: int, seed: int,
                        detail: str = "") -> None:
    """`calls` calls of `once` under poisoned allocations; every result bitwise equal to the first.

    All results are compared with the first's at once, on the device (hunt.all_same_as_first: one sync):
    where all calls gave the first call's bits (the passing case) that is the whole record; otherwise the
    differences are counted and located one by one."""
    results: list[tuple[torch.Tensor, ...]] = []
    names: tuple[str, ...] = ()
    for _ in range(calls):
        with hunt.poisoned_allocations():
            out, names = once()
        results.append(tuple(t.detach().clone() for t in out))
    if hunt.all_same_as_first(results):  # what the lines below give when every result is the first's
        k, first_diff, odd, i = 1, "", results[0], 0
    else:
        first_diff = next((d for d in (hunt.first_difference(results[0], r, names) for r in results[1:]) if d), "")
        k = hunt.distinct(results)
        # the record compares the first result that differs from the first call's (or the first call's
        # own output with itself), on the tensor that differs
        odd = next((r for r in results[1:] if hunt.first_difference(results[0], r, names)), results[0])
        i = next((j for j, t in enumerate(names) if hunt.first_difference((results[0][j],), (odd[j],), (t,))), 0)
    p = hunt.P_GPU if torch.device(DEVICE).type == "cuda" else hunt.P_CPU
    budget = Budget(0.0, f"bitwise across {calls} calls (oracles.hunt: p={p}, alpha={hunt.ALPHA})")
    as_float = (lambda t: t.float()) if odd[i].element_size() == 1 else (lambda t: t)
    rec = judge(property="deterministic_across_calls", engine=engine, subject=name, actual=as_float(odd[i]),
                reference=up(as_float(results[0][i])), budget=budget, seed=seed,
                detail=";".join(filter(None, [detail, f"{k} distinct of {calls}", first_diff])),
                verdict="fail" if k > 1 else "pass")
    report(dataclasses.replace(rec, calls=calls, distinct=k), climb=False)
