"""`k3num impact`: what each engine's K3 paths do to the draft's proposed tokens, per (engine, drafter).

    k3num impact [--engine E[,E...]] [--engine-src E=PATH] [--device D] [--cases N] [--seed S] [--format md|csv]

For each engine and each drafter whose K3 paths it binds (harness/draft_step.py), N seeded cases of the
tiny draft step (fixtures.strategies.DraftStepCase) run through the engine's paths and the one bf16
remainder, and are judged position by position against the float64 step (oracles/tokens.py). One row per
(engine, drafter, paths): positions judged, IDENTICAL / TIE-BREAK / DIVERGED, the decided share, the mean
agreement length against the oracle's and the noise floor's, the worst logit error over delta, and a
severity ("changes decided tokens", "near-ties only", "no token changes").

Exit: 0 nothing diverged outside the ledger (a row whose divergence an entry filed on the token property
explains names it in `ledger`); 1 a decided token flipped otherwise; 2 could not run (an unknown engine, a bad tree, no
engine that binds a drafter's path). The ledger's entries are not run through the step yet (the step has
no path 2, and the entries' case classes need their own inputs: docs/architecture.md lists it as next).
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path
from typing import Any

import pandas as pd

from k3num.fixtures.strategies import DraftStepCase
from k3num.oracles import tokens

CHANGES, NEAR_TIES, NONE = "changes decided tokens", "near-ties only", "no token changes"


def sample_cases(kind: str, n: int, seed: int) -> list[DraftStepCase]:
    """n cases of `kind` drawn from the strategy's choices with a seeded generator (reproducible by seed)."""
    rng = random.Random(f"{kind}:{seed}")
    out = []
    for _ in range(n):
        heads = rng.choice([2, 4])
        head_dim = rng.choice([8, 16])
        out.append(DraftStepCase(
            kind=kind, hidden=rng.choice([32, 64]), num_layers=rng.randint(1, 2), num_heads=heads, head_dim=head_dim,
            kv_heads=rng.choice([h for h in (1, 2) if heads % h == 0]) if kind == "dflash" else 1,
            kv_lora=16 if kind == "dspark" else 0, rotary_dim=8 if kind == "dspark" else head_dim,
            window=rng.choice([0, 4, 64]) if kind == "dflash" else 0, vocab=rng.choice([64, 256]),
            taps=rng.randint(1, 3), tokens=rng.randint(1, 12), block=rng.choice([4, 7, 8]),
            seed=rng.randrange(2**31), logit_scale=rng.choice([6.0, 10.0, 16.0])))
    return out


def severity(diverged: int, tie_break: int) -> str:
    return CHANGES if diverged else (NEAR_TIES if tie_break else NONE)


def engine_table(engines: list[str], sources: dict[str, Path], mode: str, device: str, n: int, seed: int,
                 log=None) -> pd.DataFrame:
    """One row per (engine, drafter) that binds a path of the drafter's step (module docstring)."""
    from k3num.engines import registry
    from k3num.harness import draft_step

    mirror = registry.get("mirror")
    rows = []
    for name in engines:
        try:
            engine = registry.get(name, sources, mode)
        except registry.EngineUnavailable as e:
            rows.append({"engine": name, "drafter": "-", "paths": f"unavailable: {e}"[:200]})
            continue
        for kind in ("dspark", "dflash"):
            results = []
            try:
                for case in sample_cases(kind, n, seed):
                    results.append(draft_step.run(engine, mirror, kind, case, device))
            except draft_step.NoPathBound as e:
                rows.append({"engine": name, "drafter": kind, "paths": f"none bound ({e})"[:200]})
                continue
            if log:
                log(f"[impact] {name} {kind}: {len(results)} blocks")
            v = [r.verdict for r in results]
            counts = {label: sum(b.count(label) for b in v) for label in (tokens.IDENTICAL, tokens.TIE_BREAK,
                                                                           tokens.DIVERGED)}
            judged = sum(b.positions for b in v)
            rows.append({
                "engine": name, "drafter": kind, "paths": results[0].paths, "ledger": _filed(engine, sources, mode),
                "blocks": len(v), "positions": judged,
                "identical": counts[tokens.IDENTICAL], "tie_break": counts[tokens.TIE_BREAK],
                "diverged": counts[tokens.DIVERGED], "decided_share": sum(b.decided for b in v) / judged,
                "agreement": sum(b.agreement for b in v) / len(v),
                "noise_agreement": sum(r.noise_verdict.agreement for r in results) / len(v),
                "block": sum(b.positions for b in v) / len(v),
                "worst_err_over_delta": max(b.worst_err_over_delta for b in v),
                "severity": severity(counts[tokens.DIVERGED], counts[tokens.TIE_BREAK])})
    return pd.DataFrame(rows)


TOKEN_TEST = "test_a_decided_token_never_flips"  # properties/test_draft_tokens.py: the ledger files entries on it


def _filed(engine: Any, sources: dict[str, Path], mode: str) -> str:
    """The ledger entries filed on the token property for this engine, while their files are the bytes run
    (an entry whose files a local tree changed is judged plainly): a divergence they explain is known."""
    from k3num.oracles import ledger
    from k3num.supply import fetch, installed

    pin = fetch.PINS.get(engine.name.split("-")[0])
    if pin is None:
        return ""
    src = fetch.source_of(pin.engine, sources)
    found = ledger.lookup_all(engine.name, pin.version, TOKEN_TEST, installed.expected_mode(src, mode))
    return ",".join(d.id for d in found if fetch.pinned_files(src, d.files))


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
        from k3num.fixtures import device as dev

        device = dev.resolve(args.device or "")
    except ValueError as e:
        print(f"[impact] ERROR: {e}", file=sys.stderr)
        return 2
    table = engine_table(names, sources, "auto", device, args.cases, args.seed,
                         log=lambda m: print(m, file=sys.stderr))
    judged = table[table.get("positions", pd.Series(dtype=float)).notna()] if "positions" in table else table.iloc[0:0]
    if judged.empty:
        print("[impact] ERROR: no engine binds a K3 path of either drafter's step: nothing was judged\n"
              + table.to_string(index=False), file=sys.stderr)
        return 2
    if args.format == "csv":
        print(table.to_csv(index=False), end="")
    else:
        print(_markdown(table, args))
    unexplained = judged[(judged["diverged"] > 0) & (judged["ledger"].fillna("") == "")]
    return 1 if len(unexplained) else 0


def _markdown(table: pd.DataFrame, args: argparse.Namespace) -> str:
    cols = ["engine", "drafter", "paths", "positions", "identical", "tie_break", "diverged", "decided_share",
            "agreement", "noise_agreement", "block", "worst_err_over_delta", "severity", "ledger"]
    lines = [f"# k3num impact: {args.cases} seeded blocks per engine and drafter (seed {args.seed})", "",
             "Per position against the float64 step: IDENTICAL, TIE-BREAK (a near-tie: the oracle's top-two gap "
             "below delta, the logit budget from the noise floor), DIVERGED (a decided token flipped). agreement: "
             "the mean leading positions equal to the oracle's proposal; noise_agreement: the same for the noise "
             "floor (every K3 path through the bf16 mirror).", "",
             "| " + " | ".join(cols) + " |", "| " + " | ".join("---" for _ in cols) + " |"]
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
                                      "draft step; exit 0 nothing diverged, 1 a decided token flipped, 2 could not run")
    p.add_argument("--engine", default=None, help="engines (comma-separated; default: the real engines)")
    p.add_argument("--engine-src", action="append", default=[], metavar="NAME=PATH",
                   help="read an engine's files from a local tree (a checkout, a patch)")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda where there is one)")
    p.add_argument("--cases", type=int, default=20, help="seeded blocks per engine and drafter (default 20)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--format", choices=("md", "csv"), default="md")
    p.set_defaults(func=cmd_impact)
