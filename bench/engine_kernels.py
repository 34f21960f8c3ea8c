"""Achieved bandwidth of the engines' Triton kernels at K3 shapes, against the copy rate of the same run.

Usage (on a CUDA machine, after `k3num fetch`):
    python bench/engine_kernels.py [--tokens 8192] [--reps 20] [--csv PATH]
    python bench/engine_kernels.py --device cpu --tokens 4 --hidden 1024   # a smoke run under the interpreter

Kernels (BRIEF §4): vLLM `attn_res` (8 committed blocks + the prefix, output norm),
vLLM ROCm `attn_res` (Triton; it runs on NVIDIA too), SGLang `_mix_fused` (score +
combine pair) and `fused_kv_norm_rope_write` alone (6 layers, 8 KV heads x 128, NeoX; its K/V
GEMMs are not timed).
Bytes are the fewest each kernel must move (inputs read once, outputs written
once); the copy rate is a device-to-device copy of 2 GiB timed the same way,
counting bytes read plus written. Timing: CUDA events, median of --reps after a
warm-up; on the CPU, perf_counter (interpreter timings mean nothing but that it ran).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.timing import copy_seconds, median_seconds  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--csv", default=None)
    args = ap.parse_args()
    device = torch.device(args.device)
    if device.type == "cpu":
        import os

        os.environ.setdefault("TRITON_INTERPRET", "1")
    from k3num.engines import base, registry

    t, h, nb, bf = args.tokens, args.hidden, 8, 2
    g = torch.Generator(device=device).manual_seed(0)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g, device=device).to(torch.bfloat16)

    rows: list[dict[str, object]] = []
    copy_s, copy_bytes = copy_seconds(device, args.reps)
    copy_rate = copy_bytes / copy_s
    rows.append({"kernel": "device copy (2 GiB)", "ms": copy_s * 1e3, "GB/s": copy_rate / 1e9, "of copy": 1.0})

    prefix, delta, blocks = randn(t, h), randn(t, h), randn(t, nb, h)
    nw, qk, ow = randn(h).abs() + 0.5, randn(h) / h**0.5, randn(h).abs() + 0.5
    # attn_res updates the prefix in place (prefix += delta); the timed calls reuse it (values drift,
    # the work does not), so no copy is timed with the kernel
    cases: list[tuple[str, str, str, Callable[[base.Subject], object], float]] = [
        ("vllm", base.ATTN_RES, "vLLM attn_res (8 blocks, delta, output norm)",
         lambda f: f(prefix, delta, blocks, nw, qk, ow, nb, -1, 1e-5, 1e-5), bf * t * h * (nb + 4)),
        ("vllm-rocm", base.ATTN_RES, "vLLM ROCm attn_res (same call)",
         lambda f: f(prefix, delta, blocks, nw, qk, ow, nb, -1, 1e-5, 1e-5), bf * t * h * (nb + 4)),
        ("sglang", base.ATTN_RES_MIX_TRITON, "SGLang _mix_fused (score + combine)",
         lambda f: f(prefix, blocks, nb, nw, qk, 1e-5), bf * t * h * (nb + 2)),
    ]
    # SGLang fused_kv_norm_rope_write alone (K3 DFlash: 6 layers, 8 KV heads x 128, NeoX): reads the
    # projected [T, L*2*KV] rows, the norm weights and T rows of the fp32 [cos | sin] cache; writes bf16
    # K and V rows into per-layer pools
    kvh, d, layers = 8, 128, 6
    width = kvh * d
    kv = randn(t, layers * 2 * width)
    kn = randn(layers, d).abs() + 0.5
    pos = torch.arange(t, device=device)
    rope_cache = torch.randn(t, d, generator=g, device=device)
    pools = [torch.empty(t, width, dtype=torch.bfloat16, device=device) for _ in range(2 * layers)]
    meta = torch.tensor([[pools[2 * i].data_ptr(), pools[2 * i + 1].data_ptr(), width, width] for i in range(layers)],
                        dtype=torch.int64, device=device)
    kv_bytes = bf * t * layers * 2 * width
    cases.append(("sglang", "extras:fused_kv_norm_rope_write", "SGLang fused_kv_norm_rope_write (6 layers)",
                  lambda f: f(kv, meta, kn, rope_cache, pos, pos, layers, width, d, 1e-5, is_neox_style=True,
                              rotary_dim=d), 2 * kv_bytes + 4 * t * d + 2 * 8 * t))
    for engine_name, subject_name, label, call, nbytes in cases:
        try:
            eng = registry.get(engine_name)
            if subject_name.startswith("extras:"):
                fn = eng.extras[subject_name.removeprefix("extras:")]
            else:
                fn = eng.subject(subject_name)
        except (registry.EngineUnavailable, base.SubjectMissing, KeyError) as e:
            print(f"  {label}: skipped: {e}", file=sys.stderr)
            continue
        print(f"  {label} ...", file=sys.stderr, flush=True)
        try:
            s = median_seconds(lambda: call(fn), device, args.reps)
        except NotImplementedError as e:
            print(f"  {label}: skipped: {e}", file=sys.stderr)
            continue
        rows.append({"kernel": label, "ms": s * 1e3, "GB/s": nbytes / s / 1e9, "of copy": nbytes / s / copy_rate})
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (Triton interpreter)"
    print(f"# engine kernels on {name}, T={t}, hidden={h}, reps {args.reps} (median)")
    print(f"| {'kernel':<52} | {'ms':>8} | {'GB/s':>8} | {'of copy':>7} |")
    print(f"|{'-' * 54}|{'-' * 10}|{'-' * 10}|{'-' * 9}|")
    for r in rows:
        print(f"| {r['kernel']:<52} | {r['ms']:>8.3f} | {r['GB/s']:>8.1f} | {r['of copy']:>7.2f} |")
    if args.csv:
        import pandas as pd

        pd.DataFrame(rows).to_csv(args.csv, index=False)


if __name__ == "__main__":
    main()
