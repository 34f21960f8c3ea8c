"""Spreading a pytest run over GPUs with pytest-xdist: which GPU each worker sees, how many workers.

The root conftest uses these pure functions:
- the controller (the process the user started) reads the GPUs it may use once, from
  CUDA_VISIBLE_DEVICES or the device count, and exports them as K3NUM_GPUS before the workers start;
- each worker (PYTEST_XDIST_WORKER=gwN) sets CUDA_VISIBLE_DEVICES to one of them before CUDA is
  initialised, so that every worker sees exactly one GPU, as cuda:0;
- `-n auto` means one worker per visible GPU, times K3NUM_WORKERS_PER_GPU (default 1): the K3-shape
  kernels are small enough that several workers keep one H200 busier than one does.

A property whose examples are costly (the 152-call repeat hunts) can have its example budget split into
`--shards N` tests (`Shard`), so that N workers run one property's budget side by side. The shards draw
their examples at random, each its own (a derandomized profile would give every shard the same ones, so
the plugin refuses it); the explicit @example cases run in every shard.

Workers write their drift records to partial CSVs beside the requested one (`partial_path`); the
controller merges them into the one CSV when the session ends (harness.plugin.pytest_sessionfinish), so a
worker that crashed still leaves what it measured.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

GPUS_ENV = "K3NUM_GPUS"
SHARDS_ENV = "K3NUM_SHARDS"
PER_GPU_ENV = "K3NUM_WORKERS_PER_GPU"
_WORKER = re.compile(r"^gw(\d+)$")


def visible_gpus(cuda_visible_devices: str | None, device_count: int) -> list[str]:
    """The GPU ids the run may use: CUDA_VISIBLE_DEVICES's entries where it is set, else 0..count-1."""
    if cuda_visible_devices is not None and cuda_visible_devices.strip():
        return [x.strip() for x in cuda_visible_devices.split(",") if x.strip()]
    return [str(i) for i in range(device_count)]


def worker_index(worker: str) -> int:
    """gw7 -> 7; anything else is refused (xdist names its workers gw0, gw1, ...)."""
    m = _WORKER.match(worker)
    if m is None:
        raise ValueError(f"not a pytest-xdist worker id: {worker!r} (expected gw0, gw1, ...)")
    return int(m.group(1))


def gpu_for_worker(worker: str, gpus: list[str]) -> str:
    """The one GPU worker gwN sees: round robin over `gpus` (worker N -> gpus[N mod len])."""
    if not gpus:
        raise ValueError(f"{GPUS_ENV} lists no GPU")
    return gpus[worker_index(worker) % len(gpus)]


def auto_workers(n_gpus: int, per_gpu: str | None) -> int | None:
    """`-n auto`: n_gpus x per_gpu workers on a GPU machine; None (xdist's own default: one per CPU
    core) where there is no GPU. per_gpu is K3NUM_WORKERS_PER_GPU's text (default 1)."""
    if n_gpus <= 0:
        return None
    try:
        k = int(per_gpu) if per_gpu not in (None, "") else 1
    except ValueError:
        raise ValueError(f"{PER_GPU_ENV}={per_gpu!r}: not a whole number") from None
    if k < 1:
        raise ValueError(f"{PER_GPU_ENV}={per_gpu!r}: must be at least 1")
    return n_gpus * k


def partial_path(csv: str | Path, worker: str) -> Path:
    """Where worker gwN keeps its drift records while the run lasts: out/drift.csv -> out/drift.gwN.part.csv."""
    p = Path(csv)
    return p.with_name(f"{p.stem}.{worker}.part{p.suffix or '.csv'}")


def partial_paths(csv: str | Path) -> list[Path]:
    """Every worker's partial file of this CSV, in worker order."""
    p = Path(csv)
    found = p.parent.glob(f"{p.stem}.gw*.part{p.suffix or '.csv'}")
    return sorted(found, key=lambda q: worker_index(q.name[len(p.stem) + 1:].split(".")[0]))


@dataclass(frozen=True)
class Shard:
    """Shard `index` of `count` of a property's example budget (0 of 1: the whole of it)."""

    index: int = 0
    count: int = 1

    def __post_init__(self) -> None:
        if not (isinstance(self.count, int) and self.count >= 1 and 0 <= self.index < self.count):
            raise ValueError(f"Shard: expected 0 <= index < count, count >= 1; got {self.index} of {self.count}")

    def examples(self, max_examples: int) -> int:
        """This shard's part of a budget of max_examples (rounded up: the shards together run at least it)."""
        return -(-max_examples // self.count)

    @property
    def id(self) -> str:
        return f"shard{self.index + 1}of{self.count}"
