"""A vLLM tree that breaks what the adapter binds gives one clear result per subject: the subject is
missing with "contract changed: <file>: <what>" and the others still bind (engines/vllm_adapter)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from k3num.engines import base, registry
from k3num.engines.vllm_adapter import AMD_ATTN_RES_PY, ATTN_RES_PY, DSPARK_PY, MODEL_PY
from k3num.harness import fixes
from k3num.supply import fetch

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    if fetch.missing_files("vllm"):
        pytest.skip("vllm 0.33.0 is not fetched here: run `k3num fetch vllm`")
    root = fixes.pinned_tree("vllm", tmp_path / "vllm-checkout")
    return root


def _edit(root: Path, rel: str, old: str, new: str) -> None:
    text = (root / rel).read_text()
    assert old in text, (rel, old)
    (root / rel).write_text(text.replace(old, new))


def test_a_kernel_importing_a_reorganised_package_leaves_that_subject_missing(tree: Path) -> None:
    _edit(tree, ATTN_RES_PY, "from vllm.triton_utils import tl, triton",
          "from vllm.backends.triton_utils import tl, triton")
    engine = registry.build("vllm", {"vllm": tree})
    why = engine.missing[base.ATTN_RES]
    assert why.startswith(f"contract changed: {ATTN_RES_PY}: imports a module the adapter's stubs do not provide")
    assert "vllm.backends" in why
    assert engine.missing[base.AUX_CAPTURE] == f"needs attn_res: {why}"
    assert engine.provides(base.CONTEXT_KV_FUSED) and "weight_loading" in engine.extras


def test_a_renamed_function_leaves_its_subject_missing_naming_the_function(tree: Path) -> None:
    _edit(tree, DSPARK_PY, "def _precompute_fused_context_kv(", "def _precompute_context_kv(")
    engine = registry.build("vllm", {"vllm": tree})
    assert engine.missing[base.CONTEXT_KV_FUSED] == (
        f"contract changed: {DSPARK_PY}: K3DSparkModel._precompute_fused_context_kv: _precompute_fused_context_kv "
        "not found")
    assert engine.provides(base.ATTN_RES) and engine.provides(base.AUX_CAPTURE)


def test_a_changed_signature_leaves_its_subject_missing_with_both_signatures(tree: Path) -> None:
    _edit(tree, MODEL_PY, "        pending_mlp_out: torch.Tensor | None,\n",
          "        pending_mlp_out: torch.Tensor | None,\n        scale: float,\n")
    _edit(tree, MODEL_PY, "        layer_idx: int,\n        prefix_sum: torch.Tensor,\n",
          "        prefix_sum: torch.Tensor,\n        layer_idx: int,\n")
    engine = registry.build("vllm", {"vllm": tree})
    why = engine.missing[base.AUX_CAPTURE]
    assert why.startswith(f"contract changed: {MODEL_PY}: KimiLinearModel._capture_aux_hidden_stream takes "
                          "['self', 'prefix_sum', 'layer_idx'")
    assert "the adapter binds ['self', 'layer_idx', 'prefix_sum'" in why
    assert engine.provides(base.ATTN_RES)


def test_a_tree_breaking_every_subject_makes_the_engine_unavailable_with_each_reason(tree: Path) -> None:
    _edit(tree, ATTN_RES_PY, "def attn_res(", "def attn_res_v2(")
    _edit(tree, DSPARK_PY, "def _precompute_fused_context_kv(", "def _precompute_context_kv(")
    with pytest.raises(registry.EngineUnavailable, match=r"no subject could be bound: attn_res: contract changed"):
        registry.build("vllm", {"vllm": tree})
    _edit(tree, AMD_ATTN_RES_PY, "def attn_res(", "def attn_res_v2(")
    rocm = registry.build("vllm-rocm", {"vllm": tree})  # its tap still binds
    assert "attn_res not found" in rocm.missing[base.ATTN_RES] and rocm.provides(base.AUX_CAPTURE)


def test_the_properties_on_a_reorganised_tree_skip_with_the_reason_instead_of_erroring(tree: Path) -> None:
    _edit(tree, ATTN_RES_PY, "from vllm.triton_utils import tl, triton",
          "from vllm.backends.triton_utils import tl, triton")
    r = subprocess.run([sys.executable, "-m", "pytest", "properties/test_attn_res.py", "--engine", "vllm",
                        "--engine-src", f"vllm={tree}", "-q", "-rs", "-p", "no:cacheprovider",
                        "--hypothesis-profile=ci"], cwd=ROOT, capture_output=True, text=True)
    # every selected test skips with the reason (no error); and since vllm was asked for and ran nothing,
    # the run fails naming why (nothing passes on nothing)
    tally = next(ln for ln in reversed(r.stdout.splitlines()) if re.search(r" in [0-9.]+s", ln))
    assert "error" not in tally and "skipped" in tally, r.stdout[-3000:]
    assert re.search(r"contract changed: vllm/models/kimi_k3/nvidia/ops/attn_res.py: imports a module", r.stdout)
    assert r.returncode == 1 and "ERROR: engine vllm was asked for and ran no test: " in r.stdout, r.stdout[-3000:]
