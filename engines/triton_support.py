"""Triton and interpreter helpers shared by the adapters whose subjects are Triton kernels.

- `require_interpreter`: choose TRITON_INTERPRET=1 before triton's first import (no CUDA here).
- `triton_modules`: (triton, triton.language), or EngineUnavailable naming the missing package and
  the extra that brings it.
- `round_bf16_to_nearest_even`: the interpreter patched to round float32 -> bfloat16 as the GPU does
  (it truncates toward zero otherwise); `truncate_to_bf16` is what it did.
- `index_runtime_ranges`: the interpreter adaptation that lets a kernel loop `range(...)` over a
  runtime kernel argument (see its docstring); applied at load time, in interpreter mode only.
"""

from __future__ import annotations

import ast
import sys
from typing import Any

import torch

from k3num.engines.registry import EngineUnavailable
from k3num.supply import env

# the extra of this project that installs triton (pyproject.toml)
TRITON_EXTRA = "test"


def require_interpreter() -> None:
    """TRITON_INTERPRET must be set before triton is first imported (triton.language's own
    jit helpers are decorated at import); the pytest plugin (k3num.harness.plugin) sets it on machines without CUDA."""
    if env.get("TRITON_INTERPRET") != "1":
        if "triton" in sys.modules:
            raise EngineUnavailable(
                "no CUDA device, and triton was imported before TRITON_INTERPRET=1 was set: "
                "set TRITON_INTERPRET=1 in the environment to run the Triton kernels under the interpreter"
            )
        env.put("TRITON_INTERPRET", "1")


def triton_modules(engine: str) -> tuple[Any, Any]:
    """(triton, triton.language) or EngineUnavailable: the engine's kernels need triton."""
    try:
        import triton
        import triton.language as tl
    except ImportError as e:
        raise EngineUnavailable(
            f"{engine}: its kernels need the triton package, which is not installed ({e}); "
            f"install this project with the `{TRITON_EXTRA}` extra (pip install -e '.[{TRITON_EXTRA}]') "
            "or `pip install triton`") from e
    return triton, tl


def truncate_to_bf16(x: torch.Tensor) -> torch.Tensor:
    """float32 -> bfloat16 rounding toward zero: what triton 3.6's unpatched interpreter does (quirk a);
    kept to show the patch below matters (tests/test_interpreter_rounding.py)."""
    bits = x.float().contiguous().view(torch.int32) & ~0xFFFF
    return bits.view(torch.float32).to(torch.bfloat16)


# --- the nearest-even adaptation ------------------------------------------------------------------

NEAREST_EVEN_ADAPTATION = (
    "interpreter adaptation: float32 -> bfloat16 casts round to nearest even as on the GPU (the interpreter "
    "truncates; engines/triton_support.py)")


def _bf16_nearest_even(data: Any) -> Any:
    """float32 array -> its bfloat16 bit patterns (uint16), rounded to nearest even by torch."""
    import numpy as np

    a = np.ascontiguousarray(np.asarray(data, dtype=np.float32))
    bits = torch.from_numpy(a.reshape(-1).copy()).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    return bits.reshape(a.shape)


def round_bf16_to_nearest_even() -> None:
    """Patch the interpreter (idempotent): its float32 -> bfloat16 casts round to nearest even
    (NEAREST_EVEN_ADAPTATION). Installed by the adapters before they load a kernel in interpreter mode;
    an explicit `fp_downcast_rounding="rtz"` keeps rounding toward zero."""
    from triton.runtime import interpreter as interp

    tl = triton_modules("triton")[1]
    builder = interp.InterpreterBuilder
    if getattr(builder, "_k3num_nearest_even", False):
        return
    cast_impl, fp_to_fp = builder.cast_impl, builder.create_fp_to_fp
    rtne = interp._ir.ROUNDING_MODE.RTNE

    def patched_cast(self: Any, src: Any, dst_type: Any) -> Any:
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            return interp.TensorHandle(_bf16_nearest_even(src.data), dst_type.scalar)
        return cast_impl(self, src, dst_type)

    def patched_fp_to_fp(self: Any, src: Any, dst_type: Any, rounding_mode: Any) -> Any:
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16 and rounding_mode in (None, rtne):
            return interp.TensorHandle(_bf16_nearest_even(src.data), dst_type.scalar)
        return fp_to_fp(self, src, dst_type, rounding_mode)

    builder._k3num_original = (cast_impl, fp_to_fp)  # what the interpreter did (the rounding test shows it)
    builder.cast_impl = patched_cast
    builder.create_fp_to_fp = patched_fp_to_fp
    builder._k3num_nearest_even = True


# --- the runtime-range adaptation ---------------------------------------------------------------

INDEX_HELPER = "_k3num_interpreter_index"
RUNTIME_RANGE_ADAPTATION = (
    "interpreter adaptation: in @triton.jit functions each argument of `range(...)` is wrapped in "
    f"{INDEX_HELPER}(...), which turns the interpreter's one-element scalar tensor into a Python int "
    "(triton 3.6's interpreter indexes it with int(ndarray), which numpy >= 2.x refuses for a 1-d array); "
    "the loop bounds and the body are unchanged")


def interpreter_index(x: Any) -> Any:
    """A scalar kernel value as a Python int under the interpreter (a plain value passes through)."""
    handle = getattr(x, "handle", None)
    data = getattr(handle, "data", None)
    if data is None:
        return x
    flat = data.reshape(-1)
    if flat.size != 1:
        raise TypeError(f"{INDEX_HELPER}: range() over a block of {flat.size} values, not a scalar")
    return int(flat[0])


def _is_jit(fn: ast.FunctionDef) -> bool:
    for d in fn.decorator_list:
        node = d.func if isinstance(d, ast.Call) else d
        if isinstance(node, ast.Attribute) and node.attr == "jit":
            return True
        if isinstance(node, ast.Name) and node.id == "jit":
            return True
    return False


class _WrapRangeArgs(ast.NodeTransformer):
    def __init__(self) -> None:
        self.count = 0

    def visit_Call(self, node: ast.Call) -> ast.AST:
        self.generic_visit(node)
        if isinstance(node.func, ast.Name) and node.func.id == "range":
            node.args = [ast.Call(func=ast.Name(id=INDEX_HELPER, ctx=ast.Load()), args=[a], keywords=[])
                         for a in node.args]
            self.count += 1
        return node


def index_runtime_ranges(text: str, filename: str) -> tuple[ast.Module, int]:
    """The module's AST with every `range(...)` inside a @triton.jit function rewritten (see
    RUNTIME_RANGE_ADAPTATION), and how many loops were rewritten."""
    tree = ast.parse(text, filename=filename)
    wrap = _WrapRangeArgs()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and _is_jit(node):
            wrap.visit(node)
    return ast.fix_missing_locations(tree), wrap.count


# --- the inline-PTX add adaptation --------------------------------------------------------------

ADD_RN_PTX = "add.rn.f32 $0, $1, $2;"
ADD_RN_ADAPTATION = (
    "interpreter adaptation: a @triton.jit function whose whole body is `tl.inline_asm_elementwise` of the PTX "
    f"`{ADD_RN_PTX}` (one float32 add, rounded to nearest even) returns `a + b` instead: the interpreter cannot run "
    "inline PTX, and its float32 add (numpy's) is that same IEEE add; on a GPU the PTX runs")


def _is_add_rn(fn: ast.FunctionDef) -> bool:
    """`fn` is exactly `return tl.inline_asm_elementwise("add.rn.f32 $0, $1, $2;", ...)` over two arguments."""
    if not _is_jit(fn) or len(fn.args.args) != 2 or len(fn.body) != 1 or not isinstance(fn.body[0], ast.Return):
        return False
    call = fn.body[0].value
    return (isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute)
            and call.func.attr == "inline_asm_elementwise" and bool(call.args)
            and isinstance(call.args[0], ast.Constant) and call.args[0].value == ADD_RN_PTX)


def replace_add_rn(text: str, filename: str, name: str) -> ast.Module:
    """The module's AST with the jit function `name` (an inline-PTX rounded add, checked) returning `a + b`
    (ADD_RN_ADAPTATION). engines.source.SourceError when `name` is missing or is anything else: a kernel whose
    helper changed is never adapted silently."""
    tree = ast.parse(text, filename=filename)
    hits = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == name]
    if len(hits) != 1 or not _is_add_rn(hits[0]):
        from k3num.engines.source import SourceError

        raise SourceError(f"{filename}: {name} is not the one-line inline-PTX `{ADD_RN_PTX}` helper the interpreter "
                         "adaptation replaces")
    fn = hits[0]
    a, b = (arg.arg for arg in fn.args.args)
    fn.body = [ast.Return(value=ast.BinOp(left=ast.Name(id=a, ctx=ast.Load()), op=ast.Add(),
                                          right=ast.Name(id=b, ctx=ast.Load())))]
    return ast.fix_missing_locations(tree)


# --- the bf16 dot adaptation ----------------------------------------------------------------------

BF16_DOT_ADAPTATION = (
    "interpreter adaptation: tl.dot of bfloat16 operands multiplies their values (widened exactly to float32), "
    "not the uint16 bit patterns the interpreter stores them as (triton 3.6's interpreter returns garbage there, "
    "about 1e10 for unit inputs); the float32 accumulation is numpy's, a summation order like any tiling's")


def _bf16_values(data: Any) -> Any:
    """bfloat16 bit patterns (uint16) -> their float32 values, exactly."""
    import numpy as np

    return (data.astype(np.uint32) << np.uint32(16)).view(np.float32)


def dot_bf16_by_value() -> None:
    """Patch the interpreter (idempotent): its tl.dot reads bfloat16 operands by value (BF16_DOT_ADAPTATION)."""
    from triton.runtime import interpreter as interp

    tl = triton_modules("triton")[1]
    builder = interp.InterpreterBuilder
    if getattr(builder, "_k3num_bf16_dot", False):
        return
    create_dot = builder.create_dot

    def patched_dot(self: Any, a: Any, b: Any, d: Any, input_precision: Any, max_num_imprecise_acc: Any) -> Any:
        if a.dtype.scalar == tl.bfloat16 and b.dtype.scalar == tl.bfloat16:
            a = interp.TensorHandle(_bf16_values(a.data), tl.float32)
            b = interp.TensorHandle(_bf16_values(b.data), tl.float32)
        return create_dot(self, a, b, d, input_precision, max_num_imprecise_acc)

    builder._k3num_original_dot = create_dot
    builder.create_dot = patched_dot
    builder._k3num_bf16_dot = True
