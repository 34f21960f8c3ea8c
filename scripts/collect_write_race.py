"""The outputs K3N-004/005's write race gives, and how far a stale-read model explains them.

Each case inside the entries' rule (a bank write inside [0, num_blocks), no delta) is called --calls times as
the repeat property calls it (fresh inputs from the case's seed, poisoned allocations); every distinct output
is saved with its count, beside the inputs (the written bank row before the store is `blocks[:, w]`). Each
output row is then fitted, in float64, by the candidate model (`fit`): the mixture whose written row w takes
its value before the store ("old") in a set of 32-element segments, for its values and its score, and whose
softmax normalizer takes w's score from another such set (both sets any subset up to 8 segments). The
largest error of the best candidate, relative to the row's largest element, is printed per output: about
1e-3 is bf16's own rounding, more is not explained. docs/gpu-run.md (run 112) has what the GPU gave.

Usage (CUDA machine): python scripts/collect_write_race.py OUT.pt [--calls 300] [--engines vllm,vllm-rocm]
          (any machine): python scripts/collect_write_race.py --explain OUT.pt   (re-fit a saved file)
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


SEGMENT = 32  # the granularity of the stale sets tried (K3N-007's race moved 32-element segments, GPU run 80)


def fit(d: dict, out: torch.Tensor) -> float:
    """The worst row's error of the best stale-read candidate against `out` [T,H], relative to that row's
    largest element (float64; the module docstring says which candidates)."""
    import itertools

    from k3num.harness.judges import EPS, OUT_EPS

    c = d["case"]
    p, b = d["prefix"].double(), d["blocks"].double()
    w, h = c.block_write_idx, c.hidden
    wq = d["norm"].double() * d["qk"].double()
    on = None if d["out_norm"] is None else d["out_norm"].double()
    n = -(-h // SEGMENT)
    if n > 8:
        return float("nan")
    sets = torch.tensor(list(itertools.product([0, 1], repeat=n)), dtype=torch.bool)  # [C, n]
    mask = sets.repeat_interleave(SEGMENT, 1)[:, :h]  # [C, H]
    worst = 0.0
    for t in range(c.tokens):
        row = torch.where(mask, b[t, w], p[t])  # [C, H] the written row, stale in each set's segments
        others = torch.stack([b[t, j] for j in range(c.num_blocks) if j != w] + [p[t]])  # [S, H]
        logit = lambda x: (x * wq).sum(-1) * torch.rsqrt(x.square().mean(-1) + EPS)  # noqa: E731
        lw, lo = logit(row), logit(others)
        m = torch.maximum(lo.max(), lw.max())
        eo, ew = torch.exp(lo - m), torch.exp(lw - m)
        num = (eo[:, None] * others).sum(0)[None] + ew[:, None] * row  # [C, H] values and scores of one set
        mix = num[:, None, :] / (eo.sum() + ew)[None, :, None]  # [C, C, H] the normalizer's set apart
        if on is not None:
            mix = mix * torch.rsqrt(mix.square().mean(-1, keepdim=True) + OUT_EPS) * on
        o = out.double()[t]
        worst = max(worst, float((mix - o).abs().amax(-1).min() / o.abs().max()))
    return worst


def explain(saved: list[dict]) -> None:
    for d in saved:
        fits = [fit(d, o) for o, _ in d["outs"]]
        print(f"{d['engine']} {d['case']}: {len(d['outs'])} distinct; (count, worst relative error of the best "
              f"stale-read candidate) {[(c, f'{f:.1e}') for (_, c), f in zip(d['outs'], fits)]}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", help="the .pt file to write (with --explain: to read)")
    ap.add_argument("--explain", action="store_true", help="re-fit a saved file's outputs, call nothing")
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--engines", default="vllm,vllm-rocm")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()
    if args.explain:
        explain(torch.load(args.out, weights_only=False))
        return
    if args.device == "cpu":
        import os

        os.environ.setdefault("TRITON_INTERPRET", "1")
    from k3num.engines import base, registry
    from k3num.fixtures.builders import attn_res_inputs
    from k3num.fixtures.strategies import AttnResCase
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
            print(f"{name} {case}: {len(outs)} distinct of {args.calls}", flush=True)
            saved.append({"engine": name, "case": case, "prefix": before[0].cpu(), "blocks": before[1].cpu(),
                          "norm": inp.norm.cpu(), "qk": inp.qk.cpu(),
                          "out_norm": None if inp.out_norm is None else inp.out_norm.cpu(),
                          "outs": [(o, c) for o, c in outs.values()]})
    torch.save(saved, args.out)
    print(f"wrote {args.out}: {len(saved)} cases")
    explain(saved)


if __name__ == "__main__":
    main()
