"""The rounding contracts (properties/test_rounding_contracts.py) catch one more bf16 rounding: TokenSpeed's running
sum rounded per tap (harness/fixes.py accumulator-bf16) and vLLM's AttnRes mixture rounded before its output norm
(attn-res-mixture-bf16) and SGLang's draft K/V writer rounding its norm's reciprocal root (draft-kv-inv-bf16) fail
their contracts, outside every ledger entry, where their controls (a comment in the
same file) pass; a contract line gone from a release is a contract error naming it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from k3num.harness import fixes
from k3num.properties import test_rounding_contracts as contracts
from k3num.supply import fetch

ROOT = Path(__file__).resolve().parents[1]


def _run(tree: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pytest", "properties/test_rounding_contracts.py", "--engine",
                           "tokenspeed", "--engine-src", f"tokenspeed={tree}", "-q", "-p", "no:cacheprovider",
                           "--hypothesis-profile=ci"], cwd=ROOT, capture_output=True, text=True, timeout=600)


def test_the_planted_accumulator_rounding_breaks_the_contract_and_its_control_does_not(tmp_path: Path) -> None:
    if not fetch.verified_manifest("tokenspeed"):
        pytest.skip("tokenspeed is not fetched")
    bad = _run(fixes.patched_tree(fixes.by_id("accumulator-bf16"), tmp_path / "bad"))
    assert bad.returncode == 1 and "rounds where its code does not say it does" in bad.stdout, bad.stdout[-3000:]
    assert "xfail" not in bad.stdout.split("short test summary")[-1].lower()  # no ledger entry absorbs it
    good = _run(fixes.patched_tree(fixes.by_id("accumulator-control"), tmp_path / "good"))
    assert good.returncode == 0, good.stdout[-3000:]


def _run_vllm(tree: Path, k: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pytest", "properties/test_rounding_contracts.py",
                           "properties/test_attn_res.py", "-k", k, "--engine", "vllm", "--engine-src",
                           f"vllm={tree}", "-q", "-p", "no:cacheprovider", "--hypothesis-profile=ci"],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)


def test_the_planted_attn_res_mixture_rounding_breaks_vllms_contract_and_not_the_accuracy_budget(
        tmp_path: Path) -> None:
    """A second planted rounding, on another engine and path (vLLM's AttnRes kernel rounds its mixture to bf16
    before the output norm: harness/fixes.py attn-res-mixture-bf16): the AttnRes contract fails, outside every
    ledger entry, while the accuracy property's worst-case budget passes it; its control passes both."""
    if not fetch.verified_manifest("vllm"):
        pytest.skip("vllm is not fetched")
    bad = fixes.patched_tree(fixes.by_id("attn-res-mixture-bf16"), tmp_path / "bad")
    contract = _run_vllm(bad, "attn_res_rounds_only_where_its_code_says")
    assert contract.returncode == 1 and "attn_res rounds where its code does not say it does" in contract.stdout, \
        contract.stdout[-3000:]
    assert "xfail" not in contract.stdout.split("short test summary")[-1].lower()
    accuracy = _run_vllm(bad, "test_attn_res_within_rounding_budget_of_oracle")
    assert accuracy.returncode == 0, accuracy.stdout[-3000:]
    good = _run_vllm(fixes.patched_tree(fixes.by_id("attn-res-control"), tmp_path / "good"),
                     "attn_res_rounds_only_where_its_code_says or test_attn_res_within_rounding_budget_of_oracle")
    assert good.returncode == 0, good.stdout[-3000:]


def _run_sglang(tree: Path, k: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pytest", "properties/test_rounding_contracts.py",
                           "properties/test_draft_kv.py", "-k", k, "--engine", "sglang", "--engine-src",
                           f"sglang={tree}", "-q", "-p", "no:cacheprovider", "--hypothesis-profile=ci"],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)


def test_the_planted_draft_kv_norm_rounding_breaks_sglangs_contract_and_not_the_accuracy_budget(
        tmp_path: Path) -> None:
    """A third planted rounding, on SGLang's draft K/V writer (the K norm's reciprocal root rounded to bf16:
    harness/fixes.py draft-kv-inv-bf16): the writer's contract fails, outside every ledger entry, while the draft
    K/V accuracy property's budget passes it; its control (a comment in the same file) passes both."""
    if not fetch.verified_manifest("sglang"):
        pytest.skip("sglang is not fetched")
    bad = fixes.patched_tree(fixes.by_id("draft-kv-inv-bf16"), tmp_path / "bad")
    contract = _run_sglang(bad, "draft_kv_write_rounds_only_where_its_code_says")
    assert contract.returncode == 1 and "the draft K/V write rounds where its code does not say" in contract.stdout, \
        contract.stdout[-3000:]
    assert "xfail" not in contract.stdout.split("short test summary")[-1].lower()
    accuracy = _run_sglang(bad, "test_draft_context_kv_within_rounding_budget_of_oracle")
    assert accuracy.returncode == 0, accuracy.stdout[-3000:]
    good = _run_sglang(fixes.patched_tree(fixes.by_id("draft-kv-control"), tmp_path / "good"),
                       "draft_kv_write_rounds_only_where_its_code_says or "
                       "test_draft_context_kv_within_rounding_budget_of_oracle")
    assert good.returncode == 0, good.stdout[-3000:]


def test_a_contract_line_the_file_lacks_is_a_contract_error_naming_it(tmp_path: Path) -> None:
    if not fetch.verified_manifest("tokenspeed"):
        pytest.skip("tokenspeed is not fetched")
    tree = fixes.pinned_tree("tokenspeed", tmp_path / "t")
    rel = contracts.TOKENSPEED_MODEL
    text = (tree / rel).read_text()
    (tree / rel).write_text(text.replace("projected.to(self.context_norm.weight.dtype)", "projected"))
    missing = contracts.contract_lines_missing(tree, contracts.CONTRACT_LINES["tokenspeed"])
    assert len(missing) == 1 and missing[0].startswith(f"contract error: {rel}: expected a line matching"), missing
    r = _run(tree)
    assert r.returncode == 1 and "ContractError: contract error" in r.stdout, r.stdout[-3000:]


@pytest.mark.parametrize("taps", [3, 5, 9])
def test_the_rounding_count_reads_one_more_rounding_per_tap_on_the_planted_accumulator(taps: int,
                                                                                      tmp_path: Path) -> None:
    """The drift records' rounding count (oracles/metrics.roundings_of) on TokenSpeed's sharded projection, one
    stage holding every tap, tap 0 dominant (the others scaled by 1/16, so every partial sum has the output's
    magnitude): the planted running sum rounded per tap adds one rounding per tap after the first (the first
    add is exact: 0 + a bf16 value) and makes the pre-norm rounding exact (its input is bf16 already), so it
    reads taps - 2 roundings more than its control, within 20%."""
    import torch

    from k3num.engines import base, registry
    from k3num.fixtures.builders import projection_inputs
    from k3num.fixtures.strategies import ProjectionCase
    from k3num.harness.judges import EPS
    from k3num.oracles import metrics
    from k3num.refmodel.rmsnorm import rms_norm

    if not fetch.verified_manifest("tokenspeed"):
        pytest.skip("tokenspeed is not fetched")
    case = ProjectionCase(taps=taps, tokens=64, hidden=64, hidden_out=64, stages=(tuple(range(taps)),), order=(0,),
                          seed=3, scale=1.0, outliers=0.0)
    counts = {}
    for fid in ("accumulator-bf16", "accumulator-control"):
        engine = registry.get("tokenspeed", {"tokenspeed": fixes.patched_tree(fixes.by_id(fid), tmp_path / fid)},
                              "source")
        inp = projection_inputs(case, torch.bfloat16, "cpu")
        t = inp.taps.clone()
        t[1:] = (t[1:].float() / 16).to(torch.bfloat16)
        partial = engine.subjects[base.STAGE_PARTIAL](t, inp.fc, list(range(taps)))
        out = engine.subjects[base.FINALIZE_PROJECTION]([partial], inp.norm, EPS, torch.float32, [0])
        h = case.hidden
        exact = sum(t[i].double() @ inp.fc[:, i * h:(i + 1) * h].double().T for i in range(taps))
        counts[fid] = metrics.compare(out, rms_norm(exact, inp.norm.double(), EPS)).roundings
    extra = counts["accumulator-bf16"] - counts["accumulator-control"]
    assert abs(extra - (taps - 2)) <= 0.2 * (taps - 2), counts
    assert 2.0 < counts["accumulator-control"] < 4.0, counts  # the taps', the pre-norm and the output's roundings
