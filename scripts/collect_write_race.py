"""The outputs K3N-004/005's write race gives, kept for the bug model's tests (harness/ledger_models.py
`written_row_read_stale`): each case inside the entries' rule (a bank write inside [0, num_blocks), no delta)
is called --calls times as the repeat property calls it (fresh inputs from the case's seed, poisoned
allocations), and every distinct output is saved with its count, beside the inputs the calls were given and
the bank row as it was before the store. A raced output's model is the mixture with the written bank row
read stale (its value before the call's store) in some of its elements.

Usage (CUDA machine): python scripts/collect_write_race.py OUT.pt [--calls 300] [--engines vllm,vllm-rocm]
Prints one line per (engine, case): the distinct outputs and the model's verdict on each.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

#        tokens hidden bank nb write out_norm seed scale
CASES = [(1, 32, 2, 2, 0, False, 0, 0.01),   # K3N-004's reproducer
         (1, 32, 2, 2, 0, False, 7, 1.0),    # K3N-005's
         (4, 128, 4, 3, 1, True, 3, 1.0),
         (2, 256, 8, 7, 0, False, 11, 1.0),
         (3, 96, 4, 4, 3, True, 5, 1.0),
         (8, 7168, 9, 4, 2, True, 1, 1.0)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", help="the .pt file to write")
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--engines", default="vllm,vllm-rocm")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()
    if args.device == "cpu":
        import os

        os.environ.setdefault("TRITON_INTERPRET", "1")
    from k3num.engines import base, registry
    from k3num.fixtures.builders import attn_res_inputs
    from k3num.fixtures.strategies import AttnResCase
    from k3num.harness import ledger_models
    from k3num.harness.judges import EPS, OUT_EPS
    from k3num.oracles import hunt

    saved = []
    for name in args.engines.split(","):
        engine = registry.get(name)
        fn = engine.subject(base.ATTN_RES)
        for tokens, hidden, bank, nb, write, out_norm, seed, scale in CASES:
            case = AttnResCase(tokens, hidden, bank, nb, write, False, out_norm, seed, scale, 30.0)
            outs: dict[bytes, list] = {}
            for _ in range(args.calls):
                with hunt.poisoned_allocations():
                    inp = attn_res_inputs(case, torch.bfloat16, args.device)
                    before = (inp.prefix.clone(), inp.blocks.clone())
                    out = fn(inp.prefix, None, inp.blocks, inp.norm, inp.qk, inp.out_norm, nb, write, EPS, OUT_EPS)
                key = out.detach().cpu().view(torch.int16).numpy().tobytes()
                if key in outs:
                    outs[key][1] += 1
                else:
                    outs[key] = [out.detach().cpu().clone(), 1]
            inp = attn_res_inputs(case, torch.bfloat16, args.device)
            verdicts = []
            for out, count in outs.values():
                call = ledger_models.Call(base.ATTN_RES, (before[0], None, before[1], inp.norm, inp.qk, inp.out_norm,
                                                         nb, write, EPS, OUT_EPS), {}, out.to(args.device), engine)
                model = getattr(ledger_models, "written_row_read_stale", None)
                verdicts.append(model([call]) if model else "(no model in this tree)")
            print(f"{name} {case}: {len(outs)} distinct of {args.calls}; counts "
                  f"{[c for _, c in outs.values()]}; model: {[v or 'explained' for v in verdicts]}", flush=True)
            saved.append({"engine": name, "case": case, "prefix": before[0].cpu(), "blocks": before[1].cpu(),
                          "norm": inp.norm.cpu(), "qk": inp.qk.cpu(),
                          "out_norm": None if inp.out_norm is None else inp.out_norm.cpu(),
                          "outs": [(o, c) for o, c in outs.values()]})
    torch.save(saved, args.out)
    print(f"wrote {args.out}: {len(saved)} cases")


if __name__ == "__main__":
    main()
