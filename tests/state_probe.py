"""A diagnostic pytest plugin (`-p tests.state_probe`, K3NUM_STATE_PROBE=FILE): what a test leaves behind.

Issue 32: with a bug planted in SGLang's `_combine_kernel`, `test_dflash_materialized_kv_writes_every_element`
failed in the whole-suite run (8 of 16 K elements NaN) and passed alone. After every test this plugin
appends one JSON line to FILE: the node, its outcome, and the process state a test could leave changed
(torch's function-mode stack, default dtype, deterministic flags, grad mode, CUDA stream and device,
matmul precision flags, allocator figures). Around the DFlash materializer it also records, when an
output is not finite, which elements are, and what the same call gives again: at once, after a
synchronize, outside the poisoned-allocation mode and after emptying the allocator's cache.
"""

from __future__ import annotations

import json
import os
from typing import Any

import pytest
import torch

PROBE_ENV = "K3NUM_STATE_PROBE"
WATCH = "dflash_materialized"


def _state() -> dict[str, Any]:
    s: dict[str, Any] = {
        "fn_modes": torch._C._len_torch_function_stack(),
        "default_dtype": str(torch.get_default_dtype()),
        "deterministic": torch.are_deterministic_algorithms_enabled(),
        "fill_uninit": bool(getattr(torch.utils.deterministic, "fill_uninitialized_memory", False)),
        "grad": torch.is_grad_enabled(),
        "tf32": torch.backends.cuda.matmul.allow_tf32,
        "bf16_reduced": torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction,
        "threads": torch.get_num_threads(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        s.update(device=torch.cuda.current_device(), stream=torch.cuda.current_stream().cuda_stream,
                 allocated=torch.cuda.memory_allocated(), reserved=torch.cuda.memory_reserved(),
                 retries=torch.cuda.memory_stats().get("num_alloc_retries", 0))
    return s


def _write(row: dict[str, Any]) -> None:
    path = os.environ.get(PROBE_ENV)
    if path:
        with open(path, "a") as fh:
            fh.write(json.dumps(row, default=str) + "\n")


def _nonfinite(t: torch.Tensor) -> list[list[int]]:
    return (~torch.isfinite(t.float())).nonzero().tolist()[:64]


def _watched(fn: Any, node: str) -> Any:
    from k3num.oracles import hunt

    def materialize(*args: Any, **kwargs: Any) -> Any:
        k, v = fn(*args, **kwargs)
        if torch.isfinite(k.float()).all() and torch.isfinite(v.float()).all():
            return k, v
        row: dict[str, Any] = {"node": node, "event": "nonfinite", "k_shape": list(k.shape),
                               "k_bad": _nonfinite(k), "v_bad": _nonfinite(v), "state": _state(),
                               "positions": args[4].tolist() if len(args) > 4 else None}
        again = {}
        k2, v2 = fn(*args, **kwargs)
        again["at_once"] = [len(_nonfinite(k2)), len(_nonfinite(v2))]
        if torch.cuda.is_available():
            torch.cuda.synchronize()
            k2, v2 = fn(*args, **kwargs)
            torch.cuda.synchronize()
            again["synchronized"] = [len(_nonfinite(k2)), len(_nonfinite(v2))]
        with torch.overrides._disable_current_modes():
            k2, v2 = fn(*args, **kwargs)
        again["unpoisoned"] = [len(_nonfinite(k2)), len(_nonfinite(v2))]
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
            with hunt.poisoned_allocations():
                k2, v2 = fn(*args, **kwargs)
            again["after_empty_cache"] = [len(_nonfinite(k2)), len(_nonfinite(v2))]
        row["again"] = again
        _write(row)
        return k, v

    return materialize


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item):
    engine = getattr(item, "funcargs", {}).get("engine")
    extras = getattr(engine, "extras", None)
    watched = WATCH in item.nodeid and isinstance(extras, dict) and "draft_kv_materialize" in extras
    if watched:
        fn = extras["draft_kv_materialize"]
        extras["draft_kv_materialize"] = _watched(fn, item.nodeid)
    try:
        return (yield)
    finally:
        if watched:
            extras["draft_kv_materialize"] = fn


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.when == "teardown":
        _write({"node": report.nodeid, "event": "teardown", "state": _state()})
    elif report.when == "call" or report.outcome != "passed":
        _write({"node": report.nodeid, "event": report.when, "outcome": report.outcome})
