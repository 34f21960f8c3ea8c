"""What vLLM 0.33.0's compiled FP8 cache inserts write for a zero or non-finite layer scale (K3N-014).

Needs CUDA and `k3num build-ops` (mode source-gpu+ops). For each insert (grouped, per layer), format and
bad scale, one layer of [kv_c | k_pe] entries (bf16, N(0, 16)) is written into a uint8 cache: the table
says whether the call raised, and which FP8 values the written slots hold (the distinct decoded values,
and how many of the 576 x N bytes are NaN). Usage: python scripts/fp8_bad_scale_probe.py [--csv OUT]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pandas as pd
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from k3num.engines import registry  # noqa: E402

BAD = (0.0, -0.0, float("inf"), float("-inf"), float("nan"))
FORMATS = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


def probe(ops, grouped: bool, fmt: str, scale: float, tokens: int = 8) -> dict:
    gen = torch.Generator().manual_seed(0)
    kv_c = (torch.randn(1, tokens, 512, generator=gen) * 4).bfloat16().cuda()
    k_pe = (torch.randn(1, tokens, 64, generator=gen) * 4).bfloat16().cuda()
    cache = torch.zeros(1, 16, 576, dtype=torch.uint8, device="cuda")  # one layer: [NB, BS, W]
    slots = torch.arange(tokens, device="cuda")[None]
    scales = torch.tensor([scale], dtype=torch.float32, device="cuda")
    row = {"insert": "grouped" if grouped else "per-layer", "format": fmt, "scale": scale}
    try:
        if grouped:
            ops.insert_grouped(kv_c, k_pe, [cache], slots, fmt, scales)
        else:
            ops.insert_per_layer(kv_c[0], k_pe[0], cache, slots[0].contiguous(), fmt, scales)
        torch.cuda.synchronize()
    except (RuntimeError, ValueError) as e:
        row.update(raised=str(e).splitlines()[0][:80], changed=int((cache != 0).sum()))
        return row
    vals = cache[0, :tokens].view(FORMATS[fmt]).float()
    finite = vals[torch.isfinite(vals)]
    row.update(raised="", nan=int(torch.isnan(vals).sum()), inf=int(torch.isinf(vals).sum()), bytes=vals.numel(),
               values=" ".join(f"{v:g}" for v in sorted(set(finite.unique().tolist()))[:6]))
    return row


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--csv")
    args = ap.parse_args()
    engine = registry.get("vllm")
    ops = engine.extras.get("context_kv_ops")
    if ops is None or "+ops" not in engine.mode:
        print(f"needs vLLM's built ops (mode {engine.mode}: {engine.mode_note})")
        return 2
    rows = [probe(ops, g, f, s) for g in (True, False) for f in FORMATS for s in BAD]
    table = pd.DataFrame(rows)
    print(table.to_string(index=False))
    if args.csv:
        table.to_csv(args.csv, index=False)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
