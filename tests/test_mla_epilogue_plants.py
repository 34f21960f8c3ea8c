"""The planted bugs of vLLM's fused MLA epilogue kernel (scripts/mla_epilogue_plants.py) still apply to every pinned
release's csrc, exactly once each, so the GPU proof (device_session.sh part `epilogue`) plants what it says; and the
trees they make are checkouts the harness reads (pinned files, csrc beside them, the edit in the kernel)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from k3num.supply import fetch

ROOT = Path(__file__).resolve().parents[1]


def _plants():
    spec = importlib.util.spec_from_file_location("mla_epilogue_plants", ROOT / "scripts" / "mla_epilogue_plants.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


PLANTS = _plants()


@pytest.mark.parametrize("spec", fetch.csrc_specs())
@pytest.mark.parametrize("name", sorted(PLANTS.PLANTS))
def test_each_plant_edits_the_pinned_kernel_once_and_changes_it(spec: str, name: str) -> None:
    kernel = fetch.csrc_dir(spec) / PLANTS.KERNEL
    if fetch.csrc_problems(spec):
        pytest.skip(f"{spec}'s csrc is not fetched here: run `k3num fetch {spec}-csrc`")
    text = kernel.read_text()
    out = PLANTS.planted(text, name)
    assert out != text and out.count("\n") > text.count("\n") - 1


def test_a_plant_whose_text_moved_is_refused_naming_it() -> None:
    with pytest.raises(ValueError, match="plant epilogue_cache_with_k_scale: its text occurs 0 times"):
        PLANTS.planted("// nothing of the kernel here\n", "epilogue_cache_with_k_scale")


def test_a_planted_tree_is_the_pinned_files_with_the_csrc_and_the_edit(tmp_path: Path) -> None:
    if fetch.csrc_problems("vllm") or not fetch.verified_manifest("vllm"):
        pytest.skip("vLLM and its csrc are not fetched here: run `k3num fetch vllm vllm-csrc`")
    (tree,) = PLANTS.make(tmp_path, ["epilogue_cache_with_k_scale"])
    for rel in fetch.PINS["vllm"].files:
        assert (tree / rel).is_file(), rel
    text = (tree / PLANTS.KERNEL).read_text()
    assert "float const ksi = __ldg(k_scale_inv);" in text
    assert "float const ksi = __ldg(cache_scale_inv);" not in text
