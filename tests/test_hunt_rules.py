"""oracles.hunt: the repeat rule, the poison and its check, poisoned allocations, guard bands."""

from __future__ import annotations

import math

import pytest
import torch

from k3num.oracles import hunt


@pytest.mark.parametrize("p", [0.03, 0.1, 0.5, 0.8])
@pytest.mark.parametrize("alpha", [0.01, 0.05])
def test_calls_to_detect_is_the_smallest_n_with_miss_probability_at_most_alpha(p: float, alpha: float) -> None:
    n = hunt.calls_to_detect(p, alpha)
    assert (1 - p) ** n <= alpha < (1 - p) ** (n - 1)


def test_the_stated_repeat_counts() -> None:
    assert hunt.calls_to_detect(hunt.P_GPU) == 152 == hunt.repeats_for("cuda")
    assert hunt.calls_to_detect(hunt.P_CPU) == 3 == hunt.repeats_for("cpu")


@pytest.mark.parametrize("p,alpha", [(0.0, 0.01), (1.0, 0.01), (0.5, 0.0), (0.5, 1.0), (-0.1, 0.5)])
def test_calls_to_detect_refuses_rates_outside_the_open_unit_interval(p: float, alpha: float) -> None:
    with pytest.raises(ValueError, match="0 < p < 1"):
        hunt.calls_to_detect(p, alpha)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn,
                                   torch.float8_e5m2, torch.int64, torch.int32, torch.uint8])
def test_poison_is_recognised_and_any_write_is_not(dtype: torch.dtype) -> None:
    t = hunt.poison_(torch.empty(6, dtype=dtype))
    assert bool(hunt.is_sentinel(t).all())
    t[2] = 1 if not dtype.is_floating_point else torch.tensor(1.0).to(dtype)
    assert hunt.is_sentinel(t).tolist() == [True, True, False, True, True, True]


def test_every_uninitialised_allocator_is_poisoned_inside_the_mode() -> None:
    x = torch.ones(3)
    with hunt.poisoned_allocations() as mode:
        made = [torch.empty(2), torch.empty_like(x), x.new_empty((4,)), torch.empty_strided((2,), (1,)),
                torch.empty(3, dtype=torch.int32)]
        untouched = torch.zeros(2)
    assert mode.count == len(made)
    assert all(bool(hunt.is_sentinel(t).all()) for t in made)
    assert torch.equal(untouched, torch.zeros(2))


def test_a_guard_band_shows_a_write_past_the_tensor_and_keeps_the_values() -> None:
    v = torch.arange(6.0).view(2, 3)
    g = hunt.guarded(v, guard=8)
    assert torch.equal(g.view, v) and g.view.is_contiguous() and g.guards_intact()
    g.buffer[g.start + g.numel + 2] = 0.0  # two elements past the end
    assert not g.guards_intact()
    assert "1 element(s) written after the tensor (first at offset 2)" in g.guard_damage()


def test_a_read_past_a_guarded_row_reads_nan() -> None:
    g = hunt.guarded(torch.ones(2, 4), guard=8)
    past = g.buffer[g.start: g.start + 10]  # a 10-wide load from a row of 8 elements in all
    assert math.isnan(float(past.sum()))


def test_distinct_counts_bitwise_different_results_with_nan_payloads_equal() -> None:
    a = (torch.tensor([1.0, float("nan")]),)
    b = (torch.tensor([1.0, float("nan")]),)
    c = (torch.tensor([1.0, 2.0]),)
    assert hunt.distinct([a, b]) == 1 and hunt.distinct([a, b, c]) == 2
    assert hunt.first_difference(a, b, ("x",)) == ""
    assert hunt.first_difference(a, c, ("x",)).startswith("x: 1 element(s) differ, first at [1]")
