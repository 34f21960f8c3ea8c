"""Lead 1 (issue 13), the evidence behind its refutation: vLLM 0.33.0's ROCm forward loop
(amd/linear.py) neither packs its taps into the PP slots nor collects the upstream ones, and taps
the start layer on every rank. The V2 model runner, the only one that runs DSpark, refuses PP for
that model at load (eagle3_utils.verify_supports_aux_hidden_states_over_pp: the ROCm
KimiLinearModel does not declare supports_aux_hidden_states_over_pp), so no wrong taps reach a draft.
These tests pin both facts: the refusal, and what the loop would hand on without it. If either
changes upstream, docs/upstream-reports.md (lead 1) must be revisited."""

from __future__ import annotations

import pytest
import torch

from k3num.engines import base, registry
from k3num.engines.base import PPTapPlan
from k3num.fixtures.builders import attn_res_weights
from k3num.fixtures.tensors import Draw
from k3num.supply import fetch

PLAN = PPTapPlan(6, (0, 2, 4, 6), (), 2, False)


@pytest.fixture
def inputs():
    if fetch.missing_files("vllm"):
        pytest.skip("vllm 0.33.0 is not fetched here: run `k3num fetch vllm`")
    d = Draw.for_device(0, "cpu")
    return (d.normal((1, 16)).to(torch.bfloat16), attn_res_weights(d, 6, 16, torch.bfloat16, "cpu"),
            d.normal((6, 16)).to(torch.bfloat16))


def test_the_v2_runner_refuses_pp_for_the_rocm_model_at_load(inputs) -> None:
    taps = registry.get("vllm-rocm").extras["pp_taps"]
    with pytest.raises(base.StageRefused, match="KimiLinearForCausalLM does not support dspark with pipeline"):
        taps(PPTapPlan(6, (0, 2, 4, 6), (3,), 2, False), *inputs)


def test_without_the_refusal_the_rocm_loop_would_lose_upstream_taps_and_repeat_a_start_tap(inputs) -> None:
    taps = registry.get("vllm-rocm").extras["pp_taps"]
    one = taps(PLAN, *inputs)
    lost = taps(PPTapPlan(6, (0, 2, 4, 6), (3,), 2, False), *inputs, runner_check=False)  # [0,3) [3,6)
    assert len(one) == 4 and len(lost) == 2  # taps 0 and 2 (stage 0's) never reach the last stage
    assert torch.equal(lost[0], one[2]) and torch.equal(lost[1], one[3])
    doubled = taps(PPTapPlan(6, (0, 2, 4, 6), (2,), 2, False), *inputs, runner_check=False)  # [0,2) [2,6)
    assert len(doubled) == 3 and torch.equal(doubled[0], one[1])  # tap 2 taken again at the stage start


def test_the_nvidia_loop_hands_on_every_tap_under_the_same_plans(inputs) -> None:
    taps = registry.get("vllm").extras["pp_taps"]
    one = taps(PLAN, *inputs)
    for ends in ((3,), (2,), (2, 4), (1, 3, 5)):
        split = taps(PPTapPlan(6, (0, 2, 4, 6), ends, 2, False), *inputs)
        assert len(split) == 4 and all(torch.equal(a, b) for a, b in zip(one, split)), ends
