"""The token properties' cost at K3 geometry: examples/s of the draft step (float64 oracle, the engine's step,
the noise floor, the float64-paths step, the judge) per engine and drafter.

Usage:
    python bench/draft_step_speed.py [--geometry k3|tiny] [--engines vllm,sglang,tokenspeed] [--examples 10]
                                     [--tokens 256] [--device cuda] [--csv PATH]

Geometry `k3`: refmodel/draft_step.STEP_PRESETS (DSpark: hidden 7168, 5 layers, block 7, MLA with kv_lora 512
and rope 64; DFlash: 6 layers, block 16, 8 KV heads of 128, window 4096; both with the presets' assumed
128/64 heads, MLP width 2048 and vocabulary 163840), 5 (DSpark) or 6 (DFlash) target taps of a target of
8 layers (AttnRes block 2), --tokens context positions. `tiny`: the properties' sizes (a CPU smoke run).

Per example a new seed: `draw_s` is fixtures.builders.draft_step_inputs (every weight and activation drawn,
on the device on CUDA), `step_s` is harness.draft_step.run on those inputs (the four steps and both judges),
each the median over --examples after one warm-up example, with the device synchronized around it. Two
rates: `ex_per_s` with everything drawn per example (what a property that draws its weights per example
costs) and `ex_per_s_fixed_weights` = 1 / step_s (a run that draws the weights once and the activations per
example: the activations are a few MB against GBs of weights). `decided_share` and `diverged` show that the
positions judged were decided ones. An engine that binds no path of a drafter's step gets a row saying so.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _case(kind: str, geometry: str, tokens: int, seed: int):  # noqa: ANN202 - a DraftStepCase
    from k3num.fixtures.strategies import DraftStepCase

    if geometry == "tiny":
        return DraftStepCase(kind=kind, hidden=64, num_layers=2, num_heads=4, head_dim=16,
                             kv_heads=2 if kind == "dflash" else 1, kv_lora=16 if kind == "dspark" else 0,
                             rotary_dim=8 if kind == "dspark" else 16, window=4 if kind == "dflash" else 0, vocab=256,
                             taps=3, tokens=min(tokens, 12), block=7 if kind == "dspark" else 8, seed=seed,
                             logit_scale=10.0)
    from k3num.harness.impact import preset_case

    return preset_case(kind, tokens, seed)


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def measure(engine, mirror, kind: str, geometry: str, tokens: int, examples: int, device: str) -> dict:  # noqa: ANN001
    from k3num.fixtures.builders import draft_step_inputs
    from k3num.harness import draft_step
    from k3num.harness.judges import LOW
    from k3num.oracles import tokens as tok

    draws, steps, positions, decided, diverged, paths = [], [], 0, 0, 0, ""
    for i in range(examples + 1):  # example 0 warms up (Triton's compiles, the allocator)
        case = _case(kind, geometry, tokens, seed=1000 + i)
        _sync(device)
        t0 = time.perf_counter()
        inp = draft_step_inputs(case, LOW, device)
        _sync(device)
        t1 = time.perf_counter()
        r = draft_step.run(engine, mirror, kind, case, device, inputs=inp)
        _sync(device)
        t2 = time.perf_counter()
        del inp
        if i:
            draws.append(t1 - t0)
            steps.append(t2 - t1)
            positions += r.verdict.positions
            decided += r.verdict.decided
            diverged += r.verdict.count(tok.DIVERGED)
        paths = r.paths
    draw_s, step_s = statistics.median(draws), statistics.median(steps)
    return {"engine": engine.name, "drafter": kind, "paths": paths, "examples": examples, "draw_s": draw_s,
            "step_s": step_s, "ex_per_s": 1 / (draw_s + step_s), "ex_per_s_fixed_weights": 1 / step_s,
            "positions": positions, "decided_share": decided / positions, "diverged": diverged}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--geometry", choices=("k3", "tiny"), default="k3")
    ap.add_argument("--engines", default="vllm,sglang,tokenspeed")
    ap.add_argument("--kinds", default="dspark,dflash")
    ap.add_argument("--examples", type=int, default=10)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--csv", default=None)
    ap.add_argument("--profile", action="store_true",
                    help="instead: the torch profiler's top operators over 2 examples of each (engine, drafter)")
    args = ap.parse_args()
    if args.examples < 1 or args.tokens < 1:
        ap.error("--examples and --tokens must be >= 1")
    if args.device == "cpu":
        from k3num.supply import env

        env.put_default("TRITON_INTERPRET", "1")
    import pandas as pd

    from k3num.engines import registry
    from k3num.harness import draft_step

    mirror = registry.get("mirror")
    rows = []
    for name in [e for e in args.engines.split(",") if e]:
        try:
            engine = registry.get(name)
        except registry.EngineUnavailable as e:
            rows.append({"engine": name, "paths": f"unavailable: {e}"[:120]})
            continue
        for kind in args.kinds.split(","):
            print(f"[draft_step_speed] {name} {kind} ({args.geometry}, {args.examples} examples)", file=sys.stderr,
                  flush=True)
            try:
                if args.profile:
                    from torch.profiler import ProfilerActivity, profile

                    measure(engine, mirror, kind, args.geometry, args.tokens, 1, args.device)
                    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                        rows.append(measure(engine, mirror, kind, args.geometry, args.tokens, 1, args.device))
                    for key in ("cpu_time_total", "self_cpu_time_total", "self_device_time_total"):
                        print(prof.key_averages().table(sort_by=key, row_limit=30))
                    continue
                rows.append(measure(engine, mirror, kind, args.geometry, args.tokens, args.examples, args.device))
            except draft_step.NoPathBound as e:
                rows.append({"engine": name, "drafter": kind, "paths": f"none bound ({e})"[:120]})
            if args.device.startswith("cuda"):
                torch.cuda.empty_cache()
    table = pd.DataFrame(rows)
    if args.device.startswith("cuda"):
        print(f"# {torch.cuda.get_device_name()}; peak memory {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB")
    print(table.to_string(index=False, float_format=lambda v: f"{v:.3g}"))
    if args.csv:
        table.to_csv(args.csv, index=False)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
