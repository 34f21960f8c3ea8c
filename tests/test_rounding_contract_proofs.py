"""The rounding contracts (properties/test_rounding_contracts.py) catch one more bf16 rounding: TokenSpeed's running
sum rounded per tap (harness/fixes.py accumulator-bf16) fails the contract, outside every ledger entry, where its
control (a comment in the same file) passes; a contract line gone from a release is a contract error naming it."""

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
