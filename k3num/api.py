"""k3num.api: what a test of your own needs from the harness, in one import.

    from hypothesis import given
    from k3num import api

    @given(case=api.strategies.attn_res_cases())
    def test_my_attn_res_kernel(case):
        inp = api.builders.attn_res_inputs(case, api.LOW, api.device())
        want, budget = api.judges.attn_res_oracle(api.NEAREST, inp.prefix, inp.delta, inp.blocks, inp.norm,
                                                  inp.qk, inp.out_norm, case.num_blocks, case.block_write_idx)
        out = my_attn_res(inp.prefix, inp.delta, inp.blocks, ...)
        api.assert_within_budget(out, want, budget, property="my_attn_res_within_budget", seed=case.seed)

- the oracle: `refmodel` (`api.refmodel.attn_res`, `.mla`, `.partial_projection`, `.rope`, `.geometry`
  with the K3 presets, `.quant`, `.transfer_plan`): float64 pure functions;
- the strategies and input builders: `api.strategies` (hypothesis strategies of cases, not test
  modules: importing them adds no test to yours; each takes a field's own strategy by name, e.g.
  `attn_res_cases(num_blocks=st.just(0))`), `api.builders` (seeded tensors of a case);
- the oracle-and-budget of each judged property, the very functions the harness's properties use:
  `api.judges` (`attn_res_oracle`, `read_only_mixture`, `fused_context_kv`, `unfused_context_kv`,
  `draft_context_kv`, `unsharded_projection`, ...), and `api.budgets` for your own rules;
- `api.engine(name)`: an engine's subjects bound as the suite binds them (the pinned release, or the
  tree `K3NUM_ENGINE_SRC` / `--engine-src` names: your checkout);
- `api.subjects`: the subject table (engines/subjects.py): per subject its typed call (a Protocol, shapes
  in its docstring), its K3 path, the oracle entry point it is judged against and the properties replay
  re-judges; `api.oracle_of(name)` is that entry point, the float64 function itself;
- `assert_within_budget`: the one judge call, raising the suite's small report (mismatched elements,
  the worst index, the budget and its rule, NaN/Inf disagreements) and returning the record, which
  joins the drift CSV when the k3num pytest plugin writes one.
"""

from __future__ import annotations

from typing import Any

import torch

from k3num import refmodel  # noqa: F401  (the oracle's package, for api.refmodel.<module>)
from k3num.engines import subjects  # noqa: F401  (the subject table, for api.subjects)
from k3num.fixtures import builders, strategies  # noqa: F401
from k3num.harness import judges  # noqa: F401
from k3num.oracles import budgets  # noqa: F401
from k3num.oracles.records import Record, judge
from k3num.refmodel import attn_res, geometry, mla, partial_projection, quant, rope, transfer_plan  # noqa: F401

LOW = torch.bfloat16  # the storage dtype of every K3 path here


class _Platform:
    """The rounding a subject's platform declares, for the judges that take an engine: round to nearest."""

    name, version, mode, real_ops = "own", "", "reference", ""
    storage_rounding = None
    rounding = "nearest"
    extras: dict[str, Any] = {}
    source_sha256: dict[str, str] = {}


NEAREST = _Platform()  # pass where a judge takes an engine and your code rounds to nearest even


def device(ctx: Any = None) -> str:
    """The device the suite puts tensors on: the run's `--device` (the `k3num_run` fixture's context; without
    one, the context this process was started with: K3NUM_DEVICE), else cuda where there is one, else cpu."""
    from k3num.fixtures import device as dev
    from k3num.harness import run

    return dev.resolve((ctx or run.current()).device)


def engine(name: str, ctx: Any = None) -> Any:
    """An engine of the harness (mirror, vllm, vllm-rocm, sglang, tokenspeed) with its subjects bound, read
    from the run's sources (`ctx`: the `k3num_run` fixture's context, with `--engine-src`; without one, the
    context this process was started with: K3NUM_ENGINE_SRC); `engines.registry.EngineUnavailable` says
    why one cannot be had here."""
    from k3num.engines import registry
    from k3num.harness import run

    ctx = ctx or run.current()
    return registry.get(name, ctx.sources, ctx.engine_mode)


def oracle_of(name: str) -> Any:
    """The float64 oracle entry point subject `name` is judged against (its record in engines/subjects.py), as
    the harness's judges call it (harness/oracle.py `current()`); ValueError for a name the table lacks."""
    from k3num.harness import oracle

    record = subjects.SUBJECT_RECORDS.get(name)
    if record is None:
        raise ValueError(f"no subject {name!r}; the subjects: {', '.join(subjects.SUBJECT_RECORDS)}")
    return getattr(oracle.current(), record.oracle)


def assert_within_budget(actual: torch.Tensor, reference: torch.Tensor, budget: budgets.Budget, *, property: str,
                         subject: str = "", engine: Any = NEAREST, seed: int = 0, reduction_len: int = 0,
                         detail: str = "") -> Record:
    """Judge `actual` (your subject's output, any dtype) against the float64 `reference` under `budget`:
    the record when it holds, else AssertionError with the suite's small report. The record is collected
    for the drift CSV (harness plugin) either way, as the suite's own records are (harness/recording.py)."""
    from k3num.harness import recording

    record = judge(property=property, engine=engine, subject=subject or property, actual=actual,
                   reference=reference, budget=budget, seed=seed, reduction_len=reduction_len, detail=detail)
    return recording.collect(record)
