"""The check's oracle memo (harness/oracle_memo.py): a base's pass is answered from the head's only on
the same input bits, and the answer is the oracle's own."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from k3num.harness import oracle, oracle_memo
from k3num.refmodel import partial_projection


@dataclasses.dataclass
class _Spec:
    w: torch.Tensor
    eps: float


def test_same_compares_tensor_bits_not_values():
    a = torch.tensor([0.0, float("nan"), 1.0], dtype=torch.float64)
    assert oracle_memo.same(a, a.clone())  # a NaN is the same as its own bits
    assert not oracle_memo.same(a, torch.tensor([-0.0, float("nan"), 1.0], dtype=torch.float64))  # -0.0 is not 0.0
    assert not oracle_memo.same(a, a.float())  # dtype
    assert not oracle_memo.same(a, a[None])  # shape
    assert not oracle_memo.same(torch.ones(2), torch.ones(2).to(torch.bfloat16))
    assert oracle_memo.same(torch.ones(2, 3, dtype=torch.bfloat16).t(), torch.ones(3, 2, dtype=torch.bfloat16))


def test_same_walks_dataclasses_and_containers():
    s = _Spec(torch.ones(3), 1e-5)
    assert oracle_memo.same((s, [1, "a"], {"k": torch.zeros(1)}), (_Spec(torch.ones(3), 1e-5), [1, "a"],
                                                                        {"k": torch.zeros(1)}))
    assert not oracle_memo.same(s, _Spec(torch.ones(3), 1e-6))
    assert not oracle_memo.same(s, _Spec(torch.tensor([1.0, 1.0, 1.0 + 2 ** -20]), 1e-5))
    assert not oracle_memo.same([1, 2], (1, 2))


@pytest.fixture
def memo():
    return oracle_memo.Memo()  # one check's memo


def _inputs(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(3, 4, 16, generator=g, dtype=torch.float64), torch.randn(8, 48, generator=g,
            dtype=torch.float64), torch.randn(8, generator=g, dtype=torch.float64))


def _project(*args):
    return oracle.current().project_context(*args)  # as the judges call it


def test_a_replayed_pass_reuses_the_heads_answer_only_on_the_same_bits(memo):
    real = partial_projection.project_context
    taps, fc, norm = _inputs(0)
    before = dict(memo.stats)
    with memo.passing(recording=True):
        want = _project(taps, fc, norm, 1e-5)
    with memo.passing(recording=False):
        same = _project(taps.clone(), fc.clone(), norm.clone(), 1e-5)
        same.fill_(7.0)  # the caller owns what it gets: the kept answer is a copy
    with memo.passing(recording=False):
        again = _project(taps.clone(), fc.clone(), norm.clone(), 1e-5)
        flipped = taps.clone()
        flipped.view(torch.int64)[0, 0, 0] ^= 1  # one bit of one input
        other = _project(flipped, fc, norm, 1e-5)
    assert torch.equal(again, want)
    assert torch.equal(other, real(flipped, fc, norm, 1e-5))
    got = {k: memo.stats[k] - before[k] for k in memo.stats}
    assert got == {"computed": 1, "reused": 2, "missed": 1}, got  # the flipped bit was computed, not reused


def test_outside_a_pass_the_oracle_is_refmodels_own(memo):
    taps, fc, norm = _inputs(1)
    before = dict(memo.stats)
    assert oracle.current() is oracle.PLAIN
    out = _project(taps, fc, norm, 1e-5)
    assert torch.equal(out, partial_projection.project_context(taps, fc, norm, 1e-5)) and memo.stats == before


def test_a_pass_scopes_the_memo_and_replaces_nothing_in_refmodel(memo):
    import importlib

    modules = {"attn_res": "attn_res", "attn_res_with_sources": "attn_res", "capture_aux_stream": "attn_res",
               "context_kv": "mla", "project_context": "partial_projection", "draft_context_kv": "partial_projection"}
    assert set(modules) == set(oracle.Oracle.entry_points())
    with pytest.raises(RuntimeError, match="raised inside"):
        with memo.passing(recording=True):
            assert oracle.current() is memo.oracle
            raise RuntimeError("raised inside")
    assert oracle.current() is oracle.PLAIN  # the scope ended with its block, on an exception too
    for name, module in modules.items():
        fn = getattr(importlib.import_module(f"k3num.refmodel.{module}"), name)
        assert getattr(oracle.PLAIN, name) is fn and getattr(memo.oracle, name) is not fn
