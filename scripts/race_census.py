#!/usr/bin/env python
"""A census of nondeterminism in an attn_res kernel: random cases of every kind the signature allows,
each called oracles.hunt.repeats_for(device) times on identical fresh inputs, classified by what the
call does (a bank write inside the mixed rows, at num_blocks as the model writes, or none; a delta;
the output norm; the source tile BLOCK_L). Answers "which configurations race", e.g. whether any
nondeterminism is left once the ledger's known configurations are set apart (lead 2).

Usage: scripts/race_census.py --engine vllm [--cases 300] [--csv PATH] [--seed 0]
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import pandas as pd  # noqa: E402
import torch  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine", default="vllm")
    ap.add_argument("--cases", type=int, default=300)
    ap.add_argument("--csv", default=None)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    from k3num.engines import base, registry
    from k3num.fixtures.strategies import AttnResCase
    from k3num.oracles import hunt
    from k3num.properties.checks.determinism import attn_res_call

    engine = registry.get(args.engine)
    fn = engine.subject(base.ATTN_RES)
    rng = random.Random(args.seed)
    calls = hunt.repeats_for(device)
    rows = []
    for i in range(args.cases):
        bank = rng.randint(1, 8)
        nb = rng.randint(0, bank)
        write = rng.randint(-1, bank - 1)
        case = AttnResCase(rng.choice([1, 2, 3, 5, 8, 64]), rng.choice([16, 32, 64, 128, 256]), bank, nb, write,
                           rng.random() < 0.5, rng.random() < 0.5, rng.randint(0, 2**16), rng.choice([0.01, 1.0]),
                           rng.choice([0.0, 30.0]))
        once = attn_res_call(engine, fn, case, device)
        outs = []
        for _ in range(calls):
            with hunt.poisoned_allocations():
                o, _ = once()
            outs.append(tuple(t.detach().clone() for t in o))
        k = hunt.distinct(outs)
        kind = "write-in-mix" if 0 <= write < nb else ("write-at/after" if write >= 0 else "no-write")
        rows.append({**case.__dict__, "kind": kind, "block_l": 1 if case.tokens >= 256 or nb <= 1 else 4,
                     "calls": calls, "distinct": k})
        if k > 1:
            print(f"case {i}: {k} distinct of {calls}: {case} [{kind}]", flush=True)
    df = pd.DataFrame(rows)
    table = df.assign(racy=df.distinct > 1).groupby(["kind", "with_delta", "with_output_norm", "block_l"]).agg(
        cases=("racy", "size"), racy=("racy", "sum")).reset_index()
    print(f"\n{engine.name} {engine.version} ({engine.mode}, {device}): {args.cases} cases x {calls} calls")
    print(table.to_string(index=False))
    if args.csv:
        df.to_csv(args.csv, index=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
