"""`k3num coverage`: every K3 kernel and code path on the three paths, bound or not, and what judges it.

    k3num coverage [--format markdown|csv] [--out FILE]

One row per (engine, file, function): its language, the K3 path (1 context KV, 2 AttnRes and the aux
tap, 3 the PP partial projection and the transfer that follows it), whether the harness binds it,
the property tests that judge it (found by reading properties/*.py for the subject or contract it is
bound as), and, where it is not bound, why and what binding it would need.

The bound rows are built from the adapters' declarations: vLLM's `CONTRACT`
(engines/vllm_adapter), SGLang's and TokenSpeed's `BOUND` (engines/sglang_adapter/,
engines/tokenspeed_adapter/, engines/sglang_adapter/transfer.py). The unbound rows are the census below
(UNBOUND). tests/test_coverage.py keeps the table true: every pinned file has a row, and every
bound row names a function its pinned file defines.

Shapes: none.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from k3num.engines import subjects

COLUMNS = ("engine", "file", "function", "language", "path", "releases", "bound", "runs_here", "properties",
           "why_not")
GPU_ONLY = "test_k3_shapes.py"  # its properties are gpu-marked (full K3 shapes): they skip without CUDA
PROPERTIES = Path(__file__).resolve().parents[1] / "properties"


@dataclass(frozen=True)
class Row:
    engine: str
    file: str
    function: str
    language: str  # python, triton, cuda, cute-dsl
    path: str  # "1", "2", "3" (BRIEF's three paths; 3 includes the transfer after the projection)
    subject: str  # the subject or contract it is bound as ("" when not bound)
    why_not: str = ""  # where not bound: why, and what binding it would need


# Kernels and code paths of the three releases (and the kernel packages they require) that are not
# bound here, with the reason. A row leaves this list when an adapter binds it.
NEEDS_SM100 = "needs an SM100 (Blackwell) GPU; {here}"  # {here}: what this machine has (machine_here())
UNBOUND: tuple[Row, ...] = (
    Row("tokenspeed", "tokenspeed_kernel/ops/kvcache/triton.py", "mla_latent_norm_rope_scatter", "triton", "1", "",
        "TokenSpeed's DFlash drafter's fused MLA context write (execution/drafter/dflash.py "
        "_write_native_cache_fused_mla: one stacked GEMM, then norm + RoPE + scatter for all layers); not in the "
        "census of the K3 DSpark path (write_context_kv), not bound yet: needs drafter/dflash.py pinned and a "
        "CONTEXT_KV_FUSED subject over it"),
    Row("vllm", "csrc/kimi_k3/attn_res_kernel.cu", "kimi_k3_attn_res (tcgen05/TMEM)", "cuda", "2", "",
        f"{NEEDS_SM100}. Ready: on a 10.x GPU with CUDA >= 13 `k3num build-ops` also builds it (supply/cuda_ops."
        "build_plan: vLLM's 10.0f arch rule and flags), and the attn_res subject takes it exactly where vLLM's "
        "wrapper does (hidden 7168, dense rows, num_blocks <= 8: tests/test_cuda_ops_build.py); elsewhere the "
        "mode note says 'native kernel kimi_k3_attn_res: needs SM100'"),
    Row("vllm", "vllm/models/kimi_k3/nvidia/ops/", "CuTe-DSL AttnRes decode", "cute-dsl", "2", "",
        f"{NEEDS_SM100}; running it needs nvidia-cutlass-dsl (CUDA 13) on the SM100 host and its file pinned"),
    Row("sglang", "sglang/kernels/jit/csrc/kimi_k3/attn_res/", "AttnResFusedTmaKernel", "cuda", "2", "",
        f"{NEEDS_SM100}; running it needs SGLang's JIT build of the kernel (nvcc 13, the csrc folder pinned from "
        "the wheel) on the SM100 host"),
    Row("tokenspeed", "tokenspeed_kernel/ops/residual/cuda.py", "cuda_attn_res_fwd (attn_res.so)", "cuda", "2", "",
        f"{NEEDS_SM100}; registered with min arch 10.0, so select_attn_res_fwd_kernel never takes it on SM90 "
        "(the bound torch_attn_res_fwd is what an H200 runs); running it needs the wheel's attn_res.so "
        "(fetch.BINARIES) and tvm_ffi on an SM100 host"),
)


def bound_rows() -> list[Row]:
    """The rows the adapters declare they bind (each adapter package's `coverage_rows()`, one format)."""
    import importlib

    from k3num.engines import registry

    rows = [Row(*row) for module in registry.adapters() for row in importlib.import_module(module).coverage_rows()]
    merged: dict[tuple[str, str, str], Row] = {}  # one row per function: a function bound for two subjects
    for r in rows:
        key = (r.engine, r.file, r.function)
        old = merged.get(key)
        merged[key] = r if old is None else Row(*key, r.language, r.path, f"{old.subject},{r.subject}")
    return list(merged.values())


# the K3 path each subject or contract belongs to (one record per name: engines/subjects.py)
PATH_OF = subjects.PATH_OF


def judged_by() -> dict[str, list[str]]:
    """subject or contract -> the property tests that use it, read from properties/*.py: a test that
    names `base.CONSTANT` (a subject), `"name"` (an extras key) or a module-level constant holding one,
    itself or through a helper it calls (one of its module's, or one of properties/checks/ it imports, with
    the helpers those call). A test calling a helper that names two subjects is counted for both, whichever
    it passes."""
    constants = _subject_constants()
    trees = {path: ast.parse(path.read_text()) for path in sorted(PROPERTIES.glob("test_*.py"))}
    shared = [ast.parse(path.read_text()) for path in sorted((PROPERTIES / "checks").glob("*.py"))]
    # module-level NAME = "contract", or NAME = [base.SUBJECT, ...] (a list a test is parametrized over), in any
    # property or checks module (imported by the others)
    names = {t.id: named for tree in [*trees.values(), *shared] for node in tree.body
             if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None
             for named in [_named(node.value, constants)] if named
             for t in (node.targets if isinstance(node, ast.Assign) else [node.target]) if isinstance(t, ast.Name)}
    checks = _helpers_using([n for tree in shared for n in tree.body if isinstance(n, ast.FunctionDef)],
                            constants, names)
    out: dict[str, set[str]] = {}
    for path, tree in trees.items():
        local = [n for n in tree.body if isinstance(n, ast.FunctionDef) and not n.name.startswith("test_")]
        used_by_helper = {alias: checks.get(orig, set()) for alias, orig in _checks_imports(tree).items()}
        used_by_helper.update(_helpers_using(local, constants, names, used_by_helper))
        for fn in (n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name.startswith("test_")):
            used = _uses(fn, constants, names) | _calls(fn, used_by_helper)
            for u in used:
                out.setdefault(u, set()).add(f"{path.name}::{fn.name}")
    return {k: sorted(v) for k, v in out.items()}


def _subject_constants() -> dict[str, str]:
    """engines/base.py's constant name -> the subject it names (`base.ATTN_RES` -> "attn_res")."""
    from k3num.engines import base

    return {k: v for k, v in vars(base).items() if isinstance(v, str) and v in base.SUBJECTS}


def determinism_declared(properties: Path = PROPERTIES) -> dict[str, str]:
    """subject -> "module::test" for each determinism property a property module declares with
    properties/checks/determinism.py `deterministic_across_calls(NAME, ...)` at module level, NAME given as
    `base.CONSTANT`, a string, or a module-level constant holding one (read from the source, as judged_by reads;
    importing a test module here would import it a second time beside pytest's own import)."""
    constants = _subject_constants()
    out: dict[str, str] = {}
    for path in sorted(properties.glob("test_*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        names = {t.id: node.value.value for node in tree.body if isinstance(node, ast.Assign)
                 and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)
                 for t in node.targets if isinstance(t, ast.Name)}
        for node in tree.body:
            call = node.value if isinstance(node, ast.Assign) else None
            if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Name)
                    and call.func.id == "deterministic_across_calls" and call.args):
                continue
            arg, name = call.args[0], None
            if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                name = arg.value
            elif isinstance(arg, ast.Name):
                name = names.get(arg.id)
            elif isinstance(arg, ast.Attribute) and isinstance(arg.value, ast.Name) and arg.value.id == "base":
                name = constants.get(arg.attr)
            if name is None:
                raise ValueError(f"{path.name}:{node.lineno}: deterministic_across_calls' subject must be a "
                                 "string, base.CONSTANT or a module-level constant (read from the source)")
            targets = [t.id for t in node.targets if isinstance(t, ast.Name) and t.id.startswith("test_")]
            if not targets:
                raise ValueError(f"{path.name}:{node.lineno}: deterministic_across_calls(...) must be assigned to a "
                                 "module-level name starting with test_ (pytest collects nothing else)")
            out[name] = f"{path.name}::{targets[0]}"
    return out


def _checks_imports(tree: ast.Module) -> dict[str, str]:
    """name in the module -> name in properties/checks/ (`from k3num.properties.checks.X import a as b`)."""
    return {a.asname or a.name: a.name for node in tree.body if isinstance(node, ast.ImportFrom)
            and (node.module or "").startswith("k3num.properties.checks.") for a in node.names}


def _calls(fn: ast.AST, used_by: dict[str, set[str]]) -> set[str]:
    out: set[str] = set()
    for call in ast.walk(fn):
        if isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and call.func.id in used_by:
            out |= used_by[call.func.id]
    return out


def _helpers_using(helpers: list[ast.FunctionDef], constants: dict[str, str], names: dict[str, set[str]],
                   known: dict[str, set[str]] | None = None) -> dict[str, set[str]]:
    """helper name -> what it uses, itself or through the helpers it calls (to a fixed point)."""
    used = {fn.name: _uses(fn, constants, names) for fn in helpers}
    changed = True
    while changed:
        changed = False
        for fn in helpers:
            more = _calls(fn, {**(known or {}), **used}) - used[fn.name]
            if more:
                used[fn.name] |= more
                changed = True
    return used


def _named(value: ast.expr, constants: dict[str, str]) -> set[str]:
    """The subjects or contracts a module-level value names: a "contract" string, or a list or tuple of them
    and of `base.SUBJECT` constants (every element must name one), or a dict keyed by them (a test parametrized
    over its keys); else none."""
    if isinstance(value, ast.Constant) and isinstance(value.value, str) and value.value in PATH_OF:
        return {value.value}
    if isinstance(value, ast.Dict) and value.keys and all(k is not None for k in value.keys):
        return _named(ast.List(elts=[k for k in value.keys if k is not None]), constants)
    if isinstance(value, (ast.List, ast.Tuple)) and value.elts:
        each = [_named(e, constants) or ({constants[e.attr]} if isinstance(e, ast.Attribute) and isinstance(
            e.value, ast.Name) and e.value.id == "base" and e.attr in constants else set()) for e in value.elts]
        return set().union(*each) if all(each) else set()
    return set()


def _uses(fn: ast.AST, constants: dict[str, str], names: dict[str, set[str]]) -> set[str]:
    used: set[str] = set()
    for node in ast.walk(fn):
        if isinstance(node, ast.Name) and node.id in names:
            used |= names[node.id]
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "base" \
                and node.attr in constants:
            used.add(constants[node.attr])
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in PATH_OF:
            used.add(node.value)
    return used


def machine_here() -> str:
    """What this machine has, as the table's reasons say it: its GPU by name and compute capability, or none."""
    import torch

    if not torch.cuda.is_available():
        return "this machine has no CUDA device"
    major, minor = torch.cuda.get_device_capability(0)
    return f"this machine's GPU is {torch.cuda.get_device_name(0)} (SM{major}{minor})"


def runs_here(language: str, bound: bool, cuda: bool, ops_built: bool) -> str:
    """What of a row runs on this machine: the real code, under Triton's interpreter, a stand-in, or nothing."""
    if not bound:
        return "no"
    if language == "cuda":
        if not cuda:
            return "stand-in (the compiled op needs CUDA)"
        return "yes (built ops)" if ops_built else "stand-in (run `k3num build-ops`)"
    if language == "triton":
        return "yes (native)" if cuda else "yes (Triton's interpreter)"
    return "yes"


def _ops_built() -> bool:
    try:
        from k3num.supply import cuda_ops

        return cuda_ops.library_path(cuda_ops.arch(), cuda_ops.sources_for(None)).is_file()
    except Exception:  # no CUDA, no sdist fetched, no toolchain: not built
        return False


def releases_of(engine: str, file: str, function: str, language: str) -> str:
    """The fetched pinned releases of the engine's pin whose tree holds `file` (its own, or the release's csrc
    folder) and, for Python and Triton rows, defines `function`; "-" where the engine reads no pin, "?" where no
    release of it is fetched here. A row's function that only a newer release has says so."""
    from k3num.engines import registry
    from k3num.supply import fetch

    pin = registry.pin_of(engine)
    if pin is None:
        return "-"
    found, fetched, held = [], False, False
    for version in fetch.releases(pin):
        spec = fetch.spec_of(fetch.release_pin(f"{pin}@{version}"))
        if fetch.missing_files(spec):
            continue
        fetched = True
        root = fetch.release_root(spec)
        path = next((p for p in (root / file, root.with_name(root.name + "-csrc") / file) if p.exists()), None)
        if path is None:
            continue
        held = True
        if language in ("python", "triton") and path.is_file() and re.fullmatch(r"[\w.]+", function):
            try:
                if not _defines(ast.parse(path.read_text(), filename=str(path)), function):
                    continue
            except SyntaxError:
                continue
        found.append(version)
    if found:
        return ", ".join(found)
    return "none fetched here" if not fetched else ("none" if held else "not pinned")


def _defines(tree: ast.Module, qualname: str) -> bool:
    """Whether the module defines `qualname`: a function, class or assigned name, inside its classes."""
    node: ast.AST = tree
    for part in qualname.split("."):
        body = getattr(node, "body", [])
        hit = next((n for n in body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
                    and n.name == part), None)
        if hit is None:
            assigned = any(isinstance(t, ast.Name) and t.id == part for n in body if isinstance(n, ast.Assign)
                           for t in n.targets) or any(isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)
                                                      and n.target.id == part for n in body)
            return assigned and part == qualname.split(".")[-1]
        node = hit
    return True


def table() -> pd.DataFrame:
    import torch

    judges = judged_by()
    here = machine_here()
    cuda = torch.cuda.is_available()
    built = _ops_built() if cuda else False
    rows = []
    for r in [*bound_rows(), *(dataclasses.replace(u, why_not=u.why_not.replace("{here}", here)) for u in UNBOUND)]:
        props = sorted({p for subj in r.subject.split(",") if subj for p in judges.get(subj, [])})
        if not cuda:  # the gpu-marked K3-shape properties skip here: said on each
            props = [f"{p} (GPU only: skips here)" if p.startswith(GPU_ONLY) else p for p in props]
        rows.append({"engine": r.engine, "file": r.file, "function": r.function, "language": r.language,
                     "path": r.path, "releases": releases_of(r.engine, r.file, r.function, r.language),
                     "bound": "yes" if r.subject else "no",
                     "runs_here": runs_here(r.language, bool(r.subject), cuda, built), "properties": "; ".join(props),
                     "why_not": r.why_not or ("" if props else "bound, but no property test names its subject")})
    return pd.DataFrame(rows, columns=list(COLUMNS)).sort_values(["path", "engine", "bound", "file"],
                                                                 ascending=[True, True, False, True])


def markdown(frame: pd.DataFrame) -> str:
    short = frame.assign(properties=[re.sub(r"test_\w+\.py::", "", p).replace("; ", ", ") for p in frame["properties"]])
    lines = ["| " + " | ".join(COLUMNS) + " |", "| " + " | ".join("---" for _ in COLUMNS) + " |"]
    for r in short.itertuples(index=False):
        lines.append("| " + " | ".join(str(getattr(r, c)).replace("|", "/") for c in COLUMNS) + " |")
    bound = int((frame["bound"] == "yes").sum())
    return (f"{bound} bound, {len(frame) - bound} not bound (K3 paths: 1 context KV, 2 AttnRes and the aux tap, "
            "3 the PP partial projection and the draft-KV transfer)\n\n" + "\n".join(lines) + "\n")


def cmd_coverage(args: argparse.Namespace) -> int:
    unlisted: list[str] = []
    if args.census:
        from k3num.harness import census

        entries = census.census()
        if not entries:
            print("[coverage] ERROR: no pinned release is fetched here: run `k3num fetch`", file=sys.stderr)
            return 2
        files = census.file_census()
        unlisted = [f"{e.engine} {e.release} {e.file}: {e.function}" for e in entries if e.status == "unlisted"]
        unlisted += [f"{f.engine} {f.release} {f.file} (a K3 file)" for f in files if f.status == "unlisted"]
        frame = census.frame(entries)
        text = frame.to_csv(index=False) if args.format == "csv" else census.markdown(entries, files)
        for u in unlisted:
            print(f"[coverage] UNLISTED: {u}", file=sys.stderr)
    else:
        frame = table()
        text = frame.to_csv(index=False) if args.format == "csv" else markdown(frame)
    if args.out:
        Path(args.out).write_text(text)
        print(f"[coverage] {len(frame)} rows: {args.out}", file=sys.stderr)
    else:
        sys.stdout.write(text)
    return 1 if unlisted else 0


def add_parser(sub) -> None:
    c = sub.add_parser("coverage", help="every K3 kernel and code path on the three paths: bound or not, the "
                                        "property tests that judge it, and why not where it is not bound",
                       epilog="exit codes: 0 written; 1 --census: a function or file no rule lists; 2 --census: no "
                              "pinned release fetched here")
    c.add_argument("--format", choices=("markdown", "csv"), default="markdown",
                   help="markdown (default): the table for a page; csv: one row per kernel or code path")
    c.add_argument("--out", default=None, metavar="FILE", help="write there instead of stdout")
    c.add_argument("--census", action="store_true",
                   help="the census from the files instead (harness/census.py): every function of every pinned K3 "
                        "file per release, bound, reached from a bound one, or declared (exit 1 on any unlisted)")
    c.set_defaults(func=cmd_coverage)
