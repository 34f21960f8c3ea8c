"""`k3num mutate` (harness/mutate.py) and its numeric operators (harness/mutation_operators.py).

The operators are proven on their examples and on the engines' own files: each must apply where its bug would
be written (the dropped max subtraction at SGLang's combine kernel, the dropped copy at TokenSpeed's tap), and
the mutants those make must be killed by the suite (two fresh plants that had passed whole suites), end to end
through cosmic-ray's session. The command's bad input exits 2 and writes nothing.
"""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest

from k3num.harness import mutate, mutation_operators
from k3num.supply import fetch

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("name", sorted(mutation_operators.OPERATORS))
def test_each_numeric_operator_makes_exactly_its_examples(name: str) -> None:
    """Each example's code mutates to its stated result at its occurrence; an example whose result is its
    input states a place the operator must leave alone (no mutation there)."""
    from cosmic_ray.mutating import mutate_code

    op = mutation_operators.OPERATORS[name]
    for ex in op.examples():
        got = mutate_code(ex.pre_mutation_code, op(), ex.occurrence or 0)
        if ex.post_mutation_code == ex.pre_mutation_code:
            assert got is None, (name, ex.pre_mutation_code, got)
        else:
            assert got == ex.post_mutation_code, (name, ex.pre_mutation_code, got)
            compile(got, name, "exec")  # a mutant the operator makes is still Python


def test_the_numeric_operators_are_registered_with_cosmic_ray_under_k3num() -> None:
    import cosmic_ray.plugins

    names = cosmic_ray.plugins.operator_names()
    assert {f"k3num/{n}" for n in mutation_operators.OPERATORS} <= set(names)
    assert cosmic_ray.plugins.get_operator("k3num/DropMaxSubtraction") is mutation_operators.DropMaxSubtraction


def _positions(path: Path, op) -> list[int]:
    from cosmic_ray.ast import ast_nodes, get_ast_from_path

    return [start[0] for node in ast_nodes(get_ast_from_path(path)) for start, _ in op().mutation_positions(node)]


def _spans(path: Path, op) -> list[tuple[int, int]]:
    """(first line, last line) of each of the operator's mutation positions in the file, in occurrence order."""
    from cosmic_ray.ast import ast_nodes, get_ast_from_path

    return [(start[0], end[0]) for node in ast_nodes(get_ast_from_path(path))
            for start, end in op().mutation_positions(node)]


def test_the_operators_reach_the_two_misses_in_the_engines_files() -> None:
    """The dropped max subtraction of SGLang's _combine_kernel and the dropped copy of TokenSpeed's prefix-stream
    tap (two fresh bugs that had passed whole suites) are each a mutant of the operators, at the line."""
    for engine in ("sglang", "tokenspeed"):
        if fetch.missing_files(engine):
            pytest.skip(f"{engine} is not fetched (k3num fetch {engine})")
    sg = fetch.release_root("sglang") / "sglang/srt/layers/attn_residual.py"
    lines = sg.read_text().splitlines()
    assert [lines[n - 1].strip() for n in _positions(sg, mutation_operators.DropMaxSubtraction)] == [
        "e = tl.where(mask_b, tl.exp(raw - m), 0.0)"]
    ts = fetch.release_root("tokenspeed") / "tokenspeed/runtime/models/kimi_k3.py"
    lines = ts.read_text().splitlines()
    assert "return prefix_sum.clone()" in [lines[n - 1].strip() for n in _positions(ts, mutation_operators.DropCopy)]


@pytest.mark.parametrize("rc, output, outcome", [
    (None, "", mutate.TIMED_OUT),
    (1, "FAILED properties/test_a.py::test_b[sglang] - AssertionError\n", mutate.KILLED),
    (0, "engines (how each was bound):\n  sglang 0.5.23+local: source-interpreter (-v): 3 run, 1 skipped, 0 known\n",
     mutate.SURVIVED),
    (0, "engines (how each was bound):\n  sglang 0.5.23+local: source-interpreter (-v): 0 run, 4 skipped, 0 known\n",
     mutate.INCOMPETENT),  # the mutant broke the binding: every test skipped, none judged it
    (0, "engines (how each was bound):\n  sglang 0.5.23+local: source-interpreter (-v): 0 run, 6 skipped, 3 known\n",
     mutate.SURVIVED),  # known failures ran: the entries' models judged them (vLLM 0.33.0's linear.py)
    (4, "ERROR: usage\n", mutate.INCOMPETENT),
    (1, "no test named\n", mutate.INCOMPETENT),
])
def test_a_mutants_run_is_killed_survived_timed_out_or_incompetent(rc, output, outcome) -> None:
    got, test = mutate.judge_run(rc, output, "sglang")
    assert got == outcome
    if outcome == mutate.KILLED:
        assert test == "properties/test_a.py::test_b[sglang]"


def test_the_score_interval_is_wilsons() -> None:
    """Closed forms: all of n killed gives the lower bound n / (n + z^2); none gives the upper z^2 / (n + z^2)."""
    import pandas as pd

    z2 = mutate.Z95**2
    all_killed = pd.DataFrame({"outcome": [mutate.KILLED] * 9 + [mutate.INCOMPETENT]})
    k, n, p, lo, hi = mutate.score(all_killed)
    assert (k, n, p, hi) == (9, 9, 1.0, 1.0) and math.isclose(lo, 9 / (9 + z2))
    none = pd.DataFrame({"outcome": [mutate.SURVIVED] * 4})
    assert math.isclose(mutate.score(none)[4], z2 / (4 + z2)) and mutate.score(none)[3] == 0.0


def _mutate(*args: str, timeout: int = 900) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "k3num.harness.cli", "mutate", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout)


@pytest.mark.parametrize("args, said", [
    (["--engine", "nope"], "--engine nope: unknown"),
    (["--engine", "sglang", "--release", "9.9"], "--release 9.9: not pinned for sglang"),
    (["--engine", "sglang", "--file", "sglang/x.py"], "--file sglang/x.py: not a bound file"),
    (["--engine", "sglang", "--function", "nope"], "--function nope: not a bound function"),
    (["--engine", "sglang", "--operators", "k3num/Nope"], "--operators k3num/Nope: no such operator"),
    (["--engine", "sglang", "--sample", "0"], "--sample 0: must be a positive count"),
    (["--engine", "sglang", "--sample", "3", "--gate", "harness/mutation_gate.csv"], "no recorded score for sglang"),
])
def test_bad_input_to_mutate_exits_2_naming_it_and_writes_nothing(tmp_path: Path, args, said) -> None:
    if fetch.missing_files("sglang"):
        pytest.skip("sglang is not fetched (k3num fetch sglang)")
    out = tmp_path / "session"
    r = _mutate(*args, "--out", str(out), timeout=300)
    assert r.returncode == 2, r.stderr[-2000:]
    assert said in r.stderr, r.stderr[-2000:]
    assert not out.exists()


def test_mutate_kills_sglangs_dropped_max_subtraction_and_resumes_a_finished_session(tmp_path: Path) -> None:
    """End to end on the pinned SGLang tree: a run whose --deadline passes before its one mutant starts leaves
    it pending, says PARTIAL and exits 1; run again, the session resumes: the one DropMaxSubtraction mutant of
    _combine_kernel is killed by the extreme-scores property (the softmax overflows past a score of ~88); the
    CSV and report name it; run again with the same parameters, the session has nothing left to run."""
    if fetch.missing_files("sglang"):
        pytest.skip("sglang is not fetched (k3num fetch sglang)")
    import pandas as pd

    out = tmp_path / "session"
    args = ["--engine", "sglang", "--function", "_combine_kernel", "--operators", "k3num/DropMaxSubtraction",
            "--out", str(out)]
    cut = _mutate(*args, "--deadline", "0.01")
    assert cut.returncode == 1, cut.stdout[-2000:] + cut.stderr[-3000:]
    assert "deadline reached: 1 mutant(s) not started" in cut.stderr and "PARTIAL: 1 mutant(s)" in cut.stdout
    r = _mutate(*args)
    assert "resuming the session" in r.stderr, r.stderr[-2000:]
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    frame = pd.read_csv(out / "mutants.csv")
    assert len(frame) == 1 and frame["outcome"][0] == mutate.KILLED, frame.to_string()
    assert frame["line"][0] == 188 and frame["function"][0] == "_combine_kernel"
    assert "test_extreme_scores.py::test_read_only_mixture_within_budget_where_scores_leave_exps_range" in \
        frame["test"][0]
    assert "-    e = tl.where(mask_b, tl.exp(raw - m), 0.0)" in frame["diff"][0]
    assert "1 of 1 competent mutants killed" in (out / "report.md").read_text()
    again = _mutate(*args)
    assert again.returncode == 0 and "resuming the session" in again.stderr, again.stderr[-2000:]
    assert "0 mutants to run" in again.stderr, again.stderr[-2000:]
    other = _mutate(*args[:-2], "--operators", "k3num/SwapAxis", "--out", str(out))
    assert other.returncode == 2 and "--fresh starts over" in other.stderr


def test_every_listed_equivalent_mutant_is_one_the_operators_still_make_on_a_pinned_tree() -> None:
    """The reviewed list of equivalent mutants names each by engine, file, function, operator and its changed
    line (before, after): each row must still be a mutant its operator makes in that function of a pinned
    release's file, with a reason, so the list cannot keep a mutant that no longer exists (or hide another)."""
    import cosmic_ray.plugins
    from cosmic_ray.mutating import _make_diff, mutate_code

    listed = mutate.equivalents()
    assert len(listed), "the list is read (an empty list needs no test)"
    for _, row in listed.iterrows():
        pin = mutate.pin_engine(row["engine"])
        if fetch.missing_files(pin):
            pytest.skip(f"{pin} is not fetched (k3num fetch {pin})")
        op = cosmic_ray.plugins.get_operator(row["operator"])
        found = False
        for version in fetch.releases(pin):
            path = fetch.release_root(f"{pin}@{version}") / row["file"]
            if not path.exists():
                continue
            code, spans = path.read_text(), mutate.function_spans(path)
            lines = code.splitlines()
            for occurrence, (line, end) in enumerate(_spans(path, op)):
                if row["before"] not in (x.strip() for x in lines[line - 1:end]):  # elsewhere (mutating is slow)
                    continue
                mutated = mutate_code(code, op(), occurrence)
                if mutate.function_at(spans, line) == row["function"] and mutate.changed_lines(
                        "\n".join(_make_diff(code, mutated, row["file"]))) == (row["before"], row["after"]):
                    found = True
        assert found, f"listed equivalent not made by {row['operator']} in {row['file']}: {row['before']!r}"


def test_a_listed_equivalent_survivor_is_marked_and_left_out_of_the_score() -> None:
    import pandas as pd

    row = mutate.equivalents().iloc[0]
    diff = f"--- a/{row['file']}\n+++ b/{row['file']}\n@@ -1 +1 @@\n-    {row['before']}\n+    {row['after']}"
    frame = pd.DataFrame([{"engine": row["engine"], "file": row["file"], "function": row["function"],
                           "operator": row["operator"], "outcome": mutate.SURVIVED, "test": "", "diff": diff},
                          {"engine": row["engine"], "file": row["file"], "function": row["function"],
                           "operator": row["operator"], "outcome": mutate.KILLED, "test": "t", "diff": ""}])
    marked = mutate.mark_equivalents(frame)
    assert list(marked["outcome"]) == [mutate.EQUIVALENT, mutate.KILLED] and marked["test"][0] == row["reason"]
    assert mutate.score(marked)[:3] == (1, 1, 1.0)
    other = frame.assign(function="another_function")  # the same change elsewhere is not listed: a survivor
    assert list(mutate.mark_equivalents(other)["outcome"]) == [mutate.SURVIVED, mutate.KILLED]


def _head_tree(tmp_path: Path, old: str, new: str) -> Path:
    """TokenSpeed's pinned tree (k3num tree) with one edit of kimi_k3.py."""
    from k3num.harness import fixes

    head = fixes.pinned_tree("tokenspeed", tmp_path / "head")
    path = head / "tokenspeed/runtime/models/kimi_k3.py"
    text = path.read_text()
    assert text.count(old) == 1
    path.write_text(text.replace(old, new))
    return head


TAP = '        if self.dflash_aux_stream != "attn_res":\n            return prefix_sum.clone()\n'


def test_mutate_on_a_head_mutates_only_its_changed_lines_and_lists_an_untested_branchs_survivors(tmp_path) -> None:
    """A head that adds a branch no drawn case reaches (hidden 7168 past layer 90): the mutants of its two new
    lines survive and are listed (exit 1), and no line the head left alone is mutated; a comment-only head
    has nothing to mutate (exit 0)."""
    if fetch.missing_files("tokenspeed"):
        pytest.skip("tokenspeed is not fetched (k3num fetch tokenspeed)")
    import pandas as pd

    head = _head_tree(tmp_path, TAP, TAP + "        if prefix_sum.shape[-1] == 7168 and layer_idx > 90:\n"
                                        "            return prefix_sum * 2\n")
    ops = ["--operators", "core/ReplaceComparisonOperator_Gt_GtE", "core/ReplaceBinaryOperator_Mul_Add"]
    r = _mutate("--engine", "tokenspeed", "--head", str(head), *ops, "--out", str(tmp_path / "m"))
    assert r.returncode == 1, r.stdout[-2000:] + r.stderr[-3000:]
    frame = pd.read_csv(tmp_path / "m" / "mutants.csv")
    assert sorted(frame["line"]) == [3447, 3448] and set(frame["outcome"]) == {mutate.SURVIVED}, frame.to_string()
    assert "survived: tokenspeed/runtime/models/kimi_k3.py:3448 KimiLinearModel._dspark_capture_stream" in r.stdout
    comment = _head_tree(tmp_path / "c", TAP, TAP.replace('"attn_res":', '"attn_res":  # the prefix stream'))
    r = _mutate("--engine", "tokenspeed", "--head", str(comment), "--out", str(tmp_path / "c" / "m"))  # every operator
    assert r.returncode == 0 and "only comments or whitespace changed" in r.stderr, r.stdout[-2000:] + r.stderr[-2000:]


PLANTED_ANNOTATIONS = '''from __future__ import annotations
import dataclasses
import triton


def plain(x: int | None = None, *, eps: float = 1e-6) -> int | None:
    y: int | None = x
    return y


@triton.jit
def kernel(x, BLOCK: tl.constexpr | None):
    pass


@dataclasses.dataclass
class Config:
    width: int | None = None
'''


def test_only_annotations_no_behaviour_reads_are_left_unmutated(tmp_path: Path) -> None:
    """A plain function's parameter, return and local annotations are read by nothing (never evaluated under
    postponed annotations; without them, evaluated once at the engine module's import, where a mutant cannot
    import); a default value, a decorated function's annotations and a class body's (read by triton.jit, a
    dataclass) are code and stay mutated; a file that may evaluate its annotations (a custom op's schema)
    keeps its signatures."""
    f = tmp_path / "planted.py"
    f.write_text(PLANTED_ANNOTATIONS)
    spans = mutate.unevaluated_annotations(f)
    src = PLANTED_ANNOTATIONS.splitlines()

    def left_out(line: int, text: str, last: bool = False) -> bool:
        col = src[line - 1].rindex(text) if last else src[line - 1].index(text)
        return mutate.inside(spans, (line, col), (line, col + len(text)))

    assert left_out(6, "int | None") and left_out(6, "float") and left_out(6, "int | None", last=True)
    assert left_out(7, "int | None"), "a local variable's annotation"
    assert not left_out(6, "1e-6") and not left_out(6, "= None"), "a default value is code"
    assert not left_out(12, "tl.constexpr | None"), "triton.jit reads a kernel's annotations"
    assert not left_out(18, "int | None"), "a dataclass reads its fields' annotations"
    eager = tmp_path / "eager.py"
    eager.write_text(PLANTED_ANNOTATIONS.replace("from __future__ import annotations", "import math"))
    assert mutate.unevaluated_annotations(eager) == spans, "without the future import: evaluated at import only"
    schema = tmp_path / "schema.py"
    schema.write_text(PLANTED_ANNOTATIONS + "torch.library.custom_op('k3::plain')(plain)\n")
    assert mutate.unevaluated_annotations(schema) == [((7, 7), (7, 17))], "a custom op's schema reads them"
    imported = tmp_path / "imported.py"
    imported.write_text("from vllm.model_executor.custom_op import PluggableLayer\n" + PLANTED_ANNOTATIONS)
    assert len(mutate.unevaluated_annotations(imported)) == len(spans), "a module named custom_op reads nothing"


def test_a_survivor_listed_not_runnable_here_is_counted_apart_and_left_out_of_the_score(tmp_path: Path) -> None:
    import pandas as pd

    listed = mutate.equivalents()
    row = listed[listed["kind"] == mutate.NOT_RUNNABLE].iloc[0]
    diff = f"--- a/{row['file']}\n+++ b/{row['file']}\n@@ -1 +1 @@\n-    {row['before']}\n+    {row['after']}"
    frame = pd.DataFrame([{"engine": row["engine"], "file": row["file"], "function": row["function"],
                           "operator": row["operator"], "outcome": mutate.SURVIVED, "test": "", "diff": diff,
                           "subject": "", "line": 1}])
    marked = mutate.mark_equivalents(frame)
    assert list(marked["outcome"]) == [mutate.NOT_RUNNABLE] and marked["test"][0] == row["reason"]
    assert mutate.score(marked)[:2] == (0, 0)
    assert "1 not runnable here" in mutate.report(marked, row["engine"], "0.1.1", "")
    bad = tmp_path / "bad.csv"
    listed.assign(kind="maybe").to_csv(bad, index=False)
    with pytest.raises(ValueError, match="kind 'maybe'"):
        mutate.equivalents(bad)


def test_the_gate_fails_a_score_below_the_recorded_interval_and_passes_one_within(tmp_path: Path) -> None:
    """--record writes the score as its key's row (replacing an older one); --gate's verdict passes a score at or
    above the recorded interval's lower end and fails one below it, or a NaN (nothing competent)."""
    gate = tmp_path / "gate.csv"
    key = mutate.gate_key("tokenspeed", "0.1.1", 16, 0, "ci")
    mutate.record(gate, key, 9, 16, 9 / 16, 0.33, 0.77)
    mutate.record(gate, key, 12, 16, 0.75, 0.51, 0.90)  # replaces the row of the same key
    mutate.record(gate, mutate.gate_key("sglang", "0.5.23", 16, 0, "ci"), 1, 2, 0.5, 0.1, 0.9)
    row = mutate.recorded(gate, key)
    assert row["killed"] == "12" and row["lo"] == "0.5100" and len(gate.read_text().splitlines()) == 3
    assert mutate.recorded(gate, mutate.gate_key("tokenspeed", "0.1.1", 16, 1, "ci")) is None
    assert mutate.gate_verdict(row, 0.75)[0] and mutate.gate_verdict(row, 0.51)[0]
    ok, said = mutate.gate_verdict(row, 0.50)
    assert not ok and "BELOW" in said
    assert not mutate.gate_verdict(row, math.nan)[0]


def test_ci_sample_holds_the_recorded_score(tmp_path: Path) -> None:
    """CI's mutation gate: TokenSpeed's seeded sample of 12 (seed 0, `ci`: derandomized, the same mutants get the
    same verdicts) must not fall below the score recorded in harness/mutation_gate.csv by more than its 95%
    interval (docs/mutation.md), and every survivor must be one the reviewed list names. About 5 minutes on 2
    cores."""
    if fetch.missing_files("tokenspeed"):
        pytest.skip("tokenspeed is not fetched (k3num fetch tokenspeed)")
    r = _mutate("--engine", "tokenspeed", "--sample", "12", "--seed", "0", "--workers", "2", "--out",
                str(tmp_path / "gate"), "--gate", str(ROOT / "harness" / "mutation_gate.csv"), timeout=1500)
    assert "[mutate] gate:" in r.stdout, r.stderr[-3000:]
    assert r.returncode == 0, r.stdout[-3000:]
    unlisted = [x for x in r.stdout.splitlines() if x.startswith("[mutate] survived:")]
    assert not unlisted, ("a survivor neither killed nor listed in harness/mutation_equivalents.csv (kill it with a "
                          "property, or list it with its reason):\n" + "\n".join(unlisted))
