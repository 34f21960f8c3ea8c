"""What `k3num replay` pays for judging with its own oracle and budget (harness/judges.py), per bundle.

Writes a mirror bundle of attn_res and of the fused context KV at a small and at the K3 shape, then
times, median of --reps: the whole replay, and the recomputation alone (the judge on the stored
inputs: the float64 oracle and, for the fused context KV, the eager unfused baseline). Prints a table.

    python bench/replay_speed.py [--device cpu|cuda] [--reps 5]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from k3num.engines import base, registry  # noqa: E402
from k3num.fixtures.builders import attn_res_inputs, context_kv_inputs  # noqa: E402
from k3num.fixtures.strategies import AttnResCase, ContextKVCase  # noqa: E402
from k3num.harness import judges, repro  # noqa: E402
from k3num.oracles.records import judge  # noqa: E402
from k3num.refmodel import geometry  # noqa: E402

LOW = torch.bfloat16


def attn_res_bundle(tmp: Path, hidden: int, tokens: int, device: str) -> Path:
    case = AttnResCase(tokens=tokens, hidden=hidden, bank=8, num_blocks=8, block_write_idx=-1, with_delta=True,
                       with_output_norm=True, seed=0, scale=1.0, outliers=30.0)
    inp = attn_res_inputs(case, LOW, device)
    args = (inp.prefix, inp.delta, inp.blocks, inp.norm, inp.qk, inp.out_norm, 8, -1, judges.EPS, judges.OUT_EPS)
    engine = registry.get("mirror")
    want, budget = judges.attn_res_oracle(engine, *args[:8])
    cloned = tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in args)
    out = engine.subject(base.ATTN_RES)(*args)
    path = tmp / f"attn_res-{hidden}.safetensors"
    repro.write(path, call=(cloned, {}, out, args, {}), actual=out, reference=want,
                meta=_meta(engine, "attn_res_within_rounding_budget", base.ATTN_RES, want, budget, out, ""))
    return path


def context_kv_bundle(tmp: Path, g: geometry.MLADraftGeometry, tokens: int, device: str) -> Path:
    case = ContextKVCase(g.hidden, g.num_layers, g.q_lora_rank, g.kv_lora_rank, g.rope, tokens, 4096, 0, 1.0, 30.0)
    inp = context_kv_inputs(case, LOW, device)
    engine = registry.get("mirror")
    from k3num.engines.mirror import context_kv as eager

    baseline = eager.context_kv_unfused(inp.x, inp.fused_qkv_a, inp.norm, inp.positions, case.rope, judges.EPS)
    want = judges.fused_context_kv(inp.x, inp.kv_a, inp.norm, inp.positions, case.rope, judges.EPS, baseline)
    args = (inp.x, inp.kv_a, inp.norm, inp.positions, case.rope, judges.EPS)
    out = engine.subject(base.CONTEXT_KV_FUSED)(*args)
    path = tmp / f"context_kv-{g.hidden}.safetensors"
    repro.write(path, call=(args, {}, out, args, {}), actual=out[0], reference=want["kv_c"].reference,
                meta=_meta(engine, "fused_within_budget_of_unfused", base.CONTEXT_KV_FUSED, want["kv_c"].reference,
                           want["kv_c"].budget, out[0], f"kv_c;q_lora={case.q_lora}"))
    return path


def _meta(engine, prop, subject, want, budget, out, detail) -> dict:
    rec = judge(property=prop, engine=engine, subject=subject, actual=out, reference=want, budget=budget, seed=0,
                detail=detail)
    return {k: getattr(rec, k) for k in ("engine", "engine_version", "mode", "source_sha256", "subject", "property",
                                         "detail", "seed", "budget", "budget_rule", "max_abs", "ratio", "verdict")}


def _median(fn, reps: int, device: str) -> float:
    times = []
    for _ in range(reps):
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    tiny, k3 = geometry.preset("tiny-dspark"), geometry.preset("k3-dspark")
    rows = []
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        cases = [("attn_res", "T=16, H=256", attn_res_bundle(tmp, 256, 16, args.device)),
                 ("attn_res", "T=16, H=7168, 9 sources", attn_res_bundle(tmp, 7168, 16, args.device)),
                 ("fused context KV", f"N=16, H={tiny.hidden}", context_kv_bundle(tmp, tiny, 16, args.device)),
                 ("fused context KV", "N=64, H=7168, 5 layers", context_kv_bundle(tmp, k3, 64, args.device))]
        for what, shape, path in cases:
            repro.replay(path, device=args.device)  # warm
            meta, tensors = repro.load(path)
            c = repro._checked(meta, tensors, args.device)
            how = judges.REPLAYABLE[c["property"]]
            engine = registry.get("mirror")
            t_judge = _median(lambda: how(engine, c["subject"], c["args"], c["kwargs"], c["detail"]), args.reps,
                              args.device)
            t_all = _median(lambda: repro.replay(path, device=args.device), args.reps, args.device)
            rows.append((what, shape, t_all, t_judge))
    print(f"replay on {args.device} (median of {args.reps}), mirror subjects")
    print("| bundle | shape | replay s | of which the recomputed oracle and budget s |")
    print("| --- | --- | --- | --- |")
    for what, shape, t_all, t_judge in rows:
        print(f"| {what} | {shape} | {t_all:.3f} | {t_judge:.3f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
