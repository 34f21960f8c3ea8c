"""The engine cache runs only the pinned bytes (issue 12).

Source mode checks the cache once per process before binding a file
(`fetch.verified_manifest`): the manifest against its pinned sha256, every pinned
file against the manifest. A difference is repaired from the cached wheel, or,
with no wheel, refused with the file, the sha256 expected and the sha256 found.
Each tampering case is tried both ways, on a toy engine whose wheel the test
writes, and once end to end on vLLM's real cache as a user would tamper with it.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import zipfile
from collections.abc import Callable
from pathlib import Path

import pytest

from k3num.engines import registry
from k3num.supply import fetch

FILES = {"toy/kernel.py": "def k(x):\n    return 2 * x\n", "toy/model.py": "LAYERS = 5\n"}


@pytest.fixture
def toy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fetched toy engine in a fresh cache: its wheel in <cache>/wheels, its files extracted."""
    monkeypatch.setenv("K3NUM_ENGINE_CACHE", str(tmp_path))
    monkeypatch.delenv("K3NUM_ENGINE_SRC", raising=False)
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    wheel = wheels / "toy_engine-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        for name, text in FILES.items():
            zf.writestr(name, text)
    hashes = {rel: hashlib.sha256(text.encode()).hexdigest() for rel, text in FILES.items()}
    msha = hashlib.sha256(fetch.manifest_text(hashes).encode()).hexdigest()
    monkeypatch.setitem(fetch.PINS, "toy", fetch.Pin("toy", "toy-engine", "1.0", fetch.sha256_of(wheel),
                                                     tuple(FILES), manifest_sha256=msha))
    fetch.forget_verified()
    root = fetch.fetch("toy", log=lambda _: None)
    yield root
    fetch.forget_verified()


def _append_byte(root: Path) -> None:
    with open(root / "toy/kernel.py", "ab") as fh:
        fh.write(b"#")


def _truncate(root: Path) -> None:
    path = root / "toy/kernel.py"
    path.write_bytes(path.read_bytes()[:10])


def _delete(root: Path) -> None:
    (root / "toy/kernel.py").unlink()


def _edit_file_and_its_manifest_entry(root: Path) -> None:
    """The careful tamperer: the file edited and the manifest made to agree with it."""
    path = root / "toy/kernel.py"
    path.write_text(FILES["toy/kernel.py"].replace("2 * x", "3 * x"))
    m = json.loads((root / fetch.MANIFEST).read_text())
    m["toy/kernel.py"] = fetch.sha256_of(path)
    (root / fetch.MANIFEST).write_text(fetch.manifest_text(m))


TAMPERINGS: dict[str, Callable[[Path], None]] = {
    "appended-byte": _append_byte, "truncated": _truncate, "missing": _delete,
    "edited-manifest": _edit_file_and_its_manifest_entry,
}


@pytest.mark.parametrize("tamper", list(TAMPERINGS))
def test_a_tampered_cache_is_re_extracted_from_the_verified_wheel(toy: Path, tamper: str) -> None:
    TAMPERINGS[tamper](toy)
    said: list[str] = []
    got = fetch.verified_manifest("toy", log=said.append)
    assert (toy / "toy/kernel.py").read_text() == FILES["toy/kernel.py"]  # the pinned bytes are back
    assert got["toy/kernel.py"] == hashlib.sha256(FILES["toy/kernel.py"].encode()).hexdigest()
    named = fetch.MANIFEST if tamper == "edited-manifest" else "toy/kernel.py"  # what failed its hash
    assert len(said) == 1 and named in said[0] and "re-extracted from the verified wheel" in said[0]


@pytest.mark.parametrize("tamper", list(TAMPERINGS))
def test_a_tampered_cache_without_its_wheel_is_refused_naming_file_and_hashes(toy: Path, tamper: str) -> None:
    shutil.rmtree(toy.parent / "wheels")
    TAMPERINGS[tamper](toy)
    with pytest.raises(fetch.FetchError) as info:
        fetch.verified_manifest("toy", log=lambda _: None)
    msg = str(info.value)
    if tamper == "edited-manifest":  # the manifest itself is what fails its pin
        assert f"{fetch.MANIFEST}: expected sha256 {fetch.PINS['toy'].manifest_sha256}, found " in msg
    else:
        want = hashlib.sha256(FILES["toy/kernel.py"].encode()).hexdigest()
        found = "none (the file is missing)" if tamper == "missing" else fetch.sha256_of(toy / "toy/kernel.py")
        assert f"toy/kernel.py: expected sha256 {want}, found {found}" in msg
    assert "the wheel is not in" in msg and "k3num fetch toy" in msg
    if tamper != "missing":  # nothing was "repaired" behind the user's back either
        assert (toy / "toy/kernel.py").read_text() != FILES["toy/kernel.py"]


def test_a_wheel_that_fails_its_pin_is_not_re_extracted_from(toy: Path) -> None:
    wheel = next((toy.parent / "wheels").glob("*.whl"))
    with zipfile.ZipFile(wheel, "a") as zf:
        zf.writestr("toy/extra.py", "")
    _append_byte(toy)
    with pytest.raises(fetch.FetchError, match=r"has sha256 [0-9a-f]{64}, the pin is [0-9a-f]{64}: refused$"):
        fetch.verified_manifest("toy", log=lambda _: None)


def test_the_cache_is_hashed_once_per_process(toy: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[Path] = []
    real = fetch.sha256_of
    monkeypatch.setattr(fetch, "sha256_of", lambda p: calls.append(p) or real(p))
    first = fetch.verified_manifest("toy")
    n = len(calls)
    assert n == len(FILES) + 1  # each file and the manifest, once
    for _ in range(5):
        assert fetch.verified_manifest("toy") == first
    assert len(calls) == n


def test_an_untouched_cache_verifies_and_fetch_says_up_to_date(toy: Path) -> None:
    assert fetch.cache_problems("toy") == []
    lines: list[str] = []
    fetch.fetch("toy", log=lines.append)
    assert any("up to date" in line and "hashes checked" in line for line in lines)


def test_fetch_repairs_a_tampered_cache(toy: Path) -> None:
    _edit_file_and_its_manifest_entry(toy)
    fetch.fetch("toy", log=lambda _: None)
    assert fetch.cache_problems("toy") == [] and (toy / "toy/kernel.py").read_text() == FILES["toy/kernel.py"]


def test_every_pin_carries_the_hash_of_its_manifest() -> None:
    for name, pin in fetch.PINS.items():
        assert len(pin.manifest_sha256) == 64, f"{name}: Pin.manifest_sha256 is not set"


# --- the issue's own scenario, on vLLM's real cache ---------------------------------------------------

ATTN = "vllm/models/kimi_k3/nvidia/ops/attn_res.py"
REAL_WHEELS: list[Path] = [Path()]  # the real cache's wheels folder, set by the fixture before it moves the cache


TREE = f"vllm-{fetch.PINS['vllm'].version}"  # the default release's cache tree


@pytest.fixture
def vllm_copy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A copy of the fetched vLLM files (no wheels) with one line appended to the attn_res kernel;
    REAL_WHEELS[0] is where the real cache keeps its wheels."""
    if fetch.cache_problems("vllm") != [] or not (fetch.cache_root() / "wheels").exists():
        pytest.skip(f"vllm {fetch.PINS['vllm'].version} is not fetched here: run `k3num fetch vllm`")
    real = fetch.cache_root()
    REAL_WHEELS[0] = real / "wheels"
    copy = tmp_path / "engines"
    shutil.copytree(real / TREE, copy / TREE)
    with open(copy / TREE / ATTN, "a") as fh:
        fh.write("# patched by hand\n")
    monkeypatch.setenv("K3NUM_ENGINE_CACHE", str(copy))
    monkeypatch.delenv("K3NUM_ENGINE_SRC", raising=False)
    fetch.forget_verified()
    yield copy
    fetch.forget_verified()


def test_a_hand_patched_vllm_kernel_is_refused_without_the_wheel(vllm_copy: Path) -> None:
    pinned = json.loads((vllm_copy / TREE / fetch.MANIFEST).read_text())[ATTN]
    found = fetch.sha256_of(vllm_copy / TREE / ATTN)
    with pytest.raises(registry.EngineUnavailable, match=f"{ATTN}: expected sha256 {pinned}, found {found}"):
        registry.build("vllm", mode="source")


def test_a_hand_patched_vllm_kernel_is_replaced_by_the_pinned_bytes_before_it_runs(vllm_copy: Path) -> None:
    (vllm_copy / "wheels").symlink_to(REAL_WHEELS[0], target_is_directory=True)
    engine = registry.build("vllm", mode="source")
    pinned = fetch.manifest("vllm")[ATTN]
    assert engine.version == fetch.PINS["vllm"].version and engine.source_sha256["attn_res"] == pinned
    assert fetch.sha256_of(vllm_copy / TREE / ATTN) == pinned

