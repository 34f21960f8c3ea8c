"""Does K3N-007's bug model explain every output of one attn_res case, called as the in-place property calls it
(fresh inputs each call, under the repeat properties' poisoned allocations)? For each distinct output of
--calls calls: the model's verdict (harness/ledger_models.delta_applied_twice: a set of 32-element prefix
segments with the delta applied twice) and, up to 8 segments (hidden 256), which set of them the raw kernel
on the raced prefix gives bit for bit.

Usage (CUDA machine): python scripts/explain_attn_res_race.py [--engine vllm-rocm] [--calls 152]
    [--case "tokens=1,hidden=128,bank=8,num_blocks=7,seed=355,scale=1.0"] [--no-poison]
    (K3 shapes: --case "tokens=6,hidden=7168,bank=9,num_blocks=4,block_write_idx=4,seed=1,scale=1.0")
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine", default="vllm-rocm", help="an engine name (its default pinned release; both vLLM "
                    "releases ship attn_res.py byte-identical)")
    ap.add_argument("--calls", type=int, default=152)
    ap.add_argument("--case", default="tokens=1,hidden=128,bank=8,num_blocks=7,seed=355,scale=1.0")
    ap.add_argument("--no-poison", action="store_true", help="call without the poisoned allocations")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()
    if args.device == "cpu":
        import os

        os.environ.setdefault("TRITON_INTERPRET", "1")
    from k3num.engines import base, registry
    from k3num.fixtures.builders import attn_res_inputs
    from k3num.fixtures.strategies import AttnResCase
    from k3num.harness import ledger_models, ledger_run
    from k3num.harness.judges import EPS, OUT_EPS
    from k3num.oracles import hunt
    from k3num.properties.support import round_storage

    name = args.engine
    fields = {"block_write_idx": -1, "with_delta": True, "with_output_norm": True, "outliers": 30.0}
    for kv in args.case.split(","):
        k, _, v = kv.partition("=")
        fields[k.strip()] = float(v) if k.strip() in ("scale", "outliers") else int(v)
    case = AttnResCase(**fields)
    engine = registry.get(name)
    print(f"{engine.name} {engine.version} ({engine.mode}) {case}", flush=True)
    calls: list = []
    watched = ledger_run.record_calls(engine, (base.ATTN_RES,), calls)
    fn = watched.subjects[base.ATTN_RES]
    outs: dict[bytes, int] = {}
    for i in range(args.calls):
        inp = attn_res_inputs(case, torch.bfloat16, args.device)
        ctx = hunt.poisoned_allocations() if not args.no_poison else torch.no_grad()
        with ctx:
            out = fn(inp.prefix, inp.delta, inp.blocks, inp.norm, inp.qk, inp.out_norm, case.num_blocks,
                     case.block_write_idx, EPS, OUT_EPS)
        key = out.detach().cpu().view(torch.int16).numpy().tobytes()
        outs[key] = outs.get(key, 0) + 1
    inp = attn_res_inputs(case, torch.bfloat16, args.device)
    once = round_storage(engine, inp.prefix.float() + inp.delta.float())
    twice = round_storage(engine, once.float() + inp.delta.float())
    bank = inp.blocks.clone()
    if case.block_write_idx >= 0:
        bank[:, case.block_write_idx] = once
    raw = engine.subject(base.ATTN_RES)
    bits = {}
    n = -(-case.hidden // 32)
    if n <= ledger_models.EVERY_SUBSET:  # every raced set, bitwise through the raw kernel
        for k in range(n + 1):
            for combo in itertools.combinations(range(n), k):
                pre = once.clone()
                for s in combo:
                    pre[:, 32 * s: 32 * (s + 1)] = twice[:, 32 * s: 32 * (s + 1)]
                o = raw(pre, None, bank.clone(), inp.norm, inp.qk, inp.out_norm, case.num_blocks, -1, EPS, OUT_EPS)
                bits.setdefault(o.detach().cpu().view(torch.int16).numpy().tobytes(), combo)
    print(f"{len(outs)} distinct outputs of {args.calls} calls; {len(calls)} recorded"
          f"{' (truncated)' if any(c.subject == ledger_models.TRUNCATED for c in calls) else ''}")
    refused = 0
    for key, count in sorted(outs.items(), key=lambda kv: -kv[1]):
        c = next((c for c in calls if c.subject == base.ATTN_RES
                  and c.out.detach().cpu().view(torch.int16).numpy().tobytes() == key), None)
        verdict = ledger_models.delta_applied_twice([c]) if c is not None else "(not recorded)"
        refused += bool(verdict)
        same_in = c is not None and all(
            torch.equal(a, b) for a, b in zip(c.args[:3], (inp.prefix, inp.delta, inp.blocks)))
        raced = bits.get(key, "none of the subsets") if bits else "(not enumerated past 8 segments)"
        print(f"  {count:>4} calls: raced segments {raced}; model: {verdict or 'explained'}; recorded inputs "
              f"equal the drawn ones: {same_in}")
        if verdict and c is not None and n <= 4:
            _split(c, once, twice, bank, inp, case)
        if verdict and c is not None:  # the same model at a finer race granularity
            for seg in (16, 8, 4, 1):
                saved, ledger_models.SEGMENT = ledger_models.SEGMENT, seg
                try:
                    fine = ledger_models.delta_applied_twice([c])
                finally:
                    ledger_models.SEGMENT = saved
                print(f"      with {seg}-element segments: {fine or 'explained'}")
    print(f"model: {len(outs) - refused} of {len(outs)} distinct outputs explained")


def _split(c, once, twice, bank, inp, case) -> None:
    """For an output the model refuses: per row, the best pair (score set, value set) of raced segments, the
    prefix's score (its rms and logit) read with one set and its mixed value with another, in float64."""
    import itertools

    from k3num.harness.judges import EPS, OUT_EPS

    def variant(segs):
        pre = once.double().clone()
        for s in segs:
            pre[:, 32 * s: 32 * (s + 1)] = twice.double()[:, 32 * s: 32 * (s + 1)]
        return pre

    nb = case.num_blocks
    w = inp.norm.double() * inp.qk.double()
    n = -(-case.hidden // 32)
    sets = [k for r in range(n + 1) for k in itertools.combinations(range(n), r)]
    out = c.out.double()
    best = [(float("inf"), None)] * out.shape[0]
    for s1 in sets:
        sc = torch.cat([bank[:, :nb].double(), variant(s1)[:, None]], dim=1)  # [T, nb+1, H]
        rstd = torch.rsqrt(sc.square().mean(-1) + EPS)
        wts = torch.softmax((sc * w).sum(-1) * rstd, dim=-1)  # [T, nb+1]
        for s2 in sets:
            vals = torch.cat([bank[:, :nb].double(), variant(s2)[:, None]], dim=1)
            mixed = (wts[..., None] * vals).sum(1)
            o = mixed * torch.rsqrt(mixed.square().mean(-1, keepdim=True) + OUT_EPS) * inp.out_norm.double()
            err = (o - out).abs().amax(-1)
            for r in range(out.shape[0]):
                if float(err[r]) < best[r][0]:
                    best[r] = (float(err[r]), (s1, s2))
    for r, (e, sets_) in enumerate(best):
        print(f"      row {r}: best (score set, value set) {sets_} at {e:.3g}")


if __name__ == "__main__":
    main()
