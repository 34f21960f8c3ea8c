"""The float64 oracle and the judges' budgets, bit for bit, on one fixed set of cases: the check that a
speed change to refmodel/ or harness/judges.py changed no value (the derandomized drift CSV depends on
every bit of them).

Usage:
    python scripts/oracle_bits.py save OUT.pt [--device cpu|cuda] [--root TREE]
    python scripts/oracle_bits.py compare A.pt B.pt

`save` imports k3num from TREE (default: this checkout; another checkout's root to record its
values) and writes every result of the cases below; `compare` exits 1 naming each result whose bits
differ (NaNs equal). Cases: the context-KV oracle with and without the cache write (K3's geometry
with both RoPE flavours, the tiny one with a partial rotary of each style, skipped slots), RoPE
alone, attn_res over every branch (no delta, delta, a write inside and past the mix, no sources,
the output norm on and off) at hidden 64 and 7168, and the three AttnRes judges (values and budgets)
on the mirror engine, with the metrics (oracles.metrics.compare) of a perturbed copy of each.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def _save(out: str, device: str, root: str) -> None:
    sys.path.insert(0, root)
    import torch

    from k3num.engines import registry
    from k3num.fixtures.tensors import Draw
    from k3num.harness import judges
    from k3num.refmodel import attn_res, geometry, mla, rope
    from k3num.refmodel.geometry import RopeSpec

    got: dict[str, torch.Tensor] = {}
    cases = [("tiny-dspark", 17, None), ("k3-dspark", 33, None), ("k3-dspark-plain-rope", 9, None),
             ("tiny-dspark", 5, "gptj"), ("tiny-dspark", 5, "neox")]
    for i, (name, n, style) in enumerate(cases):
        g = geometry.preset(name)
        assert isinstance(g, geometry.MLADraftGeometry)
        spec = g.rope if style is None else RopeSpec(g.rope.rotary_dim // 2, g.rope.theta, style, g.rope.yarn)
        d = Draw(i, device)
        x = d.normal((n, g.hidden))
        w = d.normal((g.num_layers, g.kv_width, g.hidden), g.hidden**-0.5)
        nw, pos = d.positive((g.num_layers, g.kv_lora_rank)), d.integers(0, 5000, (n,))
        kv_c, k_pe = mla.context_kv(x, w, nw, pos, spec, 1e-5)
        caches = d.normal((g.num_layers, 4, 16, g.kv_width))
        slots = torch.randperm(64, generator=torch.Generator().manual_seed(i))[:n].to(device)
        slots[0] = -1
        a, b, c = mla.precompute_context_kv(x, w, nw, pos, spec, 1e-5, caches, slots)
        got.update({f"ckv{i}.kv_c": kv_c, f"ckv{i}.k_pe": k_pe, f"ckv{i}.pre.kv_c": a, f"ckv{i}.pre.k_pe": b,
                    f"ckv{i}.pre.caches": c, f"ckv{i}.write": mla.write_mla_cache(caches, kv_c, k_pe, slots),
                    f"ckv{i}.rope": rope.apply_rope(d.normal((n, 3, 64)), pos, spec)})
    engine = registry.get("mirror")
    lo = torch.bfloat16
    for h in (64, 7168):
        for j, (nb, write, delta, onorm) in enumerate([(0, -1, False, False), (3, 3, True, True), (5, -1, False, True),
                                                       (2, 1, True, False), (4, -1, True, True)]):
            d = Draw(10 + j, device)
            t, bank = 7, 5
            pr, dl, bl = d.normal((t, h)), d.normal((t, h)), d.normal((t, bank, h))
            nwt, qk, ow = d.positive((h,)), d.normal((h,)), d.positive((h,))
            o, p, bk = attn_res.attn_res(pr, dl if delta else None, bl, nwt, qk, ow if onorm else None, nb, write,
                                         1e-5, 1e-6)
            key = f"ar{h}.{j}"
            got.update({f"{key}.out": o, f"{key}.prefix": p, f"{key}.bank": bk})
            lp, ld, lb = pr.to(lo), dl.to(lo), bl.to(lo)
            ln, lq, low = nwt.to(lo), qk.to(lo), ow.to(lo)
            want, budget = judges.attn_res_oracle(engine, lp, ld if delta else None, lb, ln, lq, low if onorm else None,
                                                  nb, write)
            got[f"{key}.judge"], got[f"{key}.judge.budget"] = want, torch.tensor(budget.value)
            want, budget = judges.read_only_mixture(engine, "attn_res_mix", lp, lb, nb, ln, lq)
            got[f"{key}.mix"], got[f"{key}.mix.budget"] = want, torch.tensor(budget.value)
            want, budget = judges.residual_mixture(engine, lp, lb, nb, ln, lq, low)
            got[f"{key}.residual"], got[f"{key}.residual.budget"] = want, torch.tensor(budget.value)
    from k3num.oracles import metrics

    for key in [k for k in got if k.endswith((".judge", ".mix", ".residual"))]:  # the judge's metrics too
        ref = got[key]
        m = metrics.compare((ref * 1.01).to(lo), ref, over=float(got[key + ".budget"]))
        got[key + ".metrics"] = torch.tensor([m.max_abs, m.rel_fro, m.max_ulp, m.cosine, m.nonfinite_mismatch,
                                              m.ref_max_abs, m.over, m.numel] + [i for w in m.worst for i in w],
                                             dtype=torch.float64)
    torch.save({k: v.detach().cpu().contiguous() for k, v in got.items()}, out)
    print(f"oracle_bits: {len(got)} results on {device} from {root} -> {out}")


def _compare(a: str, b: str) -> int:
    import torch

    x, y = torch.load(a), torch.load(b)
    bad = sorted(set(x) ^ set(y))
    for k in sorted(set(x) & set(y)):
        u, v = x[k], y[k]
        same = u.shape == v.shape and u.dtype == v.dtype and bool(((u == v) | (u.isnan() & v.isnan())).all())
        if not same:
            bad.append(k)
    print(f"oracle_bits: {len(set(x) & set(y))} results compared, {len(bad)} differ" + (f": {bad}" if bad else ""))
    return 1 if bad else 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("save")
    s.add_argument("out")
    s.add_argument("--device", default="cpu")
    s.add_argument("--root", default=str(Path(__file__).resolve().parents[1]))
    c = sub.add_parser("compare")
    c.add_argument("a")
    c.add_argument("b")
    args = ap.parse_args()
    if args.cmd == "save":
        _save(args.out, args.device, args.root)
    else:
        sys.exit(_compare(args.a, args.b))


if __name__ == "__main__":
    main()
