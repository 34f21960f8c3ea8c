"""oracles.sanitizer reads compute-sanitizer's reports; scripts/gpu_sanitize.py refuses bad tool names
and skips (never passes) without compute-sanitizer."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from k3num.oracles import sanitizer

ROOT = Path(__file__).resolve().parents[1]
P = sanitizer.PREFIX

# the shapes of the reports compute-sanitizer 2025+ prints (written here from the format, shortened)
MEMCHECK = "\n".join([
    f"{P[:-1]}",
    f"{P}COMPUTE-SANITIZER",
    f"{sanitizer.MARKER}vllm attn_res K3N-009:num_blocks>bank",
    f"{P}Invalid __global__ read of size 2 bytes",
    f"{P}    at _attn_res_kernel+0x1b0 in attn_res.py:130",
    f"{P}    by thread (64,0,0) in block (2,0,0)",
    f"{P}    Access to 0x7f5d0a812780 is out of bounds",
    f"{P}    Saved host backtrace up to driver entry point at kernel launch time",
    f"{P}        Host Frame: launch [0x206b] in __triton_launcher.so",
    f"{P}",
    f"{P}Invalid __global__ read of size 2 bytes",
    f"{P}    at _attn_res_kernel+0x1b0 in attn_res.py:130",
    f"{P}    by thread (65,0,0) in block (2,0,0)",
    f"{sanitizer.MARKER}vllm aux_capture model:inner tap",
    f"{P}Program hit cudaErrorLaunchFailure (error 719) due to \"unspecified launch failure\" on CUDA API call to "
    "cudaStreamIsCapturing.",
    f"{P}    Saved host backtrace up to driver entry point at error",
    f"{P}ERROR SUMMARY: 3 errors",
])
INITCHECK = "\n".join([
    f"{sanitizer.MARKER}vllm context_kv_fused model:L=3",
    f"{P}Uninitialized __global__ memory read of size 2 bytes",
    f"{P}    at void at::native::elementwise_kernel<(int)128, (int)4, void at::native::gpu_kernel_impl_nocast<"
    "at::native::direct_copy_kernel_cuda(at::TensorIteratorBase &)>(int, T3)+0x13b0",
    f"{P}    by thread (64,0,0) in block (0,0,0)",
    f"{P}ERROR SUMMARY: 1 error",
])
RACECHECK = "\n".join([
    f"{sanitizer.MARKER}sglang attn_res_mix_triton model:H=1024,nvb=3",
    f"{P}Error: Race reported between Write access at _combine_kernel+0x90 in attn_residual.py:200",
    f"{P}    and Read access at _combine_kernel+0xa0 in attn_residual.py:201 [128 hazards]",
    f"{P}RACECHECK SUMMARY: 1 hazard displayed (1 error, 0 warnings)",
])


def test_memcheck_reports_are_grouped_by_subject_and_kernel_with_the_first_report() -> None:
    found, total = sanitizer.parse("memcheck", MEMCHECK)
    rows = {(f.subject, f.kernel): f for f in found}
    assert total == 3
    oob = rows[("vllm attn_res K3N-009:num_blocks>bank", "_attn_res_kernel")]
    assert (oob.hazards, oob.reports) == (2, 2)
    assert oob.first_report.startswith("Invalid __global__ read of size 2 bytes | at _attn_res_kernel+0x1b0")
    host = rows[("vllm aux_capture model:inner tap", "(host)")]
    assert host.reports == 1 and "cudaErrorLaunchFailure" in host.first_report


def test_a_templated_kernel_is_named_without_its_template_arguments() -> None:
    found, total = sanitizer.parse("initcheck", INITCHECK)
    assert total == 1 and [(f.kernel, f.hazards) for f in found] == [("at::native::elementwise_kernel", 1)]


def test_racecheck_counts_the_hazards_a_report_carries_and_reads_its_own_summary() -> None:
    found, total = sanitizer.parse("racecheck", RACECHECK)
    assert total == 1
    assert [(f.subject, f.kernel, f.hazards, f.reports) for f in found] == [
        ("sglang attn_res_mix_triton model:H=1024,nvb=3", "_combine_kernel", 128, 1)]


def test_a_clean_log_has_no_findings() -> None:
    assert sanitizer.parse("synccheck", f"{P}COMPUTE-SANITIZER\nran\n{P}ERROR SUMMARY: 0 errors\n") == ([], 0)


def test_an_unknown_tool_is_refused_with_the_valid_names() -> None:
    with pytest.raises(ValueError, match="valid: memcheck,racecheck,initcheck,synccheck"):
        sanitizer.check_tools("memcheck,leakcheck")
    assert sanitizer.check_tools("racecheck, memcheck") == ["racecheck", "memcheck"]


def _script(*args: str, path: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PATH": path}
    return subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_sanitize.py"), *args], cwd=ROOT, env=env,
                          capture_output=True, text=True)


def test_the_sanitizer_mode_refuses_an_unknown_tool(tmp_path: Path) -> None:
    r = _script("--sanitize", "memcheck,bogus", "--out", str(tmp_path), path=os.environ.get("PATH", ""))
    assert r.returncode == 2 and "unknown tool(s) ['bogus']; valid: memcheck,racecheck,initcheck,synccheck" in r.stderr


def test_without_compute_sanitizer_the_mode_skips_with_its_reason_and_does_not_pass(tmp_path: Path) -> None:
    r = _script("--out", str(tmp_path), path=str(Path(sys.executable).parent))  # no CUDA toolkit on this PATH
    assert r.returncode == 3, r.stdout + r.stderr
    assert "SKIPPED (not passed): compute-sanitizer is not on PATH" in r.stdout
    assert "skipped" in (tmp_path / "sanitizer.csv").read_text()
    assert "not on PATH" in (tmp_path / "sanitizer.md").read_text()


def test_the_initcheck_account_separates_the_engines_reports_from_the_mutants_and_the_control() -> None:
    """A clean run: 0 in the engines' cases and the cuBLAS control, > 0 in the unwritten-output mutants."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_sanitize", ROOT / "scripts" / "gpu_sanitize.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)

    def row(subject: str, n: int) -> dict:
        return {"tool": "initcheck", "subject": subject, "kernel": "k", "reports": n}

    clean = [row("mutant-attn_res_last_token_unwritten attn_res model", 128), row("control linear control", 0)]
    assert mod.initcheck_account(clean)[0].endswith(": as expected")
    assert mod.initcheck_account(clean + [row("vllm attn_res model", 3)])[0].endswith("NOT as expected")
    assert mod.initcheck_account([row("vllm attn_res model", 0)])[0].endswith("NOT as expected")  # blind
