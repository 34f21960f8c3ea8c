"""`k3num mutate`: the suite's mutation score on an engine's bound K3 functions.

The engine underneath is cosmic-ray 8.7 (docs/mutation.md says why, from the measured spike): its operators
(and ours, harness/mutation_operators.py: `k3num/<Name>`) enumerate the mutants of each bound file, its
sqlite session (`cosmic_ray.work_db`) keeps them and their results, so a run that stops continues where it
stopped, and its `use_mutation` applies one mutant to a file on disk and restores it. What is ours is the
selection and the judging:

- the mutants: the census's rows (harness/coverage.py) of the engine and release that run here (python and
  Triton under the interpreter), mutants inside one of the file's bound functions only (every other mutant is
  recorded SKIPPED, with why); `--operators` keeps those named; `--sample N --seed S` a seeded sample;
- the tests of a mutant: the properties the census lists for its file's bound functions, under `--profile`
  (ci), stopping at the first failure (-x), with the ledger kept on the edited file
  (`--ledger-on-edited-files`): a known bug's failure is still known where its model explains it, so a mutant
  is killed only by a failure that is new;
- each mutant runs in a tree of its own worker (`--workers`, one pinned copy each: `k3num tree`), with a
  timeout from the unmutated run (3x its time, at least a minute);
- outcomes: killed (the first failing test), survived, timed out, incompetent (the mutated file does not
  compile, or the engine no longer binds: no test of it ran).

Output in OUT: session.sqlite (cosmic-ray's), mutants.csv (one row per mutant run: engine, release, file,
line, function, subject, operator, outcome, test, seconds, diff), report.md (the score per file, function,
subject and operator; every survivor with its diff). Exit 0 written, 1 a survivor (or mutants left pending by
`--deadline`), 2 bad input (nothing written).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import json
import math
import random
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RUNS = ("yes",)  # the census's runs_here values that mean the real code runs on this machine
KILLED, SURVIVED, TIMED_OUT, INCOMPETENT = "killed", "survived", "timed out", "incompetent"
NOT_JUDGED = "not judged here"  # every property of the mutant's file skips on this machine (no checkpoint, ...)
# the 95% interval's normal quantile (about 1.96), and the least timeout of a mutant's run (a minute), written
# from literals already in the package: a new number in a non-test module would join hypothesis's literal pool
# and move every derandomized draw (harness/literal_pool.py)
Z95 = statistics.NormalDist().inv_cdf(1 - 0.05 / 2)
MIN_TIMEOUT = 2 * 30.0


class MutateError(ValueError):
    """Bad input: an engine, release, file, function or operator not known (exit 2, nothing written)."""


@dataclasses.dataclass(frozen=True)
class Target:
    """One bound file of the engine's tree and what judges it."""

    file: str  # the tree-relative path (the census's `file`)
    functions: tuple[str, ...]  # the bound functions' qualified names (Class.method), as the census names them
    subjects: dict[str, str]  # function's qualified name -> the subject it is bound as
    properties: tuple[str, ...]  # pytest node ids: properties/test_x.py::test_y


def pin_engine(engine: str) -> str:
    """The pinned package an engine's registry name reads (vllm-rocm reads vllm's tree)."""
    return engine.split("-")[0]


def targets(engine: str, release: str, files: list[str] | None = None,
            functions: list[str] | None = None) -> list[Target]:
    """The census's rows of `engine` at `release` that run here, grouped by file (MutateError for a file or
    function the census does not bind, naming the known ones)."""
    from k3num.harness import coverage

    table = coverage.table()
    subjects = {(r.engine, r.file, r.function): r.subject for r in coverage.bound_rows()}
    rows = table[(table["engine"] == engine) & table["runs_here"].str.startswith(RUNS)
                 & table["language"].isin(["python", "triton"])
                 & table["releases"].map(lambda v: release in [x.strip() for x in str(v).split(",")])]
    if rows.empty:
        raise MutateError(f"{engine} {release}: no bound function of the census runs here")
    known_files = sorted(set(rows["file"]))
    for f in files or []:
        if f not in known_files:
            raise MutateError(f"--file {f}: not a bound file of {engine} {release}; bound: {', '.join(known_files)}")
    if files:
        rows = rows[rows["file"].isin(files)]
    qual = rows["function"].map(lambda f: f.split(" ")[0])  # the census's name, without its note
    last = qual.map(lambda f: f.split(".")[-1])
    for fn in functions or []:  # a function named as the census names it, or by its last name
        if fn not in set(qual) and fn not in set(last):
            raise MutateError(f"--function {fn}: not a bound function of the files chosen; bound: "
                              f"{', '.join(sorted(set(qual)))}")
    if functions:
        keep = qual.isin(functions) | last.isin(functions)
        rows, qual = rows[keep], qual[keep]
    out = []
    for file, group in rows.groupby("file", sort=True):
        names = tuple(sorted(set(qual[group.index])))
        props = sorted({p.split(" ")[0] for cell in group["properties"] for p in str(cell).split("; ") if p
                        and "GPU only" not in p})
        subj = {n: subjects.get((engine, file, f), "") for n, f in zip(qual[group.index], group["function"])}
        out.append(Target(file, names, subj, tuple(f"properties/{p}" for p in props)))
    return out


def operator_names(chosen: list[str] | None) -> list[str]:
    """cosmic-ray's operators (core and k3num) to keep: all when `chosen` is empty (MutateError for a name that
    does not exist)."""
    import cosmic_ray.plugins

    every = [n for n in cosmic_ray.plugins.operator_names()]
    for n in chosen or []:
        if n not in every:
            raise MutateError(f"--operators {n}: no such operator; k3num's: "
                              f"{', '.join(x for x in every if x.startswith('k3num/'))} (and cosmic-ray's core/...)")
    return list(chosen) if chosen else every


def _pytest(engine: str, tree: Path, props: tuple[str, ...], profile: str) -> list[str]:
    return [sys.executable, "-m", "pytest", *props, "--engine", engine, "--engine-src",
            f"{pin_engine(engine)}={tree}", "-x", "-q", "-p", "no:cacheprovider", f"--hypothesis-profile={profile}",
            "-rfE", "--ledger-on-edited-files"]


def _bound_engine_ran(output: str, engine: str) -> bool:
    """Whether the run's account says some test of the engine ran, passed or known (an xfail the ledger's model
    judges: a mutant that changes the known failure fails it); a mutant that breaks the binding skips all."""
    m = re.search(rf"^\s+{re.escape(engine)} \S+: .*?: (\d+) run, \d+ skipped, (\d+) known", output, re.M)
    return bool(m and int(m.group(1)) + int(m.group(2)) > 0)


def judge_run(rc: int | None, output: str, engine: str) -> tuple[str, str]:
    """(outcome, the first failing test) of one mutant's test run (rc None: it timed out)."""
    if rc is None:
        return TIMED_OUT, ""
    failed = re.findall(r"^(?:FAILED|ERROR) (\S+)", output, re.M)
    if rc == 1 and failed:
        return KILLED, failed[0]
    if rc == 0 and _bound_engine_ran(output, engine):
        return SURVIVED, ""
    return INCOMPETENT, (f"exit {rc}: " + (output.strip().splitlines() or [""])[-1])[:200]


def run_one(item, tree: Path, engine: str, target: Target, timeout: float, profile: str) -> dict:
    """Apply the work item's mutation in `tree`, run its properties, restore the file: the result's fields."""
    import cosmic_ray.plugins
    from cosmic_ray.mutating import _make_diff, use_mutation

    spec = item.mutations[0]
    path = tree / target.file
    op = cosmic_ray.plugins.get_operator(spec.operator_name)(**(spec.operator_args or {}))
    t0 = time.monotonic()
    with use_mutation(path, op, spec.occurrence) as (original, mutated):
        if mutated is None:
            return {"outcome": INCOMPETENT, "test": "no mutation at this occurrence", "seconds": 0.0, "diff": ""}
        diff = "\n".join(_make_diff(original, mutated, target.file)[1:])
        try:
            compile(mutated, str(path), "exec")
        except SyntaxError as e:
            return {"outcome": INCOMPETENT, "test": f"does not compile: {e.msg}", "seconds": 0.0, "diff": diff}
        try:
            p = subprocess.run(_pytest(engine, tree, target.properties, profile), cwd=ROOT, capture_output=True,
                               text=True, timeout=timeout)
            rc, output = p.returncode, p.stdout + p.stderr
        except subprocess.TimeoutExpired:
            rc, output = None, ""
    outcome, test = judge_run(rc, output, engine)
    return {"outcome": outcome, "test": test, "seconds": round(time.monotonic() - t0, 1), "diff": diff}


def function_spans(path: Path) -> list[tuple[int, int, str]]:
    """(first line, last line, qualified name) of every function and method of the file (Class.method; a
    function inside a function is named by its own and its enclosing names)."""
    import ast

    spans: list[tuple[int, int, str]] = []

    def walk(node, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = f"{prefix}{child.name}"
                if not isinstance(child, ast.ClassDef):
                    spans.append((child.lineno, child.end_lineno or child.lineno, name))
                walk(child, f"{name}.")

    walk(ast.parse(path.read_text()), "")
    return spans


# A file that may evaluate its signatures' annotations: a call that reads them (a custom op's schema is inferred
# from them), or pydantic. A call, not the word: vLLM's linear.py imports `vllm.model_executor.custom_op` and
# reads none, and matching the word kept its `Tensor | tuple[...]` returns mutated (0.34.0's first sample: a
# survivor no input can reach).
EVALUATES_ANNOTATIONS = re.compile(r"\b(?:get_type_hints|custom_op|direct_register_custom_op|infer_schema|register_fake"
                                   r"|signature)\s*\(|\bjit\.script\b|^\s*(?:from|import)\s+pydantic\b", re.M)


def unevaluated_annotations(path: Path) -> list[tuple[tuple[int, int], tuple[int, int]]]:
    """((line, col), (end line, end col)) of every annotation no behaviour reads: a plain function's parameters
    and return, and local variables'. In a file with `from __future__ import annotations` Python never evaluates
    them; without it it evaluates a signature's once, when the engine's module is imported, where a mutant's
    `X // None` raises TypeError: that mutant does not import (incompetent), and the adapters' lifted code
    compiles with postponed annotations, so neither way can a property see one. Kept as code: a class body's (a
    dataclass or pydantic model reads them), a decorated function's (triton.jit reads `tl.constexpr`, a
    registry may read the rest) and every signature of a file that may read them (EVALUATES_ANNOTATIONS: a
    custom op's schema is inferred from them)."""
    import ast

    text = path.read_text()
    signatures = not EVALUATES_ANNOTATIONS.search(text)
    found: list[ast.expr] = []

    def walk(node, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) and signatures and not child.decorator_list:
                args = child.args
                found.extend(a.annotation for a in (*args.posonlyargs, *args.args, *args.kwonlyargs,
                                                    args.vararg, args.kwarg) if a is not None and a.annotation)
                found.extend([child.returns] if child.returns is not None else [])
            if isinstance(child, ast.AnnAssign) and in_function:
                found.append(child.annotation)
            walk(child, in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

    walk(ast.parse(text), False)
    return [((a.lineno, a.col_offset), (a.end_lineno, a.end_col_offset)) for a in found]


def inside(spans: list[tuple[tuple[int, int], tuple[int, int]]], start: tuple[int, int],
           end: tuple[int, int]) -> bool:
    """Whether the source range start..end ((line, col), 1-based lines) lies within one of `spans`."""
    return any(a <= tuple(start) and tuple(end) <= b for a, b in spans)


def function_at(spans: list[tuple[int, int, str]], line: int) -> str:
    """The qualified name of the innermost function holding `line` ("" at module level)."""
    inside = [s for s in spans if s[0] <= line <= s[1]]
    return max(inside)[2] if inside else ""


def changed_lines_of(head: Path, base: Path, files: list[str]) -> dict[str, set[int]]:
    """file -> the head's line numbers (1-based) that differ from the base's (replaced or inserted), for each
    of `files` the head changed."""
    import difflib

    out = {}
    for f in files:
        a = _code_lines((base / f).read_text()) if (base / f).is_file() else []
        b = _code_lines((head / f).read_text())
        ops = difflib.SequenceMatcher(a=a, b=b, autojunk=False).get_opcodes()
        changed = {j + 1 for tag, _, _, j1, j2 in ops if tag in ("replace", "insert") for j in range(j1, j2)}
        if changed:
            out[f] = changed
    return out


def _code_lines(text: str) -> list[str]:
    """Each line's code without its comment and whitespace (a comment-only edit changes no code line); the
    lines as they are where the file does not tokenize."""
    import io
    import tokenize

    lines = text.splitlines()
    try:
        for tok in tokenize.generate_tokens(io.StringIO(text).readline):
            if tok.type == tokenize.COMMENT:
                row, col = tok.start
                lines[row - 1] = lines[row - 1][:col]
    except (tokenize.TokenError, SyntaxError, IndexError):
        return [ln.strip() for ln in text.splitlines()]
    return ["".join(ln.split()) for ln in lines]


def _init(db_path: Path, tree: Path, chosen: list[Target], ops: list[str], sample: int | None, seed: int,
          lines: dict[str, set[int]] | None = None) -> None:
    """A new cosmic-ray session over the targets' files; the mutants outside the bound functions, of other
    operators, on a line `lines` (file -> the head's changed lines) leaves out, or outside the sample recorded
    SKIPPED with why."""
    from cosmic_ray.commands import init
    from cosmic_ray.work_db import WorkDB, use_db
    from cosmic_ray.work_item import WorkerOutcome, WorkResult

    by_file = {str(tree / t.file): t for t in chosen}
    spans = {p: function_spans(Path(p)) for p in by_file}
    unevaluated = {p: unevaluated_annotations(Path(p)) for p in by_file}
    with use_db(str(db_path), WorkDB.Mode.create) as db:
        init([Path(p) for p in by_file], db, {})
        kept = {}  # (file, operator, occurrence): a mutant's name whatever job id the session gave it
        for item in db.pending_work_items:
            spec = item.mutations[0]
            t = by_file[str(spec.module_path)]
            why = ("outside the bound functions"
                   if function_at(spans[str(spec.module_path)], spec.start_pos[0]) not in t.functions else
                   "operator not chosen" if spec.operator_name not in ops else
                   "in an annotation no behaviour reads" if inside(unevaluated[str(spec.module_path)],
                                                                       spec.start_pos, spec.end_pos) else
                   "a line the head did not change" if lines is not None and not (
                       set(range(spec.start_pos[0], spec.end_pos[0] + 1)) & lines.get(t.file, set())) else "")
            if why:
                db.set_result(item.job_id, WorkResult(worker_outcome=WorkerOutcome.SKIPPED, output=why))
            else:
                kept[(t.file, spec.operator_name, spec.occurrence)] = item.job_id
        if sample is not None and sample < len(kept):
            picked = set(random.Random(seed).sample(sorted(kept), sample))  # the same mutants for the same seed
            for name, job in kept.items():
                if name not in picked:
                    db.set_result(job, WorkResult(worker_outcome=WorkerOutcome.SKIPPED,
                                                  output=f"not in the sample (seed {seed})"))


def execute(out: Path, engine: str, release: str, chosen: list[Target], workers: int, profile: str,
            log=print, stop_at: float | None = None) -> float:
    """Run every pending mutant of the session in OUT on `workers` trees of their own; the baseline's seconds.
    After `stop_at` (a time.monotonic() value) no new mutant starts: the running ones finish and the rest stay
    pending in the session, to resume. Raises MutateError when the unmutated tree fails its own properties."""
    from cosmic_ray.work_db import WorkDB, use_db
    from cosmic_ray.work_item import TestOutcome, WorkerOutcome, WorkResult

    with use_db(str(out / "session.sqlite"), WorkDB.Mode.open) as db:
        if not list(db.pending_work_items):
            log("[mutate] 0 mutants to run: the session is complete")
            return 0.0
    trees = [out / "trees" / f"w{i}" for i in range(workers)]
    for t in trees:
        if not t.exists():
            shutil.copytree(out / "trees" / "ref", t)
    by_file = {t.file: t for t in chosen}
    with use_db(str(out / "session.sqlite"), WorkDB.Mode.open) as db:
        ref = out / "trees" / "ref"
        wanted = {str(Path(i.mutations[0].module_path).relative_to(ref)) for i in db.pending_work_items}

    def baseline(t: Target, tree: Path) -> tuple[float, str, str]:
        t0 = time.monotonic()
        p = subprocess.run(_pytest(engine, tree, t.properties, profile), cwd=ROOT, capture_output=True, text=True)
        return (time.monotonic() - t0, *judge_run(p.returncode, p.stdout + p.stderr, engine))

    base, unjudged = {}, {}
    todo = [t for t in chosen if t.file in wanted]  # the unmutated runs, side by side: each sets its timeout
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        runs = {t.file: pool.submit(baseline, t, trees[i % workers]) for i, t in enumerate(todo)}
        for t in todo:
            base[t.file], outcome, test = runs[t.file].result()
            if outcome == INCOMPETENT and "ran no test" in test:  # every property skips here (a checkpoint...)
                unjudged[t.file] = test
                log(f"[mutate] {t.file}: no property of it runs here, its mutants are not judged ({test})")
                continue
            if outcome != SURVIVED:
                raise MutateError(f"{engine} {release} {t.file}: the unmutated tree does not pass its own "
                                  f"properties ({outcome}: {test or 'no test ran'})")
            log(f"[mutate] {t.file}: unmutated run {base[t.file]:.0f} s ({len(t.properties)} properties)")
    with use_db(str(out / "session.sqlite"), WorkDB.Mode.open) as db:
        for item in list(db.pending_work_items):
            rel = str(Path(item.mutations[0].module_path).relative_to(ref))
            if rel in unjudged:
                r = {"outcome": NOT_JUDGED, "test": unjudged[rel], "seconds": 0.0, "diff": ""}
                db.set_result(item.job_id, WorkResult(worker_outcome=WorkerOutcome.NORMAL, output=json.dumps(r),
                                                      test_outcome=TestOutcome.INCOMPETENT))
        pending = list(db.pending_work_items)
        total, done, t_start = len(pending), 0, time.monotonic()
        log(f"[mutate] {total} mutants to run on {workers} worker(s)")
        free = list(trees)
        with concurrent.futures.ThreadPoolExecutor(workers) as pool:
            running: dict = {}
            queue = list(pending)
            while queue or running:
                if queue and stop_at is not None and time.monotonic() >= stop_at:
                    log(f"[mutate] deadline reached: {len(queue)} mutant(s) not started, left pending (run again "
                        "with the same --out to resume)")
                    queue = []
                while queue and free:
                    item = queue.pop(0)
                    rel = str(Path(item.mutations[0].module_path).relative_to(out / "trees" / "ref"))
                    tree = free.pop()
                    timeout = max(MIN_TIMEOUT, 3.0 * base[rel])
                    running[pool.submit(run_one, item, tree, engine, by_file[rel], timeout, profile)] = (item, tree)
                if not running:
                    break
                finished, _ = concurrent.futures.wait(running, return_when=concurrent.futures.FIRST_COMPLETED)
                for fut in finished:
                    item, tree = running.pop(fut)
                    free.append(tree)
                    r = fut.result()
                    test_outcome = {KILLED: TestOutcome.KILLED, TIMED_OUT: TestOutcome.KILLED,
                                    SURVIVED: TestOutcome.SURVIVED}.get(r["outcome"], TestOutcome.INCOMPETENT)
                    db.set_result(item.job_id, WorkResult(worker_outcome=WorkerOutcome.NORMAL, diff=r["diff"],
                                                          test_outcome=test_outcome, output=json.dumps(r)))
                    done += 1
                    eta = (time.monotonic() - t_start) / done * (total - done)
                    ran = item.mutations[0]
                    log(f"[mutate] {done}/{total} {r['outcome']} ({r['seconds']:.0f} s) {ran.operator_name} "
                        f"line {ran.start_pos[0]}; ~{eta / 60:.0f} min left")
    return sum(base.values())


def pending_count(out: Path) -> int:
    """How many of the session's mutants have not run (a run stopped by --deadline leaves them pending)."""
    from cosmic_ray.work_db import WorkDB, use_db

    with use_db(str(out / "session.sqlite"), WorkDB.Mode.open) as db:
        return sum(1 for _ in db.pending_work_items)


def results(out: Path, engine: str, release: str, chosen: list[Target]):
    """The session's mutants that ran, one row each (a pandas frame of mutants.csv's columns)."""
    import pandas as pd
    from cosmic_ray.work_db import WorkDB, use_db

    subjects = {(t.file, f): s for t in chosen for f, s in t.subjects.items()}
    spans = {t.file: function_spans(out / "trees" / "ref" / t.file) for t in chosen}
    rows = []
    with use_db(str(out / "session.sqlite"), WorkDB.Mode.open) as db:
        for item, result in db.completed_work_items:
            if result.worker_outcome != "normal":
                continue
            spec = item.mutations[0]
            rel = str(Path(spec.module_path).relative_to(out / "trees" / "ref"))
            r = json.loads(result.output)
            fn = function_at(spans[rel], spec.start_pos[0])
            rows.append({"engine": engine, "release": release, "file": rel, "line": spec.start_pos[0],
                         "function": fn, "subject": subjects.get((rel, fn), ""),
                         "operator": spec.operator_name, "outcome": r["outcome"], "test": r["test"],
                         "seconds": r["seconds"], "diff": r["diff"]})
    cols = ["engine", "release", "file", "line", "function", "subject", "operator", "outcome", "test", "seconds",
            "diff"]
    return pd.DataFrame(rows, columns=cols).sort_values(["file", "line", "operator"]).reset_index(drop=True)


EQUIVALENTS = Path(__file__).resolve().parent / "mutation_equivalents.csv"
EQUIVALENT = "equivalent"  # a survivor listed in EQUIVALENTS: it cannot change any output the engine can give
# a survivor listed as changing only what runs on hardware this project cannot run (a choice among SM100 or
# CDNA kernels): not CPU-runnable code, so outside the score, and counted apart
NOT_RUNNABLE = "not runnable here"
KINDS = (EQUIVALENT, NOT_RUNNABLE)
KEY = ("engine", "file", "function", "operator", "before", "after")  # what names a mutant across line moves


def changed_lines(diff: str) -> tuple[str, str]:
    """The mutant's first removed and first added line, stripped (its key, with the file, function and operator,
    across releases whose lines moved)."""
    lines = diff.splitlines()
    before = next((x[1:].strip() for x in lines if x.startswith("-") and not x.startswith("---")), "")
    after = next((x[1:].strip() for x in lines if x.startswith("+") and not x.startswith("+++")), "")
    return before, after


def equivalents(path: Path = EQUIVALENTS):
    """The reviewed list of survivors left out of the score (KEY columns, `kind` (KINDS) and `reason`, every one
    non-empty; ValueError naming the row otherwise)."""
    import pandas as pd

    frame = pd.read_csv(path, dtype=str, keep_default_na=False)
    missing = [c for c in (*KEY, "kind", "reason") if c not in frame.columns]
    if missing:
        raise ValueError(f"{path}: no column(s) {missing}")
    for i, row in frame.iterrows():
        empty = [c for c in (*KEY, "kind", "reason") if not row[c].strip()]
        if empty:
            raise ValueError(f"{path}: row {i + 2}: empty {empty}")
        if row["kind"] not in KINDS:
            raise ValueError(f"{path}: row {i + 2}: kind {row['kind']!r} is none of {list(KINDS)}")
    return frame


def mark_equivalents(frame, listed=None):
    """The frame with each survivor that the reviewed list names marked with its kind (EQUIVALENT or
    NOT_RUNNABLE) and its reason in `test`."""
    listed = equivalents() if listed is None else listed
    reasons = {tuple(r[c] for c in KEY): (r["kind"], r["reason"]) for _, r in listed.iterrows()}
    frame = frame.copy()
    for i, r in frame.iterrows():
        if r["outcome"] == SURVIVED:
            key = (r["engine"], r["file"], r["function"], r["operator"], *changed_lines(r["diff"]))
            if key in reasons:
                frame.loc[i, ["outcome", "test"]] = list(reasons[key])
    return frame


def score(frame) -> tuple[int, int, float, float, float]:
    """(killed incl. timed out, competent and not equivalent, score, and its 95% Wilson interval) of a frame of
    mutants."""
    competent = frame[~frame["outcome"].isin([INCOMPETENT, NOT_JUDGED, *KINDS])]
    n, k = len(competent), int(competent["outcome"].isin([KILLED, TIMED_OUT]).sum())
    if n == 0:
        return k, n, math.nan, math.nan, math.nan
    z, p = Z95, k / n
    shrink = 1 + z * z / n
    mid, half = (p + z * z / (2 * n)) / shrink, z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / shrink
    return k, n, p, max(0.0, mid - half), min(1.0, mid + half)


def report(frame, engine: str, release: str, sample: str) -> str:
    """report.md: the score overall and per file, function, subject and operator; each survivor's diff."""
    k, n, p, lo, hi = score(frame)
    lines = [f"# Mutation score: {engine} {release}", "",
             f"{k} of {n} competent mutants killed: **{p:.1%}** (95% interval {lo:.1%}-{hi:.1%}){sample}; "
             f"{int((frame['outcome'] == INCOMPETENT).sum())} incompetent, "
             f"{int((frame['outcome'] == EQUIVALENT).sum())} equivalent and "
             f"{int((frame['outcome'] == NOT_RUNNABLE).sum())} not runnable here (listed, with why: "
             f"{EQUIVALENTS.name}), "
             f"{int((frame['outcome'] == TIMED_OUT).sum())} timed out (counted killed), "
             f"{int((frame['outcome'] == NOT_JUDGED).sum())} not judged here (no property of their file runs "
             "here: listed below).", ""]
    for key in ("file", "function", "subject", "operator"):
        lines += [f"## By {key}", "", f"| {key} | killed | competent | score |", "|---|---|---|---|"]
        for name, group in frame.groupby(key, sort=True):
            gk, gn, gp, _, _ = score(group)
            lines.append(f"| {name or '(none)'} | {gk} | {gn} | {gp:.0%} |" if gn else f"| {name} | 0 | 0 | - |")
        lines.append("")
    unjudged = frame[frame["outcome"] == NOT_JUDGED].groupby("file")["test"].agg(["first", "size"])
    if len(unjudged):
        lines += ["## Not judged here", "", "| file | mutants | why |", "|---|---|---|"]
        lines += [f"| {f} | {r['size']} | {r['first']} |" for f, r in unjudged.iterrows()] + [""]
    survivors = frame[frame["outcome"] == SURVIVED]
    lines += [f"## Survivors ({len(survivors)}): each a defect of the suite, or equivalent (then listed in "
              f"harness/{EQUIVALENTS.name} with why)", ""]
    for _, r in survivors.iterrows():
        lines += [f"### {r['file']}:{r['line']} {r['function']} ({r['operator']})", "", "```diff", r["diff"], "```", ""]
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    """Exit 0 every mutant killed (or nothing to mutate), 1 a survivor, 2 bad input (nothing written); with
    --gate, 0 or 1 is the gate's verdict on the score instead."""
    from k3num.engines import registry
    from k3num.supply import fetch

    out = Path(args.out)
    head = getattr(args, "head", None)
    try:
        if args.engine not in registry.known():
            raise MutateError(f"--engine {args.engine}: unknown; known: {', '.join(registry.known())}")
        pin = pin_engine(args.engine)
        pins = fetch.releases(pin)
        if head is not None:  # a head tree: judged as the release its version file names, mutated where it changed
            from k3num.harness import check

            try:
                head = check._tree("--head", str(head), pin)
            except check.CheckError as e:
                raise MutateError(str(e)) from None
            release = fetch.Source(pin, head).pin.version
        else:
            release = args.release or fetch.PINS[pin].version
        if release not in pins:
            raise MutateError(f"--release {release}: not pinned for {args.engine}; pinned: {', '.join(pins)}")
        gate = getattr(args, "gate", None)
        if gate is not None and recorded(Path(gate), gate_key(args.engine, release, args.sample, args.seed,
                                                              args.profile)) is None:
            raise MutateError(f"--gate {gate}: no recorded score for {args.engine} {release} sample {args.sample} "
                              f"seed {args.seed} profile {args.profile} (record one with --record)")
        if args.sample is not None and args.sample < 1:
            raise MutateError(f"--sample {args.sample}: must be a positive count of mutants")
        if args.workers < 1:
            raise MutateError(f"--workers {args.workers}: must be at least 1")
        deadline = getattr(args, "deadline", None)
        if deadline is not None and deadline <= 0:
            raise MutateError(f"--deadline {deadline}: must be a positive number of seconds")
        stop_at = None if deadline is None else time.monotonic() + deadline
        chosen = targets(args.engine, release, args.file, args.function)
        ops = operator_names(args.operators)
        lines = None
        if head is not None:
            base = fetch.release_root(f"{pin}@{release}")
            changed = [f for f in fetch.Source(pin, head).pin.files if (head / f).is_file() and not (
                (base / f).is_file() and (head / f).read_bytes() == (base / f).read_bytes())]
            if not changed:
                print(f"[mutate] {head}: the same bytes as {args.engine} {release}: nothing to mutate", file=sys.stderr)
                return 0
            if not set(changed) & {t.file for t in chosen}:
                raise MutateError(f"--head {head}: its changed lines ({', '.join(changed)}) are outside every bound "
                                  f"file of {args.engine} {release} that runs here")
            lines = changed_lines_of(head, base, [t.file for t in chosen])
            if not lines:
                print(f"[mutate] {head}: only comments or whitespace changed in {', '.join(changed)}: nothing to "
                      "mutate", file=sys.stderr)
                return 0
            chosen = [t for t in chosen if t.file in lines]
    except MutateError as e:
        print(f"[mutate] ERROR: {e}", file=sys.stderr)
        return 2
    params = {"engine": args.engine, "release": release, "head": str(head) if head else None,
              "files": [t.file for t in chosen], "functions": [f for t in chosen for f in t.functions],
              "operators": ops, "sample": args.sample, "seed": args.seed, "profile": args.profile}
    stamp = out / "session.json"
    if stamp.exists() and not args.fresh:
        old = json.loads(stamp.read_text())
        if old != params:
            print(f"[mutate] ERROR: {out} holds a session of other parameters ({stamp}); --fresh starts over",
                  file=sys.stderr)
            return 2
        print(f"[mutate] resuming the session in {out}", file=sys.stderr)
    else:
        from k3num.harness import fixes

        if out.exists():
            shutil.rmtree(out)
        (out / "trees").mkdir(parents=True)
        ref = out / "trees" / "ref"
        try:
            if head is None:
                fixes.pinned_tree(f"{pin}@{release}", ref)
            else:  # the head's bound files, laid out as the pinned tree's
                for rel in fetch.Source(pin, head).pin.files:
                    (ref / rel).parent.mkdir(parents=True, exist_ok=True)
                    shutil.copyfile(head / rel, ref / rel)
        except (fixes.FixError, ValueError, OSError) as e:
            shutil.rmtree(out)
            print(f"[mutate] ERROR: {e}", file=sys.stderr)
            return 2
        _init(out / "session.sqlite", ref, chosen, ops, args.sample, args.seed, lines)
        stamp.write_text(json.dumps(params, indent=1))
    try:
        execute(out, args.engine, release, chosen, args.workers, args.profile,
                log=lambda m: print(m, file=sys.stderr, flush=True), stop_at=stop_at)
    except MutateError as e:
        print(f"[mutate] ERROR: {e}", file=sys.stderr)
        return 2
    frame = mark_equivalents(results(out, args.engine, release, chosen))
    frame.to_csv(out / "mutants.csv", index=False)
    left = pending_count(out)
    what = (f", a sample of {args.sample} (seed {args.seed})" if args.sample else "") + (
        f", the lines {head} changed" if head else "") + (
        f"; PARTIAL: {left} mutant(s) not run (the deadline), resume with the same --out" if left else "")
    (out / "report.md").write_text(report(frame, args.engine, release, what))
    k, n, p, lo, hi = score(frame)
    if n == 0 and left:
        print(f"[mutate] {args.engine} {release}: no mutant judged before the deadline{what}")
        return 1
    if n == 0:
        print(f"[mutate] {args.engine} {release}: no mutant to judge{what} (the operators make none there)")
        if getattr(args, "gate", None):  # a sample that judged nothing (every mutant incompetent) cannot pass
            key = gate_key(args.engine, release, args.sample, args.seed, args.profile)
            print(f"[mutate] gate: {gate_verdict(recorded(Path(args.gate), key), p)[1]}")
            return 1
        return 0
    print(f"[mutate] {args.engine} {release}: {k}/{n} killed ({p:.1%}, 95% {lo:.1%}-{hi:.1%}){what}; "
          f"{out / 'report.md'}, {out / 'mutants.csv'}")
    for _, r in frame[frame["outcome"] == SURVIVED].iterrows():
        print(f"[mutate] survived: {r['file']}:{r['line']} {r['function']} ({r['operator']}): "
              f"{' -> '.join(changed_lines(r['diff']))}")
    key = gate_key(args.engine, release, args.sample, args.seed, args.profile)
    if left and (getattr(args, "record", None) or getattr(args, "gate", None)):
        print(f"[mutate] ERROR: {left} mutant(s) of the sample did not run: a partial score is neither recorded "
              "nor gated", file=sys.stderr)
        return 1
    if getattr(args, "record", None):
        record(Path(args.record), key, k, n, p, lo, hi)
        print(f"[mutate] recorded {k}/{n} ({p:.1%}, 95% {lo:.1%}-{hi:.1%}) in {args.record}")
    if getattr(args, "gate", None):
        ok, said = gate_verdict(recorded(Path(args.gate), key), p)
        print(f"[mutate] gate: {said}")
        return 0 if ok else 1
    return 1 if left or (frame["outcome"] == SURVIVED).any() else 0


GATE_KEY = ("engine", "release", "sample", "seed", "profile")


def gate_key(engine: str, release: str, sample: int | None, seed: int, profile: str) -> dict[str, str]:
    return dict(zip(GATE_KEY, (engine, release, str(sample or "all"), str(seed), profile)))


def recorded(path: Path, key: dict[str, str]) -> dict[str, str] | None:
    """The recorded score's row for `key` in the gate file (None: no such row, or no file)."""
    import csv

    if not path.is_file():
        return None
    with path.open(newline="") as f:
        return next((r for r in csv.DictReader(f) if all(r.get(c) == v for c, v in key.items())), None)


def record(path: Path, key: dict[str, str], killed: int, competent: int, p: float, lo: float, hi: float) -> None:
    """Write the score as `key`'s row of the gate file (replacing an older one)."""
    import csv

    cols = [*GATE_KEY, "killed", "competent", "score", "lo", "hi", "recorded"]
    rows = []
    if path.is_file():
        with path.open(newline="") as f:
            rows = [r for r in csv.DictReader(f) if not all(r.get(c) == v for c, v in key.items())]
    rows.append({**key, "killed": killed, "competent": competent, "score": f"{p:.4f}", "lo": f"{lo:.4f}",
                 "hi": f"{hi:.4f}", "recorded": time.strftime("%Y-%m-%d")})
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=cols)
        w.writeheader()
        w.writerows(rows)


def gate_verdict(row: dict[str, str], p: float) -> tuple[bool, str]:
    """(pass, what to say): the score passes unless it falls below the recorded score by more than the recorded
    interval's lower half (below its `lo`); NaN (nothing competent) fails."""
    lo = float(row["lo"])
    said = f"score {p:.1%} against the recorded {float(row['score']):.1%} (95% from {lo:.1%}, {row['recorded']})"
    if not p >= lo:
        return False, f"{said}: BELOW the recorded interval, the suite lost power"
    return True, f"{said}: within"


def add_parser(sub) -> None:
    m = sub.add_parser("mutate", help="the mutation score of the suite on an engine's bound K3 functions "
                       "(cosmic-ray; harness/mutate.py)",
                       epilog="exit codes: 0 every mutant killed; 1 a survivor (report.md lists it) or mutants left "
                              "pending by --deadline; 2 bad input "
                              "(an engine, release, file, function or operator not known; nothing written)")
    m.add_argument("--engine", required=True, help="the engine's registry name (vllm, vllm-rocm, sglang, tokenspeed)")
    m.add_argument("--release", default=None, help="a pinned release (default: the engine's default)")
    m.add_argument("--head", default=None, metavar="PATH",
                   help="a tree laid out like the package (k3num tree): only the lines it changes against the "
                        "release it names are mutated, in it")
    m.add_argument("--file", action="append", default=None, help="a bound file (the census's path); repeatable")
    m.add_argument("--function", action="append", default=None, help="a bound function's name; repeatable")
    m.add_argument("--operators", nargs="+", default=None, metavar="OP",
                   help="cosmic-ray operator names to keep (core/..., k3num/...; default every one)")
    m.add_argument("--sample", type=int, default=None, metavar="N", help="a seeded sample of N mutants")
    m.add_argument("--seed", type=int, default=0)
    m.add_argument("--workers", type=int, default=1, help="mutants run side by side, each in a tree of its own")
    m.add_argument("--profile", default="ci", help="the hypothesis profile the properties run under")
    m.add_argument("--out", required=True, help="the session folder: session.sqlite, mutants.csv, report.md")
    m.add_argument("--fresh", action="store_true", help="start the session in OUT over")
    m.add_argument("--deadline", type=float, default=None, metavar="SECONDS",
                   help="start no mutant after SECONDS: the running ones finish, the report covers what ran and "
                        "says PARTIAL, the rest stay pending in OUT (run again to resume)")
    m.add_argument("--gate", default=None, metavar="CSV",
                   help="fail (exit 1) when the score falls below the recorded one's 95%% interval for the same "
                        "engine, release, sample, seed and profile (harness/mutation_gate.csv is CI's)")
    m.add_argument("--record", default=None, metavar="CSV",
                   help="write this run's score into CSV as the one --gate compares with (its row replaced)")
    m.set_defaults(func=main)
