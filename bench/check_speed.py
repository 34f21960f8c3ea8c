"""What `k3num check` costs against a plain run of the same selection (the target: at most 2.2x).

For each engine (default: tokenspeed and sglang, whole suite; vllm with -k attn_res), times, on this
machine: the plain property run (`pytest --pyargs k3num.properties --engine E --engine-src E=COPY`,
the pinned bytes as a local tree) and `k3num check --engine E --head COPY` on the same selection
and profile (both sides of every example, the judgement and the report). Prints a table; wall
seconds of one run each (median of --reps).

    python bench/check_speed.py [--reps 1] [--profile ci] [--engines tokenspeed,sglang,vllm]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from k3num.harness import fixes  # noqa: E402
from k3num.harness.check import _plugin_args  # noqa: E402
from k3num.supply import fetch  # noqa: E402

SELECT = {"vllm": "attn_res"}


def _timed(cmd: list[str], cwd: Path) -> tuple[float, int]:
    t0 = time.perf_counter()
    r = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True)
    return time.perf_counter() - t0, r.returncode


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=1)
    ap.add_argument("--profile", default="ci")
    ap.add_argument("--engines", default="tokenspeed,sglang,vllm")
    ap.add_argument("-k", default=None, help="one -k expression for every engine (default: vllm -k attn_res)")
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for engine in args.engines.split(","):
            pin = engine.split("-")[0]
            if not fetch.verified_manifest(pin):
                print(f"[bench] {engine}: not fetched, skipped (k3num fetch {pin})", file=sys.stderr)
                continue
            copy = fixes.pinned_tree(pin, Path(tmp) / pin)
            expr = args.k or SELECT.get(engine)
            k = ["-k", expr] if expr else []
            plain = [sys.executable, "-m", "pytest", *_plugin_args(), "--pyargs", "k3num.properties", "--engine",
                     engine, "--engine-src", f"{pin}={copy}", "--engine-mode", "source",
                     f"--hypothesis-profile={args.profile}", "-p", "no:cacheprovider", "-q", *k]
            check = [sys.executable, "-m", "k3num.harness.cli", "check", "--engine", engine, "--head", str(copy),
                     "--hypothesis-profile", args.profile, "--out", str(Path(tmp) / f"out-{engine}"), *k]
            times: dict[str, list[float]] = {"plain": [], "check": []}
            for _ in range(args.reps):
                for name, cmd in (("plain", plain), ("check", check)):
                    print(f"[bench] {engine}: {name} run", file=sys.stderr)
                    sec, rc = _timed(cmd, Path.cwd())
                    if rc not in (0, 1):
                        print(f"[bench] {engine}: {name} exited {rc}", file=sys.stderr)
                    times[name].append(sec)
            p, c = statistics.median(times["plain"]), statistics.median(times["check"])
            rows.append((engine, " ".join(k) or "(all)", p, c, c / p))
    print(f"{'engine':<11} {'selection':<12} {'plain s':>8} {'check s':>8} {'ratio':>6}")
    for engine, sel, p, c, ratio in rows:
        print(f"{engine:<11} {sel:<12} {p:>8.1f} {c:>8.1f} {ratio:>6.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
