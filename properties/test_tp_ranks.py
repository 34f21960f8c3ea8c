"""Tensor-parallel ranks (harness/tp_ranks.py): vLLM 0.34.0's column-parallel, all-gathered context projection (path
3's GEMM) run as `world` real ranks, each loading its rows of the checkpoint's whole `context_proj.weight` through
vLLM's own loader, equal bit for bit to the replicated projection on every rank and within the rounding budget of
the float64 oracle. The release's docstring claims exactly this ("same dot products, full K per output column").

Engines: the run's engines that bind extras["context_proj_tp"] (vLLM 0.34.0: `--engine vllm@0.34.0`); the others
skip saying why. On CUDA one GPU per rank (NCCL); where fewer GPUs show, that world size skips saying so. The
self-test's mutants (a gather in reverse rank order, every rank loading rank 0's rows) fail it:
tests/test_tp_ranks.py."""

from __future__ import annotations

import random

import pytest

from k3num.harness import judges, tp_ranks
from k3num.oracles.records import judge
from k3num.properties.support import DEVICE, report

SUBJECT = "context_proj_tp"


def tp_cases(world: int, seed: int, n: int = 4) -> tuple[tp_ranks.TpCase, ...]:
    """`n` seeded cases at TP `world`: 1-5 taps, the target's hidden 16-256, an output TP divides."""
    rng = random.Random(seed)
    return tuple(tp_ranks.TpCase(seed=rng.randrange(2**31), tokens=rng.randint(1, 8), taps=rng.randint(1, 5),
                                 hidden=rng.choice([16, 64, 128, 256]),
                                 hidden_out=world * 16 * rng.randint(1, 8)) for _ in range(n))


@pytest.mark.parametrize("world", [2, 4])
def test_the_column_parallel_context_projection_on_real_ranks_is_the_replicated_one_bit_for_bit(
        engine, world: int, k3num_run) -> None:
    if engine.extras.get(SUBJECT) is None:
        pytest.skip(f"engine {engine.name} {engine.version} has no column-parallel context projection: "
                    f"{engine.missing.get(SUBJECT, 'not bound by its adapter')}")
    if DEVICE.startswith("cuda"):
        import torch

        if torch.cuda.device_count() < world:
            pytest.skip(f"{world} ranks on NCCL need {world} GPUs; this machine shows {torch.cuda.device_count()}")
    job = tp_ranks.TpJob(engine=engine.name, world=world, cases=tp_cases(world, seed=world), device=DEVICE,
                         sources=tuple((k, str(v)) for k, v in k3num_run.sources.items()), mode=k3num_run.engine_mode)
    ranks = tp_ranks.run_ranks(job)
    for i, case in enumerate(job.cases):  # within budget of the oracle (rank 0; the others are compared below)
        x, w = tp_ranks.inputs(case, DEVICE)
        want = judges.context_projection(x, w, case.taps)
        report(judge(property="context_proj_tp_within_rounding_budget", engine=engine, subject=SUBJECT,
                     actual=ranks[0][i], reference=want.reference.cpu(), budget=want.budget, seed=case.seed,
                     reduction_len=want.reduction_len, detail=f"TP {world}"))
    problems = tp_ranks.compare(job, ranks)
    assert not problems, f"{world} ranks against the replicated projection:\n" + "\n".join(problems)
