#!/usr/bin/env python
"""The nightly's sanitizer mode: every kernel subject once per compute-sanitizer tool, at small shapes.

Usage: scripts/gpu_sanitize.py [--sanitize memcheck,racecheck,initcheck,synccheck] [--out DIR]
       [--engines vllm,vllm-rocm,sglang] [--timeout S]
Runs scripts/sanitize_subjects.py under `compute-sanitizer --tool T` for each tool (caching
allocator off, so a read past a tensor is past its allocation), parses the reports
(oracles.sanitizer) and writes DIR/sanitizer.csv (tool, subject, kernel, hazards, reports, first
report) and DIR/sanitizer.md, plus each tool's raw log.
Exit: 0 when it ran (findings are data: the summary lists them); 2 on bad input; 3 when skipped
because compute-sanitizer is not on PATH (the reason is printed and written; a skip is not a pass).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import pandas as pd  # noqa: E402

from k3num.oracles import sanitizer  # noqa: E402

SKIPPED = 3
OFF_PATH = ("K3N-009:num_blocks>bank", "K3N-008:H=1536,nvb=2")  # scripts/sanitize_subjects.py


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sanitize", default=",".join(sanitizer.TOOLS), metavar="TOOLS")
    ap.add_argument("--out", type=Path, default=ROOT / "out" / "sanitize")
    ap.add_argument("--engines", default="vllm,vllm-rocm,sglang")
    ap.add_argument("--timeout", type=int, default=240, help="seconds per tool")
    args = ap.parse_args(argv)
    try:
        tools = sanitizer.check_tools(args.sanitize)
    except ValueError as e:
        print(f"gpu_sanitize: {e}", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    exe = shutil.which("compute-sanitizer")
    if exe is None:
        why = ("SKIPPED (not passed): compute-sanitizer is not on PATH (it ships with the CUDA toolkit, e.g. "
               "/usr/local/cuda/bin)")
        print(why)
        (args.out / "sanitizer.md").write_text(f"# compute-sanitizer\n\n{why}\n")
        pd.DataFrame([{"tool": t, "status": "skipped", "detail": why} for t in tools]).to_csv(
            args.out / "sanitizer.csv", index=False)
        return SKIPPED
    rows: list[dict] = []
    env = {**os.environ, "PYTORCH_NO_CUDA_MEMORY_CACHING": "1", "PYTHONUNBUFFERED": "1"}
    # initcheck runs without the poison and with GEMM outputs marked initialised, its unwritten mutants beside
    # the engines (scripts/sanitize_subjects.py --initcheck says why)
    runs = [(tool, ["--cases", "model", *(["--initcheck"] if tool == "initcheck" else [])]) for tool in tools]
    if "memcheck" in tools:  # each out-of-bounds reproducer in its own process (the context dies after it)
        runs += [("memcheck", ["--cases", "off-path", "--only", label]) for label in OFF_PATH]
    for tool, extra in runs:
        # initcheck: cuBLAS's own kernels are not checked (they read their split-K workspace, which initcheck
        # reports as uninitialised on the H200: GPU run 56's control); their outputs are zero-filled first
        skip = ["--kernel-name-exclude", "kns=cublas", "--print-limit", "2000"] if tool == "initcheck" else \
            ["--print-limit", "200"]
        cmd = [exe, "--tool", tool, *skip, "--target-processes", "all",
               sys.executable, str(ROOT / "scripts" / "sanitize_subjects.py"), "--engines", args.engines, *extra]
        what = " ".join(x for x in extra[1:] if not x.startswith("--"))
        print(f"== {tool} [{what}]", flush=True)
        t0 = time.time()
        try:
            r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=args.timeout)
            text, rc, status = r.stdout + r.stderr, r.returncode, "ran"
        except subprocess.TimeoutExpired as e:
            text = (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
            rc, status = -1, f"timeout after {args.timeout} s"
        log = f"{tool}.log" if extra[1] == "model" else f"{tool}-{extra[-1].split(':')[0]}.log"
        (args.out / log).write_text(text)
        findings, total = sanitizer.parse(tool, text)
        ran = sum(1 for line in text.splitlines() if line.lstrip().startswith("ran "))
        print(f"   {status} in {time.time() - t0:.0f} s (exit {rc}); {ran} subject cases ran; "
              f"{len(findings)} (subject, kernel) with reports; ERROR SUMMARY {total}", flush=True)
        rows.append({"tool": tool, "status": status, "subject": f"({what})", "kernel": "(summary)", "hazards": total,
                     "reports": sum(f.reports for f in findings), "cases_ran": ran, "exit": rc,
                     "seconds": round(time.time() - t0), "first_report": ""})
        for f in findings:
            rows.append({"tool": tool, "status": status, "subject": f.subject, "kernel": f.kernel,
                         "hazards": f.hazards, "reports": f.reports, "cases_ran": "", "exit": "",
                         "seconds": "", "first_report": f.first_report})
    df = pd.DataFrame(rows)
    df.to_csv(args.out / "sanitizer.csv", index=False)
    md = ["# compute-sanitizer over the kernel subjects", "", "```",
          df.drop(columns=["first_report"]).to_string(index=False), "```", ""]
    if "initcheck" in tools:
        md += initcheck_account(rows) + [""]
    for f in (r for r in rows if r["first_report"]):
        md.append(f"- **{f['tool']}** {f['subject']} `{f['kernel']}`: {f['first_report'][:300]}")
    (args.out / "sanitizer.md").write_text("\n".join(md) + "\n")
    print(df.drop(columns=["first_report"]).to_string(index=False))
    return 0


def initcheck_account(rows: list[dict]) -> list[str]:
    """initcheck's reports split by whose case they fall in: the engines' (what needs explaining: 0 on a clean
    run), the unwritten-output mutants' (must be > 0: the mode sees an unwritten read) and the control's."""
    found = [r for r in rows if r["tool"] == "initcheck" and r["kernel"] != "(summary)"]
    mutant = sum(int(r["reports"]) for r in found if r["subject"].startswith("mutant-"))
    control = sum(int(r["reports"]) for r in found if r["subject"].startswith("control "))
    engines = sum(int(r["reports"]) for r in found if not r["subject"].startswith(("mutant-", "control ")))
    ok = engines == 0 and control == 0 and mutant > 0
    return [f"initcheck: {engines} report(s) in the engines' cases (unexplained: 0 expected), {control} in the "
            f"cuBLAS control (0 expected), {mutant} in the unwritten-output mutants (> 0 expected): "
            f"{'as expected' if ok else 'NOT as expected'}"]


if __name__ == "__main__":
    sys.exit(main())
