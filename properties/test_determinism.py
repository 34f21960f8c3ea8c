"""Determinism of every kernel subject: repeated calls on bitwise-identical fresh inputs give
bitwise-identical outputs and side effects (written prefix, bank rows, caches).

The number of calls per case is oracles.hunt's rule (detect a per-call failure rate P with
confidence 1 - ALPHA: 152 calls on the GPU, 7 on the CPU, where nothing can race and the repeats
prove the plumbing). Every call runs under poisoned allocations (oracles.hunt.PoisonAllocations),
so an element a call leaves unwritten is a NaN rather than the previous call's value. Each case
adds one record to the drift CSV with the calls made and the number of bitwise-distinct results.
"""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from k3num.engines import base
from k3num.fixtures.strategies import (  # the race cases: the ledger's race entries reproduce with them
    DELTA_OVER_FOUR_SOURCES,
    WRITE_IN_THE_MIX,
    WRITE_IN_THE_MIX_UNIT,
    AttnResCase,
    attn_res_cases,
    draft_kv_cases,
)
from k3num.harness.coverage import determinism_declared
from k3num.oracles import hunt
from k3num.properties.checks.attn_res import as_admitted
from k3num.properties.checks.determinism import KERNEL_SUBJECTS, check_deterministic, without_determinism
from k3num.properties.checks.determinism import attn_res_call as _attn_res
from k3num.properties.checks.determinism import draft_kv_call as _draft_kv
from k3num.properties.checks.draft_kv import MATERIALIZE, materializer
from k3num.properties.support import DEVICE, shardable, subject

# lead 2 (issue 13): the NVIDIA kernel with num_blocks 0 and the output norm at hidden <= 128, where
# replicated register copies of the prefix feed the norm while the prefix is rewritten in place
LEAD_2 = dataclasses.replace(DELTA_OVER_FOUR_SOURCES, num_blocks=0)


# attn_res has its own test below, with the ledger's race reproducers as explicit examples; a subject added after
# KERNEL_SUBJECTS declares its own in its property module (checks.determinism.deterministic_across_calls)
_WITHOUT = without_determinism(determinism_declared())
assert not _WITHOUT, f"determinism properties: {_WITHOUT}"


@shardable
@pytest.mark.parametrize("name", list(KERNEL_SUBJECTS))
@given(data=st.data())
def test_repeated_calls_on_identical_inputs_are_bitwise_identical(engine, name: str, data: st.DataObject) -> None:
    fn = subject(engine, name)
    strategy, make = KERNEL_SUBJECTS[name]
    case = data.draw(strategy, label="case")
    seed = case[-1] if isinstance(case, tuple) else case.seed
    check_deterministic(engine, name, make(engine, fn, case, DEVICE), hunt.repeats_for(DEVICE), seed,
                        detail=repr(case).replace(" ", ""))


@shardable
@given(case=draft_kv_cases(styles=("neox",)))
def test_dflash_materialized_kv_repeated_calls_are_bitwise_identical(engine, case) -> None:
    """SGLang's DFlash materializer (an engine extra, not a subject), called repeatedly on one input."""
    fn = materializer(engine)
    check_deterministic(engine, MATERIALIZE, _draft_kv(engine, fn, case, DEVICE), hunt.repeats_for(DEVICE),
                        case.seed, detail=repr(case).replace(" ", ""))


@shardable
@given(case=attn_res_cases())
@example(case=WRITE_IN_THE_MIX)
@example(case=WRITE_IN_THE_MIX_UNIT)
@example(case=DELTA_OVER_FOUR_SOURCES)
def test_attn_res_repeated_calls_are_bitwise_identical(engine, case: AttnResCase) -> None:
    """Every call the kernel's signature allows (in the form the engine takes: test_attn_res.as_admitted),
    the ledger's race reproducers first."""
    case = as_admitted(engine, case)
    fn = subject(engine, base.ATTN_RES)
    check_deterministic(engine, base.ATTN_RES, _attn_res(engine, fn, case, DEVICE), hunt.repeats_for(DEVICE),
                        case.seed, detail=repr(case).replace(" ", ""))


@shardable
@pytest.mark.gpu
@given(case=attn_res_cases())
@example(case=DELTA_OVER_FOUR_SOURCES)
@example(case=LEAD_2)
def test_attn_res_in_place_prefix_rewrite_is_deterministic(engine, case: AttnResCase) -> None:
    """The attn_res calls that rewrite the prefix in place (a delta) with the output norm, no bank
    write: the configuration of K3N-007 (ROCm kernel) and of lead 2 (NVIDIA kernel, num_blocks 0).
    A race hunt, so GPU only: the sequential Triton interpreter cannot race (the general test above
    covers the plumbing on the CPU)."""
    case = dataclasses.replace(case, with_delta=True, with_output_norm=True, block_write_idx=-1)
    fn = subject(engine, base.ATTN_RES)
    check_deterministic(engine, base.ATTN_RES, _attn_res(engine, fn, case, DEVICE), hunt.repeats_for(DEVICE),
                        case.seed, detail=f"nb={case.num_blocks};H={case.hidden};T={case.tokens}")
