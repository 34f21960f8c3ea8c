"""engines.triton_support: the missing-triton refusal, the interpreter's runtime-range adaptation."""

from __future__ import annotations

import sys

import pytest

from k3num.engines import triton_support
from k3num.engines.registry import EngineUnavailable


def test_without_triton_an_engine_is_unavailable_naming_the_package_and_the_extra(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "triton", None)  # import triton -> ImportError
    with pytest.raises(EngineUnavailable, match=r"vllm: its kernels need the triton package.*`test` extra"):
        triton_support.triton_modules("vllm")


KERNELS = '''
import triton
import triton.language as tl

@triton.jit
def k(N, X: tl.constexpr):
    for j in range(0, N + 1):
        pass
    for h in tl.static_range(0, X, 2):
        pass

def host(n):
    return [i for i in range(n)]
'''


def test_only_the_range_loops_of_jit_functions_are_rewritten() -> None:
    tree, count = triton_support.index_runtime_ranges(KERNELS, "k.py")
    import ast

    text = ast.unparse(tree)
    assert count == 1
    assert f"range(0, {triton_support.INDEX_HELPER}(N + 1))" not in text
    assert f"range({triton_support.INDEX_HELPER}(0), {triton_support.INDEX_HELPER}(N + 1))" in text
    assert "for i in range(n)" in text and "tl.static_range(0, X, 2)" in text


def test_the_index_helper_passes_plain_values_and_unwraps_one_element_handles() -> None:
    import numpy as np

    class Handle:
        def __init__(self, data):
            self.data = data

    class Scalar:
        def __init__(self, v):
            self.handle = Handle(np.array([v]))

    assert triton_support.interpreter_index(5) == 5
    assert triton_support.interpreter_index(Scalar(7)) == 7
    block = Scalar(0)
    block.handle.data = np.array([1, 2])
    with pytest.raises(TypeError, match="range\\(\\) over a block of 2 values"):
        triton_support.interpreter_index(block)


@pytest.mark.parametrize("name", ["vllm", "vllm-rocm", "sglang"])
def test_an_engine_without_triton_is_unavailable_with_the_reason_not_an_error(monkeypatch, name: str) -> None:
    """The root conftest turns EngineUnavailable into a skip carrying this message."""
    from k3num.engines import registry
    from k3num.supply import fetch

    if fetch.missing_files(name.split("-")[0]):
        pytest.skip(f"{name} is not fetched here")
    monkeypatch.setitem(sys.modules, "triton", None)
    monkeypatch.setitem(sys.modules, "triton.language", None)
    with pytest.raises(EngineUnavailable, match=r"kernels need the triton package.*`test` extra"):
        registry.build(name)
