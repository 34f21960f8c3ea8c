"""Seed 000's speed claim, measured: the fused context-KV precompute against the unfused path, on the
same GPU in the same run, with vLLM's real CUDA ops (mode source-gpu+ops; `k3num build-ops` first).

Usage (a CUDA machine, after `k3num fetch` and `k3num build-ops`):
    python bench/context_kv_speed.py [--tokens 64,1024,8192] [--reps 20] [--csv PATH]

Fused: vLLM 0.33.0's own `_precompute_fused_context_kv` (the engine's CONTEXT_KV_FUSED subject): one
bf16 GEMM against the 5 layers' stacked kv_a_proj_with_mqa rows [2880, 7168], the grouped
`ops.rms_norm` (2-D weight), one `ops.rotary_embedding` over the 5 layers' k_pe, one
`concat_and_cache_mla_grouped` into 5 per-layer paged caches. Unfused (before the PR): per layer, the
full fused_qkv_a GEMM [2112, 7168] with Q discarded, then the same real ops on that layer alone
(`ops.rms_norm` with its 1-D weight row, `ops.rotary_embedding`, the grouped insert with one layer).
`fused_ms` / `unfused_ms` include the Python around the ops (the lifted method, the adapter's namespace),
which dominates at small N: CUDA events around each whole call, median of --reps after a warm-up
(bench.timing). `*_kernel_ms` is the GPU time of the kernels alone: the torch profiler's device time of
every kernel the call launched, summed, over --reps calls, divided by --reps (gaps between kernels and
the host's time not counted). The speedup is given for both. The copy rate is a 2 GiB device-to-device
copy timed the same way.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.timing import copy_seconds, median_seconds  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", default="64,1024,8192")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--csv", default=None)
    args = ap.parse_args()
    import pandas as pd

    from k3num.engines import base, registry
    from k3num.engines.mirror.context_kv import rope_cache
    from k3num.refmodel import geometry

    if not torch.cuda.is_available():
        print("context_kv_speed: needs a CUDA device", file=sys.stderr)
        return 2
    engine = registry.get("vllm")
    if "context_kv_ops" not in engine.extras:
        print(f"context_kv_speed: vLLM's compiled ops are not built here ({engine.mode_note}); run "
              "`k3num build-ops`", file=sys.stderr)
        return 2
    fused = engine.subject(base.CONTEXT_KV_FUSED)
    ops = engine.extras["context_kv_ops"]._ops  # vLLM's _custom_ops wrappers over the built ops
    g = geometry.preset("k3-dspark")
    assert isinstance(g, geometry.MLADraftGeometry)
    dev = torch.device("cuda")
    L, H, W, C, Q = g.num_layers, g.hidden, g.kv_width, g.kv_lora_rank, g.q_lora_rank
    gen = torch.Generator(device=dev).manual_seed(0)
    copy_s, copy_bytes = copy_seconds(dev, args.reps)
    rows = []
    for n in (int(t) for t in args.tokens.split(",")):
        x = torch.randn(n, H, device=dev, generator=gen).bfloat16()
        qkv_a = (torch.randn(L, Q + W, H, device=dev, generator=gen) * H ** -0.5).bfloat16()
        kv_a = qkv_a[:, Q:].contiguous()
        norm = (torch.rand(L, C, device=dev, generator=gen) + 0.5).bfloat16()
        pos = torch.arange(n, device=dev)
        block_size = 64
        nb = -(-n // block_size) + 1
        caches = [torch.zeros(nb, block_size, W, device=dev, dtype=torch.bfloat16) for _ in range(L)]
        slots = torch.arange(n, device=dev)
        cos_sin = rope_cache(g.rope, n, torch.float32, dev)
        ptrs = [torch.tensor([c.data_ptr()], dtype=torch.int64, device=dev) for c in caches]

        def run_fused() -> None:
            fused(x, kv_a, norm, pos, g.rope, 1e-5, caches, slots)

        def run_unfused() -> None:
            for layer in range(L):
                y = x @ qkv_a[layer].T  # [n, Q + W]: Q computed and discarded
                kv_c = y[:, Q: Q + C].contiguous()
                k_pe = y[:, Q + C:].contiguous()
                out = torch.empty_like(kv_c)
                ops.rms_norm(out, kv_c, norm[layer], 1e-5)
                k = k_pe.view(n, 1, W - C)
                ops.rotary_embedding(pos, k, None, W - C, cos_sin, False)
                ops.concat_and_cache_mla_grouped(out[None], k.view(1, n, W - C), ptrs[layer], slots[None],
                                                 block_size, caches[layer].stride(0), caches[layer].stride(1),
                                                 None, "auto")

        t_f = median_seconds(run_fused, dev, args.reps)
        t_u = median_seconds(run_unfused, dev, args.reps)
        k_f, k_u = kernel_seconds(run_fused, args.reps), kernel_seconds(run_unfused, args.reps)
        rows.append({"tokens": n, "fused_ms": t_f * 1e3, "unfused_ms": t_u * 1e3, "speedup": t_u / t_f,
                     "fused_kernel_ms": k_f * 1e3, "unfused_kernel_ms": k_u * 1e3, "kernel_speedup": k_u / k_f,
                     "gemm_rows_fused": L * W, "gemm_rows_unfused": L * (Q + W),
                     "copy_TBps": copy_bytes / copy_s / 1e12})
    df = pd.DataFrame(rows)
    print(f"device: {torch.cuda.get_device_name()}; engine vllm {engine.version} ({engine.mode}); real_ops: "
          f"{engine.real_ops}")
    print(df.to_markdown(index=False, floatfmt=".3f") if hasattr(df, "to_markdown") and _has_tabulate()
          else df.to_string(index=False, float_format=lambda v: f"{v:.3f}"))
    if args.csv:
        df.to_csv(args.csv, index=False)
    return 0


def kernel_seconds(fn, reps: int) -> float:
    """The GPU time of the kernels `fn` launches, per call: the torch profiler's self device time of every
    event over `reps` calls (after one warm-up), summed, divided by reps."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    total_us = sum(e.self_device_time_total for e in prof.key_averages())
    return total_us / reps / 1e6


def _has_tabulate() -> bool:
    try:
        import tabulate  # noqa: F401
    except ImportError:
        return False
    return True


if __name__ == "__main__":
    raise SystemExit(main())
