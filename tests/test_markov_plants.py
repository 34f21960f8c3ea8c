"""The bugs planted in vLLM 0.34.0's fused Markov steps (scripts/markov_plants.py) apply to the pinned markov.py
exactly once each, and the Markov properties catch every one of them on the release's own Triton kernels: under the
interpreter here (the GPU runs the same trees as compiled: scripts/device_session.sh part `markov`), while the
comment-only control passes them."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from k3num.supply import fetch

ROOT = Path(__file__).resolve().parents[1]
RELEASE = "vllm@0.34.0"  # the first release with markov.py


def _plants():
    spec = importlib.util.spec_from_file_location("markov_plants", ROOT / "scripts" / "markov_plants.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


PLANTS = _plants()


def _pinned_text() -> str:
    src = fetch.source_of(RELEASE, {})
    if not fetch.verified_manifest(src):
        pytest.skip(f"{RELEASE} is not fetched here: run `k3num fetch vllm`")
    return (src.root / PLANTS.KERNEL).read_text()


@pytest.mark.parametrize("name", sorted(PLANTS.PLANTS))
def test_each_plant_edits_the_pinned_markov_py_once_and_changes_it(name: str) -> None:
    text = _pinned_text()
    out = PLANTS.planted(text, name)
    assert out != text
    assert text.count(PLANTS.PLANTS[name][0]) == 1 or name == "control"


def test_a_plant_whose_text_moved_is_refused_naming_it() -> None:
    with pytest.raises(ValueError, match="plant markov_take_last_max: its text occurs 0 times"):
        PLANTS.planted("# nothing of the kernel here\n", "markov_take_last_max")


def _spare_cores() -> int:
    """The cores this process may fill with plant runs: the machine's, shared among the xdist workers (one each
    when there are as many workers as cores, as the test command runs on a 2-core machine)."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    return max(1, (os.cpu_count() or 1) // workers)


@pytest.fixture(scope="module")
def verdicts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[int, bool, str]]:
    """plant -> (pytest exit, whether a property's assertion failed and no kernel crashed, its output's tail):
    properties/test_markov.py on the planted tree under the interpreter, `ci-mutants` (a plant stops at its first
    failing property)."""
    _pinned_text()
    if fetch.PINS["vllm"].version != RELEASE.split("@")[1]:
        pytest.skip(f"the default vLLM release is not {RELEASE}: make the trees from its cache first")
    trees = PLANTS.make(tmp_path_factory.mktemp("markov-plants"), sorted(PLANTS.PLANTS))

    def one(tree: Path) -> tuple[str, tuple[int, bool, str]]:
        name = tree.name
        cmd = [sys.executable, "-m", "pytest", "properties/test_markov.py", "--engine", "vllm", "--engine-src",
               f"vllm={tree}", "--hypothesis-profile=ci-mutants", "-q", "-p", "no:cacheprovider",
               "-k", "not test_k3_"] + ([] if name == "control" else ["--maxfail=1"])
        print(f"[markov plants] {name}: properties/test_markov.py on the planted tree", flush=True)
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900,
                              env={**os.environ, "OMP_NUM_THREADS": "1"})
        text = proc.stdout + proc.stderr
        caught = "AssertionError" in text and "InterpreterError" not in text
        return name, (proc.returncode, caught, text[-3000:])

    # as many at a time as this process has cores to itself: the test command's xdist workers share the machine's
    with ThreadPoolExecutor(max_workers=_spare_cores()) as pool:
        out = dict(pool.map(one, trees))
    return out


@pytest.mark.parametrize("name", sorted(set(PLANTS.PLANTS) - {"control"}))
def test_each_kernel_plant_fails_a_markov_property_under_the_interpreter(verdicts, name: str) -> None:
    rc, caught, tail = verdicts[name]
    assert rc == 1 and caught, (f"plant {name} ({PLANTS.PLANTS[name][2]}): exit {rc}, a property's assertion "
                                f"{'failed' if caught else 'did not fail (or the kernel crashed)'}\n{tail}")


def test_the_comment_only_control_passes_every_markov_property(verdicts) -> None:
    rc, _, tail = verdicts["control"]
    assert rc == 0, f"the control (a comment in markov.py) failed: exit {rc}\n{tail}"
