"""Golden sets (fixtures/golden.py, `k3num golden write`, `pytest --golden DIR`): stored outputs
equal the live oracle bitwise; a tampered file, a missing or extra one, or another oracle's set is
refused naming the file; the golden properties pass the mirror and fail a mutant."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from k3num.fixtures import golden
from k3num.refmodel import attn_res as ref
from k3num.refmodel import geometry, mla

ROOT = Path(__file__).resolve().parents[1]


def _up(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.float64)


@pytest.fixture(scope="module")
def sets(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("golden")
    return {kind: golden.write(preset, 4, base / preset, seed=3, log=lambda *_: None)
            for kind, preset in (("attn_res", "tiny-attnres"), ("context_kv", "tiny-dspark"))}


def _copy(src: Path, dst: Path) -> Path:
    dst.mkdir()
    for p in src.iterdir():
        (dst / p.name).write_bytes(p.read_bytes())
    return dst


def test_stored_attn_res_outputs_equal_the_live_oracle_bitwise(sets) -> None:
    for _, case in golden.cases(sets["attn_res"]):
        p, i = case.params, case.inputs
        prefix = i["prefix"] if "delta" not in i else (i["prefix"].float() + i["delta"].float()).to(torch.bfloat16)
        want, new_prefix, new_blocks = ref.attn_res(_up(prefix), None, _up(i["blocks"]), _up(i["norm"]), _up(i["qk"]),
                                                    _up(i["out_norm"]) if "out_norm" in i else None, p["num_blocks"],
                                                    p["block_write_idx"], 1e-5, 1e-6)
        for name, live in (("want", want), ("new_prefix", new_prefix), ("new_blocks", new_blocks)):
            assert torch.equal(case.outputs[name], live), name


def test_stored_context_kv_outputs_equal_the_live_oracle_bitwise(sets) -> None:
    g = geometry.preset("tiny-dspark")
    assert isinstance(g, geometry.MLADraftGeometry)
    for _, case in golden.cases(sets["context_kv"]):
        i = case.inputs
        kv_c, k_pe = mla.context_kv(_up(i["x"]), _up(i["kv_a"]), _up(i["norm"]), i["positions"], g.rope, 1e-5)
        assert torch.equal(case.outputs["kv_c"], kv_c) and torch.equal(case.outputs["k_pe"], k_pe)


def test_a_tampered_case_file_is_refused_naming_it(sets, tmp_path: Path) -> None:
    bad = _copy(sets["attn_res"], tmp_path / "set")
    victim = bad / "case-0002.safetensors"
    data = bytearray(victim.read_bytes())
    data[-3] ^= 0x01  # one bit of a stored output
    victim.write_bytes(bytes(data))
    with pytest.raises(golden.GoldenError, match=r"case-0002\.safetensors: sha256 [0-9a-f]+, the manifest says"):
        golden.load_manifest(bad)


@pytest.mark.parametrize("change, match", [
    ("refmodel", r"manifest\.json: written by refmodel 0+, this refmodel is"),
    ("missing", r"case-0001\.safetensors: listed in the manifest but missing"),
    ("extra", r"case-0009\.safetensors: not in the manifest"),
    ("format", r"manifest\.json: format 'other', expected"),
])
def test_a_manifest_mismatch_is_refused_naming_the_file(sets, tmp_path: Path, change: str, match: str) -> None:
    bad = _copy(sets["attn_res"], tmp_path / "set")
    m = json.loads((bad / golden.MANIFEST).read_text())
    if change == "refmodel":
        m["refmodel_version"] = "0" * 64
    elif change == "missing":
        (bad / "case-0001.safetensors").unlink()
    elif change == "extra":
        (bad / "case-0009.safetensors").write_bytes(b"x")
    else:
        m["format"] = "other"
    (bad / golden.MANIFEST).write_text(json.dumps(m))
    with pytest.raises(golden.GoldenError, match=match):
        golden.load_manifest(bad)


def test_the_cli_refuses_an_unknown_preset_and_a_non_empty_directory(tmp_path: Path) -> None:
    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "k3num.harness.cli", "golden", "write", *args], cwd=ROOT,
                              capture_output=True, text=True)

    r = run("--preset", "k3-nothing", "--cases", "2", "--out", str(tmp_path / "a"))
    assert r.returncode == 2 and "unknown golden preset 'k3-nothing'" in r.stderr
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "x").write_text("")
    r = run("--preset", "tiny-attnres", "--cases", "2", "--out", str(tmp_path / "b"))
    assert r.returncode == 2 and "not empty" in r.stderr


def _pytest(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pytest", "properties/test_golden.py", "-q", "-p", "no:cacheprovider",
                           *args], cwd=ROOT, capture_output=True, text=True)


def test_pytest_refuses_a_tampered_set_before_running(sets, tmp_path: Path) -> None:
    bad = _copy(sets["context_kv"], tmp_path / "set")
    (bad / "case-0000.safetensors").write_bytes(b"not the stored case")
    r = _pytest("--engine", "mirror", "--golden", str(bad))
    assert r.returncode == 4 and "--golden:" in r.stderr and "case-0000.safetensors: sha256" in r.stderr


def test_the_golden_properties_pass_the_mirror_and_fail_a_mutant(sets) -> None:
    ok = _pytest("--engine", "mirror", "--golden", str(sets["attn_res"]))
    assert ok.returncode == 0 and "4 passed" in ok.stdout, ok.stdout[-2000:]
    bad = _pytest("-p", "tests.mutants", "--engine", "mutant-one_bank_row_too_many", "--golden", str(sets["attn_res"]))
    assert bad.returncode == 1 and "golden_attn_res_within_rounding_budget" in bad.stdout, bad.stdout[-2000:]
