"""Reproducer of ledger entries K3N-004/005: vLLM's attn_res Triton kernels (NVIDIA and ROCm) race
when they write a bank row that is also a source of the same call and there is no delta.

Each case calls the kernel --calls times on fresh copies of the same inputs and counts the calls
whose output is over the accuracy budget of the oracle (write, then mix: see
properties/test_attn_res.py) and how many distinct outputs the same input gave. A deterministic
kernel gives 1 distinct output. The control rows (a delta, so the kernel's barrier is emitted; or a
write at num_blocks, as the model calls it) should show 0 over budget and 1 distinct output.

Usage (CUDA machine, after `k3num fetch`): python scripts/repro_attn_res_write_race.py [--calls 200]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--csv", default=None)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                    help="cpu runs the kernels under the Triton interpreter: a smoke run (it cannot race)")
    ap.add_argument("--small", action="store_true", help="only the hidden-32 case (a smoke run)")
    args = ap.parse_args()
    if args.device == "cpu":
        import os

        os.environ.setdefault("TRITON_INTERPRET", "1")
    from k3num.engines import base, registry
    from k3num.fixtures.builders import attn_res_inputs
    from k3num.fixtures.strategies import AttnResCase
    from k3num.harness.judges import EPS, OUT_EPS, mixture_budget
    from k3num.properties.support import up
    from k3num.refmodel import attn_res as ref

    rows = []
    #          tokens hidden bank nb write delta   what
    cases = [(1, 32, 2, 2, 0, False, "write inside the mix, no delta"),
             (1, 7168, 8, 8, 3, False, "same at hidden 7168"),
             (64, 7168, 8, 4, 0, False, "64 tokens"),
             (255, 7168, 8, 4, 0, False, "255 tokens (BLOCK_L=4)"),
             (256, 7168, 8, 4, 0, False, "256 tokens (BLOCK_L=1)"),
             (64, 7168, 8, 4, 0, True, "control: with delta (barrier)"),
             (64, 7168, 8, 4, 4, False, "control: write at num_blocks (the model's call)")]
    if args.small:
        cases = cases[:1]
    for engine_name in ("vllm", "vllm-rocm"):
        fn = registry.get(engine_name).subject(base.ATTN_RES)
        for tokens, hidden, bank, nb, write, delta, what in cases:
            case = AttnResCase(tokens, hidden, bank, nb, write, delta, False, 7, 1.0, 30.0)
            inp = attn_res_inputs(case, torch.bfloat16, args.device)
            p = inp.prefix if inp.delta is None else (inp.prefix.float() + inp.delta.float()).to(torch.bfloat16)
            want, new_prefix, new_blocks = ref.attn_res(up(p), None, up(inp.blocks), up(inp.norm), up(inp.qk), None,
                                                        nb, write, EPS, OUT_EPS)
            sources = torch.cat([new_blocks[:, :nb], new_prefix[:, None]], 1)
            budget = mixture_budget(want, sources, up(inp.norm) * up(inp.qk), hidden).value
            over, seen, worst = 0, set(), 0.0
            for _ in range(args.calls):
                out = fn(inp.prefix.clone(), None if inp.delta is None else inp.delta, inp.blocks.clone(), inp.norm,
                         inp.qk, None, nb, write, EPS, OUT_EPS)
                err = (up(out) - want).abs().max().item()
                worst = max(worst, err / budget)
                over += err > budget
                seen.add(out.cpu().view(torch.int16).numpy().tobytes())
            rows.append({"engine": engine_name, "case": what, "tokens": tokens, "hidden": hidden, "nb": nb,
                         "write": write, "delta": delta, "calls": args.calls, "over_budget": over,
                         "distinct_outputs": len(seen), "worst_ratio": worst})
            print(f"{engine_name:<10} {what:<48} over budget {over:>4}/{args.calls}  distinct {len(seen):>4}  "
                  f"worst ratio {worst:.3g}", flush=True)
    if args.csv:
        import pandas as pd

        pd.DataFrame(rows).to_csv(args.csv, index=False)


if __name__ == "__main__":
    main()
