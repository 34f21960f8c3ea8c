"""--engine-src / K3NUM_ENGINE_SRC: an engine read from a local tree (a checkout or a patch).

The tree here is a copy of the fetched SGLang files: unchanged, it builds as `0.5.23+local` with
the local files' hashes and passes the transfer-pairing properties; with a one-line patch that
reuses a destination entry, the same properties fail; a tree lacking a pinned file is refused
with the file's name, as is a partly deleted cache.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from k3num.engines import registry
from k3num.harness import fixes
from k3num.supply import fetch

ROOT = Path(__file__).resolve().parents[1]
UTILS = "sglang/srt/disaggregation/utils.py"


@pytest.fixture
def sglang_tree(tmp_path: Path) -> Path:
    if fetch.missing_files("sglang"):
        pytest.skip("sglang 0.5.23 is not fetched here: run `k3num fetch sglang`")
    return fixes.pinned_tree("sglang", tmp_path / "sglang-checkout")


def _properties(tree: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pytest", "properties/test_transfer_pairs.py", "--engine", "sglang",
                           "--engine-src", f"sglang={tree}", "-q", "-p", "no:cacheprovider",
                           "--hypothesis-profile=ci"], cwd=ROOT, capture_output=True, text=True)


def test_a_local_tree_builds_with_its_own_hashes_and_a_local_version(sglang_tree: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    (sglang_tree / UTILS).write_text((sglang_tree / UTILS).read_text() + "\n# a local edit\n")
    engine = registry.build("sglang", {"sglang": sglang_tree})
    assert engine.version == "0.5.23+local"
    assert engine.source_sha256["transfer_pairs"] == fetch.sha256_of(sglang_tree / UTILS)
    assert fetch.manifest("sglang")[UTILS] != engine.source_sha256["transfer_pairs"]


def test_an_unpatched_tree_passes_and_a_patched_one_fails_the_properties(sglang_tree: Path) -> None:
    ok = _properties(sglang_tree)
    assert ok.returncode == 0, ok.stdout[-3000:]
    src = (sglang_tree / UTILS).read_text()
    assert "pairs.append((i, dst_pos[lid].popleft()))" in src
    (sglang_tree / UTILS).write_text(src.replace("dst_pos[lid].popleft()", "dst_pos[lid][0]"))  # reuse an entry
    bad = _properties(sglang_tree)
    assert bad.returncode == 1 and "test_pairing_by_layer_id_is_one_to_one_with_matching_ids" in bad.stdout


def test_a_tree_lacking_a_pinned_file_is_refused_naming_it(sglang_tree: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    (sglang_tree / UTILS).unlink()
    with pytest.raises(registry.EngineUnavailable, match="disaggregation/utils.py"):
        registry.build("sglang", {"sglang": sglang_tree})


@pytest.mark.parametrize("spec", ["sglang", "=x", "nosuch=/tmp", "vllm=/no/such/dir"])
def test_a_bad_engine_src_is_refused_naming_the_item(spec: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from k3num.harness.run import RunContext

    with pytest.raises(ValueError, match=spec.split("=")[0] or "=x"):
        fetch.parse_sources([spec])
    monkeypatch.setenv("K3NUM_ENGINE_SRC", spec)  # a process started with it: refused naming the variable
    with pytest.raises(ValueError, match="K3NUM_ENGINE_SRC"):
        RunContext.from_env()


def test_a_cache_missing_one_file_is_refused_naming_it(sglang_tree: Path, tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    cache = tmp_path / "cache"
    shutil.copytree(fetch.Source("sglang").root, cache / "sglang-0.5.23")
    (cache / "sglang-0.5.23" / UTILS).unlink()
    monkeypatch.setenv("K3NUM_ENGINE_CACHE", str(cache))
    with pytest.raises(registry.EngineUnavailable, match="disaggregation/utils.py.*k3num fetch sglang"):
        registry.build("sglang")
