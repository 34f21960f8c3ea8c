"""Hypothesis's literal pool is pinned (issue 37, harness/literal_pool.py): the same whatever is selected,
unchanged from the first draw to the session's end (a lazily imported adapter or an engine file loaded mid-run
adds nothing), and free of the engines' literals; so a derandomized draw does not move when an unrelated module
or an engine file changes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from k3num.supply import fetch

ROOT = Path(__file__).resolve().parents[1]


def _pool(tmp_path: Path, name: str, *args: str) -> dict:
    out = tmp_path / f"{name}.json"
    r = subprocess.run([sys.executable, "-m", "pytest", *args, "-p", "tests.pool_probe", "-q", "-p", "no:cacheprovider",
                        "--hypothesis-profile=ci"], cwd=ROOT, capture_output=True, text=True, timeout=900,
                       env={**os.environ, "K3NUM_POOL_PROBE": str(out)})
    assert r.returncode in (0, 5), r.stdout[-3000:] + r.stderr[-2000:]
    return json.loads(out.read_text())


def test_the_literal_pool_is_the_same_for_any_selection_and_from_the_first_draw_on(tmp_path: Path) -> None:
    if not fetch.verified_manifest("vllm"):
        pytest.skip("vllm is not fetched: the selection below builds its adapter mid-run")
    one = _pool(tmp_path, "one", "properties/test_tap_owner.py", "-k", "vllm and not rocm")
    # a node that builds vLLM's attn_res adapter (engine files loaded, adapter modules imported) during the run
    other = _pool(tmp_path, "other", "properties/test_attn_res.py", "-k",
                  "test_attn_res_within_rounding_budget_of_oracle and vllm and not rocm")
    everything = _pool(tmp_path, "all", "properties", "--collect-only")
    assert one["collection"] == one["end"] == other["collection"] == other["end"] == everything["end"]


def test_the_pool_holds_no_literal_only_an_engine_file_has(tmp_path: Path) -> None:
    """A literal planted in a vLLM kernel file that the run loads is not in the pool."""
    if not fetch.verified_manifest("vllm"):
        pytest.skip("vllm is not fetched")
    from k3num.harness import fixes

    tree = fixes.pinned_tree("vllm", tmp_path / "v")
    rel = "vllm/models/kimi_k3/nvidia/ops/attn_res.py"
    (tree / rel).write_text((tree / rel).read_text() + "\nK3NUM_PLANTED_LITERAL = 987654321987\n")
    got = _pool(tmp_path, "planted", "properties/test_attn_res.py", "-k",
                "test_attn_res_within_rounding_budget_of_oracle and vllm and not rocm", "--engine", "vllm",
                "--engine-src", f"vllm={tree}")
    assert "987654321987" not in got["end"]["integer"]
