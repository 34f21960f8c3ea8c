"""Pipeline stages as real ranks (harness/pp_ranks.py): each PP stage of an engine's forward loop in its own
process, what the loop hands from one stage to the next sent through torch.distributed (gloo on the CPU,
NCCL on GPUs), and every rank's results equal to the one-process run's, bit for bit. The one-process run is
what properties/test_pp_taps.py and properties/test_partial_projection.py judge against the oracle.

Engines: the run's real engines with a stage loop (vLLM's NVIDIA and ROCm `KimiLinearModel.forward` with the
worker's relay, TokenSpeed's stage-by-stage forward with its PPStageState and DSpark sum), and every engine of
the run that binds both halves of the partial-projection sum (STAGE_PARTIAL on each rank, FINALIZE_PROJECTION on
the last). One set of processes per world size serves every engine. The self-test's link mutants (a hand-off
that drops a tensor, one that reorders) fail it: tests/test_pp_ranks.py."""

from __future__ import annotations

import pytest

from k3num.engines import registry
from k3num.harness import pp_ranks
from k3num.harness.run_scope import engine_names as _engine_names
from k3num.properties.support import DEVICE


def _engines(config: pytest.Config) -> tuple[str, ...]:
    """The run's engines a rank run takes: real engines (they read pinned files) and the mirror; not the
    self-test's mutants, each a copy of the mirror."""
    return tuple(n for n in _engine_names(config) if registry.pin_of(n) is not None or n == "mirror")


@pytest.mark.parametrize("world", [2, 4])
def test_each_pp_stage_as_its_own_rank_computes_what_one_process_computes(world: int, request: pytest.FixtureRequest,
                                                                          k3num_run) -> None:
    if DEVICE.startswith("cuda"):
        import torch

        if torch.cuda.device_count() < world:
            pytest.skip(f"{world} ranks on NCCL need {world} GPUs; this machine shows {torch.cuda.device_count()}")
    job = pp_ranks.RankJob(engines=_engines(request.config), world=world, seed=world, device=DEVICE,
                           sources=tuple((k, str(v)) for k, v in k3num_run.sources.items()),
                           mode=k3num_run.engine_mode)
    usable = []
    for name in job.engines:
        try:
            registry.get(name, k3num_run.sources, k3num_run.engine_mode)
            usable.append(name)
        except registry.EngineUnavailable:
            continue  # its other tests skip with the reason
    job, one, refused = pp_ranks.one_process(pp_ranks.dataclasses.replace(job, engines=tuple(usable)))
    if not one:
        pytest.skip(f"no engine of this run has a stage loop or both halves of the projection sum (refused: {refused})")
    problems = pp_ranks.compare(job, pp_ranks.run_ranks(job), one)
    assert not problems, f"{world} ranks against one process ({', '.join(job.engines)}):\n" + "\n".join(problems)
