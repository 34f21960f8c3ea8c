"""Draw.normal_as against normal(...).to(dtype) on this machine's device, bit for bit: the one-pass draw of the
draft step's weights (fixtures/builders.draft_step_inputs) must draw the values the two-pass one drew.

Usage: python scripts/draw_identity.py [--device cuda]   (prints one line per case; exit 1 on a difference)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> int:
    from k3num.fixtures.tensors import Draw

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()
    cases = [((64, 48), 0.125), ((3, 257, 129), 7168**-0.5), ((1000, 77), 10.0 * 64**-0.5), ((5,), 1.0)]
    if args.device.startswith("cuda"):
        cases += [((163840, 7168), 10.0 * 7168**-0.5), ((5, 24576, 7168), 7168**-0.5)]  # K3's LM head, DSpark q_proj
    bad = 0
    for seed in (0, 1, 1000):
        for shape, scale in cases:
            old = Draw.for_device(seed, args.device).normal(shape, scale).to(torch.bfloat16)
            new = Draw.for_device(seed, args.device).normal_as(shape, scale, torch.bfloat16)
            same = old.dtype == new.dtype and torch.equal(old.view(torch.int16), new.view(torch.int16))
            bad += not same
            print(f"seed {seed} shape {list(shape)} scale {scale:.4g}: {'identical' if same else 'DIFFERENT'}")
            del old, new
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
