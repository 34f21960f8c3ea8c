"""Several processes repairing one engine cache at once (issue 23): xdist workers, two CI jobs on one
runner, `k3num fetch` during a run.

Every extracted file is replaced atomically and the manifest written last (`fetch.atomic_write`), a
repair holds the tree's lock (`fetch.cache_lock`) and a process that waited checks again before it
repairs. Each test works on a copy of the real cache (the wheels linked, not copied) with one comment
line appended to bound files of every engine, as a user who edited the cache by hand would."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from k3num.supply import fetch

ROOT = Path(__file__).resolve().parents[1]
ENGINES = ("vllm", "vllm-rocm", "sglang", "tokenspeed")
# four of vLLM's bound files (the case), and one of each other engine's
TAMPERED = {"vllm": fetch.PINS["vllm"].files[:4], "sglang": fetch.PINS["sglang"].files[:1],
            "tokenspeed": fetch.PINS["tokenspeed"].files[:1]}
PROCESSES = 4


@pytest.fixture
def tampered_cache(tmp_path: Path) -> Path:
    """A copy of the fetched cache, its wheels linked, with a comment line appended to TAMPERED."""
    src = fetch.cache_root()
    if any(fetch.cache_problems(e) != [] for e in TAMPERED) or not (src / "wheels").is_dir():
        pytest.skip("the engine cache is not fetched here (k3num fetch)")
    cache = tmp_path / "cache"
    cache.mkdir()
    for e in TAMPERED:
        tree = f"{fetch.PINS[e].engine}-{fetch.PINS[e].version}"
        shutil.copytree(src / tree, cache / tree)
        for rel in TAMPERED[e]:
            with open(cache / tree / rel, "a") as fh:
                fh.write("# edited by hand\n")
    (cache / "wheels").symlink_to(src / "wheels", target_is_directory=True)
    return cache


def _pinned_everywhere(cache: Path) -> dict[str, list[str] | None]:
    env = dict(os.environ, K3NUM_ENGINE_CACHE=str(cache))
    code = ("import json; from k3num.supply import fetch; "
            f"print(json.dumps({{e: fetch.cache_problems(e) for e in {list(TAMPERED)!r}}}))")
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    return json.loads(r.stdout)


BIND = textwrap.dedent("""
    import json, os, sys, time
    from pathlib import Path
    go = Path(sys.argv[1])
    while not go.exists():  # every process starts binding at the same moment
        time.sleep(0.001)
    from k3num.engines import registry
    out = {}
    for name in sys.argv[2:]:
        try:
            registry.get(name)
            out[name] = "ok"
        except registry.EngineUnavailable as e:
            out[name] = str(e)
    print(json.dumps(out))
""")


def test_processes_started_together_on_a_tampered_cache_all_bind_the_pinned_bytes(tampered_cache: Path,
                                                                                    tmp_path: Path) -> None:
    go = tmp_path / "go"
    env = dict(os.environ, K3NUM_ENGINE_CACHE=str(tampered_cache), TRITON_INTERPRET="1")
    env.pop("K3NUM_ENGINE_SRC", None)
    procs = [subprocess.Popen([sys.executable, "-c", BIND, str(go), *ENGINES], env=env, cwd=ROOT,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(PROCESSES)]
    time.sleep(2.0)  # let every interpreter start and wait at the line
    go.touch()
    results = [p.communicate(timeout=600) for p in procs]
    for out, err in results:
        assert "still differs" not in err, err
        bound = json.loads(out.strip().splitlines()[-1])
        assert bound == {e: "ok" for e in ENGINES}, (bound, err[-2000:])
    repairs = sum(err.count("re-extracted from the verified wheel") for _, err in results)
    # one repair per engine tree: a process that waited for the lock found the tree repaired
    assert repairs == len(TAMPERED), [err for _, err in results]
    assert _pinned_everywhere(tampered_cache) == {e: [] for e in TAMPERED}
    assert not list(tampered_cache.rglob(f"*{fetch.TMP_SUFFIX}"))


KILLED = textwrap.dedent("""
    import os, signal, sys
    from k3num.supply import fetch
    real = os.fdopen
    calls = []
    class HalfThenDie:
        def __init__(self, fh):
            self.fh = fh
        def __enter__(self):
            return self
        def __exit__(self, *a):
            return False
        def write(self, data):
            self.fh.write(data[: len(data) // 2])
            self.fh.flush()
            os.kill(os.getpid(), signal.SIGKILL)  # killed in the middle of writing the second file
    def fdopen(fd, *a, **k):
        fh = real(fd, *a, **k)
        calls.append(fd)
        return HalfThenDie(fh) if len(calls) == 2 else fh
    os.fdopen = fdopen
    fetch.verified_manifest(sys.argv[1])
""")


def test_a_process_killed_mid_repair_leaves_no_partial_file_under_a_real_name(tampered_cache: Path) -> None:
    env = dict(os.environ, K3NUM_ENGINE_CACHE=str(tampered_cache))
    r = subprocess.run([sys.executable, "-c", KILLED, "vllm"], env=env, cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == -9, (r.returncode, r.stderr[-2000:])
    tree = tampered_cache / f"vllm-{fetch.PINS['vllm'].version}"
    wheel_bytes = _wheel_files("vllm")
    for rel in fetch.PINS["vllm"].files:
        data = (tree / rel).read_bytes()
        # the pinned bytes, or the hand-edited ones not yet repaired: never a part of either
        assert data == wheel_bytes[rel] or data == wheel_bytes[rel] + b"# edited by hand\n", rel
    assert list(tree.rglob(f"*{fetch.TMP_SUFFIX}")), "the killed write left its temporary file"
    # the next process takes the lock over, says so, and repairs the tree
    r = subprocess.run([sys.executable, "-c", "import sys; from k3num.supply import fetch; "
                        "fetch.verified_manifest('vllm')"], env=env, cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    lock = re.escape(f"vllm-{fetch.PINS['vllm'].version}.lock")
    assert re.search(rf"took over .*{lock} from process \d+, which died holding it", r.stderr), r.stderr
    assert _pinned_everywhere(tampered_cache)["vllm"] == []
    assert not list(tree.rglob(f"*{fetch.TMP_SUFFIX}"))


def _wheel_files(engine: str) -> dict[str, bytes]:
    import zipfile

    pin = fetch.PINS[engine]
    wheel = fetch._find_wheel(pin, fetch.cache_root() / "wheels")
    assert wheel is not None
    with zipfile.ZipFile(wheel) as zf:
        return {rel: zf.read(rel) for rel in pin.files}


def _counts(cache: Path, tmp_path: Path, name: str) -> tuple[dict[str, int], str]:
    env = dict(os.environ, K3NUM_ENGINE_CACHE=str(cache))
    env.pop("K3NUM_ENGINE_SRC", None)
    r = subprocess.run([sys.executable, "-m", "pytest", "properties/test_attn_res.py", "properties/test_aux_tap.py",
                        "--engine", "vllm,vllm-rocm", "-n", "4", "-k", "zero_blocks or disabled",
                        "-p", "no:cacheprovider", "-q", "--hypothesis-profile=ci",
                        "--drift-csv", str(tmp_path / f"{name}.csv")],
                       env=env, cwd=ROOT, capture_output=True, text=True, timeout=900)
    tail = next(ln for ln in reversed(r.stdout.splitlines()) if re.search(r" in [0-9.]+s", ln))  # pytest's tally
    return {k: int(v) for v, k in re.findall(r"(\d+) (passed|skipped|failed|error|xfailed)", tail)}, r.stdout[-3000:]


def test_xdist_on_a_tampered_cache_runs_what_it_runs_on_a_clean_one(tampered_cache: Path, tmp_path: Path) -> None:
    clean = tmp_path / "clean"
    clean.mkdir()
    for e in TAMPERED:
        tree = f"{fetch.PINS[e].engine}-{fetch.PINS[e].version}"
        shutil.copytree(fetch.cache_root() / tree, clean / tree)
    (clean / "wheels").symlink_to(fetch.cache_root() / "wheels", target_is_directory=True)
    want, log_clean = _counts(clean, tmp_path, "clean")
    got, log_tampered = _counts(tampered_cache, tmp_path, "tampered")
    assert want.get("passed", 0) > 0 and not want.get("skipped"), log_clean
    assert got == want, log_tampered


CSRC = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    go = Path(sys.argv[1])
    while not go.exists():
        time.sleep(0.001)
    from k3num.supply import fetch
    fetch.fetch_csrc("vllm", log=lambda m: print(m, file=sys.stderr))
    print(fetch.csrc_problems("vllm"))
""")


def test_processes_repairing_the_csrc_tree_together_extract_it_once(tmp_path: Path) -> None:
    src = fetch.cache_root()
    if fetch.csrc_problems("vllm") or not (src / "sdists").is_dir():
        pytest.skip("vLLM's csrc is not fetched here (k3num fetch vllm-csrc)")
    cache = tmp_path / "cache"
    shutil.copytree(fetch.csrc_dir("vllm"), cache / fetch.csrc_dir("vllm").name)
    (cache / "sdists").symlink_to(src / "sdists", target_is_directory=True)
    with open(cache / fetch.csrc_dir("vllm").name / "csrc/cache_kernels.cu", "a") as fh:
        fh.write("// edited by hand\n")
    go = tmp_path / "go"
    env = dict(os.environ, K3NUM_ENGINE_CACHE=str(cache))
    procs = [subprocess.Popen([sys.executable, "-c", CSRC, str(go)], env=env, cwd=ROOT, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(PROCESSES)]
    time.sleep(2.0)
    go.touch()
    results = [p.communicate(timeout=300) for p in procs]
    assert all(out.strip() == "[]" for out, _ in results), results
    assert sum(err.count("sha256 ok; extracted") for _, err in results) == 1, results


BUILD = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    go = Path(sys.argv[1])
    while not go.exists():
        time.sleep(0.001)
    import torch
    from k3num.supply import cuda_ops, fetch
    cuda_ops.arch = lambda: "90"
    fetch.csrc_problems = lambda engine: []
    def compile_slowly(csrc, out, gpu_arch, **kw):  # a build that takes a while, its library written last
        print("compiling", file=sys.stderr)
        time.sleep(1.0)
        (out / "build.ninja").write_text("")
        (out / (cuda_ops.LIB_NAME + ".so")).write_bytes(b"library")
    cuda_ops._compile = compile_slowly
    torch.ops.load_library = lambda path: None
    print(cuda_ops.build(log=lambda m: print(m, file=sys.stderr)))
""")


def test_two_builds_of_the_ops_at_once_compile_once_and_never_expose_a_partial_folder(tmp_path: Path) -> None:
    """`k3num build-ops` from two processes (the compiler itself faked: this machine has no CUDA)."""
    go = tmp_path / "go"
    env = dict(os.environ, K3NUM_ENGINE_CACHE=str(tmp_path / "cache"))
    procs = [subprocess.Popen([sys.executable, "-c", BUILD, str(go)], env=env, cwd=ROOT, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(2)]
    time.sleep(2.0)
    go.touch()
    results = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], results
    assert sum(err.count("compiling") for _, err in results) == 1, results
    assert sum(err.count("[build-ops] cached:") for _, err in results) == 1, results
    so = Path(results[0][0].strip())
    assert so.read_bytes() == b"library" and so.parent.parent == tmp_path / "cache" / "ops"
    assert [p.name for p in so.parent.parent.iterdir()] == [so.parent.name], "a build folder was left behind"
