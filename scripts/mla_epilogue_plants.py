"""Bugs planted in vLLM's fused MLA prefill epilogue kernel, for the GPU (the mirror's copies of the same bugs are
tests/mutants.py EPILOGUE_MUTANTS, which the CPU suite proves caught).

    python scripts/mla_epilogue_plants.py OUT [NAME ...]

writes, for each plant (all of them without NAME, plus `control`, a comment), OUT/NAME: the pinned vLLM files
laid out as a checkout with the default release's csrc beside them, the kernel file edited. Then, on a CUDA
machine, `k3num build-ops --engine-src vllm=OUT/NAME` and `pytest properties/test_mla_epilogue.py --engine vllm
--engine-src vllm=OUT/NAME --device cuda` must fail for every plant and pass for the control
(scripts/device_session.sh part `epilogue`). Each edit must match exactly once (tests/test_mla_epilogue_plants.py
checks it against the pinned csrc of every release, so a release that moves the text is noticed on the CPU).
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the device machine runs it from a plain checkout

KERNEL = "csrc/fused_kimi_k3_mla_key_concat_kv_cache_kernel.cu"

# name -> (the text to find, once; its replacement; what the bug does)
PLANTS: dict[str, tuple[str, str, str]] = {
    "epilogue_rope_sin_negated": (
        "          f[2 * i] = x * cos - y * sin;\n          f[2 * i + 1] = x * sin + y * cos;\n",
        "          f[2 * i] = x * cos + y * sin;\n          f[2 * i + 1] = -x * sin + y * cos;\n",
        "every rotated pair turned by the opposite angle (copyChunk8: q, the key and the cache alike)"),
    "epilogue_fp8_rope_via_bf16": (
        "      if constexpr (!FP8) {\n",
        "      if constexpr (FP8 && APPLY_ROPE) {\n#pragma unroll\n        for (int i = 0; i < kVecElems; i++) {\n"
        "          f[i] = __bfloat162float(__float2bfloat16(f[i]));\n        }\n      }\n"
        "      if constexpr (!FP8) {\n",
        "the fp8 path's rotated values rounded to bf16 before they are scaled and quantized (one rounding more)"),
    "epilogue_cache_with_k_scale": (
        "      float const ksi = __ldg(cache_scale_inv);\n",
        "      float const ksi = __ldg(k_scale_inv);\n",
        "the fp8 prefill kernel's cache latent quantized with the attention key's scale, not the cache's"),
    "epilogue_skipped_slot_written": (
        "    int64_t const slot_id = slot_mapping[tokenIdx];\n    if (slot_id >= 0) {\n      scalar_t* row = k_cache +",
        "    int64_t const slot_id = slot_mapping[tokenIdx] < 0 ? 0 : slot_mapping[tokenIdx];\n"
        "    if (slot_id >= 0) {\n      scalar_t* row = k_cache +",
        "the bf16 insert writes a skipped token (slot -1) into slot 0"),
    "epilogue_decode_cache_with_q_scale": (
        "      float const ksi = KV_FP8 ? __ldg(cache_scale_inv) : 1.0f;\n",
        "      float const ksi = KV_FP8 ? __ldg(q_scale_inv) : 1.0f;\n",
        "the fp8 decode epilogue's cache latent quantized with the query's scale, not the cache's"),
    "epilogue_decode_split_lanes_overlap": (
        "  int const lane = part * 32 + laneId;\n",
        "  int const lane = laneId;\n",
        "the decode epilogue's three warps of a split row (64 tokens or fewer) write the same elements: the row's "
        "elements past the first warp's are never written"),
    "control": ("\n", "\n// a head's edit, a comment only (scripts/mla_epilogue_plants.py)\n",
                "a comment: nothing may change"),
}


def planted(text: str, name: str) -> str:
    """The kernel's text with plant `name` applied; ValueError unless its text occurs exactly once (the control
    edits the file's first newline)."""
    from k3num.harness import fixes

    return fixes.planted_text(text, name, PLANTS, KERNEL)


def make(out: Path, names: list[str]) -> list[Path]:
    from k3num.harness import fixes
    from k3num.supply import fetch

    csrc = fetch.csrc_dir("vllm") / "csrc"
    if not (csrc / Path(KERNEL).name).is_file():
        raise SystemExit(f"the pinned csrc is not at {csrc}: run `k3num fetch vllm-csrc`")
    trees = []
    for name in names:
        tree = fixes.pinned_tree("vllm", out / name)
        shutil.copytree(csrc, tree / "csrc")
        kernel = tree / KERNEL
        kernel.write_text(planted(kernel.read_text(), name))
        trees.append(tree)
    return trees


def main(argv: list[str] | None = None) -> int:
    from k3num.harness import fixes

    return fixes.plants_main(argv, __doc__.split("\n\n")[0], PLANTS, make)


if __name__ == "__main__":
    raise SystemExit(main())
