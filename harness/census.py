"""The census from the files: every K3 file a pinned wheel ships, and every function in each pinned one.

The coverage table (harness/coverage.py) lists what the adapters bind. This module derives what there
is to bind from the releases themselves, so that real code the adapters do not run cannot go unseen:

- **Files.** Of each pinned release's wheels, every file under the K3 packages (`K3_FILES`: vLLM's
  `vllm/models/kimi_k3/`, TokenSpeed's K3 models and DSpark context producer, SGLang's AttnRes,
  DSpark-kernel and DFlash files) is pinned (fetched, and censused by function below) or declared
  off the three paths by a file rule (`OFF_PATH_FILES`: a glob and the reason).
- **Functions.** Every function and method (by AST: top-level defs, methods of classes at any depth,
  not functions nested inside a function, which run as part of it) of every pinned file that is a K3
  file is one of:
  - `bound`: a coverage row names it (its real code runs under a property);
  - `reached`: a bound function of the same file names it (a call, `self.x`/`cls.x`, `Class.x`, a
    kernel launched as `kernel[grid](...)` or passed on), directly or through other reached ones: its
    code is on the path a property runs, statically (a branch a property never takes is still counted;
    the census does not claim runtime coverage);
  - `declared`: a rule of `RULES` matches it: off one of the three paths (`off-path`), or on one and not
    run, with the reason (`unbound`), or run through the adapter's own stand-in (`replaced`: the rule
    names the stand-in and why the real code cannot run here).
  A function that is none of these is `unlisted`: tests/test_census.py fails on it, and on any rule that
  matches nothing in any release (a dead rule hides the next function of that name).
- Pinned files that are not K3 files (`SUPPORT_FILES`: vLLM's op registry, its generic linear layers,
  SGLang's disaggregation transport...) are declared whole with their reason; only their bound
  functions count, and tests/test_coverage.py checks each exists.

`k3num coverage --census` prints the counts per release and status, every `unbound` function and every
K3 file on a path that is not pinned; `--format csv` the whole function census (engine, release, file,
function, status, why).

Shapes: none.
"""

from __future__ import annotations

import ast
import fnmatch
import re
import zipfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from k3num.harness.census_rules import K3_FILES, KINDS, OFF_PATH_FILES, RULES, SUPPORT_FILES, FileRule, Rule

STATUSES = ("bound", "reached", "declared", "unlisted")

@dataclass(frozen=True)
class Entry:
    engine: str
    release: str
    file: str
    function: str  # qualname: "f", "Class.method", "Outer.Inner.method"
    status: str  # one of STATUSES
    why: str  # bound: the subjects; reached: from which bound function; declared: the rule's kind and reason


class CensusError(ValueError):
    """A rule that cannot be read (an unknown kind, a bad regex, a `replaced` rule without its stand-in)."""


def functions(tree: ast.Module) -> dict[str, ast.FunctionDef | ast.AsyncFunctionDef]:
    """qualname -> def, for top-level functions and methods of classes at any depth (not functions
    nested in a function: they run as part of it)."""
    out: dict[str, ast.FunctionDef | ast.AsyncFunctionDef] = {}

    def walk(body: list[ast.stmt], prefix: str) -> None:
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                out[prefix + node.name] = node
            elif isinstance(node, ast.ClassDef):
                walk(node.body, f"{prefix}{node.name}.")
            elif isinstance(node, (ast.If, ast.Try)):  # `if TYPE_CHECKING:` / `try: import` blocks
                walk([*node.body, *node.orelse, *getattr(node, "finalbody", []),
                      *[s for h in getattr(node, "handlers", []) for s in h.body]], prefix)
    walk(tree.body, "")
    return out


def classes(tree: ast.Module) -> dict[str, ast.ClassDef]:
    """qualname -> class, at any depth of classes."""
    out: dict[str, ast.ClassDef] = {}

    def walk(body: list[ast.stmt], prefix: str) -> None:
        for node in body:
            if isinstance(node, ast.ClassDef):
                out[prefix + node.name] = node
                walk(node.body, f"{prefix}{node.name}.")
    walk(tree.body, "")
    return out


def _names(node: ast.AST) -> tuple[set[str], set[str], set[tuple[str, str]]]:
    """What a def refers to: bare names (loads), attributes of self/cls, and (Name, attr) pairs."""
    bare: set[str] = set()
    own: set[str] = set()
    dotted: set[tuple[str, str]] = set()
    for n in ast.walk(node):
        if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load):
            bare.add(n.id)
        elif isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name):
            if n.value.id in ("self", "cls"):
                own.add(n.attr)
            dotted.add((n.value.id, n.attr))
    return bare, own, dotted


def reached(tree: ast.Module, roots: Iterable[str]) -> dict[str, str]:
    """qualname -> the root it is reached from, for every def of `tree` a root names, directly or through
    defs it reaches (a root that is a class reaches its methods' dunders: `__init__`, `__call__`, ...,
    and `forward`). Roots themselves are not in the result."""
    defs = functions(tree)
    kinds = classes(tree)
    top = {q for q in defs if "." not in q}
    roots = list(roots)
    frontier: list[tuple[str, str]] = []  # (qualname, root)
    for r in roots:
        if r in kinds:
            frontier += [(q, r) for q in defs if q.rsplit(".", 1)[0] == r
                         and (q.rsplit(".", 1)[1].startswith("__") or q.endswith(".forward"))]
        elif r in defs:
            frontier.append((r, r))
    seen: dict[str, str] = {}
    done: set[str] = set()
    while frontier:
        q, root = frontier.pop()
        if q in done:
            continue
        done.add(q)
        if q not in roots:
            seen.setdefault(q, root)
        bare, own, dotted = _names(defs[q])
        owner = q.rsplit(".", 1)[0] if "." in q else ""
        targets = {b for b in bare if b in top}
        targets |= {f"{b}.__init__" for b in bare if f"{b}.__init__" in defs}
        targets |= {f"{b}.forward" for b in bare if f"{b}.forward" in defs}
        if owner:
            for base in _bases(owner, kinds):
                targets |= {f"{base}.{a}" for a in own if f"{base}.{a}" in defs}
        targets |= {f"{c}.{a}" for c, a in dotted if f"{c}.{a}" in defs}
        frontier += [(t, root) for t in targets if t not in done]
    return seen


def _bases(owner: str, kinds: dict[str, ast.ClassDef]) -> list[str]:
    """The class and those of its bases defined in the same file (by name), nearest first."""
    out, todo = [], [owner]
    while todo:
        c = todo.pop(0)
        if c in out or c not in kinds:
            continue
        out.append(c)
        todo += [b.id for b in kinds[c].bases if isinstance(b, ast.Name)]
    return out


def is_stub(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    """A def with no code: a docstring and/or `...`, `pass` or `raise NotImplementedError`."""
    body = [s for s in fn.body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]
    if not body:
        return True
    if len(body) != 1:
        return False
    s = body[0]
    if isinstance(s, ast.Pass):
        return True
    if isinstance(s, ast.Raise) and s.exc is not None:
        exc = s.exc.func if isinstance(s.exc, ast.Call) else s.exc
        return isinstance(exc, ast.Name) and exc.id == "NotImplementedError"
    return False


def check_rules(rules: Iterable[Rule]) -> None:
    """Refuse a rule that cannot be read (CensusError), naming it."""
    for r in rules:
        if r.kind not in KINDS:
            raise CensusError(f"census rule {r.engine} {r.file} {r.pattern!r}: kind {r.kind!r} is not one of {KINDS}")
        try:
            re.compile(r.pattern)
        except re.error as e:
            raise CensusError(f"census rule {r.engine} {r.file} {r.pattern!r}: not a regex ({e})") from None
        if r.kind == "replaced" and (":" not in r.stand_in or not r.why):
            raise CensusError(f"census rule {r.engine} {r.file} {r.pattern!r}: a 'replaced' rule names its "
                              "stand-in (module:function) and why the real code cannot run")
        if not r.why:
            raise CensusError(f"census rule {r.engine} {r.file} {r.pattern!r}: no reason given")


def census_file(engine: str, release: str, rel: str, text: str, bound: dict[str, str],
                rules: Iterable[Rule]) -> list[Entry]:
    """One entry per function of one pinned file (`bound`: qualname -> subjects, from coverage rows)."""
    tree = ast.parse(text)
    defs = functions(tree)
    via = reached(tree, bound)
    mine = [r for r in rules if r.engine == engine and r.file == rel]
    out = []
    for q in defs:
        if q in bound:
            out.append(Entry(engine, release, rel, q, "bound", bound[q]))
        elif is_stub(defs[q]):
            out.append(Entry(engine, release, rel, q, "declared", "a stub: no code (a protocol's or an abstract "
                                                                  "method, `...` or `pass` or NotImplementedError)"))
        elif q in via:
            out.append(Entry(engine, release, rel, q, "reached", f"from {via[q]}"))
        elif (r := next((r for r in mine if re.fullmatch(r.pattern, q)), None)) is not None:
            extra = f" (stand-in: {r.stand_in})" if r.stand_in else ""
            out.append(Entry(engine, release, rel, q, "declared", f"{r.kind}: {r.why}{extra}"))
        else:
            out.append(Entry(engine, release, rel, q, "unlisted", "no binding reaches it and no rule declares it"))
    return out


def is_k3_file(engine: str, rel: str) -> bool:
    return any(fnmatch.fnmatch(rel, g) for g in K3_FILES.get(engine, ()))


def file_status(engine: str, rel: str, pinned: Iterable[str]) -> tuple[str, str]:
    """(status, why) of one K3 file a wheel ships: pinned, off-path (a file rule), or unlisted."""
    if rel in set(pinned):
        return "pinned", "censused by function"
    r = next((r for r in OFF_PATH_FILES if r.engine == engine and fnmatch.fnmatch(rel, r.glob)), None)
    return ("declared", r.why) if r else ("unlisted", "a K3 file neither pinned nor declared")


def wheel_names(wheels: Iterable[Path]) -> list[str]:
    """The file names in the wheels (their namelists; nothing is extracted)."""
    names: set[str] = set()
    for w in wheels:
        with zipfile.ZipFile(w) as zf:
            names |= {n for n in zf.namelist() if not n.endswith("/")}
    return sorted(names)


def bound_by_file() -> dict[tuple[str, str], dict[str, str]]:
    """(pin engine, file) -> {qualname: subjects} from the coverage table's bound rows (vllm-rocm's rows
    are the vllm pin's)."""
    from k3num.harness import coverage

    out: dict[tuple[str, str], dict[str, str]] = {}
    for r in coverage.bound_rows():
        pin = "vllm" if r.engine.startswith("vllm") else r.engine
        name = r.function.split(" ")[0]
        d = out.setdefault((pin, r.file), {})
        d[name] = ",".join(sorted(set(filter(None, (d.get(name, "") + "," + r.subject).split(",")))))
    return out


@dataclass(frozen=True)
class FileEntry:
    engine: str
    release: str
    file: str
    status: str  # pinned, declared, unlisted
    why: str


def release_trees() -> list[tuple[str, str, Path]]:
    """(engine pin, release, tree) for every pinned release whose verified tree is in the cache."""
    from k3num.supply import fetch

    out = []
    for pin in fetch.PINS:
        for version in fetch.releases(pin):
            spec = f"{pin}@{version}"
            if fetch.verified_manifest(spec, log=lambda *_: None):
                out.append((pin, version, fetch.release_root(spec)))
    return out


def census(trees: Iterable[tuple[str, str, Path]] | None = None, rules: Iterable[Rule] = RULES) -> list[Entry]:
    """Every function of every pinned K3 file of every fetched release (`trees`: release_trees())."""
    from k3num.supply import fetch

    rules = tuple(rules)
    check_rules(rules)
    bound = bound_by_file()
    out: list[Entry] = []
    for pin, version, root in (release_trees() if trees is None else trees):
        for rel in fetch.release_pin(f"{pin}@{version}").files:
            if not is_k3_file(pin, rel):
                if rel not in SUPPORT_FILES.get(pin, {}):
                    raise CensusError(f"{pin} {version}: pinned file {rel} is neither a K3 file (census_rules."
                                      "K3_FILES) nor declared support (SUPPORT_FILES)")
                continue
            if rel.endswith(".py"):
                out += census_file(pin, version, rel, (root / rel).read_text(), bound.get((pin, rel), {}), rules)
    return out


def file_census() -> list[FileEntry]:
    """Every K3 file of every pinned release's cached wheels (none where no wheel is cached)."""
    from k3num.supply import fetch

    out: list[FileEntry] = []
    wheels_dir = fetch.cache_root() / "wheels"
    for pin in fetch.PINS:
        for version in fetch.releases(pin):
            p = fetch.release_pin(f"{pin}@{version}")
            found = [fetch._find_wheel(w, wheels_dir) if wheels_dir.exists() else None for w in p.wheels()]
            if any(w is None for w in found):
                continue
            for rel in wheel_names([w for w in found if w is not None]):
                if rel.endswith(".py") and is_k3_file(pin, rel):
                    status, why = file_status(pin, rel, p.files)
                    out.append(FileEntry(pin, version, rel, status, why))
    return out


def dead_rules(entries: Iterable[Entry], rules: Iterable[Rule] = RULES) -> list[Rule]:
    """Rules that declare no function of any release censused (`entries`)."""
    hits = [(e.engine, e.file, e.function) for e in entries if e.status == "declared"]
    return [r for r in rules if not any(e == r.engine and f == r.file and re.fullmatch(r.pattern, q)
                                        for e, f, q in hits)]


def dead_file_rules(entries: Iterable[FileEntry]) -> list[FileRule]:
    """File rules that declare no file of any release's wheel."""
    hits = [(e.engine, e.file) for e in entries if e.status == "declared"]
    return [r for r in OFF_PATH_FILES if not any(e == r.engine and fnmatch.fnmatch(f, r.glob) for e, f in hits)]


def frame(entries: Iterable[Entry]):
    """The function census as a table: engine, release, file, function, status, why."""
    import pandas as pd

    return pd.DataFrame([e.__dict__ for e in entries], columns=["engine", "release", "file", "function", "status",
                                                                 "why"])


def check_stand_ins(rules: Iterable[Rule] = RULES) -> None:
    """Every `replaced` rule's stand-in ("module:function") exists (CensusError naming the rule otherwise)."""
    import importlib

    for r in rules:
        if r.kind != "replaced":
            continue
        module, _, name = r.stand_in.partition(":")
        try:
            ok = hasattr(importlib.import_module(module), name)
        except ImportError:
            ok = False
        if not ok:
            raise CensusError(f"census rule {r.engine} {r.file} {r.pattern!r}: its stand-in {r.stand_in} does not "
                              "exist")


def markdown(entries: list[Entry], files: list[FileEntry]) -> str:
    """Counts per (engine, release, status), then every on-path function no property runs (kind `unbound`)."""
    f = frame(entries)
    counts = f.groupby(["engine", "release", "status"]).size().unstack(fill_value=0)
    lines = ["| engine | release | " + " | ".join(counts.columns) + " |",
             "| --- | --- | " + " | ".join("---" for _ in counts.columns) + " |"]
    lines += [f"| {e} | {v} | " + " | ".join(str(int(x)) for x in row) + " |" for (e, v), row in counts.iterrows()]
    gaps = f[f["why"].str.startswith("unbound:")]
    lines += ["", f"{len(gaps)} functions on the three paths that no property runs (kind `unbound`):", "",
              "| engine | release | file | function | why |", "| --- | --- | --- | --- | --- |"]
    lines += [f"| {r.engine} | {r.release} | {r.file} | {r.function} | {r.why[len('unbound: '):]} |"
              for r in gaps.itertuples()]
    off = [x for x in files if x.status == "declared" and x.why.startswith("UNBOUND")]
    lines += ["", f"{len(files)} K3 files in the pinned wheels; {len(off)} on a path and not pinned:", ""]
    lines += [f"- {x.engine} {x.release} `{x.file}`: {x.why}" for x in off]
    return "\n".join(lines) + "\n"
