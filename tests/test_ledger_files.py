"""A ledger entry applies while the files it names are the pinned bytes (oracles/ledger.py `files`,
supply.fetch.pinned_files): an edit elsewhere in the engine keeps it, an edit of its own file (a fix)
lets the property judge plainly. And it covers the cases its rule names (harness/ledger_cases.py):
a second bug in the same test, outside the rule, fails the test on the pinned bytes."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from k3num.harness import accounting, fixes
from k3num.oracles import ledger
from k3num.supply import fetch

ROOT = Path(__file__).resolve().parents[1]
AMD_ATTN_RES = "vllm/models/kimi_k3/amd/ops/attn_res.py"
DSPARK = "vllm/models/kimi_k3/nvidia/dspark_mla.py"


def test_every_entry_names_files_of_its_pin():
    """A Python file of the engine's pin, or a `csrc/` file of its pinned source distribution (the compiled ops)."""
    for d in ledger.LEDGER:
        pin = fetch.PINS[d.engine.split("-")[0]]
        assert d.files, d.id
        csrc = {f for f in d.files if f.startswith("csrc/")}
        assert set(d.files) - csrc <= set(pin.files), (d.id, set(d.files) - csrc - set(pin.files))
        if csrc:
            manifest = fetch.csrc_dir(pin.engine) / fetch.MANIFEST
            if not manifest.is_file():
                pytest.skip(f"{pin.engine}'s csrc is not fetched (k3num fetch): {d.id}'s {sorted(csrc)} unchecked")
            assert csrc <= set(json.loads(manifest.read_text())), (d.id, csrc)


def test_k3n_014_names_the_compiled_insert_its_defect_lives_in():
    assert "csrc/cache_kernels.cu" in ledger.by_id("K3N-014").files


def test_a_csrc_file_is_the_pinned_bytes_unless_the_trees_own_csrc_changes_it(tmp_path):
    """A tree without csrc/ builds its ops from the pinned sdist (its csrc files are the pinned bytes); a tree with
    its own csrc/ is compared file by file; a csrc name the sdist lacks is refused."""
    cu = "csrc/cache_kernels.cu"
    if not (fetch.csrc_dir("vllm") / fetch.MANIFEST).is_file():
        pytest.skip("vllm's csrc is not fetched (k3num fetch)")
    root = _tree(tmp_path, None)
    local = fetch.Source("vllm", root)
    assert fetch.pinned_files("vllm", (DSPARK, cu))  # the cache
    assert fetch.pinned_files(local, (DSPARK, cu))  # no csrc/: the pinned sdist's ops
    shutil.copytree(fetch.csrc_dir("vllm") / "csrc", root / "csrc")
    assert fetch.pinned_files(local, (DSPARK, cu))  # its own csrc, the pinned bytes
    with open(root / cu, "a") as fh:
        fh.write("\n// a head's fix of the insert\n")
    assert not fetch.pinned_files(local, (cu,))
    assert not fetch.pinned_files(local, (DSPARK, cu))
    assert fetch.pinned_files(local, (DSPARK,))  # the Python files alone are still the pinned bytes
    with pytest.raises(ValueError, match="not files of the pin"):
        fetch.pinned_files("vllm", ("csrc/no_such_kernel.cu",))


def test_every_fix_edits_a_file_of_each_entry_it_fixes():
    """Else the fixed tree would keep the entry's strict xfail and prove_fixes could not see the fix."""
    for fix in fixes.FIXES:
        edited = {rel for rel, _ in fix.edits}
        for suffix in fix.id.removeprefix("K3N-").split("/"):
            entry = ledger.by_id(f"K3N-{suffix}")
            assert entry is not None and edited & set(entry.files), (fix.id, entry)


def _tree(tmp_path: Path, edited: str | None) -> Path:
    if fetch.missing_files("vllm"):
        pytest.skip("vllm is not fetched (k3num fetch vllm)")
    root = fixes.pinned_tree("vllm", tmp_path / "vllm-tree")
    if edited:
        with open(root / edited, "a") as fh:
            fh.write("\n# a head's one-line edit\n")
    return root


def test_pinned_files_compares_each_named_file(tmp_path, monkeypatch):
    root = _tree(tmp_path, AMD_ATTN_RES)
    assert fetch.pinned_files("vllm", (DSPARK,))  # the cache
    local = fetch.Source("vllm", root)
    assert fetch.pinned_files(local, (DSPARK, "vllm/models/kimi_k3/nvidia/ops/attn_res.py"))
    assert not fetch.pinned_files(local, (AMD_ATTN_RES,))
    assert not fetch.pinned_files(local, (DSPARK, AMD_ATTN_RES))
    with pytest.raises(ValueError, match="not files of the pin"):
        fetch.pinned_files("vllm", ("vllm/nope.py",))


def _bank_indices(tree: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pytest", "properties/test_off_path_shapes.py", "-k",
                           "bank_indices_outside", "--engine", "vllm,vllm-rocm", "--engine-src", f"vllm={tree}",
                           "-p", "no:cacheprovider", "-q", "-rfxX", "--hypothesis-profile=ci"],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)


def test_an_edit_elsewhere_keeps_the_entries_and_an_edit_of_their_file_judges_plainly(tmp_path):
    """K3N-009 (NVIDIA attn_res.py) and K3N-010 (ROCm attn_res.py) on one property: a comment added to
    dspark_mla.py keeps both known; one added to the ROCm attn_res.py keeps K3N-009 and lets K3N-010's
    property fail plainly, as a real failure of that tree."""
    other = _bank_indices(_tree(tmp_path / "a", DSPARK))
    assert "2 xfailed" in accounting.tally(other.stdout), other.stdout[-3000:]
    assert "K3N-009" in other.stdout and "K3N-010" in other.stdout
    own = _bank_indices(_tree(tmp_path / "b", AMD_ATTN_RES))
    tally = accounting.tally(own.stdout)
    assert "1 failed" in tally and "1 xfailed" in tally, own.stdout[-3000:]
    assert "FAILED properties/test_off_path_shapes.py::test_attn_res_bank_indices_outside_the_bank_are_refused" \
           "[vllm-rocm]" in own.stdout


# ---- the entries' case rules (harness/ledger_cases.py, harness/ledger_run.py) -------------------


def test_every_entry_has_a_case_rule_whose_reproducer_it_covers():
    from k3num.harness import ledger_cases

    assert set(ledger_cases.CASES) == {d.id for d in ledger.LEDGER}
    for d in ledger.LEDGER:
        rule = ledger_cases.CASES[d.id]
        assert rule.test in (d.test, *d.also), (d.id, rule.test)
        view = rule.reproducer_view()
        assert (rule.inside(view) if rule.call else ledger_cases.inside(d.id, view)), d.id  # its reproducer is inside


def _off_grid(plant: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pytest", "properties/test_off_path_shapes.py", "-k",
                           "model_aggregation_off_grid", "-p", "tests.mutants", "--engine", "sglang", "-p",
                           "no:cacheprovider", "-q", "-rfxX", "--hypothesis-profile=ci"], cwd=ROOT, capture_output=True,
                          text=True, timeout=600, env={**os.environ, "K3NUM_PLANT": plant})


def test_a_bug_outside_an_entrys_rule_fails_the_test_the_entry_covers_on_the_pinned_bytes():
    """K3N-008 covers SGLang's off-grid hidden sizes in this test; a plant scaling the on-grid ones (1024,
    2048) over the pinned bytes is a second bug in the same test: the test fails, where a whole-test
    strict xfail would have reported it as K3N-008."""
    if fetch.missing_files("sglang"):
        pytest.skip("sglang is not fetched (k3num fetch sglang)")
    pinned = _off_grid("")
    assert "1 xfailed" in accounting.tally(pinned.stdout), pinned.stdout[-3000:]
    assert "K3N-008" in pinned.stdout and "inside its rule" in pinned.stdout
    planted = _off_grid("sglang-on-grid-scaled")
    assert "1 failed" in accounting.tally(planted.stdout), planted.stdout[-3000:]
    assert "hidden=1024" in planted.stdout or "hidden=2048" in planted.stdout, planted.stdout[-3000:]


def test_a_test_two_entries_share_lets_each_entrys_cases_pass_and_fails_the_rest(monkeypatch):
    """GPU run 35: ROCm's repeat property carries K3N-005 (a write, no delta) and K3N-007 (a delta, the
    4-source tile); judging by the first entry alone failed K3N-007's own case."""
    # the region rule alone: the stand-in kernel raises where the real race returns a wrong output, which
    # K3N-007's bug model judges (tests/test_ledger_models.py); here the model is set aside
    from k3num.harness import ledger_models

    monkeypatch.delitem(ledger_models.MODELS, "K3N-007")
    import torch

    from k3num.engines import base
    from k3num.engines.base import Engine
    from k3num.fixtures.strategies import DELTA_OVER_FOUR_SOURCES as K3N_007
    from k3num.fixtures.strategies import WRITE_IN_THE_MIX_UNIT as K3N_005
    from k3num.harness import ledger_run

    def racy(prefix, delta, blocks, *rest):  # fails as the repeat property's judged verdict does (ledger_cases.JUDGED)
        raise AssertionError("deterministic_across_calls [vllm-rocm 0.33.0, source-gpu] attn_res bfloat16 1x128 "
                             "seed=0: 2 distinct outputs of 152")

    rocm = Engine("vllm-rocm", "0.33.0", "source-gpu", {base.ATTN_RES: racy})

    def test_attn_res_repeated_calls_are_bitwise_identical(engine, case):
        x, bank = torch.zeros(case.tokens, case.hidden), torch.zeros(case.tokens, case.bank, case.hidden)
        engine.subject(base.ATTN_RES)(x, x if case.with_delta else None, bank, x[0], x[0],
                                      x[0] if case.with_output_norm else None, case.num_blocks,
                                      case.block_write_idx, 1e-5, 1e-5)

    body = ledger_run.ledgered(test_attn_res_repeated_calls_are_bitwise_identical)
    body._k3num_entries["vllm-rocm"] = [ledger.by_id("K3N-005"), ledger.by_id("K3N-007")]
    with ledger_run.counting() as known:
        body(engine=rocm, case=K3N_005)  # inside K3N-005's rule: known
        body(engine=rocm, case=K3N_007)  # inside K3N-007's rule: known
        outside = dataclasses.replace(K3N_007, num_blocks=1)  # a delta with one source block: neither race
        with pytest.raises(AssertionError, match="distinct outputs"):
            body(engine=rocm, case=outside)
    assert known == ["K3N-005", "K3N-007"]
