"""The ledger's AttnRes-kernel and FP8-cache case classes through the draft step (harness/impact_kernels.py): a
race's worst call is the one the step takes; a case class whose call did not race gives the noise floor bit for
bit (so a row's flips are the race's); a raced call, a bank one block short and a zero FP8 scale reach the
tokens; and the races' rows say so on the CPU instead of a verdict."""

from __future__ import annotations

import dataclasses as dc
import types

import pytest
import torch

from k3num.engines import base, registry, standins
from k3num.fixtures.builders import draft_step_inputs
from k3num.harness import draft_step, impact
from k3num.harness import impact_kernels as kernels
from k3num.harness.judges import LOW
from k3num.supply import fetch


def _vllm(name: str = "vllm"):
    if fetch.missing_files("vllm"):
        pytest.skip("vllm is not fetched (k3num fetch vllm)")
    return registry.get(name)


def _run(engine, hooks, kind: str = "dspark", n: int = 2, **shape) -> list:
    inputs, subjects = hooks[0], hooks[1]
    mirror = registry.get("mirror")
    out = []
    for case in impact.sample_cases(kind, n, 0):
        case = dc.replace(case, taps=max(case.taps, 2), **shape)
        inp = inputs(draft_step_inputs(case, LOW, "cpu"), case)
        out.append(draft_step.run(engine, mirror, kind, case, "cpu", subjects=subjects(case), inputs=inp))
    return out


def _stand_in(subject_of) -> types.SimpleNamespace:
    """An engine whose subjects are `subject_of(name)` (the mirror's where it gives None)."""
    mirror = registry.get("mirror")
    return types.SimpleNamespace(name="planted", version="0", extras={}, provides=mirror.provides,
                                 subject=lambda n: subject_of(n) or mirror.subject(n))


def test_worst_of_takes_the_raced_output_farthest_from_the_most_frequent_one() -> None:
    outs = iter([torch.tensor([1.0, 2.0]), torch.tensor([1.0, 2.0]), torch.tensor([1.0, 2.5]),
                 torch.tensor([1.0, 2.0]), torch.tensor([1.0, 9.0])])
    took, modal, raced = kernels.worst_of(lambda: next(outs), 5)
    assert raced == 2 and took.tolist() == [1.0, 9.0] and modal.tolist() == [1.0, 2.0]
    same = kernels.worst_of(lambda: torch.tensor([3.0], dtype=torch.bfloat16), 4)
    assert same[2] == 0 and torch.equal(same[0], same[1])
    first_raced = iter([torch.tensor([0.0]), torch.tensor([5.0]), torch.tensor([5.0])])
    took, modal, raced = kernels.worst_of(lambda: next(first_raced), 3)
    assert (raced, took.item(), modal.item()) == (1, 0.0, 5.0)


def test_the_taps_made_to_mix_two_or_more_blocks_are_those_whose_mixture_reads_them() -> None:
    case = impact.sample_cases("dspark", 1, 0)[0]
    for taps in (1, 2, 3):
        c = dc.replace(case, taps=taps)
        want = [layer for layer in c.tap_layers() if -(-min(layer + 1, c.target_layers) // c.attn_res_block) >= 2]
        assert kernels.mixed_taps(c) == want
    assert kernels.mixed_taps(dc.replace(case, taps=1)) == []  # layer 0's mixture reads one block


@pytest.mark.parametrize("entry", ["K3N-004", "K3N-007"])
def test_an_unraced_race_case_class_gives_the_noise_floor_bitwise(entry: str) -> None:
    """The interpreter does not race: the engine's logits are the noise floor's, bit for bit, so on a GPU every
    difference the case row shows is a raced call's."""
    engine = _vllm("vllm" if entry == "K3N-004" else "vllm-rocm")
    make = kernels.written_in_the_mix if entry == "K3N-004" else kernels.raced_layer_input
    inputs, subjects, count = make(engine, registry.get("mirror"), 2)
    for r in _run(engine, (inputs, subjects), hidden=32 if entry == "K3N-004" else 128):
        assert torch.equal(r.engine, r.noise_floor)
    assert count.calls > 0 and count.raced == 0 and count.note() == f"raced 0 of {count.calls} calls"


def test_a_race_that_hits_reaches_the_tokens() -> None:
    """A planted race: every other call of vLLM's kernel mixes the written row's old value (K3N-004's outcome), or
    adds the delta twice to the prefix's first 32 elements (K3N-007's). The step takes those calls, and the
    logits move past delta."""
    engine = _vllm()
    kernel = engine.subject(base.ATTN_RES)
    calls = {"n": 0}

    def stale(prefix, delta, blocks, norm, proj, out_norm, nb, write, eps, out_eps):
        calls["n"] += 1
        raced = calls["n"] % 2 == 0
        return kernel(prefix, delta, blocks, norm, proj, out_norm, nb, -1 if raced else write, eps, out_eps)

    def twice(prefix, delta, blocks, norm, proj, out_norm, nb, write, eps, out_eps):
        calls["n"] += 1
        if calls["n"] % 2 == 0:
            prefix = prefix.clone()
            prefix[:, :32] = prefix[:, :32] + delta[:, :32]
        return kernel(prefix, delta, blocks, norm, proj, out_norm, nb, write, eps, out_eps)

    mirror = registry.get("mirror")
    for make, planted, hidden in ((kernels.written_in_the_mix, stale, 32), (kernels.raced_layer_input, twice, 128)):
        e = _stand_in(lambda n, _p=planted: _p if n == base.ATTN_RES else None)
        inputs, subjects, count = make(e, mirror, 4)
        results = _run(e, (inputs, subjects), hidden=hidden)
        assert count.raced == count.calls // 2 > 0
        assert max(r.verdict.worst_err_over_delta for r in results) > 1, make.__name__


def test_a_bank_one_block_short_moves_the_logits_and_the_right_sized_bank_does_not() -> None:
    engine = _vllm()
    mirror = registry.get("mirror")
    short = _run(engine, kernels.bank_one_block_short(engine, mirror))
    right = _run(engine, kernels.bank_one_block_short(engine, mirror, short=False))
    assert max(r.verdict.worst_err_over_delta for r in short) > 1
    assert max(r.verdict.worst_err_over_delta for r in right) < 1
    assert all(r.verdict.count("DIVERGED") == 0 for r in right)


def test_a_zero_fp8_scale_flips_decided_tokens_past_what_the_fp8_cache_itself_does() -> None:
    """K3N-014's case class over an insert that writes as vLLM's does, without a refusal (the mirror's
    sat-RNE(x / scale), engines.standins.write_fp8_unchecked): layer 1's scale 0 saturates every entry, which
    the read back multiplies by 0."""
    ops = types.SimpleNamespace(insert_per_layer=lambda kv_c, k_pe, cache, slots, fmt, scale:
                                standins.write_fp8_unchecked(kv_c, k_pe, cache, slots, fmt, scale))
    engine = _stand_in(lambda n: None)
    engine.extras = {"context_kv_ops": ops}
    def keep(inp, case):
        return inp

    bad = _run(engine, (keep, kernels.through_an_fp8_cache(engine, 1)), n=3, num_layers=2)
    fine = _run(engine, (keep, kernels.through_an_fp8_cache(engine, None)), n=3, num_layers=2)
    worst = [max(r.verdict.worst_err_over_delta for r in rs) for rs in (bad, fine)]
    assert worst[0] > worst[1] and sum(r.verdict.count("DIVERGED") for r in bad) > 0, worst
    assert "layer 1 mod L's scale 0" in bad[0].paths and "amax / 448" in fine[0].paths


def test_allocations_can_be_filled_with_zeros_as_well_as_poisoned() -> None:
    """K3N-008's case class reads the memory SGLang leaves unwritten as zeros; the hunt's default is NaN."""
    from k3num.oracles.hunt import poisoned_allocations

    with poisoned_allocations(fill=torch.Tensor.zero_) as mode:
        zeros = torch.empty(3)
    with poisoned_allocations():
        nans = torch.empty(3)
    assert zeros.tolist() == [0.0, 0.0, 0.0] and mode.count == 1 and bool(nans.isnan().all())
