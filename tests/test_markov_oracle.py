"""The Markov oracle (refmodel/markov.py), the rounding interval the Markov properties judge by
(oracles.budgets.dot_rounded_interval) and the two interpreter adaptations the fused steps need
(engines.triton_support: the inline-PTX add and the bf16 dot), each against closed forms or an independent
computation."""

from __future__ import annotations

import pytest
import torch

from k3num.engines import triton_support
from k3num.engines.source import SourceError
from k3num.oracles import budgets
from k3num.refmodel import markov


def _f64(*rows):
    return torch.tensor(rows, dtype=torch.float64)


def test_bias_is_the_embedding_times_each_vocabulary_row_and_its_magnitude_the_absolute_one() -> None:
    w1 = _f64([1.0, -2.0], [0.5, 0.25])
    w2 = _f64([3.0, 1.0], [-1.0, 4.0], [0.0, 2.0])
    b, m = markov.bias(w1, w2, torch.tensor([0, 1, 0]))
    assert torch.equal(b, _f64([1.0, -9.0, -4.0], [1.75, 0.5, 0.5], [1.0, -9.0, -4.0]))
    assert torch.equal(m, _f64([5.0, 9.0, 4.0], [1.75, 1.5, 0.5], [5.0, 9.0, 4.0]))


def test_bias_refuses_tokens_outside_the_embedding_and_ranks_that_differ() -> None:
    w = torch.zeros(4, 2, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"token ids must lie in \[0, 4\)"):
        markov.bias(w, w, torch.tensor([4]))
    with pytest.raises(ValueError, match="one rank r"):
        markov.bias(w, torch.zeros(4, 3, dtype=torch.float64), torch.tensor([0]))
    with pytest.raises(ValueError, match="float64"):
        markov.bias(w.float(), w, torch.tensor([0]))


def test_greedy_chain_feeds_each_steps_first_argmax_to_the_next_steps_bias() -> None:
    # vocabulary 3, rank 1: w1 = [0, 1, 2], w2 = [1, 0, -1]; bias(prev)[v] = w1[prev] * w2[v]
    w1 = _f64([0.0], [1.0], [2.0])
    w2 = _f64([1.0], [0.0], [-1.0])
    base = torch.zeros(1, 3, 3, dtype=torch.float64)
    base[0, 0] = _f64(0.0, 0.0, 5.0)   # anchor 0: no bias, token 2
    base[0, 1] = _f64(3.0, 0.0, 0.0)   # prev 2: bias [2, 0, -2] -> [5, 0, -2], token 0
    base[0, 2] = _f64(1.0, 1.0, 0.0)   # prev 0: no bias, a tie -> the first, token 0
    logits, tokens = markov.greedy_chain(base, w1, w2, torch.tensor([0]))
    assert tokens.tolist() == [[2, 0, 0]]
    assert torch.equal(logits[0, 1], _f64(5.0, 0.0, -2.0))


def _fp32_dot(p: torch.Tensor, order: torch.Tensor, toward_zero: bool) -> float:
    """A float32 sum of the products p in `order`, each add rounded to nearest or toward zero."""
    acc = torch.zeros((), dtype=torch.float32)
    for i in order.tolist():
        exact = acc.double() + p[i].double()
        r = exact.float()
        if toward_zero and r.double().abs() > exact.abs():
            r = torch.nextafter(r, torch.zeros_like(r))
        acc = r
    return float(acc)


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
def test_every_order_of_a_float32_dot_rounded_once_lies_in_the_interval(out_dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(7)
    for _ in range(30):
        n = int(torch.randint(2, 64, (1,), generator=gen))
        e = torch.randn(n, generator=gen).to(torch.bfloat16)
        w = (torch.randn(n, generator=gen) * 8).to(torch.bfloat16)
        p = e.float() * w.float()  # bf16 x bf16: exact in float32
        exact, mag = (p.double().sum(), p.double().abs().sum())
        lo, hi = budgets.dot_rounded_interval(exact.reshape(1), mag.reshape(1), n, out_dtype)
        for tz in (False, True):
            for _ in range(4):
                got = torch.tensor([_fp32_dot(p, torch.randperm(n, generator=gen), tz)]).to(out_dtype)
                assert lo <= got <= hi, (n, float(got), float(lo), float(hi))


def test_the_interval_is_one_value_when_the_dot_is_exact_and_far_from_a_rounding_boundary() -> None:
    exact, mag = _f64(1.5), _f64(3.0)  # 1.5 is a bf16 value; the float32 error bound is ~1e-5
    lo, hi = budgets.dot_rounded_interval(exact, mag, 64, torch.bfloat16)
    assert float(lo) == float(hi) == 1.5
    # 1 + 3/4 of bf16's spacing at 1, computed exactly: rounded once it is 1 + 2^-7, and nothing else is admitted
    lo, hi = budgets.dot_rounded_interval(_f64(1 + 2**-8 + 2**-9), _f64(1.0), 16, torch.bfloat16)
    assert float(lo) == float(hi) == 1 + 2**-7


_ADD_RN = '''import triton
import triton.language as tl


@triton.jit
def _add_rn(a, b):
    return tl.inline_asm_elementwise(
        "add.rn.f32 $0, $1, $2;", "=r,r,r", [a, b], dtype=tl.float32, is_pure=True, pack=1
    )
'''


def test_the_add_rn_adaptation_replaces_exactly_the_checked_helper() -> None:
    tree = triton_support.replace_add_rn(_ADD_RN, "k.py", "_add_rn")
    fn = next(n for n in tree.body if getattr(n, "name", "") == "_add_rn")
    assert len(fn.body) == 1 and type(fn.body[0].value).__name__ == "BinOp"


@pytest.mark.parametrize("changed", [_ADD_RN.replace("add.rn.f32", "add.rz.f32"),
                                     _ADD_RN.replace("_add_rn(a, b)", "_add_rn(a, b, c)"),
                                     _ADD_RN.replace("@triton.jit\n", "")])
def test_a_changed_add_rn_helper_is_refused_not_adapted(changed: str) -> None:
    with pytest.raises(SourceError, match="_add_rn is not the one-line inline-PTX"):
        triton_support.replace_add_rn(changed, "k.py", "_add_rn")


def test_the_interpreter_dot_of_bf16_reads_values_not_bit_patterns() -> None:
    pytest.importorskip("triton")
    import numpy as np
    from triton.runtime import interpreter as interp

    tl = triton_support.triton_modules("triton")[1]
    triton_support.dot_bf16_by_value()
    a = torch.tensor([[1.5, -2.0], [0.25, 3.0]]).to(torch.bfloat16)
    b = torch.tensor([[2.0, 1.0], [-1.0, 0.5]]).to(torch.bfloat16)
    bits = lambda t: interp.TensorHandle(t.view(torch.int16).numpy().view(np.uint16), tl.bfloat16)  # noqa: E731
    acc = interp.TensorHandle(np.zeros((2, 2), dtype=np.float32), tl.float32)
    out = interp.InterpreterBuilder.create_dot(None, bits(a), bits(b), acc, None, None)
    assert np.array_equal(out.data, (a.float() @ b.float()).numpy())
