"""The golden sets' cost and saving at K3 shapes: the size of a set, and per example the time to read
its stored float64 outputs (memory-mapped safetensors, moved to the device) against recomputing them
with the live oracle on the device. Prints a table (and writes it as CSV with --csv).

Usage: python bench/golden_speed.py [--device cpu|cuda] [--cases 4] [--reps 5] [--csv PATH]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import pandas as pd  # noqa: E402
import torch  # noqa: E402

from bench.timing import median_seconds  # noqa: E402
from k3num.fixtures import golden  # noqa: E402
from k3num.refmodel import attn_res as ref  # noqa: E402
from k3num.refmodel import geometry, mla  # noqa: E402


def _up(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.float64)


def _live(kind: str, preset: str, case: golden.GoldenCase, device: torch.device):
    i = {k: v.to(device) for k, v in case.inputs.items()}
    if kind == "attn_res":
        p = case.params
        prefix = i["prefix"] if "delta" not in i else (i["prefix"].float() + i["delta"].float()).to(torch.bfloat16)
        return lambda: ref.attn_res(_up(prefix), None, _up(i["blocks"]), _up(i["norm"]), _up(i["qk"]),
                                    _up(i["out_norm"]) if "out_norm" in i else None, p["num_blocks"],
                                    p["block_write_idx"], 1e-5, 1e-6)
    g = geometry.preset(preset)
    assert isinstance(g, geometry.MLADraftGeometry)
    return lambda: mla.context_kv(_up(i["x"]), _up(i["kv_a"]), _up(i["norm"]), i["positions"], g.rope, 1e-5)


def _stored(root: Path, name: str, device: torch.device):
    from safetensors import safe_open

    def read():
        with safe_open(str(root / name), framework="pt") as fh:
            return [fh.get_tensor(k).to(device) for k in fh.keys() if k.startswith("out.")]
    return read


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--cases", type=int, default=4)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--csv", default=None)
    args = ap.parse_args()
    device = torch.device(args.device)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for preset in ("k3-attnres", "k3-dspark"):
            root = golden.write(preset, args.cases, Path(tmp) / preset, log=lambda *_: None)
            manifest = golden.load_manifest(root)
            size = sum((root / n).stat().st_size for n in manifest["files"])
            for name, case in golden.cases(root):
                live = median_seconds(_live(manifest["kind"], preset, case, device), device, args.reps)
                stored = median_seconds(_stored(root, name, device), device, args.reps)
                rows.append({"preset": preset, "case": name, "tokens": case.params["tokens"],
                             "set_MiB": round(size / 2**20, 1), "live_ms": round(live * 1e3, 2),
                             "golden_ms": round(stored * 1e3, 2), "saved_ms": round((live - stored) * 1e3, 2),
                             "ratio": round(live / stored, 1) if stored > 0 else float("inf")})
    df = pd.DataFrame(rows)
    print(f"golden sets vs the live oracle on {device} ({args.cases} cases per preset, median of {args.reps})")
    print(df.to_string(index=False))
    if args.csv:
        df.to_csv(args.csv, index=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
