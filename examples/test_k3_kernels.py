"""A test file to drop into an engine's own repository: its K3 kernels against the k3-numerics oracle.

    pip install k3-numerics            # brings the k3num pytest plugin and this API
    K3NUM_ENGINE_SRC=vllm=. pytest examples/test_k3_kernels.py      # from the root of a vLLM checkout
    pytest examples/test_k3_kernels.py --engine-src vllm=.          # the same through the plugin's flag

It judges the checkout's attn_res kernel (Triton: natively on a GPU, under the interpreter on a CPU)
against the float64 oracle, with the suite's own budget, on hypothesis' cases; the other judged
subjects follow the same pattern (`api.judges` holds each property's oracle and budget). A failure is
the suite's small report. K3NUM_EXAMPLE_ENGINE picks another engine of the harness (default vllm).
"""

from __future__ import annotations

import dataclasses
import os

import pytest
from hypothesis import given, settings

from k3num import api

ENGINE = os.environ.get("K3NUM_EXAMPLE_ENGINE", "vllm")


@pytest.fixture(scope="module")
def engine():
    try:
        return api.engine(ENGINE)
    except Exception as e:  # engines.registry.EngineUnavailable: the checkout lacks the files, ...
        pytest.fail(f"{ENGINE}: {e}")


@settings(max_examples=25, deadline=None, derandomize=True, database=None)
@given(case=api.strategies.attn_res_cases())
def test_attn_res_is_within_one_rounding_of_the_oracle(engine, case) -> None:
    if 0 <= case.block_write_idx < case.num_blocks:  # the model writes at num_blocks (or not at all)
        case = dataclasses.replace(case, block_write_idx=-1)
    inp = api.builders.attn_res_inputs(case, api.LOW, api.device())
    want, budget = api.judges.attn_res_oracle(engine, inp.prefix, inp.delta, inp.blocks, inp.norm, inp.qk,
                                              inp.out_norm, case.num_blocks, case.block_write_idx)
    out = engine.subject("attn_res")(inp.prefix, inp.delta, inp.blocks, inp.norm, inp.qk, inp.out_norm,
                                     case.num_blocks, case.block_write_idx, api.judges.EPS, api.judges.OUT_EPS)
    api.assert_within_budget(out, want, budget, property="example_attn_res_within_rounding_budget",
                             subject="attn_res", engine=engine, seed=case.seed,
                             reduction_len=case.hidden * (case.num_blocks + 1))
