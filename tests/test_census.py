"""The census from the files (harness/census.py): every function of every pinned K3 file of every
fetched release is bound, reached from a bound one, or declared; every K3 file of every pinned wheel is
pinned or declared; no declaration is dead; a planted function or file is caught."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from k3num.harness import census
from k3num.harness.census_rules import Rule
from k3num.supply import fetch

ROOT = Path(__file__).resolve().parents[1]
DSPARK = "vllm/models/kimi_k3/nvidia/dspark_mla.py"


def _entries() -> list[census.Entry]:
    entries = census.census()
    if not entries:
        pytest.skip("no pinned release is fetched here (k3num fetch)")
    return entries


def _all_fetched() -> None:
    missing = [f"{p}@{v}" for p in fetch.PINS for v in fetch.releases(p)
               if not fetch.verified_manifest(f"{p}@{v}", log=lambda *_: None)]
    if missing:
        pytest.skip(f"not every pinned release is fetched ({', '.join(missing)}): a rule may match only those")


def test_every_function_of_every_pinned_k3_file_is_bound_reached_or_declared() -> None:
    unlisted = [f"{e.engine} {e.release} {e.file}: {e.function}" for e in _entries() if e.status == "unlisted"]
    assert not unlisted, ("functions no binding reaches and no rule declares (harness/census_rules.py RULES):\n"
                          + "\n".join(unlisted))


def test_every_census_rule_declares_a_function_of_some_pinned_release() -> None:
    _all_fetched()
    dead = census.dead_rules(_entries())
    assert not dead, "rules that match no function of any release:\n" + "\n".join(map(repr, dead))


def test_every_k3_file_of_every_pinned_wheel_is_pinned_or_declared_and_no_file_rule_is_dead() -> None:
    files = census.file_census()
    wanted = [f"{p}@{v}" for p in fetch.PINS for v in fetch.releases(p)]
    seen = {f"{f.engine}@{f.release}" for f in files}
    if seen != set(wanted):
        pytest.skip(f"wheels not cached here for {sorted(set(wanted) - seen)} (k3num fetch keeps them)")
    unlisted = [f"{f.engine} {f.release} {f.file}" for f in files if f.status == "unlisted"]
    assert not unlisted, "K3 files neither pinned nor declared (census_rules.OFF_PATH_FILES):\n" + "\n".join(unlisted)
    assert not census.dead_file_rules(files), census.dead_file_rules(files)
    # each release is censused on its own: 0.34.0's new files are its, not 0.33.0's
    new_in_034 = {f.file for f in files if f.release == "0.34.0"} - {f.file for f in files if f.release == "0.33.0"}
    assert "vllm/models/kimi_k3/nvidia/gqa_draft.py" in new_in_034


def test_a_function_planted_in_a_pinned_file_is_unlisted_unless_a_bound_one_calls_it() -> None:
    root = fetch.Source("vllm").root
    if fetch.missing_files("vllm"):
        pytest.skip("vllm is not fetched here (k3num fetch vllm)")
    text = (root / DSPARK).read_text()
    bound = census.bound_by_file()[("vllm", DSPARK)]
    assert "K3DSparkModel._build_fused_context_kv_metadata" in bound
    planted = text + "\n\ndef _planted_helper(x):\n    return x\n"
    got = {e.function: e.status for e in census.census_file("vllm", "x", DSPARK, planted, bound, census.RULES)}
    assert got["_planted_helper"] == "unlisted"
    # the same helper, called from a bound method, is reached (its code runs on the bound path)
    lines = planted.splitlines(keepends=True)
    fn = next(n for n in ast.walk(ast.parse(planted)) if isinstance(n, ast.FunctionDef)
              and n.name == "_build_fused_context_kv_metadata")
    first = fn.body[1] if isinstance(fn.body[0], ast.Expr) else fn.body[0]
    indent = " " * first.col_offset
    lines.insert(first.lineno - 1, f"{indent}_planted_helper(None)\n")
    got = {e.function: (e.status, e.why) for e in census.census_file("vllm", "x", DSPARK, "".join(lines), bound,
                                                                      census.RULES)}
    assert got["_planted_helper"] == ("reached", "from K3DSparkModel._build_fused_context_kv_metadata")


def test_reachability_follows_calls_self_methods_bases_and_launched_kernels() -> None:
    tree = ast.parse(
        "def kernel(x):\n    pass\n"
        "def helper():\n    return 1\n"
        "def unused():\n    return 2\n"
        "class Base:\n    def shared(self):\n        return helper()\n"
        "class A(Base):\n"
        "    def run(self):\n        kernel[(1,)](0)\n        return self.shared() + self._own()\n"
        "    def _own(self):\n        return 3\n"
        "    def other(self):\n        return 4\n")
    got = census.reached(tree, ["A.run"])
    assert set(got) == {"kernel", "Base.shared", "helper", "A._own"}
    assert "unused" not in got and "A.other" not in got


def test_a_new_k3_file_is_unlisted_and_a_declared_one_says_why() -> None:
    assert census.file_status("vllm", "vllm/models/kimi_k3/nvidia/new_draft.py", ())[0] == "unlisted"
    status, why = census.file_status("vllm", "vllm/models/kimi_k3/nvidia/kda.py", ())
    assert status == "declared" and "KDA" in why
    assert census.file_status("vllm", DSPARK, fetch.PINS["vllm"].files)[0] == "pinned"


def test_the_drafters_path_files_are_not_declared_as_the_fused_target_decode() -> None:
    """0.34.0's specialized DSpark drafter lives under specialized_decode/ like the fused target decode, but its
    model.py holds path 3's column-parallel context projection (pinned on 0.34.0 and bound: context_proj_tp),
    linears.py the drafter's GEMMs and markov.py the fused Markov steps (pinned on 0.34.0 and bound:
    markov_steps): an unpinned one's first matching file rule must say UNBOUND, never the target decode's
    "off-path" reason, and the pinned ones are censused by function."""
    drafter = "vllm/models/kimi_k3/nvidia/specialized_decode/drafter/"
    status, why = census.file_status("vllm", drafter + "linears.py", ())
    assert status == "declared" and why.startswith("UNBOUND, on paths 1 and 3"), why
    pinned = fetch.source_of("vllm@0.34.0", {}).pin.files
    for name in ("model.py", "markov.py"):
        assert census.file_status("vllm", drafter + name, pinned)[0] == "pinned", name
    _, why = census.file_status("vllm", "vllm/models/kimi_k3/nvidia/specialized_decode/cutedsl/moe/tail.py", ())
    assert "fused target decode" in why


def test_a_stub_is_declared_as_having_no_code() -> None:
    tree = ast.parse("class P:\n    def a(self):\n        ...\n    def b(self):\n        '''doc'''\n"
                     "    def c(self):\n        raise NotImplementedError\n    def d(self):\n        return 1\n")
    fns = census.functions(tree)
    assert [q for q, f in fns.items() if census.is_stub(f)] == ["P.a", "P.b", "P.c"]


def test_a_rule_that_cannot_be_read_is_refused_naming_it() -> None:
    with pytest.raises(census.CensusError, match="kind 'gone'"):
        census.check_rules([Rule("vllm", DSPARK, "x", "gone", "why")])
    with pytest.raises(census.CensusError, match="not a regex"):
        census.check_rules([Rule("vllm", DSPARK, "(", "off-path", "why")])
    with pytest.raises(census.CensusError, match="names its stand-in"):
        census.check_rules([Rule("vllm", DSPARK, "x", "replaced", "why")])
    with pytest.raises(census.CensusError, match="does not exist"):
        census.check_stand_ins([Rule("vllm", DSPARK, "x", "replaced", "why", "k3num.engines.base:no_such_thing")])
    census.check_rules(census.RULES)
    census.check_stand_ins(census.RULES)


def test_the_cli_prints_the_census_and_exits_zero_when_nothing_is_unlisted() -> None:
    _entries()
    r = subprocess.run([sys.executable, "-m", "k3num.harness.cli", "coverage", "--census"], cwd=ROOT,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "| engine | release |" in r.stdout and "K3DSparkForCausalLM.combine_hidden_states" in r.stdout
