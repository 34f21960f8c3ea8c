"""The rank mode proves its power (harness/pp_ranks.py): a hand-off that drops a tensor and one that reorders
one each make every engine's rank results differ from its one-process run, for every stage loop and the
projection sum; and the pieces of the rank mode on their own."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from k3num.harness import pp_ranks
from k3num.supply import fetch


@pytest.fixture(scope="module")
def job_and_one():
    engines = ["mirror"] + [e for e, pin in (("vllm", "vllm"), ("tokenspeed", "tokenspeed"))
                            if not fetch.missing_files(pin)]
    job, one, refused = pp_ranks.one_process(pp_ranks.RankJob(engines=tuple(engines), world=2, seed=7))
    assert not refused, refused
    return job, one


@pytest.mark.parametrize("mutant", sorted(pp_ranks.LINK_MUTANTS))
def test_a_broken_hand_off_fails_the_rank_comparison_for_every_engine(job_and_one, mutant: str) -> None:
    job, one = job_and_one
    problems = pp_ranks.compare(job, pp_ranks.run_ranks(dataclasses.replace(job, mutant=mutant)), one)
    caught = {p.split(":")[0] for p in problems}
    assert caught == set(job.engines), f"{mutant}: caught for {sorted(caught)} of {job.engines}: {problems}"


def test_the_plan_gives_every_stage_a_boundary_tap_on_each_side_and_none_ending_a_non_final_stage() -> None:
    for world in (2, 3, 4):
        plan = pp_ranks.plan_for(pp_ranks.RankJob(engines=(), world=world, seed=0))
        assert len(plan.stages()) == world
        ends = set(plan.stage_ends)
        assert not ends & set(plan.taps) and all({c - 1, c + 1} <= set(plan.taps) for c in plan.stage_ends)


def test_compare_names_what_differs() -> None:
    job = pp_ranks.RankJob(engines=("e",), world=2, seed=0)
    a, b = torch.zeros(2, 3), torch.ones(2, 3)
    one = {"e:pp_taps:taps": [a, a], "e:projection:float32": a}
    same = [{"e:pp_taps:taps": [a]}, {"e:pp_taps:taps": [a], "e:projection:float32": a}]
    assert pp_ranks.compare(job, same, one) == []
    got = pp_ranks.compare(job, [{"e:pp_taps:taps": []}, {"e:pp_taps:taps": [a], "e:projection:float32": b}], one)
    assert got == ["e:pp_taps:taps: the ranks hand on 1 taps, the one-process run 2",
                   "e:projection:float32: differs from the one-process run (6 of 6 elements, max |diff| 1)"]
