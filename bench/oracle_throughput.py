"""Throughput of every float64 oracle at the full K3 shapes, against a plain float64 GEMM.

Usage:
    python bench/oracle_throughput.py [--device cpu|cuda] [--tokens 1024,8192] [--reps N] [--csv PATH]

Shapes (BRIEF §1-3): hidden 7168; context KV with 5 draft layers (kv width
576, fused_qkv_a width 2112) including the grouped norm, RoPE and the paged
cache write; AttnRes with 8 committed blocks + the prefix (9 sources) and the
output norm; the PP partial projection of 6 taps (unsharded and in 3 stages);
the DFlash draft context K/V (6 layers, 8 KV heads x 128). The reference row
for the context-KV path is a plain float64 GEMM of the same size,
[N, 7168] x [7168, 5*576], timed in the same run; the goal on the H200 is the
full context-KV oracle within 1.25x of it. On CUDA every oracle is also run
at a small shape on both devices and the largest normwise difference is
printed (CPU and CUDA oracles must agree to float64 rounding). The copy rate of the same run (a
device-to-device copy of 2 GiB, bytes read + written, as bench/engine_kernels.py times it) is the
last row, and `of copy` is each oracle's rate over its minimal bytes against it; the AttnRes goal on
the H200 is at least 0.5 of it at 8,192 tokens.
Timing: CUDA events around each call after one warm-up, median of --reps;
on the CPU, perf_counter, median of --reps.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.timing import copy_seconds, median_seconds  # noqa: E402
from k3num.fixtures.tensors import Draw  # noqa: E402
from k3num.oracles import budgets  # noqa: E402
from k3num.refmodel import attn_res, geometry, mla, partial_projection  # noqa: E402


def _profile(fn: Callable[[], object], device: torch.device) -> None:
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=acts) as prof:
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
    key = "cuda_time_total" if device.type == "cuda" else "cpu_time_total"
    print(prof.key_averages().table(sort_by=key, row_limit=14), file=sys.stderr)


Cases = dict[str, tuple[Callable[[], object], float, float]]
F64 = 8


def _context_cases(n: int, device: torch.device) -> Cases:
    """The plain GEMM reference and the context-KV oracles: name -> (call, flops, min bytes)."""
    ds = geometry.preset("k3-dspark")
    assert isinstance(ds, geometry.MLADraftGeometry)
    d = Draw(0, device)
    h, L, w = ds.hidden, ds.num_layers, ds.kv_width
    x = d.normal((n, h))
    kv_w = d.normal((L, w, h), h**-0.5)
    full_w = d.normal((L, ds.fused_qkv_a_width, h), h**-0.5)
    norm_w = d.positive((L, ds.kv_lora_rank))
    pos = torch.arange(n, device=device)
    block_size = 64
    caches = torch.zeros(L, -(-n // block_size), block_size, w, dtype=torch.float64, device=device)
    slots = torch.arange(n, device=device)
    merged = kv_w.reshape(L * w, h)

    def ckv_two_calls() -> object:
        kv_c, k_pe = mla.context_kv(x, kv_w, norm_w, pos, ds.rope, ds.eps)
        return mla.write_mla_cache(caches, kv_c, k_pe, slots)

    def ckv_full() -> object:
        return mla.precompute_context_kv(x, kv_w, norm_w, pos, ds.rope, ds.eps, caches, slots)

    gemm_flops = 2.0 * n * h * L * w
    return {
        "plain fp64 GEMM [N,7168]x[7168,2880]": (
            lambda: x @ merged.T, gemm_flops, F64 * (n * h + L * w * h + n * L * w)),
        "precompute_context_kv (full, with cache)": (
            ckv_full, gemm_flops, F64 * (n * h + L * w * h + 2 * L * n * w)),
        "context_kv, then write_mla_cache": (
            ckv_two_calls, gemm_flops, F64 * (n * h + L * w * h + 2 * L * n * w)),
        "context_kv (no cache write)": (
            lambda: mla.context_kv(x, kv_w, norm_w, pos, ds.rope, ds.eps), gemm_flops, F64 * (n * h + L * w * h)),
        "context_kv_unfused (5 full GEMMs)": (
            lambda: mla.context_kv_unfused(x, full_w, norm_w, pos, ds.rope, ds.eps),
            2.0 * n * h * L * ds.fused_qkv_a_width, F64 * (n * h + L * ds.fused_qkv_a_width * h)),
    }


def _attn_res_cases(n: int, device: torch.device) -> Cases:
    d, h, nb = Draw(1, device), 7168, 8
    prefix, delta, blocks = d.normal((n, h)), d.normal((n, h)), d.normal((n, nb, h))
    nw, qk, ow = d.positive((h,)), d.normal((h,)), d.positive((h,))
    return {
        "attn_res (9 sources, output norm)": (
            lambda: attn_res.attn_res(prefix, delta, blocks, nw, qk, ow, nb, -1, 1e-5, 1e-5),
            6.0 * n * (nb + 1) * h, F64 * n * h * (nb + 4)),
    }


def _projection_cases(n: int, device: torch.device) -> Cases:
    df = geometry.preset("k3-dflash")
    assert isinstance(df, geometry.DFlashGeometry)
    d, h = Draw(2, device), df.hidden
    k = len(df.target_taps)
    taps, fc, fc_norm = d.normal((k, n, h)), d.normal((h, k * h), (k * h) ** -0.5), d.positive((h,))
    flops, nbytes = 2.0 * n * k * h * h, F64 * (k * n * h + k * h * h + n * h)
    return {
        "project_context (6 taps, unsharded)": (
            lambda: partial_projection.project_context(taps, fc, fc_norm, 1e-5), flops, nbytes),
        "project_context (6 taps, 3 stages)": (
            lambda: partial_projection.project_context(taps, fc, fc_norm, 1e-5, [[0, 1], [2, 3], [4, 5]]),
            flops, nbytes),
    }


def _draft_cases(n: int, device: torch.device) -> Cases:
    df = geometry.preset("k3-dflash")
    assert isinstance(df, geometry.DFlashGeometry)
    d, h = Draw(3, device), df.hidden
    kd = df.num_kv_heads * df.head_dim
    ctx, pos = d.normal((n, h)), torch.arange(n, device=device)
    k_w, v_w = d.normal((df.num_layers, kd, h), h**-0.5), d.normal((df.num_layers, kd, h), h**-0.5)
    k_norm = d.positive((df.num_layers, df.head_dim))
    return {
        "draft_context_kv (6 layers, 8x128)": (
            lambda: partial_projection.draft_context_kv(ctx, k_w, v_w, k_norm, pos, df.rope, df.eps),
            4.0 * n * h * df.num_layers * kd, F64 * (n * h + 2 * df.num_layers * kd * (h + n))),
    }


GROUPS = (_context_cases, _attn_res_cases, _projection_cases, _draft_cases)


def _cpu_cuda_agreement() -> float:
    """Largest normwise relative CPU-vs-CUDA difference over all oracles at a small shape."""
    worst = 0.0
    g = geometry.preset("tiny-dspark")
    assert isinstance(g, geometry.MLADraftGeometry)
    outs = {}
    for dev in ("cpu", "cuda"):
        d = Draw(1, dev)
        x = d.normal((17, g.hidden))
        w = d.normal((g.num_layers, g.fused_qkv_a_width, g.hidden))
        nw = d.positive((g.num_layers, g.kv_lora_rank))
        pos = d.integers(0, 200, (17,))
        pre, dl, bl = d.normal((5, 32)), d.normal((5, 32)), d.normal((5, 4, 32))
        taps, fc = d.normal((3, 5, 8)), d.normal((6, 24))
        res = list(mla.context_kv(x, w[:, g.q_lora_rank:], nw, pos, g.rope, g.eps))
        res += list(attn_res.attn_res(pre, dl, bl, d.positive((32,)), d.normal((32,)), d.positive((32,)),
                                      3, 2, 1e-5, 1e-5))
        res.append(partial_projection.project_context(taps, fc, d.positive((6,)), 1e-5, [[1], [0, 2]]))
        outs[dev] = [r.cpu() for r in res]
    for a, b in zip(outs["cpu"], outs["cuda"]):
        worst = max(worst, float((a - b).abs().max() / b.abs().max()))
    return worst


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tokens", default="1024,8192")
    ap.add_argument("--reps", type=int, default=None, help="default: 10 on CUDA, 1 on the CPU")
    ap.add_argument("--only", default=None, help="comma-separated substrings of case names to run")
    ap.add_argument("--csv", default=None)
    ap.add_argument("--profile", action="store_true", help="print torch.profiler's top kernels per case")
    args = ap.parse_args()
    device = torch.device(args.device)
    reps = args.reps or (10 if device.type == "cuda" else 1)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU ({torch.get_num_threads()} threads)"
    print(f"# oracle throughput on {name}, torch {torch.__version__}, reps {reps} (median)", flush=True)
    rows = []
    for n in [int(t) for t in args.tokens.split(",")]:
        gemm_s = None
        for group in GROUPS:  # one group's tensors at a time: the CPU has 24 GiB
            cases = group(n, device)
            for case, (fn, flops, nbytes) in cases.items():
                if args.only and not any(s in case for s in args.only.split(",")) and "plain" not in case:
                    continue
                print(f"  N={n}: {case} ...", file=sys.stderr, flush=True)
                s = median_seconds(fn, device, reps)
                if args.profile:
                    _profile(fn, device)
                if "plain" in case:
                    gemm_s = s
                rows.append({
                    "device": name, "tokens": n, "oracle": case, "ms": s * 1e3,
                    "x_gemm": s / gemm_s if gemm_s else float("nan"),
                    "TFLOP/s": flops / s / 1e12, "GB/s (min bytes)": nbytes / s / 1e9,
                })
            del cases
            if device.type == "cuda":
                torch.cuda.empty_cache()
    copy_s, copy_bytes = copy_seconds(device, reps)
    copy_rate = copy_bytes / copy_s
    for r in rows:
        r["of copy"] = r["GB/s (min bytes)"] * 1e9 / copy_rate
    rows.append({"device": name, "tokens": 0, "oracle": "device copy (2 GiB)", "ms": copy_s * 1e3,
                 "x_gemm": float("nan"), "TFLOP/s": 0.0, "GB/s (min bytes)": copy_rate / 1e9, "of copy": 1.0})
    header = (f"| {'N':>5} | {'oracle':<40} | {'ms':>9} | {'x GEMM':>7} | {'TFLOP/s':>8} | {'GB/s':>7} "
              f"| {'of copy':>7} |")
    print(header)
    print("|" + "|".join("-" * (len(c)) for c in header.split("|")[1:-1]) + "|")
    for r in rows:
        print(f"| {r['tokens']:>5} | {r['oracle']:<40} | {r['ms']:>9.2f} | {r['x_gemm']:>7.3f} | "
              f"{r['TFLOP/s']:>8.2f} | {r['GB/s (min bytes)']:>7.1f} | {r['of copy']:>7.3f} |")
    if device.type == "cuda":
        agree = _cpu_cuda_agreement()
        tol = budgets.f64_identity_rtol(64)
        print(f"CPU vs CUDA oracle agreement: max normwise rel diff {agree:.2e} (bound {tol:.2e}): "
              f"{'OK' if agree <= tol else 'FAIL'}")
    if args.csv:
        import pandas as pd

        pd.DataFrame(rows).to_csv(args.csv, index=False)


if __name__ == "__main__":
    main()
