"""`k3num impact`: what each engine's K3 paths do to the draft's proposed tokens, per (engine, drafter).

    k3num impact [--engine E[,E...]] [--engine-src E=PATH] [--device D] [--cases N] [--seed S] [--format md|csv]
    k3num impact --ledger [--entry K3N-NNN[,...]] [--engine-src E=PATH] [--device D] [--cases N] [--seed S]
                 [--format md|csv]
    k3num impact --activations FILE [--engine E[,E...]] [--device D] [--cases N] ...
    k3num impact --checkpoint DIR [--lm-head DIR] [--activations FILE] [--engine E[,E...]] ...
    k3num impact --geometry k3 [--engine E[,E...]] [--device cuda] [--cases N] ...

For each engine and each drafter whose K3 paths it binds (harness/draft_step.py), N seeded cases of the
tiny draft step (fixtures.strategies.DraftStepCase) run through the engine's paths and the one bf16
remainder, and are judged position by position against the float64 step (oracles/tokens.py). One row per
(engine, drafter, paths): positions judged, IDENTICAL / TIE-BREAK / DIVERGED, the decided share, the mean
agreement length against the oracle's and the noise floor's, the worst logit error over delta, and a
severity ("changes decided tokens"; "decided tokens in reach": no flip seen, but the logit error reaches a
decided position's margin, exposed_share of them; "near-ties only"; "no token changes").

Exit: 0 nothing diverged outside the ledger (a row whose divergence an entry filed on the token property
explains names it in `ledger`); 1 a decided token flipped otherwise; 2 could not run (an unknown engine, a bad
tree, no engine that binds a drafter's path).

`--activations FILE`: a serving run's captured taps (path 2's output), positions and optionally the block's
hidden states (fixtures/activations.py, checked before anything runs) replace the drawn ones; the geometry is
the drafter's preset at the file's hidden size, and the draft weights are drawn per case (the presets'
assumed sizes; with --checkpoint, the checkpoint's). Path 2 then is not run: the rows say
`aux_capture=given taps`, and an engine that binds only path 2 gets "none bound".

`--checkpoint DIR [--lm-head DIR]`: a draft checkpoint's own weights (fixtures/draft_checkpoint.py: the
draft layers with the query's low-rank form, the LM head, path 3's projection and path 1's weight) replace the
drawn ones at the checkpoint's geometry (the block is the preset's 7); the taps, positions and block states stay
drawn (or captured, with --activations). A DFlash draft checkpoint (SGLang's DFlashDraftModel naming) likewise
runs the DFlash cases: its layers with the per-head query and K norms, its `fc` and `hidden_norm` (path 3), each
layer's k_proj/v_proj/k_norm for the context's K/V, the config's block size and sliding window. The other
drafter's row says it did not run.

`--geometry k3`: the cases at the drafters' K3 preset geometry (`preset_case`: hidden 7168, DSpark's block 7 and
5 layers, DFlash's block 16, 6 layers and window 4096, the presets' assumed heads, MLP width and vocabulary), with
256 context positions and drawn weights: the nightly runs it on the GPU (scripts/gpu_nightly.sh,
K3NUM_IMPACT_K3_CASES).

`--ledger [--entry K3N-NNN,...]`: each ledger entry's case class through the step on the entry's engine
(`ledger_table`; the AttnRes-kernel and FP8-cache ones in harness/impact_kernels.py): the divergence made to reach
the step's inputs the way it reaches a deployment, or the call a caller would make to reach it (the tap of the
wrong stream, taps whose projections cancel through the sharded sum, a draft checkpoint through vLLM's merged
loader, a bank row written inside the mix, a bank one block short, a layer input the kernel leaves unwritten or a
race corrupts, an FP8 cache with a zero scale), one row per drafter and role (the case, and a control through
what the entry lacks) with the counts, a severity and a note. A race runs on a GPU only, the FP8 cache's case
with vLLM's built ops: elsewhere their rows say why they did not run. Exit 0 when it ran, 2 when it could not.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import random
import sys
from pathlib import Path
from typing import Any

import pandas as pd

from k3num.fixtures.strategies import STEP_HIDDEN, DraftStepCase
from k3num.harness import token_cases
from k3num.oracles import tokens

CHANGES, NEAR_TIES, NONE = "changes decided tokens", "near-ties only", "no token changes"
# no decided token flipped in the blocks run, but the logit error reaches decided positions' margins (past delta/2):
# a drift the noise floor (within delta/2) does not make, and exposed_share says how often a decided token could flip
EXPOSED = "decided tokens in reach"
K3_TOKENS = 256  # context positions of a K3-geometry case (--geometry k3): a prompt's worth, as the bench


def sample_cases(kind: str, n: int, seed: int) -> list[DraftStepCase]:
    """n cases of `kind` drawn from the strategy's choices with a seeded generator (reproducible by seed); drafts of
    1 to 5 layers (K3's DSpark has 5), each layer's weights its own."""
    rng = random.Random(f"{kind}:{seed}")
    out = []
    for _ in range(n):
        heads = rng.choice([2, 4])
        head_dim = rng.choice([8, 16])
        out.append(DraftStepCase(
            kind=kind, hidden=rng.choice(STEP_HIDDEN), num_layers=rng.randint(1, 5), num_heads=heads, head_dim=head_dim,
            kv_heads=rng.choice([h for h in (1, 2) if heads % h == 0]) if kind == "dflash" else 1,
            kv_lora=16 if kind == "dspark" else 0, rotary_dim=8 if kind == "dspark" else head_dim,
            window=rng.choice([0, 4, 64]) if kind == "dflash" else 0, vocab=rng.choice([64, 256]),
            taps=rng.randint(1, 3), tokens=rng.randint(1, 12), block=rng.choice([4, 7, 8]),
            seed=rng.randrange(2**31), logit_scale=rng.choice([6.0, 10.0, 16.0])))
    return out


def case_at(g: Any, taps: int, tokens: int, seed: int, **more: Any) -> DraftStepCase:
    """A case at geometry `g` (refmodel/draft_step.DraftStepGeometry) with `taps` target taps and `tokens`
    context positions; its weights and inputs drawn from `seed` (the LM head at logit scale 10)."""
    return DraftStepCase(kind=g.kind, hidden=g.hidden, num_layers=g.num_layers, num_heads=g.num_heads,
                         head_dim=g.head_dim, kv_heads=g.num_kv_heads, kv_lora=g.kv_lora_rank,
                         rotary_dim=g.rope.rotary_dim, window=g.window, vocab=g.vocab, taps=taps, tokens=tokens,
                         block=g.block, seed=seed, logit_scale=10.0, mlp_width=g.mlp_width, **more)


def preset_case(kind: str, tokens: int, seed: int) -> DraftStepCase:
    """A case at the drafter's K3 preset geometry (refmodel/draft_step.py STEP_PRESETS: hidden 7168, the seeds'
    blocks and layers, the assumed heads, MLP width and vocabulary), one target tap per draft layer, `tokens`
    context positions; the weights are drawn from `seed`."""
    from k3num.refmodel.draft_step import STEP_PRESETS

    g = STEP_PRESETS[f"k3-{kind}-step"]
    return case_at(g, g.num_layers, tokens, seed)


def preset_cases(kind: str, n: int, seed: int, tokens: int = K3_TOKENS) -> list[DraftStepCase]:
    """n K3-geometry cases of `kind` (preset_case), seeded from `seed`."""
    rng = random.Random(f"{kind}:{seed}:k3")
    return [preset_case(kind, tokens, rng.randrange(2**31)) for _ in range(n)]


def severity(diverged: int, tie_break: int, exposed: int = 0) -> str:
    """CHANGES where a decided token flipped; else EXPOSED where the logit error reached a decided position's
    margin (oracles/tokens.BlockVerdict.exposed); else NEAR_TIES where a near-tie broke; else NONE."""
    if diverged:
        return CHANGES
    return EXPOSED if exposed else (NEAR_TIES if tie_break else NONE)


def activation_cases(acts: Any, kind: str, n: int, seed: int) -> list[DraftStepCase]:
    """n cases of `kind` over captured activations: the drafter's preset geometry (refmodel/draft_step.py
    STEP_PRESETS: layers, heads, MLP width, vocabulary) at the file's hidden size, its K taps and N tokens, its
    block (block_hidden's B, else the preset's); a seed per case for the draft weights, which are drawn."""
    import dataclasses as dc

    from k3num.refmodel.draft_step import STEP_PRESETS

    g = STEP_PRESETS[f"k3-{kind}-step"]
    k, tokens, hidden = acts.shape
    block = acts.block_hidden.shape[0] if acts.block_hidden is not None else g.block
    rng = random.Random(f"{kind}:{seed}:activations")
    return [case_at(dc.replace(g, hidden=hidden, block=block), k, tokens, rng.randrange(2**31)) for _ in range(n)]


def with_activations(inp: Any, acts: Any, device: str) -> Any:
    """The drawn inputs with the captured ones in place: the taps (path 2 not run: they are its output), the
    context positions, the block's positions after them and, when the file has it, the block's hidden."""
    import dataclasses as dc

    import torch

    dtype = inp.fc.dtype
    last = int(acts.positions[-1])
    b = inp.block_hidden.shape[0]
    return dc.replace(inp, given_taps=acts.taps.to(dtype).to(device), ctx_positions=acts.positions.to(device),
                      block_positions=torch.arange(last + 1, last + 1 + b, device=device),
                      block_hidden=(acts.block_hidden.to(dtype).to(device) if acts.block_hidden is not None
                                    else inp.block_hidden))


def checkpoint_cases(step: Any, n: int, seed: int, acts: Any = None) -> list[DraftStepCase]:
    """n cases of the checkpoint's drafter at its geometry (fixtures/draft_checkpoint.CheckpointStep): its taps,
    1-12 context positions (the captured ones with `acts`, whose taps and width must match), a seed per case for
    the drawn inputs."""
    g = step.geometry
    if acts is not None and (acts.shape[0], acts.shape[2]) != (step.taps, g.hidden):
        raise ValueError(f"--activations: {acts.shape[0]} taps of width {acts.shape[2]}, but the checkpoint's draft "
                         f"reads {step.taps} taps of width {g.hidden}")
    rng = random.Random(f"{g.kind}:{seed}:checkpoint")
    return [case_at(g, step.taps, acts.shape[1] if acts is not None else rng.randint(1, 12), rng.randrange(2**31),
                    target_layers=max(8, 2 * step.taps + 1))
            for _ in range(n)]


def engine_table(engines: list[str], sources: dict[str, Path], mode: str, device: str, n: int, seed: int,
                 log=None, activations: Any = None, checkpoint: Any = None, geometry: str = "drawn",
                 streams: tuple[tuple[str, str], ...] = (("attn_res", "attn_res"),)) -> pd.DataFrame:
    """One row per (engine, drafter) that binds a path of the drafter's step (module docstring); with
    `activations` (fixtures.activations.Activations) the cases are the captured inputs under drawn weights; with
    `checkpoint` (fixtures/draft_checkpoint.CheckpointStep) its drafter's cases run the draft's own weights and
    the other drafter gets a row saying it did not run. `streams`: (trained, served) pairs of the target stream
    the draft was trained on and the one the engine's taps read (harness/draft_step.STREAMS), a row each; a pair
    that differs is the stream mismatch (`--stream-mismatch`), and its rows carry both."""
    from k3num.engines import registry
    from k3num.fixtures.builders import draft_step_inputs
    from k3num.harness import around, draft_step, ledger_models, ledger_run
    from k3num.harness.judges import LOW

    mirror = registry.get("mirror")
    rows = []
    # an engine whose token property a known divergence owns runs once more with the entry's fix applied, so a
    # second bug there is judged plainly (harness/around.py: a fix's `around`)
    for name in engines + around.variants(engines, TOKEN_TEST):
        try:
            engine = (around.engine(name, sources, mode) if around.SEP in name
                      else registry.get(name, sources, mode))
        except (registry.EngineUnavailable, around.Unavailable) as e:
            rows.append({"engine": name, "drafter": "-", "paths": f"unavailable: {e}"})
            continue
        # the plain step, then the compositions the engine's subjects call for (harness/draft_step.VARIANTS: the PP
        # sum, the mixture in a tap), each a row of its own; a stream mismatch runs the plain step only
        mismatch = any(t != s for t, s in streams)
        variants = [None] + ([] if mismatch or checkpoint is not None or activations is not None else
                             [v for v in draft_step.VARIANTS if v.applies(engine)])
        for kind, (trained, served), variant in ((k, s, v) for k in ("dspark", "dflash") for s in streams
                                                 for v in variants):
            results = []
            step = functools.partial(draft_step.run, trained=trained, served=served)
            cols = {"trained_stream": trained, "served_stream": served} if trained != served else {}
            said = f" trained on {trained}, served {served}" if cols else ""
            if variant is not None:
                cols, said = {"variant": variant.name}, f" ({variant.name})"
                step = functools.partial(_composed, variant, trained=trained, served=served)
            if checkpoint is not None and kind != checkpoint.kind:
                rows.append({"engine": name, "drafter": kind,
                             "paths": f"not run: the checkpoint is a {checkpoint.kind} draft"})
                continue
            # the entries filed on the token property: each is named on the row only where its bug model explains
            # the calls the row's step made (a flip its model rejects is not the entry's: the row stays unlabelled)
            entries = [] if "served_stream" in cols else _filed(engine, sources, mode)
            recorded: list = []
            run_on = (ledger_run.record_calls(engine, ledger_run.model_subjects(entries), recorded) if entries
                      else engine)
            try:
                if checkpoint is not None:
                    for case in checkpoint_cases(checkpoint, n, seed, activations):
                        inp = draft_step_inputs(case, LOW, device, given=checkpoint)
                        inp = with_activations(inp, activations, device) if activations is not None else inp
                        results.append(step(run_on, mirror, kind, case, device, inputs=inp,
                                            geometry=checkpoint.geometry))
                elif activations is None:
                    for case in (sample_cases(kind, n, seed) if geometry == "drawn" else preset_cases(kind, n, seed)):
                        results.append(step(run_on, mirror, kind, case, device))
                for case in (activation_cases(activations, kind, n, seed) if activations is not None
                             and checkpoint is None else ()):
                    inp = with_activations(draft_step_inputs(case, LOW, device), activations, device)
                    results.append(step(run_on, mirror, kind, case, device, inputs=inp))
            except draft_step.NoPathBound as e:
                rows.append({"engine": name, "drafter": kind, "paths": f"none bound ({e})"[:200], **cols})
                continue
            if log:
                log(f"[impact] {name} {kind}{said}: {len(results)} blocks")
            # a stream mismatch is a deployment choice measured, not an engine bug: no ledger entry explains it
            filed = ",".join(d.id for d in entries if not ledger_models.explains(d.id, recorded))
            rows.append({**_aggregate(name, kind, results, filed), **cols})
    return pd.DataFrame(rows)


TOKEN_TEST = "test_a_decided_token_never_flips"  # properties/test_draft_tokens.py: the ledger files entries on it


def _composed(variant: Any, engine: Any, mirror: Any, kind: str, case: Any, device: str, **kw: Any) -> Any:
    """One case of a composed row (harness/draft_step.Variant): the case the variant runs, the variant's subjects
    in place of the step's."""
    from k3num.harness import draft_step

    case = variant.case(case)
    return draft_step.run(engine, mirror, kind, case, device, subjects=variant.subjects(engine, case), **kw)


def _filed(engine: Any, sources: dict[str, Path], mode: str) -> list:
    """The ledger entries filed on the token property for this engine, while their files are the bytes run
    (an entry whose files a local tree changed is judged plainly): a divergence they explain (their bug models
    judge the step's calls: engine_table) is known."""
    from k3num.harness import around
    from k3num.oracles import ledger
    from k3num.supply import fetch, installed

    name, fix = around.split(engine.name)
    pin = fetch.PINS.get(name.split("-")[0])
    if pin is None:
        return []
    src = fetch.source_of(pin.engine, sources)
    found = ledger.lookup_all(name, src.pin.version, TOKEN_TEST, installed.expected_mode(src, mode))
    found = around.unfixed_entries(fix, found) if fix is not None else found
    return [d for d in found if fetch.pinned_files(src, d.files)]


def _aggregate(name: str, kind: str, results: list[Any], ledger: str = "") -> dict[str, Any]:
    v = [r.verdict for r in results]
    counts = {label: sum(b.count(label) for b in v) for label in (tokens.IDENTICAL, tokens.TIE_BREAK,
                                                                   tokens.DIVERGED)}
    judged = sum(b.positions for b in v)
    decided, exposed = sum(b.decided for b in v), sum(b.exposed for b in v)
    return {"engine": name, "drafter": kind, "paths": results[0].paths, "ledger": ledger, "blocks": len(v),
            "positions": judged, "identical": counts[tokens.IDENTICAL], "tie_break": counts[tokens.TIE_BREAK],
            "diverged": counts[tokens.DIVERGED], "decided_share": decided / judged,
            "exposed_share": exposed / decided if decided else 0.0,
            "agreement": sum(b.agreement for b in v) / len(v),
            "noise_agreement": sum(r.noise_verdict.agreement for r in results) / len(v),
            "block": judged / len(v), "worst_err_over_delta": max(b.worst_err_over_delta for b in v),
            "q99_err_over_delta": max(b.q99_err_over_delta for b in v),
            "predicted_flips": sum(b.predicted_flips for b in v),
            "severity": severity(counts[tokens.DIVERGED], counts[tokens.TIE_BREAK], exposed)}


# --- the ledger's entries through the step (`--ledger`) -------------------------------------------------
#
# Each entry's case class (harness/token_cases.py, named by the entry's record), run through the draft step on
# the entry's engine, or the reason it does not reach the step here.

NOT_THE_STEP, NO_RACE_ON_CPU, NO_OPS = token_cases.NOT_THE_STEP, token_cases.NO_RACE_ON_CPU, token_cases.NO_OPS


def races() -> tuple[str, ...]:
    """The entries whose case class is a race (harness/impact_kernels.py): run on a GPU only."""
    from k3num.oracles import ledger

    return tuple(d.id for d in ledger.LEDGER if d.race)


def ledger_table(n: int, seed: int, device: str, sources: dict[str, Path], mode: str, entries: list[str] | None = None,
                 log=None) -> pd.DataFrame:
    """One row per ledger entry and drafter it reaches: the entry's case class through the step on its engine,
    with a severity; an entry the step does not reach says why in `severity`."""
    from k3num.engines import registry
    from k3num.oracles import ledger

    check_entries(entries or [])
    mirror = registry.get("mirror")
    rows: list[dict[str, Any]] = []
    with contextlib.ExitStack() as stack:  # the fixed trees the race controls read
        for d in sorted(ledger.LEDGER, key=lambda e: e.id):  # in the ids' order, not the ledger's
            if entries is None or d.id in entries:
                _entry_rows(d, n, seed, device, sources, mode, mirror, rows, stack, log)
    return pd.DataFrame(rows)


def check_entries(entries: list[str]) -> None:
    """ValueError naming the ids in `entries` the ledger does not hold, and those it does."""
    from k3num.oracles import ledger

    unknown = sorted(set(entries) - {d.id for d in ledger.LEDGER})
    if unknown:
        raise ValueError(f"no ledger entry {', '.join(unknown)}; known: {', '.join(d.id for d in ledger.LEDGER)}")


def _entry_rows(d: Any, n: int, seed: int, device: str, sources: dict[str, Path], mode: str, mirror: Any,
                rows: list[dict[str, Any]], stack: Any, log: Any) -> None:
    """`ledger_table`'s rows of entry `d`, appended to `rows`: its case class's plan (harness/token_cases.py), run."""
    from k3num.engines import registry
    from k3num.fixtures.builders import draft_step_inputs
    from k3num.harness import draft_step
    from k3num.harness.judges import LOW

    try:
        engine = registry.get(d.engine, sources, mode)
    except registry.EngineUnavailable as e:
        rows.append({"entry": d.id, "role": "case", "engine": d.engine,
                     "severity": f"not run: {d.engine} unavailable ({e})"[:300]})
        return
    plan = token_cases.plan(token_cases.Ctx(d, engine, mirror, device, sources, mode, stack))
    rows += plan.rows
    for role, kind, shape, hooks in plan.steps:
        results = []
        for case in (shape(c) for c in sample_cases(kind, n, seed)):
            inp = draft_step_inputs(case, LOW, device)
            subjects = None
            if hooks is not None:
                inp = hooks[0](inp, case)
                subjects = hooks[1](case)
            results.append(draft_step.run(engine, mirror, kind, case, device, subjects=subjects, inputs=inp))
        if log:
            log(f"[impact] {d.id} {role} {d.engine} {kind}: {len(results)} blocks")
        row = {"entry": d.id, "role": role, **_aggregate(plan.shown.get(role, d.engine), kind, results, d.id)}
        count, race = plan.counts.get((role, kind), (None, False))
        if count is not None:
            row["note"] = count.note()
            if race and not count.raced and role == "case":  # the race did not happen: no verdict on it
                row["severity"] = f"not seen: the race did not occur in {count.calls} calls"
        rows.append(row)

_RANK = {CHANGES: 3, EXPOSED: 2, NEAR_TIES: 1, NONE: 0}


def read_severities(path: str | Path) -> dict[str, str]:
    """`k3num impact --ledger --format csv`'s output -> {entry: severity}: the worst over the entry's case rows
    (its drafters; control rows are the check, not the entry), or the reason an entry is not reached. Raises
    ValueError naming what is wrong with the file."""
    try:
        t = pd.read_csv(path, keep_default_na=False)
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: cannot read it as a CSV ({e})") from e
    missing = {"entry", "role", "severity"} - set(t.columns)
    if missing:
        raise ValueError(f"{path}: not `k3num impact --ledger --format csv` output (no column "
                         f"{', '.join(sorted(missing))})")
    out: dict[str, str] = {}
    for entry, rows in t[t["role"] == "case"].groupby("entry"):
        sev = [str(s) for s in rows["severity"]]
        ranked = [s for s in sev if s in _RANK]
        out[str(entry)] = max(ranked, key=_RANK.__getitem__) if ranked else sev[0]
    if not out:
        raise ValueError(f"{path}: no entry's case row in it")
    return out


def cmd_impact(args: argparse.Namespace) -> int:
    from k3num.engines import registry
    from k3num.harness import cli
    from k3num.supply import env

    if args.device == "cpu":
        env.put_default("TRITON_INTERPRET", "1")  # before triton's first import, as the plugin does
    try:
        sources = cli._sources(args.engine_src)
        names = [e.strip() for e in args.engine.split(",") if e.strip()] if args.engine else [
            n for n in registry.defaults() if n != "mirror"]
        unknown = [n for n in names if n not in registry.known()]
        if unknown:
            raise ValueError(f"--engine: unknown engine(s) {', '.join(unknown)}; known: {', '.join(registry.known())}")
        if args.cases < 1:
            raise ValueError(f"--cases: expected >= 1, got {args.cases}")
        entries = [e.strip() for e in args.entry.split(",") if e.strip()] if args.entry else None
        if entries is not None and not args.ledger:
            raise ValueError("--entry names ledger entries: give --ledger")
        if entries is not None:
            try:
                check_entries(entries)
            except ValueError as e:
                raise ValueError(f"--entry: {e}") from e
        if args.ledger and args.engine:
            raise ValueError("--ledger runs each entry on its own engine: leave out --engine")
        if args.ledger and (args.activations or args.checkpoint):
            raise ValueError("--ledger runs each entry's own case class: leave out --activations and --checkpoint")
        if args.geometry == "k3" and (args.ledger or args.activations or args.checkpoint):
            raise ValueError("--geometry k3 draws its cases at the presets' geometry: leave out --ledger, "
                             "--activations and --checkpoint (they bring their own)")
        if args.lm_head and not args.checkpoint:
            raise ValueError("--lm-head is read with a draft --checkpoint: give one")
        if args.stream_mismatch and (args.ledger or args.trained_stream or args.served_stream):
            raise ValueError("--stream-mismatch runs both mismatched pairs itself: leave out --ledger, "
                             "--trained-stream and --served-stream")
        acts = None
        if args.activations:
            from k3num.fixtures import activations

            acts = activations.load(args.activations)
        from k3num.fixtures import device as dev

        device = dev.resolve(args.device or "")
        ckpt = _checkpoint_step(args.checkpoint, args.lm_head, device) if args.checkpoint else None
        if ckpt is not None and acts is not None:
            checkpoint_cases(ckpt, 1, args.seed, acts)  # the file's taps against the draft's, before any run
        streams = _streams(args, ckpt)
    except ValueError as e:
        print(f"[impact] ERROR: {e}", file=sys.stderr)
        return 2
    if args.ledger:
        table = ledger_table(args.cases, args.seed, device, sources, "auto", entries=entries,
                             log=lambda m: print(m, file=sys.stderr))
        print(table.to_csv(index=False) if args.format == "csv" else _markdown(table, args, LEDGER_COLUMNS), end="")
        return 0
    if args.geometry == "k3" and device == "cpu":
        print("[impact] WARNING: --geometry k3 on the CPU: each case draws the presets' weights (the LM head alone is "
              "163840 x 7168, about 12 GB with its float64 copy) and runs for minutes", file=sys.stderr)
    table = engine_table(names, sources, "auto", device, args.cases, args.seed,
                         log=lambda m: print(m, file=sys.stderr), activations=acts, checkpoint=ckpt,
                         geometry=args.geometry, streams=streams)
    judged = table[table.get("positions", pd.Series(dtype=float)).notna()] if "positions" in table else table.iloc[0:0]
    if judged.empty:
        causes = [f"{r['engine']} {r['drafter']}: {r['paths']}" for _, r in table.iterrows()]
        print("[impact] ERROR: nothing was judged, because:\n" + "\n".join(f"  {c}" for c in causes)
              + "\n(no engine binds a K3 path of either drafter's step)", file=sys.stderr)
        return 2
    mismatched = "served_stream" in table
    if args.format == "csv":
        print(table.to_csv(index=False), end="")
    else:
        extra = ["trained_stream", "served_stream"] if mismatched else ["variant"] if "variant" in table else []
        cols = ENGINE_COLUMNS[:2] + extra + ENGINE_COLUMNS[2:]
        print(_markdown(table, args, cols) + "\n" + reach_lines(names, sources))
    if mismatched:  # what a stream mismatch does is the measurement: it fails nothing
        return 0
    unexplained = judged[(judged["diverged"] > 0) & (judged["ledger"].fillna("") == "")]
    return 1 if len(unexplained) else 0


def _streams(args: argparse.Namespace, ckpt: Any) -> tuple[tuple[str, str], ...]:
    """The (trained, served) stream pairs to run: both mismatches (--stream-mismatch), or the one given, the
    trained stream defaulting to a checkpoint config's own (fixtures/draft_checkpoint.aux_stream), else attn_res;
    where a checkpoint's declared stream and the engine's served one differ, it is said on stderr."""
    if args.stream_mismatch:
        return (("attn_res", "prefix"), ("prefix", "attn_res"))
    declared = ckpt.stream if ckpt is not None else None
    trained = args.trained_stream or declared or "attn_res"
    served = args.served_stream or "attn_res"
    if declared is not None and args.trained_stream and args.trained_stream != declared:
        raise ValueError(f"--trained-stream {args.trained_stream}: the checkpoint's config says the draft was "
                         f"trained on {declared} (aux_hidden_stream)")
    if declared is not None:
        same = "the same stream" if served == declared else f"another stream: {served}"
        print(f"[impact] the checkpoint's config says its draft was trained on the {declared} stream "
              f"(aux_hidden_stream); the engines serve {same} (--served-stream)"
              f"{'' if served == declared else '; the rows measure that mismatch'}", file=sys.stderr)
    return ((trained, served),)


def reach_lines(names: list[str], sources: dict[str, Path]) -> str:
    """Markdown: every subject each engine binds that the step does not run, with why (harness/draft_step.py
    `reach`); the ones it runs are the rows' `paths`."""
    from k3num.engines import registry
    from k3num.harness import draft_step

    lines = []
    for name in names:
        try:
            engine = registry.get(name, sources, "auto")
        except registry.EngineUnavailable:
            continue  # its row says why
        lines += [f"- {name}: {subject}: {why.removeprefix('not in the step: ')}"
                  for subject, why in draft_step.reach(engine).items() if not why.startswith("in the step")]
    head = "Bound subjects the step does not run (each engine's others are in its rows' `paths`):"
    return "\n".join([head, "", *lines]) + "\n" if lines else f"{head} none.\n"


def _checkpoint_step(path: str, lm_head: str | None, device: str) -> Any:
    """--checkpoint DIR (and --lm-head DIR) as its drafter's step weights; a CheckpointError (a ValueError) names
    the file and the tensor."""
    from k3num.fixtures.checkpoint import open_checkpoint
    from k3num.fixtures.draft_checkpoint import read_step
    from k3num.harness.judges import LOW
    from k3num.refmodel.draft_step import STEP_PRESETS

    ckpt = open_checkpoint(path)
    head = open_checkpoint(lm_head) if lm_head else None
    blocks = {kind: STEP_PRESETS[f"k3-{kind}-step"].block for kind in ("dspark", "dflash")}
    return read_step(ckpt, head, blocks, LOW, device)


ENGINE_COLUMNS = ["engine", "drafter", "paths", "positions", "identical", "tie_break", "diverged", "decided_share",
                  "exposed_share", "agreement", "noise_agreement", "block", "worst_err_over_delta",
                  "q99_err_over_delta", "predicted_flips", "severity", "ledger"]
LEDGER_COLUMNS = ["entry", "role", "engine", "drafter", "paths", "positions", "identical", "tie_break", "diverged",
                  "exposed_share", "agreement", "noise_agreement", "worst_err_over_delta", "q99_err_over_delta",
                  "predicted_flips", "severity", "note"]


def _markdown(table: pd.DataFrame, args: argparse.Namespace, cols: list[str]) -> str:
    what = "ledger entry and drafter, each entry's case class on its engine" if args.ledger else "engine and drafter"
    lines = [f"# k3num impact: {args.cases} seeded blocks per {what} (seed {args.seed})", "",
             "Per position against the float64 step: IDENTICAL, TIE-BREAK (a near-tie: the oracle's top-two gap "
             "below delta, the logit budget from the noise floor), DIVERGED (a decided token flipped). agreement: "
             "the mean leading positions equal to the oracle's proposal; noise_agreement: the same for the noise "
             "floor (every K3 path through the bf16 mirror). decided_share: the share of positions whose oracle "
             "top-two gap is at least delta (where a flip would be a divergence); block: the drafter's block length; "
             "worst_err_over_delta: the worst logit error against the oracle, over delta (past 1, a decided token "
             "could flip); q99_err_over_delta: the worst block's 99th-percentile logit error over delta (past 1, more "
             "than 1% of a block's logits beyond delta: the token property's latent divergence); predicted_flips: "
             "the expected decided flips over the blocks run, from the oracle's margins and each position's logit "
             "error (oracles/tokens.py; compare with diverged); exposed_share: the share of decided positions "
             "within the logit error's reach (top-two gap below twice the position's logit error: the most a "
             "decided token could flip per position, "
             "severity `decided tokens in reach` where no flip was seen); role (--ledger): `case` is the entry's "
             "case class, `control` the same calls without its defect. Exit 1 only for a decided token flipped "
             "outside the ledger: a row whose flips an entry explains names it in `ledger` (vllm-rocm's aux tap) "
             "and does not fail the run.", ""]
    if "variant" in cols:
        lines += ["variant: empty for the plain step; `pp sum`: the engine's stage partials over a drawn split of 2-4 "
                  "PP stages and its finalize in place of the one-stage projection; `mixture tap`: the engine's "
                  "read-only mixture inside the tap, where it binds no tap (hidden 1024: its Triton pair); "
                  "harness/draft_step.py VARIANTS.", ""]
    if "served_stream" in cols:
        lines += ["trained_stream: the target stream the draft was trained on (the float64 step and the noise floor "
                  "read it); served_stream: the one the engine's aux taps read (attn_res: the AttnRes mixture, vLLM's "
                  "VLLM_KIMI_K3_AUX_ATTN_RES_STREAM=1; prefix: the prefix sum, its default). Where they differ the "
                  "flips and predicted_flips are what serving the draft with the other stream does to its "
                  "proposals: a deployment's choice measured, not an engine's bug (exit 0).", ""]
    if args.ledger:
        from k3num.oracles import ledger

        shown = sorted(dict.fromkeys(str(e) for e in table.get("entry", pd.Series(dtype=str)) if str(e)))
        lines += ["Entries:", ""] + [f"- {e}: {ledger.by_id(e).what.split('. ')[0][:220]}"
                                     for e in shown if ledger.by_id(e) is not None] + [""]
    lines += ["| " + " | ".join(cols) + " |", "| " + " | ".join("---" for _ in cols) + " |"]
    for r in table.to_dict("records"):
        cells = []
        for c in cols:
            v = r.get(c, "")
            cells.append(f"{v:.3g}" if isinstance(v, float) and v == v else ("" if v != v else str(v)))
        lines.append("| " + " | ".join(x.replace("|", "/") for x in cells) + " |")
    return "\n".join(lines) + "\n"


def add_parser(sub) -> None:
    p = sub.add_parser("impact", help="what each engine's K3 paths do to the draft's proposed tokens: per (engine, "
                                      "drafter) the positions identical, tie-broken and diverged against the float64 "
                                      "draft step; exit 0 no decided token flipped outside the ledger, 1 one did, 2 "
                                      "could not run",
                       epilog="exit codes: 0 no decided token flipped outside the ledger (a row whose flips a ledger "
                              "entry explains, e.g. vllm-rocm's aux tap's, is labelled with it and does not fail); 1 a "
                              "decided token flipped outside the ledger; 2 could not run (bad input). With --ledger: "
                              "0 when every entry's row ran or said why not.")
    p.add_argument("--engine", default=None, help="engines (comma-separated; default: the real engines)")
    p.add_argument("--engine-src", action="append", default=[], metavar="NAME=PATH",
                   help="read an engine's files from a local tree (a checkout, a patch)")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda where there is one)")
    p.add_argument("--cases", type=int, default=20, help="seeded blocks per engine and drafter (default 20)")
    p.add_argument("--seed", type=int, default=0,
                   help="seed of the case draws: the same seed gives the same cases, weights and inputs (default 0)")
    p.add_argument("--format", choices=("md", "csv"), default="md",
                   help="md (default): a Markdown table with its legend; csv: one row per (engine, drafter, row)")
    p.add_argument("--activations", default=None, metavar="FILE",
                   help="a serving run's captured taps and positions (safetensors: fixtures/activations.py; "
                        "docs/capturing-activations.md): the cases are these inputs under drawn draft weights at the "
                        "presets' geometry; a bad file exits 2 naming the tensor")
    p.add_argument("--geometry", choices=("drawn", "k3"), default="drawn",
                   help="drawn (default): the properties' tiny sizes, drawn per case; k3: the presets' K3 geometry "
                        "(hidden 7168, the real blocks, vocabulary 163840; GBs of weights per case: a GPU's job)")
    p.add_argument("--checkpoint", default=None, metavar="DIR",
                   help="a DSpark or DFlash draft checkpoint (HF layout; fixtures/draft_checkpoint.py lists the "
                        "tensors): that drafter's cases run the draft's own layers, LM head, projection and "
                        "context-KV weights; a bad or incomplete checkpoint exits 2 naming the file and the tensor")
    p.add_argument("--lm-head", default=None, metavar="DIR",
                   help="the checkpoint holding lm_head.weight when the draft has none (vLLM's DSpark and SGLang's "
                        "DFlash use the target's)")
    p.add_argument("--ledger", action="store_true",
                   help="instead: each ledger entry's case class through the step on the entry's engine, with a "
                        "severity, or why the step does not reach it (exit 0 when it ran)")
    p.add_argument("--entry", default=None, metavar="K3N-NNN[,...]",
                   help="with --ledger: only these entries (default: all)")
    p.add_argument("--served-stream", choices=("attn_res", "prefix"), default=None,
                   help="the target stream the engines' aux taps read: attn_res, the AttnRes mixture (vLLM with "
                        "VLLM_KIMI_K3_AUX_ATTN_RES_STREAM=1), or prefix, the prefix sum (vLLM's default, the flag "
                        "off); default attn_res")
    p.add_argument("--trained-stream", choices=("attn_res", "prefix"), default=None,
                   help="the stream the draft was trained on, which the float64 step and the noise floor read "
                        "(default: a --checkpoint config's aux_hidden_stream, else attn_res)")
    p.add_argument("--stream-mismatch", action="store_true",
                   help="instead: per engine and drafter, a draft trained on one stream served the other, both ways "
                        "(attn_res -> prefix: vLLM's default against a draft trained with the flag on): the flips "
                        "and predicted flips of the mismatch; exit 0 when it ran")
    p.set_defaults(func=cmd_impact)
