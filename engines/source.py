"""Source mode: run engine code from the fetched files without importing the engine.

Two ways (BRIEF §4):
- `load_module(path, stubs)`: execute a whole module file (a Triton kernel file
  must stay in a real file for Triton's JIT) with stub modules standing in for
  its few engine imports; the stubs are removed afterwards, so `sys.modules`
  holds exactly the same entries before and after.
- `lift(path, qualname, namespace)`: compile one function (or method) out of a
  heavy module with `ast` and run it with the names it uses injected.
"""

from __future__ import annotations

import ast
import builtins
import hashlib
import importlib.util
import symtable
import sys
import types
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any


class SourceError(RuntimeError):
    """The engine source is missing, or no longer has what the adapter binds."""


def sha256_file(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def stub(name: str, **attrs: Any) -> types.ModuleType:
    mod = types.ModuleType(name)
    mod.__dict__.update(attrs)
    return mod


@contextmanager
def stubbed(stubs: dict[str, types.ModuleType]) -> Iterator[None]:
    """Install stub modules for the duration; restore sys.modules exactly afterwards."""
    before = dict(sys.modules)
    try:
        sys.modules.update(stubs)
        yield
    finally:
        for name in [n for n in sys.modules if n not in before]:
            del sys.modules[name]
        sys.modules.update(before)
        assert dict(sys.modules).keys() == before.keys()


def load_module(path: Path, module_name: str, stubs: dict[str, types.ModuleType]) -> types.ModuleType:
    """Execute the file as a module (not registered in sys.modules) with `stubs` importable."""
    if not path.exists():
        raise SourceError(f"missing engine source {path} (run `k3num fetch`)")
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise SourceError(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    with stubbed(stubs):
        spec.loader.exec_module(module)
    return module


def is_overload(node: ast.AST) -> bool:
    """A `@overload` (`@typing.overload`) stub: a signature for type checkers, its body `...`."""
    return isinstance(node, ast.FunctionDef) and any(
        (isinstance(d, ast.Name) and d.id == "overload") or (isinstance(d, ast.Attribute) and d.attr == "overload")
        for d in node.decorator_list)


def find_def(tree: ast.Module, qualname: str) -> ast.FunctionDef:
    """The FunctionDef for `name` or `Class.method` in a parsed module: the implementation, never one of the
    `@overload` stubs before it (vLLM 0.34.0's `refill_derived` has two: lifting one sets nothing)."""
    node: ast.AST = tree
    for part in qualname.split("."):
        body = getattr(node, "body", [])
        found = [n for n in body if isinstance(n, (ast.FunctionDef, ast.ClassDef)) and n.name == part
                 and not is_overload(n)]
        if not found:
            raise SourceError(f"{qualname}: {part} not found")
        node = found[0]
    if not isinstance(node, ast.FunctionDef):
        raise SourceError(f"{qualname} is not a function")
    return node


def free_globals(fn: ast.FunctionDef) -> list[str]:
    """The global names `fn` (and the functions and comprehensions inside it) reads: what its globals must
    provide, builtins aside. From Python's own symbol table of the function compiled alone."""
    table = symtable.symtable(ast.unparse(ast.Module(body=[fn], type_ignores=[])), "<lifted>", "exec")
    found: set[str] = set()
    todo = list(table.get_children())
    while todo:
        t = todo.pop()
        found |= {s.get_name() for s in t.get_symbols() if s.is_global() and s.is_referenced()}
        todo += t.get_children()
    return sorted(n for n in found if not hasattr(builtins, n))


def check_provided(fn: ast.FunctionDef, qualname: str, path: Path, namespace: dict[str, Any]) -> None:
    """SourceError naming each global `fn` reads that `namespace` does not provide: a helper a release
    added (vLLM 0.34.0's `refill_derived`) or a `super()` call (routed to `_super_<method>`) is named before
    any test runs, not met as a NameError inside one."""
    lacking = [n for n in free_globals(fn) if n not in namespace]
    if lacking:
        said = [f"super().{n[len('_super_'):]}" if n.startswith("_super_") else n for n in lacking]
        raise SourceError(f"{path.name}: {qualname} reads {', '.join(said)}, which the adapter does not provide "
                          "(a name the release added: bind it, or give the lift a stand-in)")


def not_bound(why: str, *names: str) -> dict[str, Any]:
    """Globals a lifted body reads only on a branch the harness never takes, declared so: each raises
    SourceError naming `why` if it is reached after all."""
    def make(name: str) -> Any:
        def unbound(*args: Any, **kwargs: Any) -> Any:
            raise SourceError(f"{name}: not bound by the harness ({why})")
        return unbound
    return {n: make(n) for n in names}


def lift(path: Path, qualname: str, namespace: dict[str, Any]) -> Any:
    """Compile `qualname` (a function or `Class.method`) alone from `path`, its globals = namespace.

    Decorators are dropped (the adapters inject what the body needs); the code
    keeps the file name and line numbers so tracebacks point into the engine.
    Every global name the body reads must be in `namespace` (`check_provided`).
    """
    if not path.exists():
        raise SourceError(f"missing engine source {path} (run `k3num fetch`)")
    tree = ast.parse(path.read_text(), filename=str(path))
    fn = find_def(tree, qualname)
    fn.decorator_list = []
    check_provided(fn, qualname, path, namespace)
    mod = ast.Module(body=[fn], type_ignores=[])
    code = compile(mod, filename=str(path), mode="exec")
    glb: dict[str, Any] = {"__name__": f"k3num_lifted.{qualname}", "__builtins__": __builtins__}
    glb.update(namespace)
    exec(code, glb)
    return glb[fn.name]


class _SuperCalls(ast.NodeTransformer):
    """`super().m(args)` -> `<prefix>m(self, args)`: a lifted method has no class to call super() on."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix

    def visit_Call(self, node: ast.Call) -> ast.AST:
        self.generic_visit(node)
        f = node.func
        if (isinstance(f, ast.Attribute) and isinstance(f.value, ast.Call) and isinstance(f.value.func, ast.Name)
                and f.value.func.id == "super"):
            return ast.Call(func=ast.Name(id=f"{self.prefix}{f.attr}", ctx=ast.Load()),
                            args=[ast.Name(id="self", ctx=ast.Load()), *node.args], keywords=node.keywords)
        return node


def route_super(fn: ast.FunctionDef, prefix: str = "_super_") -> ast.FunctionDef:
    """`fn` with its super() calls routed to the globals `<prefix><method>` (which the caller injects)."""
    out = ast.fix_missing_locations(_SuperCalls(prefix).visit(fn))
    assert isinstance(out, ast.FunctionDef)
    return out


def lift_method(path: Path, qualname: str, namespace: dict[str, Any]) -> Any:
    """`Class.method` from `path` like `lift`, with `super().m(...)` calls routed to `_super_m(self, ...)`
    (the namespace provides those)."""
    if not path.exists():
        raise SourceError(f"missing engine source {path} (run `k3num fetch`)")
    fn = find_def(ast.parse(path.read_text(), filename=str(path)), qualname)
    fn.decorator_list = []
    fn = route_super(fn)
    check_provided(fn, qualname, path, namespace)
    glb: dict[str, Any] = {"__name__": f"k3num_lifted.{qualname}", "__builtins__": __builtins__, **namespace}
    exec(compile(ast.Module(body=[fn], type_ignores=[]), str(path), "exec"), glb)
    return glb[fn.name]


def signature_of(path: Path, qualname: str) -> list[str]:
    """The parameter names of `qualname`, for checking that the bound signature has not changed."""
    fn = find_def(ast.parse(path.read_text()), qualname)
    a = fn.args
    return [x.arg for x in a.posonlyargs + a.args + a.kwonlyargs]


def lift_class(path: Path, name: str, namespace: dict[str, Any]) -> Any:
    """Compile the class `name` alone from `path` (decorators kept), its globals = namespace."""
    if not path.exists():
        raise SourceError(f"missing engine source {path} (run `k3num fetch`)")
    tree = ast.parse(path.read_text(), filename=str(path))
    found = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == name]
    if not found:
        raise SourceError(f"class {name} not found in {path}")
    code = compile(ast.Module(body=[found[0]], type_ignores=[]), filename=str(path), mode="exec")
    # a decorator such as @dataclass looks its module up in sys.modules while it runs
    mod = types.ModuleType(f"k3num_lifted_{name}")
    mod.__dict__.update(namespace)
    with stubbed({mod.__name__: mod}):
        exec(code, mod.__dict__)
    return mod.__dict__[name]


def lift_value(path: Path, qualname: str, namespace: dict[str, Any]) -> Any:
    """Evaluate the right-hand side of the assignment `NAME = ...` or `Class.NAME = ...` in `path`."""
    tree = ast.parse(path.read_text(), filename=str(path))
    *owner, attr = qualname.split(".")
    node: ast.AST = tree
    for part in owner:
        hits = [n for n in getattr(node, "body", []) if isinstance(n, ast.ClassDef) and n.name == part]
        if not hits:
            raise SourceError(f"{qualname}: class {part} not found in {path}")
        node = hits[0]
    for stmt in getattr(node, "body", []):
        targets = stmt.targets if isinstance(stmt, ast.Assign) else (
            [stmt.target] if isinstance(stmt, ast.AnnAssign) and stmt.value is not None else [])
        if any(isinstance(t, ast.Name) and t.id == attr for t in targets):
            value = stmt.value
            assert value is not None
            expr = ast.Expression(body=value)
            return eval(compile(expr, filename=str(path), mode="eval"), {"__builtins__": __builtins__, **namespace})
    raise SourceError(f"{qualname}: assignment not found in {path}")


def load_kernel_module(path: Path, module_name: str, stubs: dict[str, types.ModuleType], *,
                       interpret: bool, interpreter_rewrite: Any = None,
                       interpreter_globals: dict[str, Any] | None = None) -> types.ModuleType:
    """A Triton kernel file as a module: from the file on a GPU (Triton's JIT reads the source through
    inspect); under TRITON_INTERPRET=1 exec'd from its text with no source registered, because the
    interpreter's AST rewrite of a file-backed kernel breaks loops bounded by a constexpr sum
    (BRIEF §4, quirk b). Tracebacks then lose the kernel's lines; the mode is in every CSV row.
    `interpreter_rewrite(text, filename) -> ast.Module` and `interpreter_globals` declare an adaptation
    the interpreter needs (engines.triton_support), applied in interpreter mode only."""
    if not interpret:
        return load_module(path, module_name, stubs)
    if not path.exists():
        raise SourceError(f"missing engine source {path} (run `k3num fetch`)")
    mod = types.ModuleType(module_name)
    mod.__dict__.update(interpreter_globals or {})
    text = path.read_text()
    code = compile(interpreter_rewrite(text, str(path)) if interpreter_rewrite else text,
                   f"<{path.name} (k3num source-interpreter)>", "exec")
    with stubbed(stubs):
        exec(code, mod.__dict__)
    return mod
