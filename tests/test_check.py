"""`k3num check` (harness/check.py, harness/pairing_run.py, oracles/pairing.py): a head judged against
its base on the same drawn cases. Proven on the mirror against its mutants and drift, and on the real
engines' trees: a within-budget drift of TokenSpeed, a fix of SGLang's K3N-008, a planted vLLM
mixture bug, a tree that changed a bound contract, and the pinned bytes against themselves."""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from k3num.engines.vllm_adapter import DSPARK_PY
from k3num.harness import cli, fixes
from k3num.oracles import pairing
from k3num.supply import fetch

ROOT = Path(__file__).resolve().parents[1]
UNSHARDED = "properties/test_partial_projection.py::test_unsharded_projection_within_rounding_budget_of_oracle"


# ---- the judgement ------------------------------------------------------------------------------


def test_sign_test_is_the_binomial_tail():
    assert pairing.sign_test_p(0, 0) == 1.0
    assert pairing.sign_test_p(14, 0) == 2.0**-14
    assert pairing.sign_test_p(0, 5) == 1.0
    assert pairing.sign_test_p(1, 1) == 0.75  # P(X >= 1 | n = 2)
    assert pairing.sign_test_p(32, 8) < pairing.ALPHA < pairing.sign_test_p(31, 9)  # the docstring's ci figures
    with pytest.raises(ValueError, match="counts must be >= 0"):
        pairing.sign_test_p(-1, 3)


def _examples(rows):
    return pd.DataFrame([dict(zip(pairing.EXAMPLE_COLUMNS, r)) for r in rows])


def test_outcomes_tell_new_fixed_known_and_what_the_head_lost():
    found = pairing.outcomes(_examples([
        ("t[a]", 1, "fail", "pass", "AssertionError: worse", "", ""), ("t[a]", 2, "fail", "fail", "x", "x", ""),
        ("u[a]", 1, "pass", "fail", "", "x", "K3N-008"), ("v[a]", 1, "fail", "fail", "x", "x", "K3N-006"),
        ("w[a]", 1, "skip", "pass", "contract changed: f.py: g takes (a), the adapter binds (a, b)", "", ""),
        ("z[a]", 1, "pass", "pass", "", "", ""), ("r[a]", 1, "flaky", "pass", "x", "", "K3N-004"),
        ("q[a]", 1, "flaky", "pass", "x", "", ""), ("s[a]", 1, "fail", "pass", "x", "", "K3N-004"),
        ("s[a]", 2, "fail", "fail", "x", "x", "K3N-004"), ("p[a]", 1, "fail", "pass", "x", "", "K3N-009"),
    ])).set_index("node")
    assert found.loc["t[a]", ["new", "known", "status", "first_new"]].tolist() == [1, 1, "new", "AssertionError: worse"]
    assert found.loc["u[a]", ["fixed", "status", "ledger"]].tolist() == [1, "fixed", "K3N-008"]
    assert found.loc["v[a]", "status"] == "known"
    assert found.loc["w[a]", "status"] == "head cannot run" and found.loc["w[a]", "examples"] == 0
    assert found.loc["z[a]", "status"] == "same"
    assert found.loc["r[a]", ["flaky", "status"]].tolist() == [1, "flaky"]
    # a head-only failure that repeated under CONFIRM is new whatever entry its test has, a race's included
    # (issue 37: the race rule used to file a deterministic bug under K3N-007); a flaky one stays flaky
    assert found.loc["s[a]", ["new", "flaky", "known", "status"]].tolist() == [1, 0, 1, "new"]
    assert found.loc["p[a]", ["new", "status"]].tolist() == [1, "new"]
    no_drift = pairing.paired_drift(pd.DataFrame(columns=list(pairing.RECORD_COLUMNS)))
    # a flaky failure is a known race under a ledger entry, and a finding without one
    assert pairing.exit_code(found.loc[["r[a]", "z[a]"]].reset_index(), no_drift) == 0
    assert pairing.exit_code(found.loc[["q[a]"]].reset_index(), no_drift) == 1
    assert pairing.exit_code(found.loc[["u[a]", "v[a]"]].reset_index(), no_drift) == 0  # fixed, known
    assert pairing.exit_code(found.loc[["t[a]"]].reset_index(), no_drift) == 1


def test_a_race_that_did_not_fire_on_the_head_fixes_nothing_unless_its_reproducer_passes_there():
    rows = [("k[a]", 1, "pass", "fail", "", "x", "K3N-004"), ("u[a]", 1, "fail", "fail", pairing.UNEXPLAINED + " x",
                                                                "x", "K3N-006")]
    found = pairing.outcomes(_examples(rows)).set_index("node")
    assert found.loc["k[a]", ["fixed", "flaky", "status"]].tolist() == [0, 1, "flaky"]
    # a failure on both sides that the entry's model rejects on the head is new, not known
    assert found.loc["u[a]", ["new", "known", "status"]].tolist() == [1, 0, "new"]
    repro = f"{pairing.REPRODUCER}[K3N-004]"
    found = pairing.outcomes(_examples([*rows, (repro, 1, "pass", "fail", "", "x", "K3N-004")])).set_index("node")
    assert found.loc["k[a]", ["fixed", "status"]].tolist() == [1, "fixed"]
    assert found.loc[repro, "status"] == "fixed"


def _records(pairs, budget=1.0):
    rows = []
    for i, (eh, eb) in enumerate(pairs):
        for side, e in (("head", eh), ("base", eb)):
            rows.append({"node": "n", "example": i, "side": side, "index": 0, "property": "p", "subject": "s",
                         "detail": "", "verdict": "pass", "max_abs": e, "budget": budget,
                         "ratio": e / budget if budget else float("inf"), "seed": i, "shape": "4"})
    return pd.DataFrame(rows)


def test_check_md_lists_a_new_failure_that_flips_decided_tokens_first_with_its_severity():
    import argparse

    from k3num.harness import check

    def row(node: str) -> dict:
        return {"node": node, "examples": 10, "new": 2, "fixed": 0, "known": 0, "flaky": 0, "head_skipped": 0,
                "status": "new", "ledger": "", "first_new": "seed 1", "head_skip_why": ""}

    found = pd.DataFrame([row("properties/test_attn_res.py::test_attn_res_within_rounding_budget_of_oracle[vllm]"),
                          row("properties/test_draft_tokens.py::test_a_decided_token_never_flips[vllm-dspark]")])
    drift = pd.DataFrame(columns=["node", "property", "subject", "pairs", "worse", "better", "tied", "median_ratio",
                                  "p_worse", "drift"])
    args = argparse.Namespace(engine="vllm", head="/src/vllm", base="pinned", hypothesis_profile="ci", k=None)
    md = check.markdown(found, drift, args, [])
    rows = [line for line in md.splitlines() if line.startswith("| `")]
    assert "test_a_decided_token_never_flips" in rows[0] and "| changes decided tokens |" in rows[0]
    assert "test_attn_res_within" in rows[1] and "k3num impact --engine vllm --engine-src vllm=/src/vllm" in rows[1]


def test_paired_drift_is_quiet_on_ties_and_on_noise_and_fires_on_a_consistent_worsening():
    assert pairing.paired_drift(_records([(0.1, 0.1)] * 40))["drift"].tolist() == ["same"]
    alternating = [(0.2, 0.1) if i % 2 else (0.1, 0.2) for i in range(40)]
    assert pairing.paired_drift(_records(alternating))["drift"].tolist() == ["same"]
    worse = pairing.paired_drift(_records([(0.12, 0.1)] * 32 + [(0.1, 0.12)] * 8))
    assert worse["drift"].tolist() == ["worse"] and worse["median_ratio"].iloc[0] == pytest.approx(1.2)
    better = pairing.paired_drift(_records([(0.1, 0.12)] * 20))
    assert better["drift"].tolist() == ["better"]
    # exact contracts (budget 0) are judged by pass/fail only
    assert pairing.paired_drift(_records([(1.0, 0.0)] * 20, budget=0.0)).empty


# ---- the pairing on the mirror ------------------------------------------------------------------


def _paired(tmp_path: Path, engine: str, base: str, *select: str, drift: str = "") -> pd.DataFrame:
    out = tmp_path / "out"
    r = subprocess.run([sys.executable, "-m", "pytest", *select, "-p", "tests.mutants", "--engine", engine,
                        "--check-base", base, "--check-out", str(out), "-p", "no:cacheprovider", "-q",
                        "--hypothesis-profile=ci"], cwd=ROOT, capture_output=True, text=True, timeout=600,
                       env={**os.environ, "K3NUM_DRIFT": drift})
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    examples = pd.read_csv(out / "examples.csv", keep_default_na=False)
    records = pd.read_csv(out / "records.csv", keep_default_na=False)
    return pairing.outcomes(examples), pairing.paired_drift(records), records


def test_the_mirror_against_itself_pairs_every_example_and_finds_nothing(tmp_path):
    found, drift, records = _paired(tmp_path, "mirror", "engine:mirror", "properties/test_partial_projection.py")
    assert len(found) == 11 and (found["status"] == "same").all() and (found["examples"] >= 40).all()
    assert (drift["drift"] == "same").all() and (drift["worse"] + drift["better"] == 0).all()  # every pair ties
    head, base = records[records["side"] == "head"], records[records["side"] == "base"]
    assert len(head) == len(base) > 0 and head["seed"].tolist() == base["seed"].tolist()  # the same cases
    examples = pd.read_csv(tmp_path / "out" / "examples.csv")
    # the oracle ran once per case: every base pass was answered from its head's (harness/oracle_memo.py)
    assert examples["oracle_computed"].sum() > 0 and examples["oracle_missed"].sum() == 0
    assert (examples["oracle_reused"] == examples["oracle_computed"]).all(), examples.to_string()


def test_a_within_budget_drift_is_flagged_by_the_pairing_and_passes_plainly(tmp_path):
    found, drift, _ = _paired(tmp_path, "mirror", "engine:mirror-pristine", UNSHARDED, drift="unsharded_norm_rounded")
    assert found["status"].tolist() == ["same"]  # every example passes on both sides
    assert drift["drift"].tolist() == ["worse"], drift.to_string()


def test_a_mutant_head_fails_as_new_where_its_base_passes(tmp_path):
    found, _, _ = _paired(tmp_path, "mutant-unsharded_taps_concatenated_token_major", "engine:mirror", UNSHARDED)
    assert found["status"].tolist() == ["new"] and found["new"].iloc[0] > 0 and found["fixed"].iloc[0] == 0


def test_drawn_values_inside_a_body_are_replayed_on_the_base(tmp_path):
    """test_determinism's repeat property draws its case with st.data(): both sides must see it."""
    found, _, records = _paired(
        tmp_path, "mirror", "engine:mirror",
        "properties/test_determinism.py::test_repeated_calls_on_identical_inputs_are_bitwise_identical")
    assert (found["status"] == "same").all() and (found["examples"] > 0).all()
    head, base = records[records["side"] == "head"], records[records["side"] == "base"]
    assert head[["seed", "shape"]].values.tolist() == base[["seed", "shape"]].values.tolist()


# ---- k3num check on the real engines ------------------------------------------------------------


def _check(tmp_path: Path, *args: str) -> tuple[int, str, Path]:
    out = tmp_path / "check"
    r = subprocess.run([sys.executable, "-m", "k3num.harness.cli", "check", *args, "--out", str(out)],
                       cwd=tmp_path, capture_output=True, text=True, timeout=900)
    md = (out / "check.md").read_text() if (out / "check.md").is_file() else ""
    return r.returncode, r.stdout + r.stderr + md, out


def _need(engine: str) -> None:
    if not fetch.verified_manifest(engine):
        pytest.skip(f"{engine} is not fetched (k3num fetch {engine})")


def test_check_of_the_pinned_bytes_reports_nothing_new_and_no_drift_and_names_the_known(tmp_path):
    _need("tokenspeed")
    head = fixes.pinned_tree("tokenspeed", tmp_path / "t")
    # the partial projection's properties: where TokenSpeed's known divergence (K3N-006) lives
    rc, text, out = _check(tmp_path, "--engine", "tokenspeed", "--head", str(head), "-k", "partial_projection")
    assert rc == 0, text
    assert "# k3num check: PASS" in text and "ledger K3N-006" in text
    table = pd.read_csv(out / "check.csv", keep_default_na=False)
    assert (table["new"] == 0).all() and not (table["drift"] == "worse").any()


def test_check_flags_tokenspeeds_within_budget_drift(tmp_path):
    _need("tokenspeed")
    head = fixes.patched_tree(fixes.by_id("split-context-projection"), tmp_path / "t")
    rc, text, _ = _check(tmp_path, "--engine", "tokenspeed", "--head", str(head), "-k", "unsharded")
    assert rc == 1, text
    assert "| `test_unsharded_projection_within_rounding_budget_of_oracle[tokenspeed]` | unsharded_within" in text


def test_check_reports_sglangs_fix_with_the_ledger_entry_to_remove(tmp_path):
    _need("sglang")
    head = fixes.patched_tree(fixes.by_id("K3N-008"), tmp_path / "s")
    rc, text, out = _check(tmp_path, "--engine", "sglang", "--head", str(head), "-k", "off_grid")
    assert rc == 0, text
    assert "fixes ledger entry K3N-008" in text and "remove it" in text
    # the paired run's closing lines name the files where the check keeps them, not its staging folder
    shown = [line for line in text.splitlines() if line.startswith(("drift CSV: ", "next: "))]
    assert shown and not any(".check-run-" in line for line in shown), shown
    csv = next(line for line in shown if line.startswith("drift CSV: ")).split()[2]
    assert Path(csv) == out / "drift.csv" and Path(csv).is_file(), shown


def test_check_reports_a_planted_vllm_bug_as_new_with_repro_bundles(tmp_path):
    _need("vllm")
    head = fixes.patched_tree(fixes.by_id("mixture-scaled"), tmp_path / "v")
    rc, text, out = _check(tmp_path, "--engine", "vllm", "--head", str(head), "-k",
                           "test_attn_res_within_rounding_budget_of_oracle")
    assert rc == 1, text
    new = text.split("## New failures")[1].split("##")[0]
    assert "test_attn_res_within_rounding_budget_of_oracle[vllm]" in new
    assert list((out / "repro").glob("attn_res_within_rounding_budget-vllm-*.safetensors"))
    # the bundle line is a command that runs as printed: it replays the failure on the head (exit 1)
    command = next(line.strip() for line in new.splitlines() if line.strip().startswith("k3num replay "))
    assert str(out / "repro") in command and f"vllm={head}" in command
    k3num = shutil.which("k3num")
    if k3num:
        r = subprocess.run([k3num, *shlex.split(command)[1:]], capture_output=True, text=True, timeout=600)
        assert r.returncode == 1 and "FAIL" in r.stdout + r.stderr, r.stdout + r.stderr
    # the next run into the same folder owns it whole: the pinned bytes pass, and no bundle of the
    # failing run is left beside its result
    rc, text, out = _check(tmp_path, "--engine", "vllm", "--head", str(fixes.pinned_tree("vllm", tmp_path / "p")),
                           "-k", "test_attn_res_within_rounding_budget_of_oracle")
    assert rc == 0 and "# k3num check: PASS" in text, text
    assert not (out / "repro").exists() and not list(out.glob(".check-run-*"))


def test_check_reports_every_layer_given_layer_0s_norm_weight_as_new(tmp_path):
    """vLLM's _build_fused_context_kv_metadata, once replaced by the adapter's own metadata, is bound: a slip
    there (layer 0's kv_a_layernorm weight stacked for every layer) is new (it passed as PASS, 0 new)."""
    _need("vllm")
    head = fixes.patched_tree(fixes.by_id("layer0-norm-weight"), tmp_path / "v")
    rc, text, _ = _check(tmp_path, "--engine", "vllm", "--head", str(head), "-k", "test_fused_context_kv")
    assert rc == 1, text
    assert "test_fused_context_kv" in text.split("## New failures")[1].split("## What")[0]


def test_check_shows_a_changed_contract_as_what_the_head_cannot_run(tmp_path):
    _need("vllm")
    head = fixes.pinned_tree("vllm", tmp_path / "v")
    text = (head / DSPARK_PY).read_text()
    (head / DSPARK_PY).write_text(text.replace("def _precompute_fused_context_kv(", "def _precompute_context_kv("))
    rc, out_text, _ = _check(tmp_path, "--engine", "vllm", "--head", str(head), "-k", "test_fused_context_kv_within")
    assert rc == 1, out_text
    lost = out_text.split("## What the head cannot run")[1].split("##")[0]
    assert f"contract changed: {DSPARK_PY}" in lost


def test_check_refuses_bad_input_before_running(tmp_path, capsys):
    assert cli.main(["check", "--engine", "nope", "--head", str(tmp_path)]) == 2
    assert "valid: vllm, vllm-rocm, tokenspeed, sglang" in capsys.readouterr().err
    assert cli.main(["check", "--engine", "vllm", "--head", str(tmp_path / "missing")]) == 2
    assert "not a directory" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert cli.main(["check", "--engine", "vllm", "--head", str(tmp_path / "empty")]) == 2
    assert "holds none of vllm's bound files" in capsys.readouterr().err
    partial = fixes.pinned_tree("vllm@0.33.0", tmp_path / "partial")  # says 0.33.0, lacks one of its files
    (partial / fetch.release_pin("vllm@0.33.0").files[-1]).unlink()
    assert cli.main(["check", "--engine", "vllm", "--head", str(partial)]) == 2
    assert "says vllm 0.33.0 and lacks 1 of 0.33.0's" in capsys.readouterr().err


def test_check_says_when_its_selection_checked_nothing_and_leaves_the_last_result_as_it_was(tmp_path):
    _need("tokenspeed")
    head = fixes.pinned_tree("tokenspeed", tmp_path / "t")
    last = tmp_path / "check"
    (last / "repro").mkdir(parents=True)
    for name, text in (("check.md", "# k3num check: PASS\n"), ("check.csv", "node\n"), ("repro/b.safetensors", "x")):
        (last / name).write_text(text)
    rc, text, out = _check(tmp_path, "--engine", "tokenspeed", "--head", str(head), "-k", "no_such_property")
    assert rc == 2 and "no property test selected by -k no_such_property" in text
    assert (out / "check.md").read_text() == "# k3num check: PASS\n" and (out / "check.csv").is_file()
    assert (out / "repro" / "b.safetensors").is_file() and not list(out.glob(".check-run-*"))


# ---- two processes: the base replays the head's cases ------------------------------------------


def _sides(tmp_path: Path, head: str, base: str, *select: str) -> tuple[pd.DataFrame, ...]:
    """The two-process form on the mirror: the head's process draws, the base's replays; joined."""
    common = ["-p", "tests.mutants", "-p", "no:cacheprovider", "-q", "--hypothesis-profile=ci"]
    frames = {}
    for side, engine in (("head", head), ("base", base)):
        out = tmp_path / side
        extra = ["--check-replay", str(tmp_path / "head" / "cases.pt")] if side == "base" else []
        r = subprocess.run([sys.executable, "-m", "pytest", *select, *common, "--engine", engine, "--check-side", side,
                            "--check-out", str(out), *extra], cwd=ROOT, capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
        frames[side] = (pd.read_csv(out / "examples.csv", keep_default_na=False),
                        pd.read_csv(out / "records.csv", keep_default_na=False))
    return pairing.join_sides(frames["head"][0], frames["base"][0], frames["head"][1], frames["base"][1])


def test_two_processes_pair_every_case_and_find_what_one_process_finds(tmp_path):
    """A mutant head in its own process against the mirror in another: every head case runs on the base
    (none unpaired), the mutant's test is new with its drift, the other tests are the same. The base's
    process could not be trusted to draw the head's cases itself: hypothesis also draws from the
    constants of the local modules loaded, and the two processes load different engine code."""
    examples, records, unpaired = _sides(tmp_path, "mutant-unsharded_taps_concatenated_token_major", "mirror",
                                         "properties/test_partial_projection.py")
    assert unpaired.empty, unpaired.to_string()
    found, drift = pairing.outcomes(examples), pairing.paired_drift(records)
    status = dict(zip([n.split("::")[1].split("[")[0] for n in found["node"]], found["status"]))
    assert status.pop("test_unsharded_projection_within_rounding_budget_of_oracle") == "new"
    # the mutant carries no fc_norm projection nor segmented norm (engine extras): those skip on the head only
    for name in ("test_segmented_rms_norm_segment_s_is_normed_by_weight_row_s_in_fp32_rounded_once",
                 "test_fc_norm_projection_is_the_projection_of_the_segment_normed_taps"):
        assert status.pop(name) == "head cannot run"
    assert set(status.values()) == {"same"} and len(found) == 11
    assert drift.loc[drift["node"].str.contains("test_unsharded_projection"), "drift"].tolist() == ["worse"]
    both = records[~records["node"].str.contains("segmented_rms_norm|fc_norm_projection")]  # ran on both sides
    head, base = both[both["side"] == "head"], both[both["side"] == "base"]
    assert head[["seed", "shape"]].values.tolist() == base[["seed", "shape"]].values.tolist()
    assert (examples["node"].str.contains("mutant-unsharded")).all()  # the head's node ids are kept


def test_two_processes_replay_values_drawn_inside_a_body(tmp_path):
    examples, records, unpaired = _sides(
        tmp_path, "mirror", "mirror",
        "properties/test_determinism.py::test_repeated_calls_on_identical_inputs_are_bitwise_identical")
    assert unpaired.empty and len(examples) > 0 and (pairing.outcomes(examples)["status"] == "same").all()


def test_check_in_two_processes_agrees_with_one_on_the_pinned_bytes(tmp_path):
    _need("tokenspeed")
    head = fixes.pinned_tree("tokenspeed", tmp_path / "t")
    rc, text, out = _check(tmp_path, "--engine", "tokenspeed", "--head", str(head), "--processes", "2", "-k",
                           "partial_projection")
    assert rc == 0, text
    assert "One process per side (--processes 2)" in text and "ledger K3N-006" in text
    assert pd.read_csv(out / "unpaired.csv").empty and (out / "side-head" / "cases.pt").is_file()


def test_two_processes_are_taken_where_a_side_runs_built_ops(tmp_path, monkeypatch):
    from types import SimpleNamespace

    from k3num.harness import check
    from k3num.supply import cuda_ops

    args = SimpleNamespace(processes="auto", engine="vllm", device="cuda")
    monkeypatch.setattr(cuda_ops, "arch", lambda: "90")
    monkeypatch.setattr(cuda_ops, "sources_of",
                        lambda source: SimpleNamespace(label="0.34.0+local" if source.local else "0.34.0"))
    monkeypatch.setattr(cuda_ops, "library_path", lambda a, src: tmp_path / f"{src.label}.so")
    assert check.two_processes(args, tmp_path, "pinned") == ""  # nothing built: one process
    (tmp_path / "0.34.0.so").write_bytes(b"")
    assert "the base's (0.34.0) compiled ops are built" in check.two_processes(args, tmp_path, "pinned")
    assert check.two_processes(SimpleNamespace(**{**vars(args), "device": None}), tmp_path, "pinned") == ""
    assert check.two_processes(SimpleNamespace(**{**vars(args), "engine": "sglang"}), tmp_path, "pinned") == ""
    assert check.two_processes(SimpleNamespace(**{**vars(args), "processes": "1"}), tmp_path, "pinned") == ""


def test_the_join_reads_a_node_by_its_file_name_and_its_engine_as_one_name():
    """Each process's rootdir sets the folders of its node ids (measured: `k3num/properties/test_x.py`
    in the head's, `test_x.py` in the base's, under --pyargs); the engine parameter differs by design."""
    key = pairing.node_key
    assert key("k3num/properties/test_x.py::t[vllm]", "vllm") == key("test_x.py::t[vllm]", "vllm")
    assert key("test_x.py::t[vllm]", "vllm") == "test_x.py::t[{engine}]"
    assert key("p/test_x.py::t[mutant-a-b-bf16]", "mutant-a-b") == key("test_x.py::t[mirror-bf16]", "mirror")
    assert key("test_x.py::t[vllm-rocm]", "vllm") == "test_x.py::t[{engine}-rocm]"  # a part of a name is a name
    assert key("test_x.py::t[vllm-rocm]", "vllm-rocm") == "test_x.py::t[{engine}]"
    row = {"example": 1, "outcome": "pass", "why": "", "ledger": "", "case": "c"}
    head = pd.DataFrame([{**row, "node": "k3num/properties/test_x.py::t[vllm]", "side": "head", "engine": "vllm"}])
    base = pd.DataFrame([{**row, "node": "test_x.py::t[vllm]", "side": "base", "engine": "vllm"}])
    empty = pd.DataFrame(columns=list(pairing.RECORD_COLUMNS))
    examples, _, unpaired = pairing.join_sides(head, base, empty, empty)
    assert unpaired.empty and examples["node"].tolist() == ["k3num/properties/test_x.py::t[vllm]"]
    examples, _, unpaired = pairing.join_sides(head, base.assign(case="other"), empty, empty)
    assert examples.empty and unpaired["why"].tolist() == ["the sides drew different cases"]
