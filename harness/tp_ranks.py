"""Tensor-parallel ranks: a column-parallel layer of an engine run as `world` real ranks, against its replicated form.

vLLM 0.34.0's specialized DSpark drafter makes the draft's context projection (path 3's GEMM, 5 x 7168 -> 7168 at
K3's size) column-parallel at TP > 1: each rank holds H_out / TP rows of `context_proj.weight`, sharded from the
whole checkpoint tensor by vLLM's own loader, multiplies the full input by them, and an all-gather rebuilds the
rows. Its docstring calls this exact ("same dot products, full K per output column"). This module runs `world`
processes (gloo on the CPU, NCCL on GPUs, one rank each: harness/pp_ranks.py `spawn`), builds the layer on each
rank through the engine's extras["context_proj_tp"] (engines/vllm_adapter/context_proj.py), loads the same
checkpoint tensor through the parameter's weight loader, runs the forward with torch.distributed's all-gather as
vLLM's `tensor_model_parallel_all_gather` (the ranks' shards concatenated along the last dim in rank order), and
returns every rank's output to the parent, which compares them with the replicated projection (one GEMM over the
whole weight, vLLM's stock ReplicatedLinear) bit for bit and judges them against the float64 oracle.

`MUTANTS` break one step for the self-test (tests/test_tp_ranks.py): a gather that concatenates in reverse rank
order, a loader that gives every rank rank 0's rows. Each must make the ranks' output differ from the replicated
one.

Shapes: x [T, L * H] bf16, weight [H_out, L * H] bf16, each rank's output [T, H_out].
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch

MUTANTS = ("", "gather-reversed", "rank0-rows")


@dataclasses.dataclass(frozen=True)
class TpCase:
    seed: int
    tokens: int
    taps: int  # the target layers tapped (num_target_layers)
    hidden: int  # the target's hidden size per tap
    hidden_out: int  # the draft's hidden size (the projection's output)


@dataclasses.dataclass(frozen=True)
class TpJob:
    engine: str
    world: int
    cases: tuple[TpCase, ...]
    device: str = "cpu"
    sources: tuple[tuple[str, str], ...] = ()
    mode: str = "auto"
    mutant: str = ""

    def __post_init__(self) -> None:
        if self.mutant not in MUTANTS:
            raise ValueError(f"mutant: unknown {self.mutant!r}; expected one of {list(MUTANTS)}")
        bad = [c for c in self.cases if c.hidden_out % self.world]
        if bad:
            raise ValueError(f"TP {self.world} does not divide the output of {bad[0]} (vLLM then keeps the "
                             "replicated projection)")


def inputs(case: TpCase, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(x [T, taps * H], the checkpoint's context_proj.weight [H_out, taps * H]), bf16, the same on every rank."""
    from k3num.fixtures.tensors import Draw

    d = Draw.for_device(case.seed, device)
    k = case.taps * case.hidden
    x = d.normal((case.tokens, k)).to(torch.bfloat16).to(device)
    w = (d.normal((case.hidden_out, k)) / k ** 0.5).to(torch.bfloat16).to(device)
    return x, w


def replicated(case: TpCase, device: str) -> torch.Tensor:
    """The stock replicated projection: one GEMM over the whole weight (the stand-in's F.linear), [T, H_out]."""
    x, w = inputs(case, device)
    return torch.nn.functional.linear(x, w)


def _all_gather(world: int, mutant: str) -> Any:
    import torch.distributed as dist

    def gather(shard: torch.Tensor) -> torch.Tensor:
        parts = [torch.empty_like(shard) for _ in range(world)]
        dist.all_gather(parts, shard.contiguous())
        return torch.cat(parts[::-1] if mutant == "gather-reversed" else parts, dim=-1)

    return gather


def run_rank(job: TpJob, rank: int) -> list[torch.Tensor]:
    """Rank `rank`'s output of every case (CPU tensors), inside an initialised process group."""
    from k3num.engines import registry

    engine = registry.get(job.engine, {k: Path(v) for k, v in job.sources}, job.mode)
    make = engine.extras["context_proj_tp"]
    out = []
    for case in job.cases:
        layer = make(job.world, rank, _all_gather(job.world, job.mutant), target_hidden=case.hidden,
                     target_layers=case.taps, hidden=case.hidden_out, device=job.device)
        if layer is None:
            raise RuntimeError(f"{job.engine}: context_proj kept the replicated layer at TP {job.world} for {case}")
        x, w = inputs(case, job.device)
        if job.mutant == "rank0-rows":
            layer.weight.tp_rank = 0
        layer.weight.weight_loader(layer.weight, w)  # what vLLM's default loader calls for the checkpoint tensor
        with torch.no_grad():
            out.append(layer(x).detach().cpu())
    return out


def run_ranks(job: TpJob) -> list[list[torch.Tensor]]:
    """Each rank's outputs (rank 0 first), from `job.world` processes started here (harness/pp_ranks.py `spawn`)."""
    from k3num.harness import pp_ranks

    return pp_ranks.spawn(run_rank, job)


def compare(job: TpJob, ranks: list[list[torch.Tensor]]) -> list[str]:
    """Where a rank's output differs from the replicated projection, bitwise ([] when none does)."""
    problems = []
    for i, case in enumerate(job.cases):
        want = replicated(case, "cpu" if not job.device.startswith("cuda") else job.device).cpu()
        for r, outs in enumerate(ranks):
            got = outs[i]
            if got.shape != want.shape or got.dtype != want.dtype:
                problems.append(f"{case}: rank {r} gives {got.dtype} {list(got.shape)}, the replicated "
                                f"{want.dtype} {list(want.shape)}")
            elif not torch.equal(got, want):
                diff = (got.double() - want.double()).abs()
                cols = sorted({int(c) for c in (got != want).nonzero()[:, 1].tolist()})
                problems.append(f"{case}: rank {r} differs from the replicated projection in {int((got != want).sum())}"
                                f" of {got.numel()} elements (max |diff| {float(diff.max()):.3g}; columns "
                                f"{cols[:4]}{'...' if len(cols) > 4 else ''} of {want.shape[1]})")
    return problems
