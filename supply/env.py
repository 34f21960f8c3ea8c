"""The process boundary: the one module of the product that reads or writes environment variables.

A run's settings are arguments: `harness/run.py`'s RunContext is built once from the options and
handed down (fixtures, `registry.get(name, sources)`, adapter builds, `supply.fetch.Source`). The
environment carries a setting only where one process starts another (pytest-xdist's workers, the
two sides of `k3num check`, a subprocess), where a machine's own setting comes in (the engine cache),
and where a third party reads it (Triton, torch's extension builder, CUDA). Each variable is listed
in VARS with the modules that may read and write it; tests/test_env_boundary.py holds every product
module to that list (read in the source), and to touching `os.environ` nowhere but here.

This module is on the supply floor (the lowest that reads any of them), so that supply/ can read the
machine's cache setting without reaching up to harness/.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

RUN = "harness/run.py"  # RunContext.from_env / to_env: the run's settings across a process boundary


@dataclass(frozen=True)
class Var:
    what: str
    readers: tuple[str, ...]  # repository paths of the modules that may read it
    writers: tuple[str, ...] = ()


VARS: dict[str, Var] = {
    # the run's settings, carried to processes started by another (harness/run.py)
    "K3NUM_ENGINE_SRC": Var("--engine-src: NAME=PATH[,NAME=PATH...], the local trees", (RUN,), (RUN,)),
    "K3NUM_ENGINE_MODE": Var("--engine-mode: auto, import or source", (RUN,), (RUN,)),
    "K3NUM_DEVICE": Var("--device: where the small-shape properties put their tensors", (RUN,), (RUN,)),
    "K3NUM_REPRO_DIR": Var("--repro-dir: where failing comparisons are bundled", (RUN,), (RUN,)),
    "K3NUM_REPRO_ALL": Var("--repro-all: bundle each property's worst comparison too", (RUN,), (RUN,)),
    "K3NUM_CHECKPOINT": Var("--checkpoint: a user's checkpoint folder", (RUN,), (RUN,)),
    "K3NUM_GOLDEN": Var("--golden: a golden set's folder", (RUN,), (RUN,)),
    "K3NUM_THREADS": Var("--threads: torch's CPU threads per process", (RUN,), (RUN, "harness/plugin.py")),
    "K3NUM_SHARDS": Var("--shards: the shardable properties' split (gpu_nightly.sh sets it)", (RUN,)),
    # a machine's setting
    "K3NUM_ENGINE_CACHE": Var("where the pinned engine files are extracted", ("supply/fetch.py",)),
    # what the xdist controller decides at run time and hands its workers
    "K3NUM_GPUS": Var("the GPUs the controller's workers share", ("harness/plugin.py", "harness/run_scope.py"),
                      ("harness/plugin.py",)),
    "K3NUM_WORKERS_PER_GPU": Var("workers per GPU under -n auto", ("harness/plugin.py",)),
    "K3NUM_RUN_CSV": Var("--drift-dir's file, chosen once by the controller", ("harness/plugin.py",),
                         ("harness/plugin.py",)),
    "K3NUM_RUNDIR": Var("the controller's folder where a worker that must go leaves its note",
                        ("harness/plugin.py", "harness/run_isolation.py"), ("harness/plugin.py",)),
    "K3NUM_MEMORY_LOG": Var("a file each test's CUDA memory is logged to (scripts/gpu_isolation.py)",
                            ("harness/run_isolation.py",)),
    "K3NUM_OWN_TESTS": Var("more folders whose tests the plugin treats as the harness's own",
                           ("harness/run_scope.py",)),
    # pytest-xdist's, CUDA's, Triton's and torch's own
    "PYTEST_XDIST_WORKER": Var("this process is an xdist worker (xdist sets it)", ("harness/plugin.py",)),
    "CUDA_VISIBLE_DEVICES": Var("the GPUs CUDA shows this process", ("harness/plugin.py",), ("harness/plugin.py",)),
    "TRITON_INTERPRET": Var("run Triton kernels under the interpreter (set before triton's first import)",
                            ("engines/triton_support.py",),
                            ("engines/triton_support.py", "harness/plugin.py", "harness/cli.py",
                             "harness/store_golden.py", "harness/impact.py")),
    "OMP_NUM_THREADS": Var("OpenMP's (torch's) CPU threads: set by the user, the run leaves torch's choice", (RUN,)),
    "TORCH_CUDA_ARCH_LIST": Var("the GPU architecture torch's extension builder compiles for", (),
                                ("supply/cuda_ops.py",)),
    "MAX_JOBS": Var("the parallel jobs of torch's extension builder", (), ("supply/cuda_ops.py",)),
    "NCCL_NVLS_ENABLE": Var("NCCL's NVLink multicast (0: off), for the PP and TP ranks it starts", (),
                            ("harness/pp_ranks.py",)),
}


def _var(name: str) -> Var:
    if name not in VARS:
        raise KeyError(f"{name}: not a variable of supply/env.py's VARS; add it there with its readers")
    return VARS[name]


def get(name: str, default: str | None = None) -> str | None:
    """The variable's value in this process's environment (the boundary read)."""
    _var(name)
    return os.environ.get(name, default)


def put(name: str, value: str) -> None:
    """Set the variable for this process and the processes it starts."""
    _var(name)
    os.environ[name] = value


def put_default(name: str, value: str) -> str:
    """Set the variable unless it is set; its value."""
    _var(name)
    return os.environ.setdefault(name, value)


def child(settings: Mapping[str, str]) -> dict[str, str]:
    """The environment of a process this one starts: this one's, with `settings` (variables of VARS)."""
    for name in settings:
        _var(name)
    return {**os.environ, **settings}
