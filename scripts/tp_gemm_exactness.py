"""Whether vLLM 0.34.0's column-parallel context projection is exact on this device's GEMM at K3's sizes.

The specialized DSpark drafter's `context_proj` (drafter/model.py) gives each TP rank H_out / TP rows of the
weight and all-gathers the shards; its docstring calls it exact ("same dot products, full K per output column").
That holds if the GEMM computes each output column's dot product the same way whatever N it is given. cuBLAS
picks its kernel (tile, split-K) by the problem's shape, so on a GPU it is a question of fact. This runs every
rank of each TP size in one process on one device, through the release's own layer (extras["context_proj_tp"]:
context_proj, GatheredColumnParallelLinear, ColumnParallelLinear's loader and forward), the gather being the
concatenation of the ranks' shards in rank order (what the all-gather returns), and compares the result with the
replicated projection (one GEMM over the whole weight) bit for bit and with the float64 oracle.

Usage:
    python scripts/tp_gemm_exactness.py [--device cuda] [--tokens 8,64,256] [--tp 2,4,8] [--hidden 7168]
        [--taps 5] [--csv OUT.csv]

One row per (TP, tokens): the mismatched elements against the replicated projection, their largest difference
in bf16 ulps of the replicated value, and both results' error over the oracle's one-GEMM budget. Exit 0 always
when it ran (a mismatch is the finding, not an error); 2 when it could not run.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pandas as pd
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the device machine runs it from a plain checkout


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--tokens", default="8,64,256", help="rows of the projection: R * (k + 1) (default 8,64,256)")
    p.add_argument("--tp", default="2,4,8", help="TP sizes (default 2,4,8)")
    p.add_argument("--hidden", type=int, default=7168, help="the target's and the draft's hidden size (K3: 7168)")
    p.add_argument("--taps", type=int, default=5, help="target layers tapped (K3's DSpark: 5)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--csv", default=None)
    a = p.parse_args(argv)
    from k3num.engines import registry
    from k3num.harness import judges
    from k3num.supply import fetch

    try:
        tokens = [int(t) for t in a.tokens.split(",")]
        tps = [int(t) for t in a.tp.split(",")]
        engine = registry.build("vllm", {"vllm": fetch.source_of("vllm@0.34.0", {}).root}, "auto")
        make = engine.extras["context_proj_tp"]
    except (ValueError, KeyError, registry.EngineUnavailable) as e:
        print(f"tp_gemm_exactness: cannot run: {e}", file=sys.stderr)
        return 2
    g = torch.Generator(device="cpu").manual_seed(a.seed)
    k = a.taps * a.hidden
    w = (torch.randn(a.hidden, k, generator=g) / k ** 0.5).to(torch.bfloat16).to(a.device)
    rows = []
    for t in tokens:
        x = torch.randn(t, k, generator=g).to(torch.bfloat16).to(a.device)
        want = judges.context_projection(x, w, a.taps)
        replicated = torch.nn.functional.linear(x, w)
        for tp in tps:
            shards: list[torch.Tensor] = []
            for rank in range(tp):
                layer = make(tp, rank, lambda s, _shards=shards: _shards.append(s) or s, target_hidden=a.hidden,
                             target_layers=a.taps, hidden=a.hidden, device=a.device)
                layer.weight.weight_loader(layer.weight, w)
                with torch.no_grad():
                    layer(x)  # its gather records the rank's shard
            got = torch.cat(shards, dim=-1)
            bad = got != replicated
            ulp = (replicated.float().abs().clamp(min=2.0 ** -126) * 2.0 ** -7)  # one bf16 ulp (8 bits) at |ref|
            ulps = ((got.float() - replicated.float()).abs() / ulp)[bad]
            ref = want.reference.to(a.device)
            rows.append({"device": torch.cuda.get_device_name() if a.device.startswith("cuda") else "cpu",
                         "tp": tp, "tokens": t, "K": k, "N_per_rank": a.hidden // tp,
                         "mismatched": int(bad.sum()), "of": got.numel(),
                         "max_ulps": float(ulps.max()) if ulps.numel() else 0.0,
                         "sharded_err_over_budget": float((got.double() - ref).abs().max()) / want.budget.value,
                         "replicated_err_over_budget": float((replicated.double() - ref).abs().max())
                         / want.budget.value})
            print(f"[tp-gemm] TP {tp} tokens {t}: {rows[-1]['mismatched']} of {got.numel()} differ", flush=True)
    table = pd.DataFrame(rows)
    print(table.to_string(index=False))
    if a.csv:
        table.to_csv(a.csv, index=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
