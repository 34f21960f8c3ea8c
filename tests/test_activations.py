"""Bring-your-own activations (fixtures/activations.py, `k3num impact --activations`): a captured file runs
through the step with its taps in place of path 2, and every bad file is refused before anything runs,
naming the file and the tensor."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from k3num.fixtures import activations
from k3num.supply import fetch

ROOT = Path(__file__).resolve().parents[1]


def _good(k: int = 3, n: int = 8, h: int = 64, b: int | None = 7) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    out = {"taps": torch.randn(k, n, h, generator=g).to(torch.bfloat16), "positions": torch.arange(100, 100 + n)}
    if b:
        out["block_hidden"] = torch.randn(b, h, generator=g).to(torch.bfloat16)
    return out


def _write(path: Path, tensors: dict[str, torch.Tensor]) -> Path:
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path))
    return path


def test_a_captured_file_loads_with_its_shapes_and_positions_as_int64(tmp_path: Path) -> None:
    a = activations.load(_write(tmp_path / "a.safetensors", {**_good(), "positions": torch.arange(5, 13,
                                                                                                  dtype=torch.int32)}))
    assert a.shape == (3, 8, 64) and a.positions.dtype == torch.int64 and a.block_hidden.shape == (7, 64)
    assert activations.load(_write(tmp_path / "b.safetensors", _good(b=None))).block_hidden is None


BAD = {
    "an unknown tensor": (lambda t: {**t, "weights": torch.zeros(2)}, "tensor weights is not one of"),
    "no positions": (lambda t: {"taps": t["taps"]}, "no tensor positions"),
    "integer taps": (lambda t: {**t, "taps": t["taps"].to(torch.int32)}, "tensor taps is torch.int32"),
    "2-D taps": (lambda t: {**t, "taps": t["taps"][0]}, "tensor taps is [8, 64]; expected [K, N, H]"),
    "positions of another N": (lambda t: {**t, "positions": torch.arange(9)}, "tensor positions is [9]; expected [8]"),
    "positions going back": (lambda t: {**t, "positions": torch.tensor([0, 1, 2, 3, 3, 4, 5, 6])},
                             "not strictly increasing"),
    "a negative position": (lambda t: {**t, "positions": torch.arange(-1, 7)}, "negative position"),
    "NaN in the taps": (lambda t: {**t, "taps": t["taps"].index_fill(1, torch.tensor([2]), float("nan"))},
                        "tensor taps holds 192 NaN or Inf"),
    "block_hidden of another H": (lambda t: {**t, "block_hidden": torch.zeros(7, 32, dtype=torch.bfloat16)},
                                  "tensor block_hidden is [7, 32]; expected [B, 64]"),
    "too many taps": (lambda t: {**t, "taps": torch.zeros(17, 8, 64, dtype=torch.bfloat16)},
                      "tensor taps: K = 17 is outside [1, 16]"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_a_bad_file_is_refused_naming_the_file_and_the_tensor(tmp_path: Path, case: str) -> None:
    make, message = BAD[case]
    path = _write(tmp_path / "bad.safetensors", make(_good()))
    with pytest.raises(activations.ActivationsError, match=None) as e:
        activations.load(path)
    assert str(path) in str(e.value) and message in str(e.value), str(e.value)


def test_a_file_that_is_not_safetensors_is_refused(tmp_path: Path) -> None:
    bad = tmp_path / "x.safetensors"
    bad.write_bytes(b"\x80\x04not a header at all")
    with pytest.raises(activations.ActivationsError, match="not a readable safetensors file"):
        activations.load(bad)
    with pytest.raises(activations.ActivationsError, match="no such file"):
        activations.load(tmp_path / "missing.safetensors")


def _impact(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "k3num.harness.cli", "impact", "--device", "cpu", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=900)


def test_impact_runs_captured_taps_through_the_step_and_refuses_a_bad_file(tmp_path: Path) -> None:
    if fetch.missing_files("tokenspeed") or fetch.missing_files("vllm"):
        pytest.skip("tokenspeed and vllm are not fetched (k3num fetch tokenspeed vllm)")
    good = _write(tmp_path / "a.safetensors", _good())
    r = _impact("--activations", str(good), "--engine", "tokenspeed,vllm-rocm", "--cases", "1", "--format", "csv")
    assert r.returncode == 0, r.stdout + r.stderr[-2000:]
    rows = [line for line in r.stdout.splitlines() if line.startswith(("tokenspeed,", "vllm-rocm,"))]
    ts = [row for row in rows if row.startswith("tokenspeed,")]
    assert len(ts) == 2 and all("aux_capture=given taps;project_unsharded=engine" in row for row in ts), r.stdout
    # the only path vLLM ROCm binds is path 2, which given taps replace: nothing of it runs, and it says so
    assert all("path 2 is not run: the taps are given" in row for row in rows if row.startswith("vllm-rocm,"))
    bad = _write(tmp_path / "bad.safetensors", {**_good(), "positions": torch.arange(9)})
    r = _impact("--activations", str(bad), "--engine", "tokenspeed")
    assert r.returncode == 2 and "tensor positions is [9]; expected [8]" in r.stderr, r.stderr
    r = _impact("--activations", str(good), "--ledger")
    assert r.returncode == 2 and "leave out --activations" in r.stderr
