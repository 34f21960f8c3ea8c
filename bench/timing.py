"""One timing rule for every benchmark: CUDA events around the call after one warm-up, median of reps
(perf_counter on the CPU)."""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch


def median_seconds(fn: Callable[[], object], device: torch.device, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def timed(fn: Callable[..., Any], spent: Callable[[float], None]) -> Callable[..., Any]:
    """`fn` wrapped to hand the seconds of every call to `spent` (host wall time, perf_counter), raising or not:
    what the in-process benchmarks wrap a harness function with to see its share of a run."""

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            spent(time.perf_counter() - t0)

    return call


def copy_seconds(device: torch.device, reps: int) -> tuple[float, int]:
    """Seconds for one device-to-device copy of 2 GiB (64 KiB off the GPU) and its bytes read + written:
    the copy rate every bandwidth figure is given against."""
    n = (1 << 30) if device.type == "cuda" else 1 << 15
    src = torch.empty(n, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    return median_seconds(lambda: dst.copy_(src), device, reps), 2 * 2 * n
