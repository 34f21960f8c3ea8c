"""The ledger entries' token case classes (`k3num impact --ledger`): each entry's divergence made to reach the
draft step's inputs the way it reaches a deployment's (the tap of the wrong stream, taps whose projections cancel
through the sharded sum, weights through the merged loader, a KV transfer between mismatched TP sizes), or the
call a caller would make to reach it (harness/impact_kernels.py: a bank row written inside the mix, a bank one
block short, a layer input a race corrupts or the kernel leaves unwritten, an FP8 cache with a zero scale),
beside a control through what the entry lacks.

An entry names its case class in its record (oracles/ledger.py `token_case`, and `token_hidden` where the case
runs at the reproducer's hidden size); `CASES` maps the name to the function that plans the entry's rows, so
harness/impact.py runs every entry the same way and reads no entry id. A case function takes a `Ctx` and returns
a `Plan`: the (role, drafter, case transform, hooks) steps to run through the step, the call counts of the kernel
case classes, the engine a role's row shows where it is not the entry's, and the rows of roles that cannot run
here with the reason. A hook pair is (inputs hook (inp, case) -> inp, subjects hook (case) -> {subject: (fn,
label)}); None runs the engine's own subjects on the drawn inputs.

Shapes: the draft step's (harness/draft_step.py, fixtures.strategies.DraftStepCase).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

NOT_THE_STEP = "not exercised by the draft step: "
NO_RACE_ON_CPU = ("not run on cpu: a race, and the Triton interpreter runs a kernel's programs one after another "
                  "(run with --device cuda)")
NO_OPS = "not run: vLLM's compiled FP8 insert is not built here (`k3num build-ops` on a CUDA GPU)"
BOTH = ("dspark", "dflash")


@dataclass
class Ctx:
    """What a case function plans with: the entry's record, its engine and the mirror, and the run's settings.
    `stack` (a contextlib.ExitStack) holds the fixed trees a control reads for as long as the rows run."""
    entry: Any  # oracles.ledger.Divergence
    engine: Any
    mirror: Any
    device: str
    sources: dict[str, Path]
    mode: str
    stack: Any


@dataclass
class Plan:
    steps: list[tuple[str, str, Callable[[Any], Any], Any]] = field(default_factory=list)
    counts: dict[tuple[str, str], tuple[Any, bool]] = field(default_factory=dict)  # (role, kind) -> (Calls, a race?)
    shown: dict[str, str] = field(default_factory=dict)  # role -> the engine its row shows, where not the entry's
    rows: list[dict[str, Any]] = field(default_factory=list)  # the roles that do not run here, with why

    def unrun(self, ctx: Ctx, role: str, why: str, engine: str | None = None) -> Plan:
        self.rows.append({"entry": ctx.entry.id, "role": role, "engine": engine or ctx.entry.engine,
                          "severity": why[:300]})
        return self


def _same(c: Any) -> Any:
    return c


def fixed_engine(entry: str, name: str, sources: dict[str, Path], mode: str, stack: Any) -> tuple[Any, str]:
    """(engine `name` read from a copy of its files with the entry's fix applied (harness/ledger_entries), None) or
    (None, why not). The copy lives as long as `stack`. A local tree given for the pin is not what the fix
    patches: the control then does not run."""
    import tempfile

    from k3num.engines import registry
    from k3num.harness import around, fixes

    fix = next((f for f in fixes.FIXES if entry in around.entry_ids(f)), None)
    if fix is None:
        return None, f"not run: no fix for {entry} in harness/fixes.py"
    if fix.engine in sources:
        return None, f"not run: --engine-src {fix.engine} is given, and the fix patches the pinned files"
    try:
        tree = fixes.patched_tree(fix, Path(stack.enter_context(tempfile.TemporaryDirectory())) / "fixed")
        return registry.build(name, {**sources, fix.engine: tree}, mode), ""
    except (fixes.FixError, registry.EngineUnavailable) as e:
        return None, f"not run: the fixed {name} ({e})"[:300]


# --- the case classes, by the name an entry's record gives -----------------------------------------------------

def as_drawn(ctx: Ctx) -> Plan:
    """The drawn case as it is: the engine's own subjects on the step's inputs (a wrong tap on every call)."""
    return Plan(steps=[("case", k, _same, None) for k in BOTH])


def last_tap(ctx: Ctx) -> Plan:
    """The drawn case with its last tap on the last rank (the output mixture's branch)."""
    return Plan(steps=[("case", k, lambda c: dataclasses.replace(c, last_tap=True), None) for k in BOTH])


def split_at_a_stage_end(ctx: Ctx) -> Plan:
    """The target split into two PP stages after its middle tap's layer, that tap taken through the engine's aux
    tap at a non-final stage's end (`_split_tap`); the control: the same call through TokenSpeed's tap, which
    takes a stage end's tap where the next stage's weights are (properties/test_aux_tap.py: it passes the
    stage-end property)."""
    from k3num.engines import base, registry

    plan = Plan()
    owners = [("case", ctx.engine, f"{ctx.engine.name} at a non-final stage's end")]
    try:
        ts = registry.get("tokenspeed", ctx.sources, ctx.mode)
        owners.append(("control", ts, f"{ts.name} at a non-final stage's end"))
        plan.shown["control"] = ts.name
    except registry.EngineUnavailable as e:
        plan.unrun(ctx, "control", f"not run: tokenspeed unavailable ({e})", engine="tokenspeed")
    for role, owner, label in owners:
        plan.steps += [(role, k, _same, (lambda inp, case: inp, lambda case, _o=owner, _l=label: {
            base.AUX_CAPTURE: (_split_tap(_o, ctx.mirror, case), _l)})) for k in BOTH]
    return plan


def cancelling_taps(ctx: Ctx) -> Plan:
    """Taps whose projections cancel (`_cancelling`) through the engine's sharded sum; the control: the same
    taps through one projection GEMM (the unsharded path)."""
    from k3num.engines import base

    engine = ctx.engine
    one = engine if engine.provides(base.PROJECT_UNSHARDED) else ctx.mirror
    plan = Plan()
    for role, subject in (("case", (_sharded_projection(engine), "engine(sharded sum)")),
                          ("control", (one.subject(base.PROJECT_UNSHARDED), f"{one.name}(one GEMM)"))):
        plan.steps += [(role, k, lambda c: dataclasses.replace(c, taps=max(c.taps, 2)),
                        (_cancelling, lambda case, _s={base.PROJECT_UNSHARDED: subject}: _s)) for k in BOTH]
    return plan


def _merged(ctx: Ctx, loader: Callable[[Any, str], tuple[Any, Any]], shapes: list[tuple[str, dict[str, int]]]) -> Plan:
    from k3num.engines import base

    owner = ctx.engine if ctx.engine.provides(base.CONTEXT_KV_FUSED) else ctx.mirror  # the loader is the engine's
    fused = owner.subject(base.CONTEXT_KV_FUSED)
    hooks = loader(ctx.engine, "engine" if owner is ctx.engine else "mirror")
    return Plan(steps=[(role, "dspark", lambda c, _s=shape: dataclasses.replace(c, **_s),
                        (hooks[0], lambda case, _f=fused, _h=hooks: _h[1](_f))) for role, shape in shapes])


def merged_loader_fp8(ctx: Ctx) -> Plan:
    """The draft layers' kv_a_proj_with_mqa through vLLM's merged block-FP8 loader at the K3 width: 576 rows per
    layer (4.5 blocks of 128) and three layers, the middle one misplaced (with two layers vLLM's loader raises
    instead: the second shard's scales overrun); the control: 512 rows, whole blocks, which load right."""
    return _merged(ctx, _merged_loader_fp8, [("case", {"kv_lora": 576 - 8, "num_layers": 3}),
                                             ("control", {"kv_lora": 512 - 8, "num_layers": 3})])


def merged_loader_nvfp4(ctx: Ctx) -> Plan:
    """Two draft layers through vLLM's merged NVFP4 loader, each quantized on its own."""
    return _merged(ctx, _merged_loader_nvfp4, [("case", {"num_layers": 2})])


def transfer_between_tp_sizes(ctx: Ctx) -> Plan:
    """K3's DFlash draft (8 KV heads): a prefill at attention TP 4 (2 heads a rank) and a decode at TP 8 (1 a
    rank), pages of 4 tokens, prefill page p to decode page p + 2 (seed 003); the control: both TP 8."""
    from k3num.engines import base
    from k3num.harness.transfer_memory import Transfer

    plan = Plan()
    for role, t in (("case", Transfer(4, 8, 4)), ("control", Transfer(8, 8, 4))):
        subject = (_transferred(ctx.engine, t), f"engine(+ its transfer {t.label()})")
        plan.steps.append((role, "dflash", lambda c: dataclasses.replace(c, kv_heads=8, num_heads=8),
                           (lambda inp, case: inp, lambda case, _s={base.DRAFT_CONTEXT_KV: subject}: _s)))
    return plan


def _widened(hidden: int) -> Callable[[Any], Any]:
    """At least two taps, so one mixes >= 2 blocks; at `hidden` where the record gives one (its reproducer's)."""
    return lambda c: dataclasses.replace(c, taps=max(c.taps, 2), hidden=hidden or c.hidden)


def _race(ctx: Ctx, make: Callable[..., tuple[Any, Any, Any]]) -> Plan:
    """A race's case (impact_kernels `make`), its control the same calls on the kernel with the entry's fix."""
    from k3num.harness import impact_kernels as kernels

    plan = Plan()
    if ctx.device == "cpu":
        return plan.unrun(ctx, "case", NO_RACE_ON_CPU)
    fixed, why = fixed_engine(ctx.entry.id, ctx.entry.engine, ctx.sources, ctx.mode, ctx.stack)
    if fixed is None:
        plan.unrun(ctx, "control", why)
    else:
        plan.shown["control"] = f"{ctx.entry.engine} + fix"
    for kind in BOTH:
        for role, e in (("case", ctx.engine), ("control", fixed)):
            if e is None:
                continue
            inputs, subjects, count = make(e, ctx.mirror, kernels.RACE_REPEATS)
            plan.steps.append((role, kind, _widened(ctx.entry.token_hidden), (inputs, subjects)))
            plan.counts[(role, kind)] = (count, True)
    return plan


def race_written_in_the_mix(ctx: Ctx) -> Plan:
    """impact_kernels.written_in_the_mix: a bank row written inside the mixed range in the same call."""
    from k3num.harness import impact_kernels as kernels

    return _race(ctx, kernels.written_in_the_mix)


def race_raced_layer_input(ctx: Ctx) -> Plan:
    """impact_kernels.raced_layer_input: the decoder layer's in-place call whose raced output reaches the stream."""
    from k3num.harness import impact_kernels as kernels

    return _race(ctx, kernels.raced_layer_input)


def bank_one_block_short(ctx: Ctx) -> Plan:
    """impact_kernels.bank_one_block_short; the control: the same kernel call over the bank sized right."""
    from k3num.harness import impact_kernels as kernels

    plan = Plan()
    for kind in BOTH:
        for role, short in (("case", True), ("control", False)):
            inputs, subjects, count = kernels.bank_one_block_short(ctx.engine, ctx.mirror, short=short)
            plan.steps.append((role, kind, _widened(ctx.entry.token_hidden), (inputs, subjects)))
            plan.counts[(role, kind)] = (count, False)
    return plan


def unwritten_layer_input(ctx: Ctx) -> Plan:
    """impact_kernels.unwritten_layer_input; the control: hidden 1024, where the fused path writes every element."""
    from k3num.harness import impact_kernels as kernels

    plan = Plan()
    for kind in BOTH:
        for role, hidden in (("case", None), ("control", 1024)):
            inputs, subjects, count = kernels.unwritten_layer_input(ctx.engine, ctx.mirror)
            plan.steps.append((role, kind, lambda c, _h=hidden: dataclasses.replace(c, hidden=_h or c.hidden),
                               (inputs, subjects)))
            plan.counts[(role, kind)] = (count, False)
    return plan


def through_an_fp8_cache(ctx: Ctx) -> Plan:
    """impact_kernels.through_an_fp8_cache with one layer's scale zero; the control: every scale right. Needs
    vLLM's compiled FP8 insert."""
    from k3num.harness import impact_kernels as kernels

    engine = ctx.engine
    if not engine.extras.get("context_kv_ops") or not engine.real_ops:
        return Plan().unrun(ctx, "case", NO_OPS)
    return Plan(steps=[(role, "dspark", _same, (lambda inp, case: inp, kernels.through_an_fp8_cache(engine, bad)))
                       for role, bad in (("case", 1), ("control", None))])


CASES: dict[str, Callable[[Ctx], Plan]] = {f.__name__: f for f in (
    as_drawn, last_tap, split_at_a_stage_end, cancelling_taps, merged_loader_fp8, merged_loader_nvfp4,
    transfer_between_tp_sizes, race_written_in_the_mix, race_raced_layer_input, bank_one_block_short,
    unwritten_layer_input, through_an_fp8_cache)}


def problems(entries: Any) -> list[str]:
    """What is wrong with the records' case classes: a name CASES does not hold, a race whose case class is not
    a race's, or an entry with neither a case class nor the reason it has none (`token_why`)."""
    races = {"race_written_in_the_mix", "race_raced_layer_input"}
    out = []
    for d in entries:
        if d.token_case and d.token_case not in CASES:
            out.append(f"{d.id}: token_case {d.token_case!r} is no case class here (known: {', '.join(CASES)})")
        elif not d.token_case and not d.token_why:
            out.append(f"{d.id}: no token_case and no token_why (why the draft step cannot reach it)")
        elif d.token_case and (d.token_case in races) != d.race:
            out.append(f"{d.id}: race={d.race} but its case class {d.token_case} is "
                       f"{'a' if d.token_case in races else 'not a'} race's")
    return out


def plan(ctx: Ctx) -> Plan:
    """The entry's plan, by the case class its record names; an entry without one says why in its one row."""
    d = ctx.entry
    if not d.token_case:
        return Plan().unrun(ctx, "case", NOT_THE_STEP + d.token_why)
    if d.token_case not in CASES:
        raise ValueError(f"{d.id}: token_case {d.token_case!r} is no case class in harness/token_cases.py "
                         f"(known: {', '.join(CASES)})")
    return CASES[d.token_case](ctx)


# --- the case classes' helpers -----------------------------------------------------------------------------------

def _split_tap(owner: Any, mirror: Any, case: Any) -> Any:
    """split_at_a_stage_end's tap: the target split into two PP stages after its middle tap's layer. That tap is taken
    at the end of the first stage, a non-final one, through `owner`'s aux tap (branch 3: the ROCm tap there
    returns the prefix). Every other tap goes through the mirror, so the tap's own branches 1 and 2 do not
    enter. The reference and the noise floor take the split tap as the next stage reads it: the mixture with
    layer i + 1's weights, the one-stage value (properties/test_aux_tap.py
    `test_a_stage_end_tap_taken_by_the_next_stage_...`)."""
    from k3num.engines import base

    layers = case.tap_layers()
    split = layers[len(layers) // 2]
    at_end, elsewhere = owner.subject(base.AUX_CAPTURE), mirror.subject(base.AUX_CAPTURE)

    def tap(layer: int, prefix: Any, pending: Any, bank: Any, **kw: Any) -> Any:
        if layer == split:
            return at_end(layer, prefix, pending, bank, **{**kw, "end_layer": layer + 1, "is_last_rank": False})
        return elsewhere(layer, prefix, pending, bank, **kw)

    return tap


def _cancelling(inp: Any, case: Any) -> Any:
    """cancelling_taps's inputs: taps 0 and 1 equal, and tap 1's column block of the projection minus tap 0's plus 1%
    relative noise, so their projections cancel to about a hundredth of each."""
    import dataclasses as dc

    import torch

    h = case.hidden
    taps = torch.stack([inp.tap_states[0][0]] * 2 + [s[0] for s in inp.tap_states[2:]])
    fc = inp.fc.clone()
    g = torch.Generator().manual_seed(case.seed)
    noise = torch.randn(fc[:, :h].shape, generator=g, dtype=torch.float64) * 0.01
    fc[:, h:2 * h] = (-fc[:, :h].double() * (1 + noise.to(fc.device))).to(fc.dtype)
    return dc.replace(inp, fc=fc, given_taps=taps)


def _sharded_projection(engine: Any) -> Any:
    """The unsharded projection's signature through the engine's sharded path: each tap on its own stage, the
    partials summed in fp32 in stage order, the norm once (TokenSpeed's project_target_tap and
    finalize_target_projection)."""
    import torch

    from k3num.engines import base

    partial, finalize = engine.subject(base.STAGE_PARTIAL), engine.subject(base.FINALIZE_PROJECTION)

    def project(taps: Any, fc: Any, norm: Any, eps: float) -> Any:
        parts = [partial(taps, fc, [i]) for i in range(taps.shape[0])]
        return finalize(parts, norm, eps, torch.float32, list(range(len(parts))))

    return project


def _merged_loader_fp8(engine: Any, who: str) -> tuple[Any, Any]:
    """merged_loader_fp8's hooks: (inputs hook, subjects hook). Each draft layer's kv_a_proj_with_mqa quantized to
    block FP8 on its own; the reference and the noise floor read the per-layer dequantized weights, the
    engine's fused context KV the merged weight vLLM's loader builds from the same shards."""
    import dataclasses as dc

    import torch

    from k3num.engines import base
    from k3num.fixtures.checkpoint import kv_name
    from k3num.refmodel import quant

    state: dict[str, Any] = {}

    def inputs(inp: Any, case: Any) -> Any:
        layers, width, hidden = inp.kv_a.shape
        shards = [quant.quantize_fp8_block(inp.kv_a[layer].double().cpu()) for layer in range(layers)]
        stream = [(kv_name(layer, p), t) for layer, (w, s) in enumerate(shards)
                  for p, t in (("weight", w), ("weight_scale_inv", s))]
        duplicated = engine.extras["weight_loading"].duplicate(iter(stream), layers)
        merged_in = [(n.rsplit(".", 1)[-1], t) for n, t in duplicated if n.startswith("context_kv_proj.")]
        weight, scale = engine.extras["block_fp8_loading"](merged_in, layers, (quant.FP8_BLOCK, quant.FP8_BLOCK))
        state["merged"] = quant.dequantize_fp8_block(weight, scale).view(layers, width, hidden).to(inp.kv_a)
        per_layer = torch.stack([quant.dequantize_fp8_block(w, s) for w, s in shards]).to(inp.kv_a)
        return dc.replace(inp, kv_a=per_layer)

    def subjects(fused: Any) -> dict[str, Any]:
        return {base.CONTEXT_KV_FUSED: (lambda x, kv_a, *rest: fused(x, state["merged"], *rest),
                                        f"{who}(vLLM's merged block-FP8 weight)")}

    return inputs, subjects


def _merged_loader_nvfp4(engine: Any, who: str) -> tuple[Any, Any]:
    """merged_loader_nvfp4's hooks: each layer quantized to NVFP4 on its own (compressed-tensors, its own global scale);
    the engine's context KV reads the merged weight vLLM's loader builds (one global scale kept for all)."""
    import dataclasses as dc

    import torch

    from k3num.engines import base
    from k3num.refmodel import quant

    state: dict[str, Any] = {}
    names = ("weight_packed", "weight_scale", "weight_global_scale")

    def inputs(inp: Any, case: Any) -> Any:
        layers, width, hidden = inp.kv_a.shape
        shards = [quant.quantize_nvfp4(inp.kv_a[layer].double().cpu() * (1 + layer), naming="compressed-tensors")
                  for layer in range(layers)]
        tensors = []
        for layer in range(layers):
            for name in names:
                t = shards[layer][name].detach().clone()
                t.shard_id = layer
                tensors.append((name, t))
            t = torch.ones(1)
            t.shard_id = layer
            tensors.append(("input_global_scale", t))
        got = engine.extras["nvfp4_loading"](tensors, layers)
        deq = quant.dequantize_nvfp4_modelopt(got["weight"], got["weight_scale"], got["weight_multiplier"])
        state["merged"] = deq.view(layers, width, hidden).to(inp.kv_a)
        per_layer = torch.stack([quant.dequantize_nvfp4_modelopt(
            s["weight_packed"], s["weight_scale"], (1.0 / s["weight_global_scale"]).to(torch.float32)) for s in shards])
        return dc.replace(inp, kv_a=per_layer.to(inp.kv_a))

    def subjects(fused: Any) -> dict[str, Any]:
        return {base.CONTEXT_KV_FUSED: (lambda x, kv_a, *rest: fused(x, state["merged"], *rest),
                                        f"{who}(vLLM's merged NVFP4 weight)")}

    return inputs, subjects


def _transferred(engine: Any, t: Any) -> Any:
    """transfer_between_tp_sizes's subject: the DFlash draft's context K/V (the engine's path 3) written to a
    prefill's paged caches, carried to the decode by the engine's released sender plan, and read back there
    (harness/transfer_memory.py); the decode's draft attends over what it reads."""
    from k3num.engines import base
    from k3num.harness import transfer_memory

    draft_kv = engine.subject(base.DRAFT_CONTEXT_KV)

    def subject(*args: Any) -> Any:
        return transfer_memory.transferred(t, engine.extras["kv_transfer"], *draft_kv(*args))

    return subject
