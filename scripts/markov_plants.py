"""Bugs planted in vLLM 0.34.0's fused Markov steps (specialized_decode/drafter/markov.py, Triton), for the CPU and
the GPU (the mirror's copies of the same kinds of bug are tests/mutants.py MARKOV_MUTANTS).

    python scripts/markov_plants.py OUT [NAME ...]

writes, for each plant (all of them without NAME, plus `control`, a comment), OUT/NAME: the pinned vLLM files laid
out as a checkout, markov.py edited. Then `pytest properties/test_markov.py --engine vllm --engine-src
vllm=OUT/NAME` must fail for every plant and pass for the control: under the interpreter on the CPU
(tests/test_markov_plants.py, in CI) and as compiled on a GPU (scripts/device_session.sh part `markov`). Each edit
must match exactly once in the pinned file (checked there too, so a release that moves the text is noticed).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the device machine runs it from a plain checkout

KERNEL = "vllm/models/kimi_k3/nvidia/specialized_decode/drafter/markov.py"

# name -> (the text to find, once; its replacement; what the bug does)
PLANTS: dict[str, tuple[str, str, str]] = {
    "markov_take_last_max": (
        "        take = bv > best_val\n",
        "        take = bv >= best_val\n",
        "of equal maxima in two tiles of one program the later one wins (the first must)"),
    # (tie_break_left=False was tried first: on the H100 Triton's argmax still returned the first of equal maxima
    # in every drawn case, so that edit changes nothing there; this one takes the last on every backend)
    "markov_select_last_max": (
        "    best = tl.argmax(m, axis=0, tie_break_left=True)\n",
        "    best = tl.max(tl.where(m == tl.max(m, axis=0), j, -1), axis=0)\n",
        "of equal per-program maxima the select kernel takes the last program's (the first must win)"),
    "markov_bias_unrounded": (
        "        logits = _add_rn(base.to(tl.float32), acc.to(dt).to(tl.float32)).to(dt)\n",
        "        logits = _add_rn(base.to(tl.float32), acc).to(dt)\n",
        "the float32 dot added to the base logits without its rounding to the logits' dtype (the GEMV's output)"),
    "markov_noise_position_unshifted": (
        "    pos = tl.load(pos_ptr + row * pos_stride + step) - 1\n",
        "    pos = tl.load(pos_ptr + row * pos_stride + step)\n",
        "the precomputed noise keyed by the sampled token's position P, not P - 1 as the sampler keys its draw"),
    "markov_step_seed_unmixed": (
        "    seed = spec_step_seed(tl.load(seeds_ptr + req, mask=valid, other=0), STEP)\n",
        "    seed = tl.load(seeds_ptr + req, mask=valid, other=0)\n",
        "the hashed noise of every step drawn with the request's seed, not the seed mixed with the step"),
    "markov_masked_lanes_compete": (
        "        x = tl.where(vmask[None, :], x, float(\"-inf\"))\n",
        "",
        "the tile's lanes past the vocabulary (logits 0 and their noise) take part in the argmax"),
    "control": ("\n", "\n# a head's edit, a comment only (scripts/markov_plants.py)\n",
                "a comment: nothing may change"),
}


def planted(text: str, name: str) -> str:
    """The kernel's text with plant `name` applied; ValueError unless its text occurs exactly once (the control
    edits the file's first newline)."""
    from k3num.harness import fixes

    return fixes.planted_text(text, name, PLANTS, KERNEL)


def make(out: Path, names: list[str]) -> list[Path]:
    from k3num.harness import fixes

    trees = []
    for name in names:
        tree = fixes.pinned_tree("vllm", out / name)
        kernel = tree / KERNEL
        kernel.write_text(planted(kernel.read_text(), name))
        trees.append(tree)
    return trees


def main(argv: list[str] | None = None) -> int:
    from k3num.harness import fixes

    return fixes.plants_main(argv, __doc__.split("\n\n")[0], PLANTS, make)


if __name__ == "__main__":
    raise SystemExit(main())
