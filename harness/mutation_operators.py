"""Mutation operators for the bugs kernel authors write, as a cosmic-ray operator provider.

cosmic-ray's core operators change comparisons, arithmetic, numbers and booleans; these change what numerics
code gets wrong: a rounding, a cast, a max subtraction, a copy, an axis, an eps, an argument order. Each is a
cosmic-ray `Operator` over parso's tree (found at `mutation_positions`, applied at `mutate`), registered under
the provider name `k3num` (pyproject.toml's `cosmic_ray.operator_providers` entry point), so a session names
them `k3num/<Name>`. Each states its examples (before, after), which tests/test_mutate.py applies.

    k3num/DropMaxSubtraction   exp(a - m) -> exp(a)          (the softmax that overflows past a score of ~88)
    k3num/DropCopy             x.clone() / x.contiguous() -> x   (an output that aliases a buffer changed later)
    k3num/DropFloatCast        x.float() / x.to(torch.float32) / x.to(tl.float32) -> x
    k3num/ExtraRounding        y = a * b -> y = (a * b).to(bf16)   (tl.bfloat16 in a @triton.jit function)
    k3num/EpsAcrossSqrt        sqrt(v + eps) <-> sqrt(v) + eps     (rsqrt too)
    k3num/SwapAxis             dim=/axis= 0 <-> 1, -1 <-> -2
    k3num/SwapArguments        f(a, b) -> f(b, a)              (two adjacent plain-name arguments)

A mask bound `<` -> `<=` is cosmic-ray's own `core/ReplaceComparisonOperator_Lt_LtE`.
"""

from __future__ import annotations

import parso
from cosmic_ray.operators.operator import Example, Operator

EXP = ("exp", "exp2")
SQRT = ("sqrt", "rsqrt")
AXES = {"0": "1", "1": "0", "-1": "-2", "-2": "-1"}


def _expr(code: str, prefix: str):
    """The parso node of the expression `code`, with `prefix` (the whitespace before it)."""
    node = parso.parse(code).children[0]
    node = node.children[0] if node.type == "simple_stmt" else node
    node.get_first_leaf().prefix = prefix
    return node


def _callee(node) -> str:
    """The last name of a call `f(...)` / `a.b.f(...)` (an atom_expr / power node ending in `( ... )`), or ''."""
    if node.type not in ("atom_expr", "power") or len(node.children) < 2:
        return ""
    last, before = node.children[-1], node.children[-2]
    if not (last.type == "trailer" and last.children[0] == "("):
        return ""
    if before.type == "trailer" and before.children[0] == ".":
        return before.children[1].value
    return before.value if before.type == "name" else ""


def _call_argument(node):
    """The single argument node of a call node (its last trailer `( x )`), or None."""
    trailer = node.children[-1]
    if len(trailer.children) != 3 or trailer.children[1].type in ("arglist", "argument"):
        return None
    return trailer.children[1]


def _in_jit(node) -> bool:
    """Whether the node sits in a function decorated with something named *jit (a Triton kernel)."""
    fn = node.search_ancestor("funcdef")
    while fn is not None:
        if any("jit" in d.get_code() for d in fn.get_decorators()):
            return True
        fn = fn.search_ancestor("funcdef")
    return False


def _trailing_method(node, names: tuple[str, ...]) -> bool:
    """Whether the atom_expr ends in `.name()` for one of `names` (no arguments)."""
    if node.type not in ("atom_expr", "power") or len(node.children) < 3:
        return False
    call, attr = node.children[-1], node.children[-2]
    return (call.type == "trailer" and [c.get_code() for c in call.children] == ["(", ")"]
            and attr.type == "trailer" and attr.children[0] == "." and attr.children[1].value in names)


def _put(parent, i: int, child):
    """`parent` with its i-th child replaced by `child` (parso's tree edited in place); returns `parent`."""
    parent.children[i] = child
    child.parent = parent
    return parent


def _drop_last_two(node):
    """The atom_expr without its last two trailers (`.m` and `(...)`): the object the method was called on."""
    rest = node.children[:-2]
    if len(rest) == 1:
        return rest[0]
    node.children = rest
    for child in rest:
        child.parent = node
    return node


class DropMaxSubtraction(Operator):
    """exp(a - m) -> exp(a): the max subtraction before an exponential dropped (exact in exact arithmetic,
    inf or 0 once a - m leaves exp's range)."""

    def mutation_positions(self, node):
        if _callee(node) in EXP:
            arg = _call_argument(node)
            if arg is not None and arg.type == "arith_expr" and len(arg.children) == 3 and arg.children[1] == "-":
                yield (arg.start_pos, arg.end_pos)

    def mutate(self, node, index):
        _put(node.children[-1], 1, _call_argument(node).children[0])  # the call's argument: its first operand
        return node

    @classmethod
    def examples(cls):
        return (Example("y = tl.exp(s - m)", "y = tl.exp(s)"),
                Example("y = torch.exp(x - x.max())", "y = torch.exp(x)"),
                Example("y = tl.exp2((s - m) * c)", "y = tl.exp2((s - m) * c)"))


class DropCopy(Operator):
    """x.clone() / x.contiguous() -> x: the returned value may now alias a buffer the engine changes later."""

    def mutation_positions(self, node):
        if _trailing_method(node, ("clone", "contiguous")):
            yield (node.start_pos, node.end_pos)

    def mutate(self, node, index):
        return _drop_last_two(node)

    @classmethod
    def examples(cls):
        return (Example("tap = prefix_sum.clone()", "tap = prefix_sum"),
                Example("x = a.view(-1).contiguous()", "x = a.view(-1)"))


class DropFloatCast(Operator):
    """x.float() / x.to(torch.float32) / x.to(tl.float32) -> x: the arithmetic after it stays in the storage
    type (bf16), one more rounding per operation."""

    def mutation_positions(self, node):
        if _trailing_method(node, ("float",)) or self._to_float32(node):
            yield (node.start_pos, node.end_pos)

    @staticmethod
    def _to_float32(node) -> bool:
        if _callee(node) != "to":
            return False
        arg = _call_argument(node)
        return arg is not None and arg.get_code().strip() in ("torch.float32", "tl.float32", "torch.float")

    def mutate(self, node, index):
        return _drop_last_two(node)

    @classmethod
    def examples(cls):
        return (Example("y = x.float() * w", "y = x * w"), Example("y = x.to(tl.float32)", "y = x"),
                Example("y = x.to(torch.bfloat16)", "y = x.to(torch.bfloat16)"))


class ExtraRounding(Operator):
    """y = <arithmetic> -> y = (<arithmetic>).to(bf16): one rounding to the storage type inserted where the
    result stayed in float32 (tl.bfloat16 inside a @triton.jit function, torch.bfloat16 elsewhere)."""

    def mutation_positions(self, node):
        if (node.type == "expr_stmt" and len(node.children) == 3 and node.children[1] == "="
                and node.children[2].type in ("arith_expr", "term") and node.search_ancestor("funcdef") is not None):
            yield (node.children[2].start_pos, node.children[2].end_pos)

    def mutate(self, node, index):
        rhs = node.children[2]
        ns = "tl" if _in_jit(node) else "torch"
        return _put(node, 2, _expr(f"({rhs.get_code().strip()}).to({ns}.bfloat16)", rhs.get_first_leaf().prefix))

    @classmethod
    def examples(cls):
        return (Example("def f(a, b):\n    y = a * b\n", "def f(a, b):\n    y = (a * b).to(torch.bfloat16)\n"),
                Example("@triton.jit\ndef k(a, b):\n    y = a + b\n",
                        "@triton.jit\ndef k(a, b):\n    y = (a + b).to(tl.bfloat16)\n"))


class EpsAcrossSqrt(Operator):
    """sqrt(v + eps) -> sqrt(v) + eps, and sqrt(v) + eps -> sqrt(v + eps) (rsqrt alike): the eps moved across
    the root (the norm of a tiny row is where it shows)."""

    def mutation_positions(self, node):
        if self._inside(node) or self._outside(node):
            yield (node.start_pos, node.end_pos)

    @staticmethod
    def _inside(node) -> bool:
        if _callee(node) not in SQRT:
            return False
        arg = _call_argument(node)
        return arg is not None and arg.type == "arith_expr" and len(arg.children) == 3 and arg.children[1] == "+"

    @staticmethod
    def _outside(node) -> bool:
        return (node.type == "arith_expr" and len(node.children) == 3 and node.children[1] == "+"
                and _callee(node.children[0]) in SQRT and _call_argument(node.children[0]) is not None)

    def mutate(self, node, index):
        prefix = node.get_first_leaf().prefix
        if self._inside(node):
            arg = _call_argument(node)
            head = "".join(c.get_code() for c in node.children[:-1]).strip()
            code = f"{head}({arg.children[0].get_code().strip()}) + {arg.children[2].get_code().strip()}"
        else:
            call = node.children[0]
            head = "".join(c.get_code() for c in call.children[:-1]).strip()
            code = f"{head}({_call_argument(call).get_code().strip()} + {node.children[2].get_code().strip()})"
        return _expr(code, prefix)

    @classmethod
    def examples(cls):
        return (Example("r = tl.rsqrt(v + eps)", "r = tl.rsqrt(v) + eps"),
                Example("r = torch.sqrt(v) + eps", "r = torch.sqrt(v + eps)"))


class SwapAxis(Operator):
    """dim= / axis= 0 <-> 1, -1 <-> -2: the reduction or concatenation over the other axis."""

    def mutation_positions(self, node):
        if (node.type == "argument" and len(node.children) == 3 and node.children[0].type == "name"
                and node.children[0].value in ("dim", "axis") and node.children[2].get_code().strip() in AXES):
            yield (node.children[2].start_pos, node.children[2].end_pos)

    def mutate(self, node, index):
        old = node.children[2]
        return _put(node, 2, _expr(AXES[old.get_code().strip()], old.get_first_leaf().prefix))

    @classmethod
    def examples(cls):
        return (Example("s = tl.sum(x, axis=1)", "s = tl.sum(x, axis=0)"),
                Example("y = torch.cat(p, dim=-1)", "y = torch.cat(p, dim=-2)"))


class SwapArguments(Operator):
    """f(a, b, ...) -> f(b, a, ...): two adjacent positional arguments that are plain names exchanged (the
    same-typed arguments a signature cannot tell apart)."""

    def mutation_positions(self, node):
        for i in self._pairs(node):
            yield (node.children[i].start_pos, node.children[i + 2].end_pos)

    @staticmethod
    def _pairs(node) -> list[int]:
        if node.type != "arglist":
            return []
        kids = node.children
        return [i for i in range(0, len(kids) - 2, 2)
                if kids[i].type == "name" and kids[i + 2].type == "name" and kids[i].value != kids[i + 2].value]

    def mutate(self, node, index):
        i = self._pairs(node)[index]
        a, b = node.children[i], node.children[i + 2]
        pa, pb = a.prefix, b.prefix
        a.prefix, b.prefix = pb, pa
        node.children[i], node.children[i + 2] = b, a
        return node

    @classmethod
    def examples(cls):
        return (Example("f(x, w, 3)", "f(w, x, 3)"), Example("f(x, w, y)", "f(x, y, w)", occurrence=1))


OPERATORS: dict[str, type[Operator]] = {op.__name__: op for op in (
    DropMaxSubtraction, DropCopy, DropFloatCast, ExtraRounding, EpsAcrossSqrt, SwapAxis, SwapArguments)}


class Provider:
    """cosmic-ray's operator provider for `k3num/<Name>` (pyproject.toml: cosmic_ray.operator_providers)."""

    def __iter__(self):
        return iter(OPERATORS)

    def __getitem__(self, name: str) -> type[Operator]:
        return OPERATORS[name]

