#!/usr/bin/env python
"""Show that each ledger finding's smallest fix turns its properties green (harness/fixes.py).

For each fix: the properties on the pinned engine (expected: xfailed, the ledger's strict xfail),
then on a patched copy through --engine-src (expected: passed). Prints a table, writes it as CSV.
With --mutants: the deliberately broken kernels (harness.fixes.TREE_MUTANTS) instead, each of which
must make its properties fail on the patched copy (the pinned run must pass).
Usage: scripts/prove_fixes.py [--fix ID ...] [--profile P] [--out DIR] [--cpu-only] [--mutants]
Exit 0 when every patched run passes and every pinned run fails as the ledger says (with --mutants:
every mutant is caught).
"""

from __future__ import annotations

import argparse
import csv
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from k3num.harness import accounting, fixes  # noqa: E402


def _pytest(fix: fixes.Fix, engine: str, profile: str, tree: Path | None) -> tuple[str, float, str]:
    cmd = [sys.executable, "-m", "pytest", *fix.tests, "--engine", engine, "-q", "-p", "no:cacheprovider",
           f"--hypothesis-profile={profile}", "-rxXfE"]
    if tree is not None:
        cmd += ["--engine-src", f"{fix.engine}={tree}"]
    t0 = time.time()
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    tail = accounting.tally(r.stdout) or r.stderr[-300:]
    counts = dict((k, int(n)) for n, k in re.findall(r"(\d+) (passed|failed|xfailed|xpassed|skipped|error)", tail))
    return ",".join(f"{k}={v}" for k, v in sorted(counts.items())) or tail, time.time() - t0, r.stdout


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--fix", action="append", default=[], help=f"one of {[f.id for f in fixes.FIXES]} (default: all)")
    ap.add_argument("--profile", default="ci")
    ap.add_argument("--out", type=Path, default=ROOT / "out" / "fixes")
    ap.add_argument("--cpu-only", action="store_true", help="only the fixes whose failure shows on a CPU")
    ap.add_argument("--mutants", action="store_true", help="the broken kernels instead of the fixes")
    args = ap.parse_args()
    pool = fixes.TREE_MUTANTS if args.mutants else fixes.FIXES
    chosen = [fixes.by_id(i) for i in args.fix] if args.fix else list(pool)
    if args.cpu_only:
        chosen = [f for f in chosen if not f.gpu]
    args.out.mkdir(parents=True, exist_ok=True)
    rows, ok = [], True
    for fix in chosen:
        tree = fixes.patched_tree(fix, args.out / "trees" / fix.id.replace("/", "_"))
        for engine in fix.engines:
            print(f"== {fix.id} on {engine}", flush=True)
            before, t_before, _ = _pytest(fix, engine, args.profile, None)
            after, t_after, log = _pytest(fix, engine, args.profile, tree)
            (args.out / f"{fix.id.replace('/', '_')}-{engine}.log").write_text(log)
            if args.mutants:  # the pinned kernel passes, the broken one fails
                good = "failed=" in after.replace("xfailed", "") and "failed=" not in before.replace("xfailed", "")
            else:
                good = "xfailed" in before and "failed=" not in after.replace("xfailed", "") and "passed" in after \
                    and "error" not in after
            ok &= good
            rows.append({"fix": fix.id, "engine": engine, "pinned": before, "patched": after,
                         "pinned_s": f"{t_before:.0f}", "patched_s": f"{t_after:.0f}",
                         "verdict": ("caught" if good else "NOT CAUGHT") if args.mutants else
                         ("fixed" if good else "NOT SHOWN")})
            print(f"   pinned: {before} ({t_before:.0f} s); patched: {after} ({t_after:.0f} s) -> "
                  f"{rows[-1]['verdict']}", flush=True)
    with open(args.out / "fixes.csv", "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=list(rows[0]) if rows else ["fix"])
        w.writeheader()
        w.writerows(rows)
    print("\n| fix | engine | pinned | patched | verdict |\n|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['fix']} | {r['engine']} | {r['pinned']} | {r['patched']} | {r['verdict']} |")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
