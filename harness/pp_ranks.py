"""Pipeline stages as real ranks: each PP stage of a bound forward loop in its own process.

The PP properties (properties/test_pp_taps.py, properties/test_partial_projection.py) run every stage in
one process. Real PP runs each stage on its own rank, and what crosses a stage boundary travels through
torch.distributed: dtype on the wire, ordering across ranks and buffer reuse live there. This module runs
`world` processes (gloo on the CPU, NCCL on GPUs, one stage per rank), hands what the engine's own loop
passes between stages from rank r to rank r + 1 with `Link` (torch.distributed's object send and
receive: the engine's IntermediateTensors or PPStageState, pickled as they are, dtypes included), and
returns each rank's results to the parent, which compares them with the one-process run bit for bit.

What runs per rank (`_rank_main`):
- `pp_taps`: the engine's extras["pp_taps"] (vLLM's NVIDIA and ROCm `KimiLinearModel.forward` loops with the
  worker's relay; TokenSpeed's stage-by-stage forward with its PPStageState and DSpark context sum) on a plan
  of `world` stages; the last rank's taps (vLLM) or every rank's own taps and the last rank's hidden state
  and projection sum (TokenSpeed).
- `projection`: the partial-projection sum (STAGE_PARTIAL on every rank, each partial sent to the last rank,
  FINALIZE_PROJECTION there in stage order), for engines that bind both.

`LINK_MUTANTS` break the hand-off (drop one tensor, swap two) for the self-test: each must make the ranks'
results differ from the one-process run's. NCCL_NVLS_ENABLE=0 is set for the ranks (NVLink multicast off).
"""

from __future__ import annotations

import dataclasses
import inspect
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from k3num.supply import env

EPS = 1e-5


class Link:
    """The hand-off between consecutive stages of one forward: rank r receives from r - 1 and sends to r + 1."""

    def __init__(self, rank: int, world: int, mutant: str = "") -> None:
        self.rank, self.world, self.mutant = rank, world, mutant

    def send(self, obj: Any, dst: int | None = None) -> None:
        import torch.distributed as dist

        dist.send_object_list([LINK_MUTANTS[self.mutant](obj) if self.mutant else obj],
                              dst=self.rank + 1 if dst is None else dst)

    def recv(self, src: int | None = None) -> Any:
        import torch.distributed as dist

        box: list[Any] = [None]
        dist.recv_object_list(box, src=self.rank - 1 if src is None else src)
        return box[0]


def _tensors_of(obj: Any) -> tuple[Any, list[str]]:
    """(the container holding obj's tensors as attributes or keys, their names)."""
    if hasattr(obj, "tensors") and isinstance(obj.tensors, dict):  # vLLM's IntermediateTensors
        return obj.tensors, [k for k, v in obj.tensors.items() if isinstance(v, torch.Tensor)]
    if isinstance(obj, torch.Tensor):
        return None, []
    return vars(obj), [k for k, v in vars(obj).items() if isinstance(v, torch.Tensor)]


def _drop_one(obj: Any) -> Any:
    """A hand-off that loses one tensor on the way: the last one is zeroed."""
    if isinstance(obj, torch.Tensor):
        return torch.zeros_like(obj)
    box, names = _tensors_of(obj)
    if names:
        box[names[-1]] = torch.zeros_like(box[names[-1]])
    return obj


def _swap_two(obj: Any) -> Any:
    """A hand-off that reorders: the first two rows of the largest tensor arrive swapped (a tensor with one row:
    its halves)."""
    if isinstance(obj, torch.Tensor):
        t = obj.clone()
        return t.flip(0) if t.shape[0] > 1 else t.flip(-1)
    box, names = _tensors_of(obj)
    if names:
        k = max(names, key=lambda n: box[n].numel())
        t = box[k].clone()
        box[k] = t.flip(0) if t.shape[0] > 1 else t.flip(-1)
    return obj


LINK_MUTANTS: dict[str, Callable[[Any], Any]] = {"drop": _drop_one, "swap": _swap_two}


@dataclasses.dataclass(frozen=True)
class RankJob:
    """What every rank runs: the engines (built from `sources` in `mode`), the case (seed, sizes), the device."""

    engines: tuple[str, ...]
    world: int
    seed: int
    tokens: int = 2
    hidden: int = 16
    layers: int = 8
    device: str = "cpu"
    sources: tuple[tuple[str, str], ...] = ()
    mode: str = "auto"
    mutant: str = ""


def plan_for(job: RankJob) -> Any:
    """A plan of `world` stages over `layers` layers with taps on both sides of every boundary (AttnRes-stream
    taps: the mixture crosses the boundaries; none ends a non-final stage, which vLLM refuses), block size 2."""
    from k3num.engines.base import PPTapPlan

    cuts = tuple(round(job.layers * (i + 1) / job.world) for i in range(job.world - 1))
    taps = tuple(sorted({t for c in cuts for t in (c - 1, c + 1) if 1 <= t <= job.layers} | {job.layers}))
    return PPTapPlan(job.layers, taps, cuts, 2, True)


def _inputs(job: RankJob) -> dict[str, Any]:
    from k3num.fixtures.builders import attn_res_weights
    from k3num.fixtures.strategies import ProjectionCase
    from k3num.fixtures.tensors import Draw

    d = Draw.for_device(job.seed, job.device)
    low = torch.bfloat16
    weights = attn_res_weights(d, job.layers, job.hidden, low, job.device)
    emb = d.normal((job.tokens, job.hidden)).to(low).to(job.device)
    scale = d.normal((job.layers, job.hidden)).to(low).to(job.device)
    k = job.world + 1  # taps of the projection: one stage holds two
    stages = tuple((i,) for i in range(job.world - 1)) + ((job.world - 1, job.world),)
    case = ProjectionCase(taps=k, tokens=job.tokens, hidden=job.hidden, hidden_out=job.hidden, stages=stages,
                          order=tuple(range(job.world)), seed=job.seed, scale=1.0, outliers=0.0)
    from k3num.fixtures.builders import projection_inputs

    return {"weights": weights, "emb": emb, "scale": scale,
            "projection": (case, projection_inputs(case, low, job.device))}


def run_job(job: RankJob, rank: int | None, link: Link | None) -> dict[str, Any]:
    """Every target of `job` for every engine: on one rank (`rank`, `link`) or all stages in this process
    (rank None). Results are CPU tensors keyed '<engine>:<target>:<name>'."""
    from k3num.engines import base, registry

    out: dict[str, Any] = {}
    inp = _inputs(job)
    plan = plan_for(job)
    for name in job.engines:
        engine = registry.get(name, {k: Path(v) for k, v in job.sources}, job.mode)
        pp = engine.extras.get("pp_taps")
        # an engine's loop of stages (the mirror's pp_taps is the one-stage answer: no stage to hand anything on)
        if pp is not None and "link" in inspect.signature(pp).parameters:
            kw: dict[str, Any] = {"with_hidden": True} if engine.extras.get("pp_taps_hidden") else {}
            # vLLM's V2 runner refuses DSpark under PP at load; the model's own loop is what crosses the ranks
            got = pp(plan, inp["emb"], inp["weights"], inp["scale"], EPS, **kw, runner_check=False, link=link)
            taps, extra = (got if isinstance(got, tuple) else (got, {}))
            out[f"{name}:pp_taps:taps"] = [t.detach().cpu() for t in taps]
            for k, t in extra.items():
                out[f"{name}:pp_taps:{k}"] = t.detach().cpu()
        if engine.provides(base.STAGE_PARTIAL) and engine.provides(base.FINALIZE_PROJECTION):
            case, pin = inp["projection"]
            partial = engine.subject(base.STAGE_PARTIAL)
            members = [list(s) for s in case.stages]
            if link is None:
                partials = [partial(pin.taps, pin.fc, m) for m in members]
            else:
                mine = partial(pin.taps, pin.fc, members[link.rank])
                if link.rank < job.world - 1:
                    link.send(mine, dst=job.world - 1)
                    partials = []
                else:
                    partials = [link.recv(src=r) for r in range(job.world - 1)] + [mine]
            if partials:
                for transfer in (torch.bfloat16, torch.float32):
                    try:
                        ctx = engine.subject(base.FINALIZE_PROJECTION)(partials, pin.norm, EPS, transfer,
                                                                        list(case.order))
                    except NotImplementedError:  # a transfer dtype the engine does not send (TokenSpeed: fp32 only)
                        continue
                    out[f"{name}:projection:{str(transfer).removeprefix('torch.')}"] = ctx.detach().cpu()
    return out


def one_process(job: RankJob) -> tuple[RankJob, dict[str, Any], dict[str, str]]:
    """The one-process run of every engine of `job`: (the job narrowed to the engines whose loop runs the plan,
    their results, {engine: why not} for the others). A loop that cannot run the plan in one process (a
    refusal, ROCm's relay with four stages: tests/test_pp_taps_lead1.py) is not a question for its ranks,
    which would wait on a stage that never sends."""
    ok, results, skipped = [], {}, {}
    for name in job.engines:
        try:
            results.update(run_job(dataclasses.replace(job, engines=(name,)), None, None))
            ok.append(name)
        except Exception as e:  # noqa: BLE001 - recorded with its type and message
            skipped[name] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]
    return dataclasses.replace(job, engines=tuple(ok)), results, skipped


def _rank_main(rank: int, work: Callable[[Any, int], Any], job: Any, rdv: str, out_dir: str) -> None:
    import torch.distributed as dist

    backend = "nccl" if job.device.startswith("cuda") else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(rank)
        job = dataclasses.replace(job, device=f"cuda:{rank}")
    dist.init_process_group(backend, init_method=f"file://{rdv}", rank=rank, world_size=job.world)
    try:
        torch.save(work(job, rank), os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def spawn(work: Callable[[Any, int], Any], job: Any) -> list[Any]:
    """`work(job, rank)`'s result on each of `job.world` processes started here (rank 0 first), inside a process
    group (gloo on the CPU, NCCL where `job.device` is cuda: rank r on cuda:r). `work` is a module-level function
    and `job` a picklable dataclass with `world` and `device` (this module's RankJob, harness/tp_ranks.py's TpJob)."""
    import torch.multiprocessing as mp

    env.put("NCCL_NVLS_ENABLE", "0")  # the ranks inherit it: NVLink multicast off
    with tempfile.TemporaryDirectory(prefix="k3num-ranks-") as tmp:
        mp.spawn(_rank_main, args=(work, job, os.path.join(tmp, "rdv"), tmp), nprocs=job.world, join=True)
        return [torch.load(os.path.join(tmp, f"rank{r}.pt")) for r in range(job.world)]


def _stage_work(job: RankJob, rank: int) -> dict[str, Any]:
    return run_job(job, rank, Link(rank, job.world, job.mutant))


def run_ranks(job: RankJob) -> list[dict[str, Any]]:
    """Each rank's results (rank 0 first), from `job.world` processes started here."""
    return spawn(_stage_work, job)


def compare(job: RankJob, ranks: list[dict[str, Any]], one: dict[str, Any]) -> list[str]:
    """Where the ranks' results differ from the one-process run's, bitwise ([] when they are the same). The taps
    are every rank's, in rank order (vLLM's last stage hands on all of them, the others none; each TokenSpeed
    stage projects its own); the hidden state, the projection sum and the finalized projection are the last
    rank's."""
    problems = []
    for key, want in sorted(one.items()):
        if key.endswith(":taps"):
            got = [t for r in ranks for t in r.get(key, [])]
            if len(got) != len(want):
                problems.append(f"{key}: the ranks hand on {len(got)} taps, the one-process run {len(want)}")
                continue
            problems += [f"{key}[{i}]: differs from the one-process run ({_describe(a, b)})"
                         for i, (a, b) in enumerate(zip(got, want)) if not _same(a, b)]
            continue
        got = ranks[-1].get(key)
        if got is None:
            problems.append(f"{key}: the last rank has none")
        elif not _same(got, want):
            problems.append(f"{key}: differs from the one-process run ({_describe(got, want)})")
    return problems


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


def _describe(got: torch.Tensor, want: torch.Tensor) -> str:
    if got.shape != want.shape or got.dtype != want.dtype:
        return f"{got.dtype} {list(got.shape)} against {want.dtype} {list(want.shape)}"
    diff = (got.double() - want.double()).abs()
    return f"{int((got != want).sum())} of {got.numel()} elements, max |diff| {float(diff.max()):.3g}"
