"""One planted bug fails only its own tests on the GPU (issue 20): the isolation proof.

Plants a bug in one SGLang kernel (harness/fixes.py PLANTED: `combine-scaled`, a wrong mixture from
`_combine_kernel`; `combine-illegal-address`, a store 2^40 elements past its output), instruments the
kernel's launcher to record which tests call it, and runs the property suite on that tree through
`--engine-src sglang=TREE` on cuda. Writes OUT/isolation.md and OUT/isolation.csv:
- every test with its outcome, whether it called the planted kernel, its peak CUDA memory and what
  it still held after its teardown (the plugin's K3NUM_MEMORY_LOG);
- the verdict: no test that never called the kernel failed; the peak stayed below the bound given with
  --peak-bound-gib; for the illegal address, the tests after it are "not run: CUDA context lost",
  not failed.

    python scripts/gpu_isolation.py --plant combine-scaled --out OUT [--profile ci] [--timeout 300]
    python scripts/gpu_isolation.py --plant none --out OUT     # the control: the pinned files
"""

from __future__ import annotations

import argparse
import csv
import os
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from k3num.harness import fixes  # noqa: E402

LOST = "not run: CUDA context lost"


def outcomes(junit: Path) -> dict[str, tuple[str, str]]:
    """node id -> (outcome, message) from a junit file (pytest's classname/name back to a node id)."""
    out: dict[str, tuple[str, str]] = {}
    if not junit.exists():
        return out
    for case in ET.parse(junit).iter("testcase"):
        cls, name = case.get("classname", ""), case.get("name", "")
        node = cls.replace(".", "/") + ".py::" + name if cls else name  # properties.test_x -> properties/test_x.py
        kind, msg = "passed", ""
        for tag in ("failure", "error", "skipped"):
            el = case.find(tag)
            if el is not None:
                kind, msg = {"failure": "failed", "error": "error", "skipped": "skipped"}[tag], el.get("message", "")
                break
        out[node] = (kind, msg[:200])
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--plant", required=True, choices=["none", *(f.id for f in fixes.PLANTED)])
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--profile", default="ci")
    ap.add_argument("--timeout", type=int, default=300)
    ap.add_argument("--device", default="cuda", help="cuda (the proof), or cpu to try the script here")
    ap.add_argument("--peak-bound-gib", type=float, default=0.0,
                    help="fail when a test's peak CUDA memory exceeds this (0: report only)")
    ap.add_argument("pytest_args", nargs="*", help="more pytest arguments (after --)")
    args = ap.parse_args()
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    for f in ("calls.txt", "memory.csv"):
        (out / f).unlink(missing_ok=True)
    src = []
    if args.plant != "none":
        tree = fixes.patched_tree(fixes.by_id(args.plant), out / "tree")
        src = ["--engine-src", f"sglang={tree}"]
    env = dict(os.environ, K3NUM_PLANT_LOG=str(out / "calls.txt"), K3NUM_MEMORY_LOG=str(out / "memory.csv"),
               PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-m", "pytest", "properties", "--engine", "sglang", "--device", args.device, *src,
           "-p", "no:cacheprovider", "-q", "-rN", f"--hypothesis-profile={args.profile}",
           "--junitxml", str(out / "junit.xml"), "--drift-csv", str(out / "drift.csv"), *args.pytest_args]
    print(f"[isolation] {args.plant}: {' '.join(cmd[2:])}", flush=True)
    t0 = time.time()
    with open(out / "pytest.log", "w") as logf:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=logf, stderr=subprocess.STDOUT, text=True)
        try:
            rc = proc.wait(timeout=args.timeout)
        except subprocess.TimeoutExpired:  # SIGINT: pytest stops, reports and writes its junit file
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
            rc = 124
    wall = time.time() - t0
    results = outcomes(out / "junit.xml")
    callers = set((out / "calls.txt").read_text().split()) if (out / "calls.txt").exists() else set()
    memory: dict[str, list[str]] = {}
    if (out / "memory.csv").exists():
        for row in csv.reader((out / "memory.csv").read_text().splitlines()):
            memory[row[0]] = row
    rows = []
    for node in sorted(set(results) | set(memory)):
        kind, msg = results.get(node, (memory.get(node, ["", "?"])[1] or "?", ""))
        m = memory.get(node, [node, "", "-1", "-1", "-1", "-1", ""])
        rows.append({"node": node, "outcome": kind, "calls_kernel": node in callers,
                     "peak_gib": int(m[2]) / 2**30 if m[2].lstrip("-").isdigit() else -1,
                     "held_after_gib": int(m[4]) / 2**30 if m[4].lstrip("-").isdigit() else -1,
                     "message": msg or (m[6] if len(m) > 6 else "")})
    with open(out / "isolation.csv", "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=list(rows[0]) if rows else ["node"])
        w.writeheader()
        w.writerows(rows)
    failed = [r for r in rows if r["outcome"] in ("failed", "error")]
    outside = [r for r in failed if not r["calls_kernel"]]
    lost = [r for r in rows if r["outcome"] == "skipped" and r["message"].startswith(LOST)]
    peak = max((r["peak_gib"] for r in rows), default=0.0)
    held = max((r["held_after_gib"] for r in rows), default=0.0)
    lines = [f"# GPU isolation: plant `{args.plant}`, profile {args.profile}", "",
             f"pytest exit {rc} in {wall:.0f} s; {len(rows)} tests: "
             f"{sum(r['outcome'] == 'passed' for r in rows)} passed, {len(failed)} failed or error, "
             f"{sum(r['outcome'] == 'skipped' for r in rows)} skipped ({len(lost)} of them '{LOST}'); "
             f"{len(callers)} tests called the kernel.",
             f"Peak CUDA memory of one test {peak:.2f} GiB; the most a test left allocated after its "
             f"teardown (after gc) {held:.2f} GiB.", "",
             f"Failed without calling the planted kernel: {len(outside)}"]
    lines += [f"- {r['node']}: {r['message']}" for r in outside[:30]]
    lines += ["", "Failed (all):"] + [f"- {r['node']} (calls kernel: {r['calls_kernel']}): {r['message']}"
                                      for r in failed[:60]]
    lines += ["", "Called the kernel and passed:"] + [f"- {r['node']}" for r in rows
                                                      if r["calls_kernel"] and r["outcome"] == "passed"][:40]
    ok = not outside and (not args.peak_bound_gib or peak <= args.peak_bound_gib)
    lines += ["", f"VERDICT: {'isolated' if ok else 'NOT isolated'}"]
    (out / "isolation.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines[:8] + lines[-1:]), flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
