"""Repro bundles (--repro-dir, harness/repro.py), `k3num replay` and `k3num repro`: a failing comparison
writes a bundle that replays to the same verdict, and to a pass on a fixed tree."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors import safe_open

from k3num.harness import fixes
from k3num.supply import fetch

ROOT = Path(__file__).resolve().parents[1]
K3N_008 = "properties/test_off_path_shapes.py::test_model_aggregation_off_grid_hidden_within_budget_or_refused"


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True)


@pytest.fixture(scope="module")
def bundle(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if fetch.missing_files("sglang"):
        pytest.skip("sglang 0.5.23 is not fetched here: run `k3num fetch sglang`")
    out = tmp_path_factory.mktemp("repro")
    _run("-m", "pytest", K3N_008, "--engine", "sglang", "--repro-dir", str(out), "-q", "-p", "no:cacheprovider",
         "--hypothesis-profile=ci")
    found = sorted(out.glob("off_path_shape_within_budget-sglang-*.safetensors"))
    assert found, "the failing comparison wrote no bundle"
    return found[0]


def test_a_failing_comparison_writes_inputs_outputs_and_what_it_takes_to_replay(bundle: Path) -> None:
    with safe_open(str(bundle), framework="pt") as fh:
        meta = json.loads(fh.metadata()["k3num"])
        keys = set(fh.keys())
    for field in ("engine", "engine_version", "mode", "source_sha256", "subject", "property", "detail", "seed",
                  "budget", "budget_rule", "node_id", "command"):
        assert meta.get(field) not in (None, ""), field
    assert meta["engine"] == "sglang" and meta["subject"] == "attn_res_residual" and meta["replayable"]
    assert meta["node_id"].startswith(K3N_008) and "--repro-dir" in meta["command"]
    assert {"actual", "reference"} <= keys and any(k.startswith("arg.") for k in keys)


def test_replay_fails_on_the_pinned_engine_and_passes_on_the_fixed_tree(bundle: Path, tmp_path: Path) -> None:
    bad = _run("-m", "k3num.harness.cli", "replay", str(bundle))
    assert bad.returncode == 1 and bad.stdout.startswith("FAIL: off_path_shape_within_budget [sglang 0.5.23,"), bad
    tree = fixes.patched_tree(fixes.by_id("K3N-008"), tmp_path / "fixed")
    good = _run("-m", "k3num.harness.cli", "replay", str(bundle), "--engine-src", f"sglang={tree}")
    assert good.returncode == 0 and good.stdout.startswith("PASS:") and "0.5.23+local" in good.stdout, good


def test_a_file_that_is_not_a_bundle_is_refused(tmp_path: Path) -> None:
    junk = tmp_path / "x.safetensors"
    junk.write_bytes(b"not safetensors")
    r = _run("-m", "k3num.harness.cli", "replay", str(junk))
    assert r.returncode == 2 and "not a repro bundle" in r.stderr


def test_passing_examples_write_nothing_and_repro_all_writes_each_propertys_worst(tmp_path: Path) -> None:
    args = ["-m", "pytest", "properties/test_attn_res_mix.py", "--engine", "mirror", "-q", "-p", "no:cacheprovider",
            "--hypothesis-profile=ci"]
    quiet = _run(*args, "--repro-dir", str(tmp_path / "a"))
    assert quiet.returncode == 0
    assert not (tmp_path / "a").exists() or not list((tmp_path / "a").glob("*"))
    loud = _run(*args, "--repro-dir", str(tmp_path / "b"), "--repro-all")
    assert loud.returncode == 0
    assert [p.name for p in (tmp_path / "b").glob("*")] == ["read_only_mixture_within_rounding_budget-mirror-worst"
                                                             ".safetensors"]
    r = _run("-m", "pytest", "properties/test_attn_res_mix.py", "--repro-all", "-q")
    assert r.returncode == 4 and "--repro-all: needs --repro-dir DIR" in r.stderr


def test_repro_writes_a_ledger_entrys_bundle_and_refuses_an_unknown_entry(tmp_path: Path) -> None:
    if fetch.missing_files("tokenspeed"):
        pytest.skip("tokenspeed 0.1.1 is not fetched here")
    r = _run("-m", "k3num.harness.cli", "repro", "K3N-006", "--out", str(tmp_path))
    assert r.returncode == 0 and "replay: k3num replay" in r.stdout
    bundle = next(tmp_path.glob("*.safetensors"))
    assert _run("-m", "k3num.harness.cli", "replay", str(bundle)).returncode == 1
    bad = _run("-m", "k3num.harness.cli", "repro", "K3N-999", "--out", str(tmp_path))
    assert bad.returncode == 2 and "no ledger entry 'K3N-999'" in bad.stderr
