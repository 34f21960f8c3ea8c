"""Known means the same bug (issue 37): each ledger entry's reproducer reproduces only with its own signature
and bug model, a failure inside an entry's region that its model does not explain is new, and `k3num check`
judges a head that edits an entry's files instead of aborting."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from k3num.engines import base, registry
from k3num.fixtures.strategies import DELTA_OVER_FOUR_SOURCES
from k3num.harness import fixes, judges, ledger_cases, ledger_models
from k3num.oracles import ledger, pairing
from k3num.properties import test_ledger_reproducers as reproducers
from k3num.supply import fetch

ROOT = Path(__file__).resolve().parents[1]


def test_every_entry_has_a_signature_and_a_bug_model_or_the_reason_it_has_none():
    """The ledger's records are complete: a reproducer signature for every entry, and a bug model
    (harness/ledger_models.py) or a stated reason for having none (ledger_cases.CASES' no_model)."""
    assert ledger_cases.incomplete(ledger.LEDGER) == []
    for d in ledger.LEDGER:
        assert bool(ledger_cases.CASES[d.id].no_model) != (d.id in ledger_models.MODELS), d.id


def test_an_entry_without_a_model_or_a_reason_is_named():
    bare = dataclasses.replace(ledger.by_id("K3N-003"), id="K3N-999")
    cases = {**ledger_cases.CASES, "K3N-999": dataclasses.replace(ledger_cases.CASES["K3N-003"], no_model="")}
    assert ledger_cases.incomplete([bare], cases) == ["K3N-999: no bug model and no reason for none (no_model)"]
    unsigned = {**cases, "K3N-999": dataclasses.replace(cases["K3N-999"], no_model="x", signature="")}
    assert ledger_cases.incomplete([bare], unsigned) == ["K3N-999: no reproducer signature"]
    assert ledger_cases.incomplete([bare], {}) == ["K3N-999: no case rule (its module in harness/ledger_entries)"]


# ---- the models themselves, on planted roundings of known size ----------------------------------------


def _bf(x):
    return x.to(torch.bfloat16)


def test_the_prefix_model_explains_the_prefix_and_rejects_a_mixture():
    g = torch.Generator().manual_seed(0)
    ps, pd = _bf(torch.randn(3, 16, generator=g)), _bf(torch.randn(3, 16, generator=g))
    call = lambda out: ledger_models.Call(base.AUX_CAPTURE, (0, ps, pd, None), {}, out)  # noqa: E731
    assert ledger_models.tap_returns_the_prefix([call(ps + pd)]) == ""
    mixed = _bf(0.6 * ps.float() + 0.4 * pd.float())
    assert "outside the model" in ledger_models.tap_returns_the_prefix([call(mixed)])


def test_the_prefix_model_refuses_two_near_misses_of_the_prefix():
    """Two planted near misses of K3N-001/002's shape (the tap returns a prefix, not the mixture): the prefix sum
    without its pending addend, and the right prefix with one element moved by two bf16 ulps. Neither is the
    bug's arithmetic, so neither is explained."""
    g = torch.Generator().manual_seed(1)
    ps, pd = _bf(torch.randn(3, 16, generator=g)), _bf(torch.randn(3, 16, generator=g))
    call = lambda out: ledger_models.Call(base.AUX_CAPTURE, (0, ps, pd, None), {}, out)  # noqa: E731
    moved = ps + pd
    moved[1, 5] = _bf(moved[1, 5].double() + 2 * ledger_models._ulp_bf16(moved[1, 5].double()))
    for near in (ps.clone(), moved):
        assert "outside the model" in ledger_models.tap_returns_the_prefix([call(near)])


@pytest.mark.parametrize("seed", range(2))
def test_k3n_006s_model_refuses_the_correct_sum_and_one_rounding_more_at_the_end(seed: int):
    """Two planted near misses of K3N-006's shape (a stage partial of the right taps and weight): the correct
    arithmetic (the taps' projections summed in float32 with no rounding per tap) and TokenSpeed's arithmetic
    with the finished sum rounded to bf16 once more. Neither is the bug's, so neither is explained."""
    g = torch.Generator().manual_seed(seed)
    taps, fc = _bf(torch.randn(4, 8, 64, generator=g)), _bf(torch.randn(32, 4 * 64, generator=g) * 0.1)
    members = [0, 1, 2, 3]
    h = taps.shape[-1]
    exact = sum(taps[i].double() @ fc[:, i * h:(i + 1) * h].double().T for i in members).float()
    rounded_at_the_end = _stage(taps, fc, members, False).bfloat16().float()
    for near in (exact, rounded_at_the_end):
        c = ledger_models.Call(base.STAGE_PARTIAL, (taps, fc, members), {}, near)
        assert "the stage partial of taps [0, 1, 2, 3]" in ledger_models.tap_projections_rounded_to_bf16([c])


def _stage(taps, fc, members, round_running_sum: bool):
    h = taps.shape[-1]
    acc = torch.zeros(taps.shape[1], fc.shape[0])
    for i in members:
        acc += torch.nn.functional.linear(taps[i], fc[:, i * h:(i + 1) * h]).float()
        if round_running_sum:
            acc = acc.bfloat16().float()
    return acc


@pytest.mark.parametrize("seed", range(4))
def test_k3n_006s_model_explains_its_roundings_and_rejects_one_more_per_tap(seed: int):
    """K3N-006's model (sum_i bf16(h_i W_i^T) in float32) explains TokenSpeed's own arithmetic bit for bit on
    random inputs, and rejects the planted bf16 rounding of the running sum after every tap."""
    g = torch.Generator().manual_seed(seed)
    taps, fc = _bf(torch.randn(4, 8, 64, generator=g)), _bf(torch.randn(32, 4 * 64, generator=g) * 0.1)
    members = [0, 1, 2, 3]
    ok = ledger_models.Call(base.STAGE_PARTIAL, (taps, fc, members), {}, _stage(taps, fc, members, False))
    bad = ledger_models.Call(base.STAGE_PARTIAL, (taps, fc, members), {}, _stage(taps, fc, members, True))
    assert ledger_models.tap_projections_rounded_to_bf16([ok]) == ""
    assert "the stage partial of taps [0, 1, 2, 3]" in ledger_models.tap_projections_rounded_to_bf16([bad])


@pytest.mark.parametrize("seed", range(3))
def test_k3n_006s_model_judges_every_stage_of_a_split_at_once_and_still_names_the_one_rounded_more(seed: int):
    """The PP stages of one projection share their taps and weight, so the model judges them together (one
    batched projection); a split whose stages are all TokenSpeed's arithmetic is explained, and a split where
    one stage (the middle one) rounds its running sum per tap is not, naming that stage's taps. Stages whose
    taps differ (no shared projection) are judged one by one, with the same verdicts."""
    g = torch.Generator().manual_seed(seed)
    taps, fc = _bf(torch.randn(5, 8, 64, generator=g)), _bf(torch.randn(32, 5 * 64, generator=g) * 0.1)
    split = [[0, 1], [2, 3], [4]]

    def calls(planted: int, shared: bool) -> list:
        out = []
        for j, m in enumerate(split):
            t = taps.clone() if shared else taps + 0  # a clone either way; `shared` keeps the values equal
            if not shared and j:
                t[m] = _bf(torch.randn(len(m), 8, 64, generator=g))  # another stage's own taps
            out.append(ledger_models.Call(base.STAGE_PARTIAL, (t, fc.clone(), m), {}, _stage(t, fc, m, j == planted)))
        return out

    for shared in (True, False):
        assert ledger_models.tap_projections_rounded_to_bf16(calls(-1, shared)) == ""
        assert "the stage partial of taps [2, 3]" in ledger_models.tap_projections_rounded_to_bf16(calls(1, shared))
    assert ledger_models._stage_partials_at_once(calls(-1, True))
    assert not ledger_models._stage_partials_at_once(calls(-1, False))  # different taps: judged call by call


# ---- the reproducers' signatures ----------------------------------------------------------------------


def _engine(name: str):
    try:
        return registry.get(name, {}, "source")
    except registry.EngineUnavailable as e:
        pytest.skip(f"{name} unavailable: {e}")


def test_a_reproducer_reproduces_only_with_its_signature_and_an_adapter_breakage_is_named():
    engine = _engine("tokenspeed")
    got, why = reproducers.attempt("K3N-006", engine)
    assert got == reproducers.REPRODUCED, why

    def broken(*args, **kwargs):
        raise TypeError("finalize() got an unexpected keyword argument 'order'")

    engine2 = dataclasses.replace(engine, subjects={**engine.subjects, base.FINALIZE_PROJECTION: broken})
    got, why = reproducers.attempt("K3N-006", engine2)
    assert got == reproducers.OTHER and "TypeError: finalize() got an unexpected keyword" in why, why


def test_a_reproducer_whose_failure_its_model_rejects_is_not_reproduced(tmp_path):
    """The planted accumulator rounding fails K3N-006's reproducer case too; where it does not, the model
    still has to explain the calls (here: it is judged on the calls the reproducer made)."""
    if not fetch.verified_manifest("tokenspeed"):
        pytest.skip("tokenspeed is not fetched")
    tree = fixes.patched_tree(fixes.by_id("accumulator-bf16"), tmp_path / "t")
    engine = registry.get("tokenspeed", {"tokenspeed": tree}, "source")
    got, why = reproducers.attempt("K3N-006", engine)
    # the reproducer's one stage of two cancelling taps rounds to the same bf16 either way: reproduced, or
    # (if a rounding differs) rejected by the model, never reported as the entry's bug with another cause
    assert got in (reproducers.REPRODUCED, reproducers.OTHER), why
    if got == reproducers.OTHER:
        assert "not K3N-006's bug" in why


# ---- k3num check around a known bug -------------------------------------------------------------------


def _check(tmp_path: Path, *args: str) -> tuple[int, str]:
    out = tmp_path / "check"
    r = subprocess.run([sys.executable, "-m", "k3num.harness.cli", "check", *args, "--out", str(out)], cwd=tmp_path,
                       capture_output=True, text=True, timeout=900)
    md = (out / "check.md").read_text() if (out / "check.md").is_file() else ""
    return r.returncode, r.stderr[-3000:] + md


def _need(engine: str) -> None:
    if not fetch.verified_manifest(engine):
        pytest.skip(f"{engine} is not fetched (k3num fetch {engine})")


def test_check_judges_a_comment_in_a_ledger_entrys_file_instead_of_aborting(tmp_path):
    """A head that edits K3N-009's file (a comment) is judged: its reproducer runs on both sides and still
    reproduces (known), exit 0; it used to abort the run (exit 2)."""
    _need("vllm")
    head = fixes.patched_tree(fixes.by_id("attn-res-control"), tmp_path / "v")
    rc, text = _check(tmp_path, "--engine", "vllm", "--head", str(head), "-k", "bank_indices or K3N-009")
    assert rc == 0, text
    known = text.split("## Known")[1]
    assert "test_each_ledger_reproducer_still_fails_on_the_pinned_release[K3N-009]" in known


def test_check_reports_a_planted_bug_in_a_ledger_entrys_file_as_new(tmp_path):
    _need("vllm")
    head = fixes.patched_tree(fixes.by_id("mixture-scaled"), tmp_path / "v")
    rc, text = _check(tmp_path, "--engine", "vllm", "--head", str(head), "-k",
                      "test_attn_res_within_rounding_budget_of_oracle or K3N-009")
    assert rc == 1, text
    assert "test_attn_res_within_rounding_budget_of_oracle[vllm]" in text.split("## New failures")[1].split("##")[0]


def test_check_reports_the_planted_accumulator_rounding_as_new_not_as_k3n_006(tmp_path):
    """TokenSpeed's running sum rounded to bf16 after every tap, inside K3N-006's file and test: the entry's
    model (its roundings and no other) rejects it, so it is new although the base fails the test too; the
    control (a comment in the same file) is nothing new."""
    _need("tokenspeed")
    head = fixes.patched_tree(fixes.by_id("accumulator-bf16"), tmp_path / "t")
    rc, text = _check(tmp_path, "--engine", "tokenspeed", "--head", str(head), "-k", "taps_cancel or K3N-006")
    assert rc == 1, text
    new = text.split("## New failures")[1].split("## What")[0]
    assert "test_sharded_adds_no_rounding_beyond_its_partials_when_taps_cancel[tokenspeed-fp32]" in new
    assert pairing.UNEXPLAINED in new and "not K3N-006's bug" in new
    control = fixes.patched_tree(fixes.by_id("accumulator-control"), tmp_path / "c")
    rc, text = _check(tmp_path / "c", "--engine", "tokenspeed", "--head", str(control), "-k", "taps_cancel or K3N-006")
    assert rc == 0, text


def _rocm_call(engine, hidden: int, seed: int, out_edit=None) -> ledger_models.Call:
    from k3num.fixtures.builders import attn_res_inputs
    from k3num.fixtures.strategies import AttnResCase
    from k3num.harness import ledger_run

    case = AttnResCase(tokens=3, hidden=hidden, bank=4, num_blocks=4, block_write_idx=-1, with_delta=True,
                       with_output_norm=True, seed=seed, scale=1.0, outliers=30.0)
    inp = attn_res_inputs(case, torch.bfloat16, "cpu")
    recorded: list[ledger_models.Call] = []
    watched = ledger_run.record_calls(engine, (base.ATTN_RES,), recorded)
    watched.subjects[base.ATTN_RES](inp.prefix, inp.delta, inp.blocks, inp.norm, inp.qk, inp.out_norm, 4, -1, 1e-5,
                                    1e-5)
    c = recorded[0]
    return dataclasses.replace(c, out=out_edit(c) if out_edit else c.out)


def _raced(c: ledger_models.Call, *segments: int, per_row: dict[int, tuple[int, ...]] | None = None) -> torch.Tensor:
    """What K3N-007's race returns: the call's own oracle with these prefix segments given the delta twice
    (in every row, or in row r the segments per_row[r])."""
    from k3num.harness import judges

    a = ledger_models._attn_res_args(c)
    p = judges.round_storage(c.engine, a["prefix"].float() + a["delta"].float())
    twice = judges.round_storage(c.engine, p.float() + a["delta"].float())
    rows = per_row or {r: segments for r in range(p.shape[0])}
    for r, segs in rows.items():
        for segment in segs:
            sl = slice(segment * ledger_models.SEGMENT, (segment + 1) * ledger_models.SEGMENT)
            p[r, sl] = twice[r, sl]
    want, _ = judges.attn_res_oracle(c.engine, p, None, a["blocks"], a["norm_weight"], a["qk_weight"],
                                     a["output_norm_weight"], 4, -1)
    return want.to(torch.bfloat16)


@pytest.mark.parametrize("hidden", [128, 96])
def test_k3n_007s_model_explains_the_kernel_and_its_race_and_rejects_a_padded_width_norm(hidden: int, tmp_path):
    """On ROCm's own kernel (the interpreter cannot race): its honest output is explained, an output with one
    segment's delta applied twice (what the race returns on the GPU) is explained, and three segments' (GPU run 80,
    7 blocks), and the planted score norm
    over BLOCK_D (harness/fixes.py rocm-score-norm-block-d, at a hidden size that is not a power of two) is not."""
    engine = _engine("vllm-rocm")
    honest = _rocm_call(engine, hidden, 3)
    # a correct output alone is not the race: at least one row must be raced (a repeat property's calls: the
    # honest ones beside a raced one are)
    assert "no output shows the race" in ledger_models.delta_applied_twice([honest])
    assert ledger_models.delta_applied_twice([honest, _rocm_call(engine, hidden, 3, lambda c: _raced(c, 1))]) == ""
    assert ledger_models.delta_applied_twice([_rocm_call(engine, hidden, 3, lambda c: _raced(c, 1))]) == ""
    assert ledger_models.delta_applied_twice([_rocm_call(engine, hidden, 3, lambda c: _raced(c, 0, 1, 2))]) == ""
    scaled = _rocm_call(engine, hidden, 3, lambda c: (c.out.float() * 1.02).to(torch.bfloat16))
    assert "every delta-twice variant" in ledger_models.delta_applied_twice([scaled])
    if hidden & (hidden - 1):  # BLOCK_D != hidden only where hidden is not a power of two
        tree = fixes.patched_tree(fixes.by_id("rocm-score-norm-block-d"), tmp_path / "v")
        planted = registry.get("vllm-rocm", {"vllm": tree}, "source")
        assert "every delta-twice variant" in ledger_models.delta_applied_twice([_rocm_call(planted, hidden, 3)])


@pytest.mark.parametrize("hidden", [1024, 896])
def test_k3n_007s_model_finds_any_raced_set_beyond_the_exhaustive_width(hidden: int, tmp_path):
    """Beyond EVERY_SUBSET segments (K3's hidden 7168 has 224) the model searches for the raced set instead of
    trying every one: five segments raced in every row, and a different set in each row, are explained; a 2%
    scale and the planted score norm over BLOCK_D are not (GPU run 81: at hidden 7168 the old model took at
    most one segment, and a raced output it refused failed the repeat property as new)."""
    engine = _engine("vllm-rocm")
    assert -(-hidden // ledger_models.SEGMENT) > ledger_models.EVERY_SUBSET
    assert "no output shows the race" in ledger_models.delta_applied_twice([_rocm_call(engine, hidden, 5)])
    five = _rocm_call(engine, hidden, 5, lambda c: _raced(c, 0, 5, 6, 17, hidden // 32 - 1))
    assert ledger_models.delta_applied_twice([five]) == ""
    rows = _rocm_call(engine, hidden, 5, lambda c: _raced(c, per_row={0: (3,), 1: (), 2: (1, 2, 20, 21, 22, 23)}))
    assert ledger_models.delta_applied_twice([rows]) == ""
    scaled = _rocm_call(engine, hidden, 5, lambda c: (_raced(c, 4, 9).float() * 1.02).to(torch.bfloat16))
    assert "every delta-twice variant" in ledger_models.delta_applied_twice([scaled])
    if hidden & (hidden - 1):
        tree = fixes.patched_tree(fixes.by_id("rocm-score-norm-block-d"), tmp_path / "v")
        planted = registry.get("vllm-rocm", {"vllm": tree}, "source")
        assert "every delta-twice variant" in ledger_models.delta_applied_twice([_rocm_call(planted, hidden, 5)])


def _moved(c: ledger_models.Call, ulps: int = 2, count: int = 3) -> torch.Tensor:
    """The call's output with its first `count` elements moved up by `ulps` bf16 ulps (a near miss: a kernel that
    is off by a little on some calls, as no raced read is)."""
    out = c.out.clone()
    flat = out.view(-1)
    bits = flat[:count].view(torch.int16)
    flat[:count] = (bits + torch.where(flat[:count] >= 0, ulps, -ulps).to(torch.int16)).view(torch.bfloat16)
    return out


@pytest.mark.parametrize("hidden", [128, 1024])
def test_k3n_007s_model_refuses_a_correct_output_and_a_near_miss_of_its_shape(hidden: int) -> None:
    """A kernel that moves 3 elements by 2 bf16 ulps on every second call fails the repeat property (two distinct
    outputs) inside K3N-007's region; neither output is a raced read, so the model refuses both calls together,
    as it refuses the correct output alone. Two outputs that differ only after their first 4096 bytes are each
    judged (no output is skipped by a partial fingerprint)."""
    engine = _engine("vllm-rocm")
    honest = _rocm_call(engine, hidden, 3 if hidden <= 256 else 5)
    near = dataclasses.replace(honest, out=_moved(honest))
    assert not torch.equal(near.out, honest.out)
    assert ledger_models.delta_applied_twice([honest, near, honest, near]) != ""  # refused, whatever the reason
    raced = dataclasses.replace(honest, out=_raced(honest, 1))
    late = raced.out.clone()
    late.view(-1)[-3:] += 4.0  # past the first 4096 bytes at hidden 1024 (3 rows of 2048 bytes)
    assert "every delta-twice variant" in ledger_models.delta_applied_twice(
        [raced, dataclasses.replace(raced, out=late)])


def _batch_probe(edit_second_call):
    """The batch-composition property's body on ROCm's kernel (the interpreter) with its second call's output
    edited by `edit_second_call(call)`, run under K3N-007 as the plugin files it: (the known entries counted, the
    failures kept to fail the test after hypothesis ends)."""
    from k3num.fixtures.strategies import AttnResCase
    from k3num.harness import ledger_run
    from k3num.oracles.drift import COLLECTOR
    from k3num.properties import test_batch_composition as batch

    engine = _engine("vllm-rocm")
    real = engine.subject(base.ATTN_RES)
    n = {"calls": 0}

    def second_edited(*args, **kwargs):
        before = tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in args)
        out = real(*args, **kwargs)
        n["calls"] += 1
        if n["calls"] != 2:
            return out
        return edit_second_call(ledger_models.Call(base.ATTN_RES, before, dict(kwargs), out, engine))

    edited = dataclasses.replace(engine, subjects={**engine.subjects, base.ATTN_RES: second_edited})
    body = ledger_run.ledgered(batch.test_attn_res_row_alone_is_the_row_in_its_batch_and_at_another_position_bitwise
                               .hypothesis.inner_test)
    body._k3num_entries["vllm-rocm"] = [ledger.by_id("K3N-007")]
    case = AttnResCase(tokens=3, hidden=128, bank=4, num_blocks=4, block_write_idx=-1, with_delta=True,
                       with_output_norm=True, seed=0, scale=1.0, outliers=30.0)
    deferred: list[str] = []  # a race's failure its model rejects is kept until hypothesis ends (ledger_run)
    token = ledger_run._DEFERRED.set(deferred)
    COLLECTOR.node = "probe"
    try:
        with ledger_run.counting() as known:
            body(engine=edited, case=case)
        return known, deferred
    finally:
        COLLECTOR.node = ""
        ledger_run._DEFERRED.reset(token)


def test_k3n_007_is_known_in_the_batch_composition_property_only_where_a_call_raced():
    """GPU run 115 (H100): on ROCm's kernel the batch, its reversed copy and the rows alone are separate calls
    with a delta over the 4-source tile, so K3N-007's race fires in one of them and the batch property fails.
    The entry names that property; its model judges every call: the reversed call with one segment's delta
    applied twice (what the race returns) is known, the same call scaled by 1.02 (no raced read) is new."""
    assert _batch_probe(lambda c: c.out) == ([], [])  # the honest kernel: nothing to file
    assert _batch_probe(lambda c: _raced(c, per_row={0: (1,)})) == (["K3N-007"], [])  # row 0's second segment
    known, deferred = _batch_probe(lambda c: (c.out.float() * 1.02).to(c.out.dtype))
    assert known == [] and len(deferred) == 1
    assert "batch_invariance" in deferred[0] and "not K3N-007's bug" in deferred[0] and "not its bug" in deferred[0]


def _residual_call(hidden: int, nvb: int):
    """SGLang's model aggregation as the off-grid property calls it (poisoned memory), recorded."""
    from k3num.harness import ledger_run
    from k3num.properties.checks import poisoned_memory

    calls: list = []
    engine = ledger_run.record_calls(_engine("sglang"), (base.ATTN_RES_RESIDUAL,), calls)
    with pytest.raises(AssertionError, match="over budget"):
        poisoned_memory.check_poisoned_mixture(engine, base.ATTN_RES_RESIDUAL, 2, hidden, nvb, 3,
                                               bank_rows=nvb + -(-1024 // hidden) + 1, prop="k3n_008")
    return calls[-1]


def _with_subject(c, fn):
    """The recorded call `c` with its engine's attn_res_residual replaced by `fn` (what a remake runs)."""
    engine = dataclasses.replace(c.engine, subjects={**c.engine.subjects, base.ATTN_RES_RESIDUAL: fn})
    return dataclasses.replace(c, engine=engine)


@pytest.mark.parametrize("hidden", [96, 1536])
def test_k3n_008s_model_explains_the_unwritten_tail_and_refuses_a_written_one_a_finite_row_or_another_nan(hidden: int):
    """K3N-008's model on SGLang's own aggregation (Triton interpreter): its output at an off-grid hidden size is
    explained (made again with the allocations filled with 1, the unwritten columns carry the fill through the
    output norm). Refused: the correct output (the oracle's finite mixture); a planted write of one tail
    element; below 1024, two near misses of the same all-NaN shape: a kernel that returns NaN whatever the
    allocation held (another NaN bug), and one that returns its unwritten allocation without the output norm; at
    1536, a kernel whose finite output is not the fill through the norm, and written columns holding the mixture
    scaled by 1.5."""
    c = _residual_call(hidden, 2)
    assert ledger_models.unwritten_past_the_grid([c]) == ""
    prefix, bank, nvb, norm, proj, out_norm, eps = c.args
    want, _ = judges.residual_mixture(c.engine, prefix, bank.nan_to_num(0.0), nvb, norm, proj, out_norm, eps)
    correct = dataclasses.replace(c, out=want.to(c.out.dtype))
    assert ("are not NaN" if hidden < ledger_models.GRID else "were written") in \
        ledger_models.unwritten_past_the_grid([correct])
    tail = c.out.clone()
    tail[:, -1] = 0.5
    assert "not" in ledger_models.unwritten_past_the_grid([dataclasses.replace(c, out=tail)])
    if hidden < ledger_models.GRID:
        nan_anyway = _with_subject(c, lambda p, *a, **k: torch.full_like(p, float("nan")))
        assert "norm of a row of ones" in ledger_models.unwritten_past_the_grid([nan_anyway])
        unnormed = _with_subject(c, lambda p, *a, **k: torch.empty_like(p))
        assert "norm of a row of ones" in ledger_models.unwritten_past_the_grid([unnormed])
    else:  # a kernel whose finite output, made again, is not the fill through the norm
        noise = _with_subject(c, lambda p, *a, **k: torch.randn(p.shape, generator=torch.Generator().manual_seed(0))
                              .to(p.dtype))
        assert "not out_norm times one constant" in ledger_models.unwritten_past_the_grid([noise])
        right, wrong = c.out.clone(), c.out.clone()
        right[:, :1024] = want[:, :1024].to(right.dtype)
        wrong[:, :1024] = (1.5 * want[:, :1024]).to(wrong.dtype)
        assert ledger_models.unwritten_past_the_grid([dataclasses.replace(c, out=right)]) == ""
        why = ledger_models.unwritten_past_the_grid([dataclasses.replace(c, out=wrong)])
        assert "neither the mixture within its budget nor NaN" in why


def _fp8_insert_call(engine, bad: float, fmt: str) -> tuple[str, list]:
    """The FP8 bad-scale insert property on `engine` (its bare body, one layer): (its failure message, the insert
    calls it observed for the ledger's model)."""
    import inspect

    from k3num.harness import ledger_run
    from k3num.properties import test_context_kv_ops as ops_props

    body = inspect.unwrap(ops_props.test_fp8_insert_with_a_zero_or_nonfinite_scale_refuses_or_poisons_visibly
                          .hypothesis.inner_test)
    observed: list = []
    with pytest.raises(pytest.fail.Exception) as got, ledger_run.observing(observed):
        body(engine=engine, seed=0, layers=1, tokens=5, fmt=fmt, bad=bad, grouped=False)
    return str(got.value), observed


@pytest.mark.parametrize("fmt", ["fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("bad", [0.0, float("-inf")])
def test_k3n_014s_model_computes_the_saturated_bytes_from_the_inputs_and_refuses_the_rest(bad: float, fmt: str):
    """K3N-014's model computes, from the observed insert's inputs, the bytes a saturating conversion of x / scale
    writes, and compares them with the written bytes: the mirror's insert planted without its scale check
    (tests/mutants.py fp8_bad_scale_saturated, the finding's arithmetic) is explained. Refused: the correct,
    visibly poisoned output (every byte NaN); two near misses (one byte off by one code; the sign of every byte
    dropped); and another bug failing the same property (x / 1 written for a bad scale, plausible bytes). A
    message that says "saturated" explains nothing: the model reads bytes."""
    from tests import mutants

    saturated = mutants.build("fp8_bad_scale_saturated")
    said, calls = _fp8_insert_call(saturated, bad, fmt)
    assert len(calls) == 1 and ledger_models.explains("K3N-014", calls) == "", said
    c = calls[0]
    poisoned = torch.full_like(c.out, 0x7F)  # the correct outcome short of a refusal: every byte an FP8 NaN
    one_off = c.out.clone()
    one_off.view(-1)[3] ^= 1
    unsigned = c.out & 0x7F  # every byte made positive
    for near, what in ((poisoned, "poisoned"), (one_off, "one byte"), (unsigned, "unsigned")):
        why = ledger_models.explains("K3N-014", [dataclasses.replace(c, out=near)])
        assert "not K3N-014's bug" in why and "bytes are not x /" in why, (what, why)
    assert ledger_models.explains("K3N-014", []).endswith("no FP8 insert call was observed")

    class IgnoresTheScale(type(saturated.extras["context_kv_ops"])):
        def insert_per_layer(self, kv_c, k_pe, cache, slots, kv_cache_dtype="auto", scale=None):
            if kv_cache_dtype != "auto" and not bool(torch.isfinite(scale).all() and (scale > 0).all()):
                scale = torch.ones_like(scale)
            return super().insert_per_layer(kv_c, k_pe, cache, slots, kv_cache_dtype, scale)

    ignoring = dataclasses.replace(saturated, extras={**saturated.extras,
                                                      "context_kv_ops": IgnoresTheScale("fp8_bad_scale_saturated")})
    said, calls = _fp8_insert_call(ignoring, bad, fmt)
    why = ledger_models.explains("K3N-014", calls)
    assert "not K3N-014's bug" in why and "bytes are not x /" in why, why


def test_k3n_014s_closed_form_bytes_are_the_division_s_where_the_division_is_defined():
    """The model's bytes by cases (no division) against refmodel.quant.fp8_quotient_bytes (the fp32 division,
    saturated) on every sign of x and of the scale, zeros, infinities and NaN included: the same bytes, and NaN
    exactly where the quotient is NaN."""
    from k3num.refmodel import quant

    x = torch.tensor([1.5, -2.0, 0.0, -0.0, float("inf"), float("-inf"), float("nan"), 3e38, -1e-30])
    for fmt, fp8 in quant.FP8_KV_FORMATS.items():
        for scale in (0.0, -0.0, float("inf"), float("-inf")):
            want, nan = ledger_models._saturated_bytes(x, scale, fp8)
            div = quant.fp8_quotient_bytes(x, scale, fmt)
            div_nan = torch.isnan(div.view(fp8).float())
            assert torch.equal(nan, div_nan), (fmt, scale)
            assert torch.equal(want[~nan], div[~nan]), (fmt, scale, want.tolist(), div.tolist())


def test_the_quotient_bytes_of_a_bad_scale_are_the_formats_saturated_values():
    """refmodel.quant.fp8_quotient_bytes, in closed form: a zero scale gives +-max (e4m3 0x7E / 0xFE, e5m2 0x7B /
    0xFB) and NaN for a zero element; an infinite one gives +-0 (0x00 / 0x80)."""
    from k3num.refmodel import quant

    x = torch.tensor([1.5, -2.0, 0.0], dtype=torch.bfloat16)
    assert quant.fp8_quotient_bytes(x, 0.0, "fp8_e4m3")[:2].tolist() == [0x7E, 0xFE]
    assert quant.fp8_quotient_bytes(x, 0.0, "fp8_e5m2")[:2].tolist() == [0x7B, 0xFB]
    assert bool(torch.isnan(quant.fp8_quotient_bytes(x, 0.0, "fp8_e4m3").view(torch.float8_e4m3fn).float()[2]))
    assert quant.fp8_quotient_bytes(x, float("inf"), "fp8_e4m3")[:2].tolist() == [0x00, 0x80]
    assert quant.fp8_quotient_bytes(x, 2.0, "fp8_e4m3").tolist() == quant.fp8_kv_entry(x, 2.0, "fp8_e4m3").tolist()


def test_the_recorder_keeps_every_new_output_past_its_limit_and_marks_what_it_dropped():
    """A race's new output on call 100 of a repeat property is recorded (the first LIMIT calls alone let it pass
    unjudged), repeats are not, and past DISTINCT distinct calls the mark makes every model refuse: an output
    no model saw is never called explained."""
    from k3num.harness import ledger_run

    @dataclasses.dataclass(frozen=True)
    class Engine:
        subjects: dict

    x = torch.zeros(4)
    outs = {100: torch.ones(4)}
    n = {"i": 0}

    def subject(t):
        n["i"] += 1
        return outs.get(n["i"], t + 0)

    engine = Engine({base.AUX_CAPTURE: subject})
    recorded: list[ledger_models.Call] = []
    fn = ledger_run.record_calls(engine, (base.AUX_CAPTURE,), recorded).subjects[base.AUX_CAPTURE]
    for _ in range(152):
        fn(x)
    assert len(recorded) == ledger_run.LIMIT + 1
    assert torch.equal(recorded[-1].out, torch.ones(4)) and recorded[-1].args is recorded[0].args
    many: list[ledger_models.Call] = []
    fn = ledger_run.record_calls(engine, (base.AUX_CAPTURE,), many).subjects[base.AUX_CAPTURE]
    for i in range(ledger_run.DISTINCT + 10):
        fn(torch.full((4,), float(i)))
    assert len(many) == ledger_run.DISTINCT + 1 and many[-1].subject == ledger_models.TRUNCATED
    assert "judges only the ones recorded" in ledger_models.explains("K3N-001", many)


def test_the_recorders_fingerprint_never_drops_an_output_it_did_not_see():
    """Past LIMIT a call is dropped only when it equals a kept one bitwise: an output whose fingerprint matches
    a kept one's (two elements swapped at positions its partial sums do not tell apart) is still kept, and so is
    one that differs in one bit; an exact repeat is not."""
    from k3num.harness import ledger_run

    @dataclasses.dataclass(frozen=True)
    class Engine:
        subjects: dict

    base_out = torch.arange(8, dtype=torch.float32)
    swapped = base_out.clone()
    swapped[[2, 4]] = swapped[[4, 2]]  # the same sum, the same every-second and every-seventh sums
    one_bit = base_out.clone()
    one_bit[5] = torch.nextafter(one_bit[5], torch.tensor(100.0))
    assert ledger_run._digest(swapped) == ledger_run._digest(base_out)  # the case the bitwise check decides
    late = {ledger_run.LIMIT + 5: swapped, ledger_run.LIMIT + 9: one_bit}
    n = {"i": 0}

    def subject(t):
        n["i"] += 1
        return late.get(n["i"], base_out.clone())

    recorded: list[ledger_models.Call] = []
    fn = ledger_run.record_calls(Engine({base.AUX_CAPTURE: subject}), (base.AUX_CAPTURE,), recorded).subjects[
        base.AUX_CAPTURE]
    for _ in range(ledger_run.LIMIT + 20):
        fn(torch.zeros(8))
    assert len(recorded) == ledger_run.LIMIT + 2
    assert torch.equal(recorded[-2].out, swapped) and torch.equal(recorded[-1].out, one_bit)


def test_a_race_failure_its_model_rejects_fails_the_test_with_the_verdict_not_as_hypothesis_flaky():
    """A race spares some calls, so hypothesis's replay of a failing case may pass and it raises FlakyFailure,
    which hides the model's verdict (GPU run 81). Inside a race entry's region, a failure the model rejects is
    kept and fails the test after hypothesis ends, naming the verdict: here a kernel whose first call's output
    is scaled by 1.5 (what no raced read gives) inside K3N-007's region. Without that scope, hypothesis flakes."""
    from hypothesis import given, settings
    from hypothesis import strategies as st
    from hypothesis.errors import FlakyFailure

    from k3num.harness import ledger_run
    from k3num.harness.judges import EPS, OUT_EPS
    from k3num.oracles.drift import COLLECTOR

    engine = _engine("vllm-rocm")
    real = engine.subject(base.ATTN_RES)

    def make(n: dict):
        def scaled_once(*args, **kwargs):
            out = real(*args, **kwargs)
            n["calls"] += 1
            return (out.float() * 1.5).to(out.dtype) if n["calls"] == 1 else out
        return dataclasses.replace(engine, subjects={**engine.subjects, base.ATTN_RES: scaled_once})

    def test_attn_res_repeated_calls_are_bitwise_identical(engine, case):
        from k3num.fixtures.builders import attn_res_inputs

        outs = []
        for _ in range(2):
            inp = attn_res_inputs(case, torch.bfloat16, "cpu")
            outs.append(engine.subject(base.ATTN_RES)(inp.prefix, inp.delta, inp.blocks, inp.norm, inp.qk,
                                                      inp.out_norm, case.num_blocks, -1, EPS, OUT_EPS))
        assert torch.equal(outs[0], outs[1]), "2 distinct outputs of 2 calls"

    def run(n: dict, scope: bool) -> list[str]:
        body = ledger_run.ledgered(test_attn_res_repeated_calls_are_bitwise_identical)
        body._k3num_entries["vllm-rocm"] = [ledger.by_id("K3N-007")]
        test = settings(max_examples=3, database=None, derandomize=True)(
            given(case=st.just(DELTA_OVER_FOUR_SOURCES))(lambda case: body(engine=make(n), case=case)))
        deferred: list[str] = []
        token = ledger_run._DEFERRED.set(deferred if scope else None)
        try:
            with ledger_run.counting():
                test()
        finally:
            ledger_run._DEFERRED.reset(token)
        return deferred

    COLLECTOR.node = "probe"
    try:
        deferred = run({"calls": 0}, scope=True)
        # new: its message is not the repeat property's judged verdict (the entry's signature), nor a raced read
        assert len(deferred) == 1 and "not K3N-007's" in deferred[0] and "2 distinct outputs" in deferred[0]
        with pytest.raises(FlakyFailure):
            run({"calls": 0}, scope=False)
    finally:
        COLLECTOR.node = ""


def test_the_models_numpy_bf16_rounding_is_torchs_ties_included():
    """K3N-006's CPU fast path rounds in numpy (ledger_models._bf16_np): it must give torch's float64 -> bf16
    value bit for bit, on values over 60 binades and on exact ties and near-ties of bf16's rounding."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(100_000, generator=g, dtype=torch.float64)
    x = x * torch.exp2(torch.randint(-30, 30, (100_000,), generator=g).double())
    b = x.to(torch.bfloat16).double()[:25_000]
    half = torch.exp2(torch.floor(torch.log2(b.abs())) - 8) * torch.tensor([1.0, -1.0]).repeat(12_500)
    ties = b + half  # exactly halfway between two bf16 neighbours
    xs = torch.cat([x, ties, ties * (1 + 2.0**-40), ties * (1 - 2.0**-40)])
    assert (ledger_models._bf16_np(xs.numpy()) == xs.to(torch.bfloat16).double().numpy()).all()


def test_the_models_numpy_read_of_a_bf16_tensor_is_its_exact_value():
    """The CPU fast path reads bf16 tensors as the high half of a float32 (ledger_models._np64, no torch
    operation): every value exactly, strided views, infinities, NaN, signed zero and subnormals included."""
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(64, 48, generator=g) * torch.exp2(torch.randint(-60, 60, (64, 48), generator=g).float()))
    x = x.to(torch.bfloat16)
    x[0, :5] = torch.tensor([float("inf"), -float("inf"), float("nan"), -0.0, 1e-40]).to(torch.bfloat16)
    for t in (x, x.T, x[::3, 1::2]):
        got, want = ledger_models._np64(t), t.double().numpy()
        assert got.dtype == want.dtype and got.shape == want.shape
        assert ((got == want) | (torch.isnan(t.double()).numpy() & (got != got))).all()
        assert (torch.from_numpy(got).signbit() == t.double().signbit()).all()


def test_k3n_013s_model_is_the_flat_plan_and_refuses_the_head_aware_one_and_two_near_misses():
    """K3N-013's model (refmodel.transfer_plan.flat_plan) explains SGLang's own plan for seed 003 (the transfer
    property's bare body, observed); it refuses the correct (head-aware) plan, and two near misses of the flat
    plan's shape: one chunk dropped, and every copy shifted by one item."""
    import inspect

    from k3num.fixtures.strategies import SEED_003_TRANSFER
    from k3num.harness import ledger_run
    from k3num.properties import test_kv_transfer as kv_props

    body = inspect.unwrap(kv_props.test_kv_transfer_copies_exactly_the_head_aware_plan_or_is_refused
                          .hypothesis.inner_test)
    observed: list = []
    with pytest.raises(AssertionError, match="planned"), ledger_run.observing(observed):
        body(engine=_engine("sglang"), case=SEED_003_TRANSFER)
    assert len(observed) == 1 and ledger_models.explains("K3N-013", observed) == ""
    c = observed[0]
    item = judges.transfer_layouts(SEED_003_TRANSFER, 0)[0].item_bytes
    right = sorted(judges.transfer_oracle(SEED_003_TRANSFER))
    dropped = [(s, d, n) for s, d, n in c.out][:-1] + [(c.out[-1][0], c.out[-1][1], c.out[-1][2] - item)]
    shifted = [(s, d + item, n) for s, d, n in c.out]
    for plan in ([(s, d, item) for s, d in right], dropped, shifted):
        why = ledger_models.explains("K3N-013", [dataclasses.replace(c, out=plan)])
        assert "not K3N-013's bug" in why and "not the flat plan" in why, why


class _Order:
    """hypothesis's `data` for the block-FP8 property's body: the arrival order it draws."""

    def __init__(self, order: list[int]):
        self.order = order

    def draw(self, strategy, label=None):
        return self.order


def _block_fp8_load(layers: int, width: int, order: list[int] | None, seed: int = 0) -> ledger_models.Call:
    """The block-FP8 property's body on vLLM's merged loader (its bare body, observed): the one load it saw."""
    import inspect

    from k3num.harness import ledger_run
    from k3num.properties import test_quantized_loading as q_props

    prop = q_props.test_block_fp8_merged_shards_dequantize_to_the_per_layer_weights
    body = inspect.unwrap(prop.hypothesis.inner_test)
    observed: list = []
    with pytest.raises((AssertionError, RuntimeError)), ledger_run.observing(observed):
        body(engine=_engine("vllm"), layers=layers, width=width, hidden=256, seed=seed,
             data=None if order is None else _Order(order))
    assert len(observed) == 1, observed
    return observed[0]


def test_k3n_011s_model_is_the_rounded_up_placement_and_refuses_the_correct_load_and_near_misses():
    """K3N-011's model on vLLM's merged block-FP8 loader: the reproducer (5 layers of 576 rows: [0, 320, 0, 320, 0]
    rows wrong), 3 layers arriving [2, 0, 1] and an even count whose last layer runs past the merged scale (the
    narrow's RuntimeError, start 5 + length 5 > 9) are each the rounded-up placement, bit for bit. Refused: the
    correct load (each layer's scale rows where the GEMM reads them), a shared scale row holding the earlier
    layer's (the first arrival winning), one scale element one float32 ulp off, the narrow's error with other
    numbers, and a load that returns where the placement raises."""
    five = _block_fp8_load(5, 576, None)
    assert ledger_models.explains("K3N-011", [five]) == ""
    assert ledger_models.explains("K3N-011", [_block_fp8_load(3, 576, [2, 0, 1], seed=1)]) == ""
    raised = _block_fp8_load(2, 576, None)
    assert isinstance(raised.out, RuntimeError) and ledger_models.explains("K3N-011", [raised]) == ""

    layers, order, block = five.args
    weight, scale = five.out
    from k3num.refmodel import quant

    right = torch.cat([s for _, s in layers])  # 5 x 5 rows: each layer's own, as if 576 were whole blocks
    why = ledger_models.explains("K3N-011", [dataclasses.replace(five, out=(weight, right[:scale.shape[0]]))])
    assert "rows of the merged scale are not where" in why, why
    first_wins = scale.clone()
    first_wins[9] = layers[1][1][4]  # row 9 is shared by layer 1 (its last) and layer 2 (its first, arriving later)
    assert not torch.equal(first_wins, scale)
    why = ledger_models.explains("K3N-011", [dataclasses.replace(five, out=(weight, first_wins))])
    assert "1 rows of the merged scale" in why, why
    ulp = scale.clone()
    ulp.view(torch.int32)[3, 0] += 1
    why = ledger_models.explains("K3N-011", [dataclasses.replace(five, out=(weight, ulp))])
    assert "1 rows of the merged scale" in why, why
    other = dataclasses.replace(raised, out=RuntimeError("start (4) + length (5) exceeds dimension size (9)."))
    assert "where the placement raises" in ledger_models.explains("K3N-011", [other])
    returned = dataclasses.replace(raised, out=(torch.cat([w for w, _ in raised.args[0]]), right[:9]))
    assert "the load returned, where the placement raises" in ledger_models.explains("K3N-011", [returned])
    whole = [quant.quantize_fp8_block(torch.randn(256, 128, dtype=torch.float64) * (1 + i)) for i in range(2)]
    correct = ledger_models.Call(ledger_models.BLOCK_FP8_MERGE, (whole, [0, 1], block),
                                 {}, (torch.cat([w for w, _ in whole]), torch.cat([s for _, s in whole])))
    assert "loads these shards right" in ledger_models.explains("K3N-011", [correct])


def test_a_checkpoint_known_as_a_whole_stays_known_only_where_its_entrys_model_explains_it():
    """A user's checkpoint inside K3N-011's checkpoint rule xfails the whole test, strictly, with the entry's
    exceptions (harness/plugin.py); the test body is wrapped so that the failure is the entry's only where its
    bug model explains what the test observed: vLLM's misplaced load re-raises its AssertionError (xfailed), a
    load of the same message whose scale rows are somewhere else raises NotTheEntrysFailure (failed), as does a
    TypeError."""
    from k3num.harness import ledger_run

    five = _block_fp8_load(5, 576, None)
    message = "ckpt (fp8): dequantized as the GEMM reads it, the merged weight differs from the checkpoint's " \
              "per-layer weights in [0, 320, 0, 320, 0] rows per layer (of 576)"

    def test_checkpoint_quantized_shards_load_as_the_per_layer_weights(out, error):
        ledger_run.observe(ledger_models.BLOCK_FP8_MERGE, five.args, out)
        raise error

    wrapped = ledger_run.checkpoint_modelled(test_checkpoint_quantized_shards_load_as_the_per_layer_weights, "K3N-011")
    with pytest.raises(AssertionError, match="rows per layer"):
        wrapped(out=five.out, error=AssertionError(message))
    moved = five.out[1].clone()
    moved[[0, 1]] = moved[[1, 0]]
    with pytest.raises(ledger_run.NotTheEntrysFailure, match="not K3N-011's bug .*2 rows of the merged scale"):
        wrapped(out=(five.out[0], moved), error=AssertionError(message))
    with pytest.raises(ledger_run.NotTheEntrysFailure, match="not K3N-011's failure: 'TypeError"):
        wrapped(out=five.out, error=TypeError("unsupported operand"))
    assert not issubclass(ledger_run.NotTheEntrysFailure, (AssertionError, RuntimeError))  # the xfail's raises=


def test_k3n_012s_model_is_one_kept_multiplier_and_refuses_the_correct_load_and_two_near_misses():
    """K3N-012's model on vLLM's merged NVFP4 loader (the property's bare body for the reproducer, observed): the
    layers' own values and group scales under one of their multipliers is explained. Refused: the correct load
    (each layer its own multiplier: the model's "not rescaled"), and two near misses of its shape: the kept
    multiplier not one of the layers' (scaled by 1.5), and one group scale of one row changed."""
    import inspect

    from k3num.harness import ledger_run
    from k3num.properties import test_quantized_loading as q_props

    rule = ledger_cases.CASES["K3N-012"]
    body = inspect.unwrap(q_props.test_nvfp4_merged_shards_dequantize_to_the_per_layer_weights.hypothesis.inner_test)
    observed: list = []
    with pytest.raises(AssertionError, match="differs from the per-layer weights"), ledger_run.observing(observed):
        body(engine=_engine("vllm"), **rule.reproducer)
    assert len(observed) == 1 and ledger_models.explains("K3N-012", observed) == ""
    c = observed[0]
    weight, scale, kept = c.out
    same = tuple((p, g, kept.clone()) for p, g, _ in c.args)
    assert "the load is right" in ledger_models.explains("K3N-012", [dataclasses.replace(c, args=same)])
    other = dataclasses.replace(c, out=(weight, scale, kept * 1.5))
    assert "is not one of the layers' own" in ledger_models.explains("K3N-012", [other])
    changed = scale.clone()
    flat = changed.view(torch.uint8) if changed.element_size() == 1 else changed
    flat.view(-1)[7] = flat.view(-1)[7] + 1
    why = ledger_models.explains("K3N-012", [dataclasses.replace(c, out=(weight, changed, kept))])
    assert "rows of the merged weight are not" in why, why
