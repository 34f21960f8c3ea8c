"""The draft step through an engine's K3 paths, against the float64 step: what a drift does to the tokens.

For one drawn case (fixtures.strategies.DraftStepCase) four steps run on the same inputs:

- the oracle: the K3 paths in float64 (refmodel: path 2's aux tap of the target's AttnRes stream at each
  capture layer, path 3's tap projection and its norm, then path 1's fused context KV for DSpark or path 3's
  draft K/V for DFlash) and the float64 remainder (refmodel/draft_step.py);
- the engine: the engine's own subjects for the K3 paths it binds (the mirror's for those it does not;
  `paths` names which came from where) and the one bf16 remainder (engines/mirror/draft_step.py);
- the noise floor: every K3 path through the bf16 mirror (the plain unfused, unsharded paths), the same
  remainder: the logit error the paths' own roundings make, from which the logit budget `delta` is derived
  (oracles.budgets.logit_budget);
- the remainder's own error: every K3 path in float64, rounded once to bf16, the same remainder.

A DSpark case with a Markov head (its weights have markov_w1/markov_w2: every drawn one, not a draft checkpoint
without them) then passes the head on every side: the oracle's chain in float64 (refmodel.draft_step.
markov_chain), and each bf16 block biased by the oracle's previous token at each position (engines/mirror/
draft_step.markov_biased), so that a position is judged given the same history.

Every position of the engine's block is then labelled against the oracle's (oracles/tokens.py), and so is
the noise floor's. Shapes: see refmodel/draft_step.py.
"""

from __future__ import annotations

import functools
import random
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch

from k3num.engines import base
from k3num.engines.mirror import attn_res as mirror_attn_res
from k3num.engines.mirror import draft_step as bf16_step
from k3num.engines.subjects import SUBJECT_RECORDS
from k3num.fixtures.builders import draft_step_inputs, upcast_weights
from k3num.fixtures.draft_checkpoint import STREAMS
from k3num.harness import oracle
from k3num.harness.judges import LOW, up
from k3num.oracles import budgets, tokens
from k3num.refmodel import draft_step as ref_step

EPS = 1e-5
# the K3 paths of each drafter's step, as subject names, in the order the step uses them
PATHS = {"dspark": (base.AUX_CAPTURE, base.PROJECT_UNSHARDED, base.CONTEXT_KV_FUSED),
         "dflash": (base.AUX_CAPTURE, base.PROJECT_UNSHARDED, base.DRAFT_CONTEXT_KV)}


# the bound subjects the step does not call, each with why (`reach`), read from each subject's record: none is
# silently absent from `k3num impact`
NOT_IN_THE_STEP = {name: r.not_in_step for name, r in SUBJECT_RECORDS.items() if r.not_in_step}


# --- compositions: bound subjects an engine has no whole step path for (issue 40 item 1) ----------------------

def stage_split(taps: int, seed: int) -> list[list[int]]:
    """PP stages over `taps` taps, as a pipeline owns them: contiguous runs of the taps in layer order, 2-4 of them
    (at most one per tap), the cut points drawn from `seed`."""
    rng = random.Random(f"stages:{seed}")
    stages = min(taps, rng.randint(2, 4))
    cuts = sorted(rng.sample(range(1, taps), stages - 1)) if stages > 1 else []
    bounds = [0, *cuts, taps]
    return [list(range(a, b)) for a, b in zip(bounds, bounds[1:])]


def sharded_projection(engine: Any, split: list[list[int]]) -> Any:
    """project_unsharded's signature through the engine's PP sum: each stage's partial of its own taps
    (stage_partial), the partials summed in float32 in stage order and the norm once (finalize_projection)."""
    partial, finalize = engine.subject(base.STAGE_PARTIAL), engine.subject(base.FINALIZE_PROJECTION)

    def project(taps: torch.Tensor, fc: torch.Tensor, norm: torch.Tensor, eps: float) -> torch.Tensor:
        parts = [partial(taps, fc, members) for members in split]
        return finalize(parts, norm, eps, torch.float32, list(range(len(parts))))

    return project


def mixture_tap(mix: Any) -> Any:
    """The aux tap's signature with the engine's read-only mixture (attn_res_mix: prefix, bank, nvb, norm, proj,
    eps) where the tap mixes: the mirror's tap (the prefix sum plus the pending MLP output, the branch's weights)
    with `mix` in place of its own mixture."""
    return functools.partial(mirror_attn_res.capture_aux_stream, mix=mix)


@dataclass(frozen=True)
class Variant:
    """A composed row of the step: what the engine must bind (`needs`) and must not (`lacks`: the composition
    stands in for it), the bound subjects it brings into the step (`runs`), the case it runs (`case`) and the
    path subjects it puts in place of the engine's or the mirror's (`subjects`: (engine, case) -> {subject: (fn,
    label)})."""

    name: str
    needs: tuple[str, ...]
    lacks: tuple[str, ...]
    runs: tuple[str, ...]
    case: Callable[[Any], Any]
    subjects: Callable[[Any, Any], dict[str, tuple[Any, str]]]

    def applies(self, engine: Any) -> bool:
        return all(engine.provides(n) for n in self.needs) and not any(engine.provides(n) for n in self.lacks)


MIXTURE_HIDDEN = 1024  # SGLang's dispatch takes its Triton pair on the 1024 grid (K3's 7168 is on it)


def _pp_subjects(engine: Any, case: Any) -> dict[str, tuple[Any, str]]:
    split = stage_split(case.taps, case.seed)
    return {base.PROJECT_UNSHARDED: (sharded_projection(engine, split),
                                     f"engine(PP sum: stages {'|'.join(','.join(map(str, s)) for s in split)})")}


VARIANTS = (
    Variant("pp sum", (base.STAGE_PARTIAL, base.FINALIZE_PROJECTION), (), (base.STAGE_PARTIAL,
            base.FINALIZE_PROJECTION), lambda c: replace(c, taps=max(c.taps, 4)), _pp_subjects),
    Variant("mixture tap", (base.ATTN_RES_MIX,), (base.AUX_CAPTURE,), (base.ATTN_RES_MIX, base.ATTN_RES_MIX_TRITON),
            lambda c: c if c.hidden % MIXTURE_HIDDEN == 0 else replace(c, hidden=MIXTURE_HIDDEN),
            lambda engine, case: {base.AUX_CAPTURE: (mixture_tap(engine.subject(base.ATTN_RES_MIX)),
                                                     "engine(attn_res_mix in the tap)")}),
)


def reach(engine: Any) -> dict[str, str]:
    """Every subject `engine` binds -> where the step runs it ("in the step: dspark, dflash") or why it does not
    (its record's `not_in_step`); KeyError naming a bound subject with neither, so a new subject cannot be silently
    absent."""
    out = {}
    composed = {n: v.name for v in VARIANTS if v.applies(engine) for n in v.runs}
    for name in engine.subjects:
        kinds = [k for k, names in PATHS.items() if name in names]
        if name == base.CONTEXT_KV_UNFUSED and not engine.provides(base.CONTEXT_KV_FUSED):
            kinds = ["dspark"]  # the DSpark context KV through its unfused path (_subject)
        if name == base.ATTN_RES and engine.provides(base.AUX_CAPTURE):
            out[name] = "in the step: dspark, dflash, inside the engine's aux tap (it calls it for every mixture)"
        elif kinds:
            out[name] = "in the step: " + ", ".join(kinds)
        elif name in composed:
            out[name] = (f"in the step: dspark, dflash, in the `{composed[name]}` rows (composed with the mirror's "
                         "other paths)")
        elif name == base.CONTEXT_KV_UNFUSED:
            out[name] = "the fused path is bound and runs in its place (the unfused one is its baseline)"
        elif name in SUBJECT_RECORDS and SUBJECT_RECORDS[name].not_in_step:  # read now: the records are the truth
            out[name] = "not in the step: " + SUBJECT_RECORDS[name].not_in_step
        else:
            raise KeyError(f"{engine.name}: subject {name} is bound but neither in the step's PATHS nor excused "
                           "by its record (engines/subjects.py `not_in_step`)")
    return out


class NoPathBound(LookupError):
    """The engine binds none of the drafter's K3 paths: its step would be the mirror's."""


@dataclass(frozen=True)
class StepResult:
    kind: str
    paths: str  # which K3 path each subject came from: "project_unsharded=engine;context_kv_fused=mirror"
    oracle: torch.Tensor  # [B, V] float64
    engine: torch.Tensor  # [B, V] bf16
    noise_floor: torch.Tensor  # [B, V] bf16
    exact_paths: torch.Tensor  # [B, V] bf16: float64 paths, bf16 remainder
    delta: budgets.Budget
    verdict: tokens.BlockVerdict  # the engine's block
    noise_verdict: tokens.BlockVerdict  # the noise floor's block


def _subject(engine: Any, mirror: Any, name: str) -> tuple[Any, str]:
    """The engine's subject `name` (or, for the DSpark context KV, its unfused one), else the mirror's."""
    if engine.provides(name):
        return engine.subject(name), "engine"
    if name == base.CONTEXT_KV_FUSED and engine.provides(base.CONTEXT_KV_UNFUSED):
        unfused = engine.subject(base.CONTEXT_KV_UNFUSED)

        def fused(x, kv_a, norm, positions, rope, eps):  # noqa: ANN001 - the unfused path with zero Q rows
            num_layers, _, hidden = kv_a.shape
            q = torch.zeros(num_layers, 1, hidden, dtype=kv_a.dtype, device=kv_a.device)
            return unfused(x, torch.cat([q, kv_a], dim=1), norm, positions, rope, eps)

        return fused, "engine(unfused)"
    return mirror.subject(name), "mirror"


# the target's residual stream the taps read (STREAMS, TokenSpeed's names of `aux_hidden_stream`): "attn_res" the
# AttnRes mixture (vLLM with VLLM_KIMI_K3_AUX_ATTN_RES_STREAM=1), "prefix" the prefix sum (vLLM's default, the flag
# off)


def _taps_bf16(inp: Any, case: Any, tap: Any, stream: str = "attn_res") -> torch.Tensor:
    """Path 2: each tap through the aux-tap subject, on `stream` (attn_res: the flag on, the mixture with the
    next layer's AttnRes weights; prefix: the flag off); a one-stage target, its last rank. -> [K, N, H]."""
    return torch.stack([tap(layer, prefix, pending, bank, enabled=stream == "attn_res", weights=inp.target_weights,
                            block_size=case.attn_res_block, end_layer=case.target_layers,
                            num_layers=case.target_layers, is_last_rank=True, eps=EPS, non_final_stage="raise")
                        for layer, (prefix, pending, bank) in zip(case.tap_layers(), inp.tap_states)])


def _taps_f64(inp: Any, case: Any, stream: str = "attn_res") -> torch.Tensor:
    """Path 2 in float64, on the prefix the subject mixes (prefix_sum + pending rounded to storage)."""
    w = upcast_weights(inp.target_weights)
    return torch.stack([oracle.current().capture_aux_stream(
        layer, up(prefix + pending), None, up(bank), enabled=stream == "attn_res", weights=w,
        block_size=case.attn_res_block,
        end_layer=case.target_layers, num_layers=case.target_layers, is_last_rank=True, eps=EPS)
        for layer, (prefix, pending, bank) in zip(case.tap_layers(), inp.tap_states)])


def _paths_bf16(kind: str, inp: Any, case: Any, g: Any, subjects: dict[str, Any],
                stream: str = "attn_res") -> tuple[torch.Tensor, torch.Tensor]:
    """The K3 paths' outputs through `subjects` (bf16): (kv_c, k_pe) for DSpark, (k, v) for DFlash. Taps given
    with the inputs (inp.given_taps) replace path 2, else the taps read `stream`. g: the step's geometry (its rope
    and eps)."""
    taps = inp.given_taps if inp.given_taps is not None else _taps_bf16(inp, case, subjects[base.AUX_CAPTURE],
                                                                        stream)
    ctx = subjects[base.PROJECT_UNSHARDED](taps, inp.fc, inp.fc_norm, g.eps)
    if kind == "dspark":
        kv_c, k_pe = subjects[base.CONTEXT_KV_FUSED](ctx, inp.kv_a, inp.kv_norm, inp.ctx_positions, g.rope, g.eps)
        return kv_c, k_pe
    k, v = subjects[base.DRAFT_CONTEXT_KV](ctx, inp.k_weight, inp.v_weight, inp.k_norm, inp.ctx_positions, g.rope,
                                           g.eps)
    return k, v


def _paths_f64(kind: str, inp: Any, case: Any, g: Any, stream: str = "attn_res") -> tuple[torch.Tensor, torch.Tensor]:
    taps = up(inp.given_taps) if inp.given_taps is not None else _taps_f64(inp, case, stream)
    ctx = oracle.current().project_context(taps, up(inp.fc), up(inp.fc_norm), g.eps)
    if kind == "dspark":
        return oracle.current().context_kv(ctx, up(inp.kv_a), up(inp.kv_norm), inp.ctx_positions, g.rope, g.eps)
    return oracle.current().draft_context_kv(ctx, up(inp.k_weight), up(inp.v_weight), up(inp.k_norm),
                                             inp.ctx_positions, g.rope, g.eps)


def _weights_f64(w: ref_step.DraftWeights) -> ref_step.DraftWeights:
    return replace(w, **{f: up(getattr(w, f)) for f in w.__dataclass_fields__ if getattr(w, f) is not None})


def run(engine: Any, mirror: Any, kind: str, case: Any, device: str, subjects: dict[str, Any] | None = None,
        inputs: Any = None, geometry: Any = None, trained: str = "attn_res", served: str = "attn_res") -> StepResult:
    """The four steps of one case (module docstring); NoPathBound when the engine binds none of the paths.
    `subjects` overrides a path's subject with (callable, label: what it is, shown in `paths`) and `inputs` the
    drawn inputs (a ledger entry's case class: `k3num impact --ledger`; inputs.given_taps replaces path 2 on
    every side); `geometry` the case's (a draft checkpoint's: fixtures/draft_checkpoint.py). `trained` is the
    stream (STREAMS) the draft was trained on, which the oracle, the noise floor and the exact paths read;
    `served` the one the engine's taps read: where they differ, the row is what serving the draft with the other
    stream does to its proposals (`k3num impact --stream-mismatch`)."""
    bad = [s for s in (trained, served) if s not in STREAMS]
    if bad:
        raise ValueError(f"stream {bad[0]!r}: expected one of {', '.join(STREAMS)}")
    inp = inputs if inputs is not None else draft_step_inputs(case, LOW, device)
    chosen = {name: _subject(engine, mirror, name) for name in PATHS[kind]}
    chosen.update(subjects or {})
    if inp.given_taps is not None:
        chosen[base.AUX_CAPTURE] = (None, "given taps")
    if all(src in ("mirror", "given taps") for _, src in chosen.values()):
        runs = [n for n in PATHS[kind] if not (n == base.AUX_CAPTURE and inp.given_taps is not None)]
        given = " (path 2 is not run: the taps are given)" if inp.given_taps is not None else ""
        raise NoPathBound(f"engine {engine.name} {engine.version} binds none of the {kind} step's K3 paths "
                          f"that run here ({', '.join(runs)}){given}")
    g = geometry if geometry is not None else case.geometry()
    step_bf16 = bf16_step.dspark_step if kind == "dspark" else bf16_step.dflash_step
    step_f64 = ref_step.dspark_step if kind == "dspark" else ref_step.dflash_step
    exact = _paths_f64(kind, inp, case, g, trained)
    w64 = _weights_f64(inp.weights)
    oracle = step_f64(*exact, inp.ctx_positions, up(inp.block_hidden), inp.block_positions, w64, g)
    remainder = (inp.ctx_positions, inp.block_hidden, inp.block_positions, inp.weights, g)
    engine_logits = step_bf16(*_paths_bf16(kind, inp, case, g, {n: fn for n, (fn, _) in chosen.items()}, served),
                              *remainder)
    noise = step_bf16(*_paths_bf16(kind, inp, case, g, {n: mirror.subject(n) for n in PATHS[kind]}, trained),
                      *remainder)
    exact_paths = step_bf16(*(t.to(LOW) for t in exact), *remainder)
    if inp.weights.markov_w1 is not None:  # DSpark's Markov head (refmodel.draft_step.markov_chain)
        oracle, chain = ref_step.markov_chain(oracle, w64, inp.markov_anchor)
        # every side biased by the oracle's previous token at each position: a position is judged given the same
        # history (after a flipped token the verifier rejects the rest of the block anyway)
        prev = torch.cat([torch.tensor([inp.markov_anchor], device=chain.device), chain[:-1]])
        engine_logits, noise, exact_paths = (bf16_step.markov_biased(x, inp.weights, prev)
                                             for x in (engine_logits, noise, exact_paths))
    noise_err, logit_max = torch.stack([(up(noise) - oracle).abs().max(), oracle.abs().max()]).tolist()
    delta = budgets.logit_budget(noise_err, logit_max, LOW)
    return StepResult(kind, ";".join(f"{n}={src}" for n, (_, src) in chosen.items()), oracle, engine_logits, noise,
                      exact_paths, delta, tokens.judge_block(engine_logits, oracle, delta.value),
                      tokens.judge_block(noise, oracle, delta.value))


def detail(r: StepResult) -> str:
    """The token-level fields of a drift record (`detail`; properties/README.md lists them)."""
    v, n = r.verdict, r.noise_verdict
    return (f"kind={r.kind};positions={v.positions};decided={v.decided};identical={v.count(tokens.IDENTICAL)};"
            f"tie_break={v.count(tokens.TIE_BREAK)};diverged={v.count(tokens.DIVERGED)};agreement={v.agreement};"
            f"noise_agreement={n.agreement};noise_diverged={n.count(tokens.DIVERGED)};kl={v.kl:.3g};"
            f"min_gap_over_delta={min(v.gap) / v.delta if v.delta else float('inf'):.3g};"
            f"worst_err_over_delta={v.worst_err_over_delta:.3g};q99_err_over_delta={v.q99_err_over_delta:.3g};"
            f"decided_over_budget={v.decided_over_budget};"
            f"predicted_flips={v.predicted_flips:.3g};"
            f"predicted_rate={v.predicted_flip_rate:.3g};paths={r.paths}")
