"""`k3num impact` (harness/impact.py): the per-engine token table, its exit codes, and that it sees a path bug
that changes tokens (a TokenSpeed tree whose unsharded projection returns zeros)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from k3num.harness import fixes
from k3num.supply import fetch

ROOT = Path(__file__).resolve().parents[1]
PROJECTION = "return self.finalize_target_projection(self.context_proj(target_hidden)[0])"


def _impact(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "k3num.harness.cli", "impact", "--cases", "4", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)


def test_impact_refuses_what_it_cannot_run() -> None:
    r = _impact("--engine", "nope")
    assert r.returncode == 2 and "unknown engine(s) nope" in r.stderr
    r = _impact("--engine", "mirror", "--cases", "0")
    assert r.returncode == 2 and "--cases: expected >= 1" in r.stderr


def test_impact_on_the_pinned_release_changes_no_decided_token_and_a_broken_path_does(tmp_path: Path) -> None:
    if fetch.missing_files("tokenspeed"):
        pytest.skip("tokenspeed is not fetched (k3num fetch tokenspeed)")
    pinned = _impact("--engine", "tokenspeed", "--format", "csv")
    assert pinned.returncode == 0, pinned.stdout + pinned.stderr[-2000:]
    assert "tokenspeed,dspark,aux_capture=engine;project_unsharded=engine" in pinned.stdout
    assert ",no token changes" in pinned.stdout and "changes decided" not in pinned.stdout
    tree = fixes.pinned_tree("tokenspeed", tmp_path / "t")
    model = tree / fixes.TOKENSPEED_MODEL
    text = model.read_text()
    assert PROJECTION in text
    model.write_text(text.replace(PROJECTION, PROJECTION.replace("[0])", "[0] * 0.0)")))
    broken = _impact("--engine", "tokenspeed", "--engine-src", f"tokenspeed={tree}")
    assert broken.returncode == 1, broken.stdout + broken.stderr[-2000:]
    assert "changes decided tokens" in broken.stdout


def test_impact_names_the_ledger_entry_that_changes_tokens_and_exits_0_for_it() -> None:
    """vLLM ROCm's aux tap ignores the stream flag (K3N-001): the draft proposes other tokens from its taps. A
    known divergence: the row names it, and the exit is 0."""
    if fetch.missing_files("vllm"):
        pytest.skip("vllm is not fetched (k3num fetch vllm)")
    r = _impact("--engine", "vllm-rocm", "--format", "csv")
    assert r.returncode == 0, r.stdout + r.stderr[-2000:]
    rows = [line for line in r.stdout.splitlines() if line.startswith("vllm-rocm,")]
    assert rows and all(",K3N-001," in row and row.endswith(",changes decided tokens") for row in rows), r.stdout


def test_impact_ledger_gives_every_entry_a_severity_or_the_reason_the_step_does_not_reach_it() -> None:
    """`k3num impact --ledger`: every ledger entry has a row; an entry the step reaches is run through it with its
    case class, and its control (the same inputs through the path that is not in the entry: one projection GEMM
    for K3N-006, whole 128-row blocks for K3N-011, one attention TP on both sides of K3N-013's transfer) changes
    no decided token, so the case row's flips are the entry's. K3N-003's control is the same stage-end call
    through another engine's tap (TokenSpeed's, which mixes there); K3N-009/010's the same kernel call over a
    bank sized right; K3N-008's SGLang's model aggregation at hidden 1024, where its fused path writes every
    element. K3N-001, filed on the token property,
    changes decided tokens in both drafters; so does K3N-013's transfer, whose decode reads other bytes than
    the prefill wrote."""
    if any(fetch.missing_files(e) for e in ("vllm", "tokenspeed", "sglang")):
        pytest.skip("vllm, tokenspeed and sglang are not fetched (k3num fetch)")
    from k3num.harness import impact
    from k3num.oracles import ledger

    table = impact.ledger_table(2, 0, "cpu", {}, "auto")
    assert set(table["entry"]) == {d.id for d in ledger.LEDGER}
    unrun = table[table["positions"].isna()]
    # on the CPU: the races need a GPU, the FP8 case vLLM's built ops
    assert dict(zip(unrun["entry"], unrun["severity"])) == {
        **{e: impact.NO_RACE_ON_CPU for e in impact.races()}, "K3N-014": impact.NO_OPS}, unrun.to_string()
    run = table[table["positions"].notna()]
    assert set(run["entry"]) == {d.id for d in ledger.LEDGER} - set(impact.races()) - {"K3N-014"}
    controls = run[run["role"] == "control"]
    assert set(controls["entry"]) == {"K3N-003", "K3N-006", "K3N-008", "K3N-009", "K3N-010", "K3N-011", "K3N-013"}
    assert (controls["diverged"] == 0).all() and (controls["worst_err_over_delta"] < 1).all(), controls.to_string()
    k001 = run[run["entry"] == "K3N-001"]
    assert sorted(k001["drafter"]) == ["dflash", "dspark"] and (k001["severity"] == impact.CHANGES).all()
    k013 = run[(run["entry"] == "K3N-013") & (run["role"] == "case")]
    assert list(k013["drafter"]) == ["dflash"] and (k013["severity"] == impact.CHANGES).all(), k013.to_string()
    assert "transfer P TP4 -> D TP8" in k013["paths"].iloc[0]
    k003 = run[run["entry"] == "K3N-003"]
    assert set(zip(k003["role"], k003["engine"])) == {("case", "vllm-rocm"), ("control", "tokenspeed")}
    assert (k003["paths"].str.contains("at a non-final stage's end")).all(), k003.to_string()
    for entry in ("K3N-003", "K3N-006", "K3N-008", "K3N-009", "K3N-010", "K3N-011"):
        rows = run[run["entry"] == entry]
        worst = rows.groupby("role")["worst_err_over_delta"].max()
        assert worst["case"] > 1 > worst["control"], rows.to_string()


def test_impact_ledger_refuses_an_engine_and_an_unknown_entry() -> None:
    r = _impact("--ledger", "--engine", "vllm")
    assert r.returncode == 2 and "--ledger runs each entry on its own engine" in r.stderr
    from k3num.harness import impact

    with pytest.raises(ValueError, match="no ledger entry K3N-999"):
        impact.ledger_table(1, 0, "cpu", {}, "auto", entries=["K3N-999"])
    r = _impact("--ledger", "--entry", "K3N-001,K3N-999")
    assert r.returncode == 2 and "--entry: no ledger entry K3N-999" in r.stderr
    r = _impact("--entry", "K3N-001")
    assert r.returncode == 2 and "--entry names ledger entries: give --ledger" in r.stderr


def test_the_k3_geometry_cases_are_the_presets_and_the_option_refuses_what_brings_its_own_cases() -> None:
    from k3num.harness import impact
    from k3num.refmodel.draft_step import STEP_PRESETS

    for kind in ("dspark", "dflash"):
        cases = impact.preset_cases(kind, 3, seed=0)
        assert len({c.seed for c in cases}) == 3 and cases == impact.preset_cases(kind, 3, seed=0)
        g, want = cases[0].geometry(), STEP_PRESETS[f"k3-{kind}-step"]
        assert (g.hidden, g.num_layers, g.block, g.num_heads, g.head_dim, g.num_kv_heads, g.kv_lora_rank,
                g.rope.rotary_dim, g.mlp_width, g.vocab, g.window) == (
            want.hidden, want.num_layers, want.block, want.num_heads, want.head_dim, want.num_kv_heads,
            want.kv_lora_rank, want.rope.rotary_dim, want.mlp_width, want.vocab, want.window)
        assert cases[0].tokens == impact.K3_TOKENS and cases[0].taps == want.num_layers
    r = _impact("--geometry", "k3", "--ledger")
    assert r.returncode == 2 and "--geometry k3 draws its cases at the presets' geometry" in r.stderr
    r = _impact("--geometry", "k4")
    assert r.returncode == 2 and "invalid choice: 'k4'" in r.stderr


def test_the_impact_tables_legend_names_every_column_and_the_exit_rule_and_each_entry(monkeypatch):
    """issue 41: the legend left out decided_share, block, worst_err_over_delta and role; --ledger rows had no
    line saying what each entry is; the entries ran K3N-012 before K3N-010."""
    import argparse

    import pandas as pd

    from k3num.harness import impact as imp

    table = pd.DataFrame([{"entry": "K3N-010", "role": "case"}, {"entry": "K3N-001", "role": "control"}])
    text = imp._markdown(table, argparse.Namespace(ledger=True, cases=1, seed=0), imp.LEDGER_COLUMNS)
    legend = text.split("| entry")[0]
    for word in ("decided_share", "block", "worst_err_over_delta", "q99_err_over_delta", "predicted_flips", "role",
                 "outside the ledger"):
        assert word in legend, word
    assert "- K3N-001: " in legend and "- K3N-010: same as K3N-009" in legend
    order: list[str] = []
    monkeypatch.setattr(imp, "_entry_rows", lambda d, *a, **k: order.append(d.id))
    imp.ledger_table(1, 0, "cpu", {}, "auto")
    assert order == sorted(order) and order.index("K3N-010") < order.index("K3N-012")


def test_a_drift_past_half_delta_is_told_from_noise_though_no_decided_token_flips() -> None:
    """The mirror's DSpark context KV scaled by 1.03 (about 8 bf16 units, far outside the tensor budget) flips no
    decided token in 6 blocks, as the untouched mirror does not; its logit error reaches the margins of
    decided positions (exposed_share > 0) and its severity says so, where the untouched mirror's (within delta/2
    everywhere) exposes none. Before, both rows read "near-ties only". (With the step's widths that are not powers
    of two, 1.05 flips one decided token of these 6 blocks: a drift past that one is no longer the case stated.)"""
    from k3num.engines import base, registry
    from k3num.harness import draft_step, impact

    mirror = registry.get("mirror")
    fused = mirror.subject(base.CONTEXT_KV_FUSED)

    def scaled(*args, **kwargs):
        out = fused(*args, **kwargs)
        return ((out[0].float() * 1.03).to(out[0].dtype), *out[1:])

    cases = impact.sample_cases("dspark", 6, 0)
    rows = {label: impact._aggregate("mirror", "dspark", [draft_step.run(mirror, mirror, "dspark", c, "cpu",
                                                                         subjects=subs) for c in cases])
            for label, subs in (("pinned", None), ("scaled", {base.CONTEXT_KV_FUSED: (scaled, "kv_c x 1.03")}))}
    assert rows["pinned"]["exposed_share"] == 0 and rows["pinned"]["severity"] != impact.EXPOSED, rows["pinned"]
    assert rows["scaled"]["diverged"] == 0 and rows["scaled"]["worst_err_over_delta"] > 1, rows["scaled"]
    assert rows["scaled"]["exposed_share"] > 0 and rows["scaled"]["severity"] == impact.EXPOSED, rows["scaled"]


def test_exposed_counts_the_decided_positions_within_twice_the_logit_error():
    """Gaps of 0.5, 1.5 and 3 delta: an error of 0.4 delta exposes none (the noise floor's reach), 0.8 delta the
    1.5-delta position, 2 delta both decided positions; a near-tie is never counted."""
    import torch

    from k3num.harness import impact
    from k3num.oracles import tokens

    oracle = torch.tensor([[0.5, 0.0, -9.0], [1.5, 0.0, -9.0], [3.0, 0.0, -9.0]], dtype=torch.float64)
    for err, want in ((0.4, 0), (0.8, 1), (2.0, 2)):
        subject = oracle.clone()
        subject[:, 2] += err  # a logit error of `err` where it flips nothing
        v = tokens.judge_block(subject, oracle, 1.0)
        assert v.exposed == want and v.count(tokens.DIVERGED) == 0, (err, v)
    assert impact.severity(0, 0, 1) == impact.EXPOSED and impact.severity(1, 0, 1) == impact.CHANGES
    assert impact.severity(0, 2, 0) == impact.NEAR_TIES and impact.severity(0, 0, 0) == impact.NONE


def test_every_ledger_entry_names_its_token_case_class_and_impact_reads_no_entry_id() -> None:
    """The entries' case classes are read from their records (oracles/ledger.py `token_case`, harness/token_cases.py
    CASES): impact.py and token_cases.py name no entry id, and every record's name is a case class, a race's a
    race's, or the entry says why the step cannot reach it."""
    import re

    from k3num.harness import token_cases
    from k3num.oracles import ledger

    for rel in ("harness/impact.py", "harness/token_cases.py"):
        ids = sorted(set(re.findall(r"K3N-\d{3}", (ROOT / rel).read_text())))
        assert not ids, f"{rel} names ledger entries {ids}: an entry's facts belong in its record"
    assert token_cases.problems(ledger.LEDGER) == []


def test_a_record_with_an_unknown_or_mismatched_case_class_is_refused_naming_it() -> None:
    import dataclasses

    from k3num.harness import token_cases
    from k3num.oracles import ledger

    d = ledger.LEDGER[0]
    bad = [dataclasses.replace(d, id="X-1", token_case="no_such_case"),
           dataclasses.replace(d, id="X-2", token_case=""),
           dataclasses.replace(d, id="X-3", token_case="race_written_in_the_mix"),  # not a race
           dataclasses.replace(d, id="X-4", token_case="", token_why="a test of the reason")]
    found = token_cases.problems(bad)
    assert [p.split(":")[0] for p in found] == ["X-1", "X-2", "X-3"], found
    assert "no_such_case" in found[0] and "token_why" in found[1] and "race" in found[2]
    with pytest.raises(ValueError, match="X-1: token_case 'no_such_case'"):
        token_cases.plan(token_cases.Ctx(bad[0], None, None, "cpu", {}, "auto", None))
    unrun = token_cases.plan(token_cases.Ctx(bad[3], None, None, "cpu", {}, "auto", None))
    assert not unrun.steps and unrun.rows[0]["severity"] == token_cases.NOT_THE_STEP + "a test of the reason"


def test_every_bound_subject_is_in_the_step_or_listed_with_why_it_is_not() -> None:
    """No subject an engine binds is silently absent from the draft step: `reach` places each one, and a bound
    subject neither in the step's paths nor excused by its record (`not_in_step`) is refused naming it."""
    import dataclasses

    from k3num.engines import registry
    from k3num.harness import draft_step
    from k3num.harness import impact as imp

    for name in registry.defaults():
        try:
            engine = registry.get(name)
        except registry.EngineUnavailable:
            continue
        placed = draft_step.reach(engine)
        assert set(placed) == set(engine.subjects), name
        assert all(v.startswith(("in the step: ", "not in the step: ", "the fused path")) for v in placed.values())
    vllm = registry.get("vllm")
    assert draft_step.reach(vllm)["attn_res"].startswith("in the step: dspark, dflash, inside the engine's aux tap")
    planted = dataclasses.replace(vllm, subjects={**vllm.subjects, "a_new_subject": lambda *a: None})
    with pytest.raises(KeyError, match="a_new_subject is bound but neither"):
        draft_step.reach(planted)
    from k3num.engines import base

    in_paths = {n for names in draft_step.PATHS.values() for n in names}
    assert set(base.SUBJECTS) <= in_paths | set(draft_step.NOT_IN_THE_STEP) | {base.CONTEXT_KV_UNFUSED}
    text = imp.reach_lines(["sglang"], {})
    assert "- sglang: attn_res_mix_eager: the eager reference" in text and "sglang: attn_res_mix:" not in text
    # SGLang's mixture and TokenSpeed's PP sum reach the step through the composed rows (draft_step.VARIANTS)
    sglang, tokenspeed = (registry.get(n) for n in ("sglang", "tokenspeed"))
    for engine, names, variant in ((sglang, ("attn_res_mix", "attn_res_mix_triton"), "mixture tap"),
                                   (tokenspeed, ("stage_partial", "finalize_projection"), "pp sum")):
        for n in names:
            assert draft_step.reach(engine)[n] == (f"in the step: dspark, dflash, in the `{variant}` rows (composed "
                                                   "with the mirror's other paths)"), n


def test_impact_files_a_rows_flips_to_an_entry_only_where_its_model_explains_them(monkeypatch) -> None:
    """A row's flips are K3N-001's only where K3N-001's bug model (the tap returns the prefix) explains the calls the
    row's step made: a ROCm tap that returns 1.03 x what it returns now is inside the entry's region (every case)
    but not its bug, so its rows stay unlabelled (and the command exits 1); the pinned tap's rows name it."""
    if fetch.missing_files("vllm"):
        pytest.skip("vllm is not fetched (k3num fetch vllm)")
    import dataclasses

    from k3num.engines import base, registry
    from k3num.harness import impact

    real_get = registry.get
    pinned = real_get("vllm-rocm")
    tap = pinned.subjects[base.AUX_CAPTURE]

    def scaled(*args, **kwargs):
        out = tap(*args, **kwargs)
        return (out.float() * 1.03).to(out.dtype)

    broken = dataclasses.replace(pinned, subjects={**pinned.subjects, base.AUX_CAPTURE: scaled})
    plain = impact.engine_table(["vllm-rocm"], {}, "auto", "cpu", 2, 0)
    assert set(plain.loc[plain["engine"] == "vllm-rocm", "ledger"]) == {"K3N-001"}, plain
    monkeypatch.setattr(registry, "get",
                        lambda name, *a, **k: broken if name == "vllm-rocm" else real_get(name, *a, **k))
    table = impact.engine_table(["vllm-rocm"], {}, "auto", "cpu", 2, 0)
    rows = table[table["engine"] == "vllm-rocm"]
    assert len(rows) and set(rows["ledger"]) == {""}, rows
