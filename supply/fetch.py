"""`k3num fetch`: the pinned engine wheels, hash-checked, with only the needed .py files extracted.

Engine source is never committed: it is read at run time from the pinned
wheels (BRIEF §4) into an ignored cache, by default
`~/.cache/k3-numerics/engines` (override: K3NUM_ENGINE_CACHE). Layout:

    <cache>/wheels/<wheel file>                  the downloaded wheel
    <cache>/<engine>-<version>/<package path>    the extracted .py files
    <cache>/<engine>-<version>/MANIFEST.json     {path: sha256} of what was extracted

A wheel whose sha256 differs from the pin is refused (and deleted). Running it
again re-extracts nothing that is already there with the right hashes.

What runs is checked, not only what was downloaded: the first time in a process
that an engine's cache is used in source mode (`verified_manifest`, which the
adapters call before binding a file), the manifest's own sha256 is checked
against the pin (`Pin.manifest_sha256`, next to the wheel's) and every pinned
file against the manifest. On any mismatch (an edited, truncated or missing
file, an edited manifest) the files are re-extracted from the cached wheel,
itself re-checked against its pin; with no wheel to re-extract from, the engine
is refused with each file, the sha256 expected and the sha256 found. The
result is kept for the process (hashed once per session, not per example).

Processes share the cache: files are replaced atomically (temporary file, then os.replace; the
manifest last) and extraction, repair and the csrc extraction are serialised by `cache_lock`, so a
reader never sees a half-written file and a waiting process finds the repair done.

`--engine-src NAME=PATH` (K3NUM_ENGINE_SRC in a process started by another; harness/run.py) points
an engine at a local tree laid out like the installed package (PATH/vllm/models/kimi_k3/...)
instead of the cache: a checkout, or a patch before it is merged. It reaches this module as a
`Source` argument. Its files are hashed as they are read; the engine's version reads `<pin>+local`.
"""

from __future__ import annotations

import hashlib
import json
import os
import posixpath
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import zipfile
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from k3num.supply import env


@dataclass(frozen=True)
class Pin:
    engine: str
    dist: str
    version: str
    sha256: str
    files: tuple[str, ...]
    pip_args: tuple[str, ...] = ()
    # sha256 of the MANIFEST.json that extracting `files` from the pinned wheel writes
    # (`manifest_text`): a manifest edited to match an edited file is caught too
    manifest_sha256: str = ""
    # wheels the engine requires whose files live in the same tree, as in a site-packages directory
    # (TokenSpeed's tokenspeed_kernel): each pinned by its own sha256; `files` lists theirs too, and
    # a file is taken from the companion whose `files` name it, else from this wheel
    companions: tuple["Pin", ...] = ()
    # the engines built from these files: (registry name, factory in the adapter package
    # k3num.engines.<engine>_adapter), registered by engines/registry.py in this table's order: adding an
    # engine is this entry and its adapter package
    builds: tuple[tuple[str, str], ...] = ()

    def wheel_of(self, rel: str) -> "Pin":
        """The pin of the wheel that holds `rel`: a companion's, or this one."""
        return next((c for c in self.companions if rel in c.files), self)

    def wheels(self) -> tuple["Pin", ...]:
        return (self, *self.companions)


# TokenSpeed 0.1.1 requires tokenspeed-kernel>=0.1.4: the K3 kernels it calls on an H200
TOKENSPEED_KERNEL_FILES = (
    "tokenspeed_kernel/ops/residual/torch.py",
    "tokenspeed_kernel/ops/residual/__init__.py",
    "tokenspeed_kernel/ops/embedding/__init__.py",
    "tokenspeed_kernel/ops/embedding/triton.py",
    "tokenspeed_kernel/ops/kvcache/triton.py",
    "tokenspeed_kernel/thirdparty/cuda/rope.py",
)

PINS: dict[str, Pin] = {
    "vllm": Pin(
        "vllm", "vllm", "0.33.0", "4b6bdec4ab269990bf70d45a3c1e94c3760a27064513760193b26d6f0da883aa",
        (
            "vllm/models/kimi_k3/nvidia/ops/attn_res.py",
            "vllm/models/kimi_k3/amd/ops/attn_res.py",
            "vllm/models/kimi_k3/nvidia/model.py",
            "vllm/models/kimi_k3/amd/linear.py",
            "vllm/models/kimi_k3/nvidia/dspark_mla.py",
            "vllm/model_executor/models/utils.py",
            "vllm/_custom_ops.py",
            "vllm/model_executor/models/interfaces.py",
            "vllm/v1/worker/gpu/pp_utils.py",
            "vllm/v1/worker/gpu/spec_decode/eagle/eagle3_utils.py",
            "vllm/model_executor/layers/linear.py",
            "vllm/model_executor/parameter.py",
            "vllm/model_executor/layers/quantization/compressed_tensors/schemes/compressed_tensors_w4a4_nvfp4.py",
            "vllm/model_executor/layers/quantization/modelopt.py",
        ),
        manifest_sha256="4ed01d8b069bd36542fe70f4f2cbdc0b63a9dafaa5a4f5525846f930a372f65c",
        builds=(("vllm", "build"), ("vllm-rocm", "build_rocm")),
    ),
    "tokenspeed": Pin(
        "tokenspeed", "tokenspeed", "0.1.1", "c20d4e87830c821f0b36f665baff999c4d08603b38becc6be33dc2636b97fb19",
        ("tokenspeed/runtime/models/kimi_k3_dspark.py", "tokenspeed/runtime/execution/dspark_context.py",
         "tokenspeed/runtime/models/kimi_k3.py", "tokenspeed/runtime/layers/segmented_rmsnorm.py",
         *TOKENSPEED_KERNEL_FILES),
        manifest_sha256="bc39d5ff776725bfd5f435c784d8bb9be756e6650ed3a7794449045f32c63f12",
        companions=(Pin("tokenspeed", "tokenspeed-kernel", "0.1.4",
                        "958ed94e8ec272ba198277bda56b0b4fa10b03626a80bb7d2a5a50440cd0b38b", TOKENSPEED_KERNEL_FILES,
                        # the wheel is cp311-only, like SGLang's
                        ("--only-binary=:all:", "--python-version", "3.11", "--platform",
                         "manylinux_2_28_x86_64")),),
        builds=(("tokenspeed", "build"),),
    ),
    "sglang": Pin(
        "sglang", "sglang", "0.5.23", "00b3cd5b265ac76c64185fbb6b95424f324ddd9f428d0306b77bc9db9d859937",
        (
            "sglang/srt/layers/attn_residual.py",
            "sglang/kernels/ops/speculative/dspark/fused_kv_write.py",
            "sglang/srt/models/dflash.py",
            "sglang/srt/disaggregation/utils.py",
            "sglang/srt/disaggregation/mooncake/conn.py",
            "sglang/srt/disaggregation/common/conn.py",
            "sglang/srt/disaggregation/common/utils.py",
            "sglang/srt/disaggregation/base/conn.py",
            "sglang/kernels/ops/speculative/fused_kv_materialize.py",
        ),
        # the wheel is cp311-only: ask for it explicitly from any Python
        ("--only-binary=:all:", "--python-version", "3.11", "--platform", "manylinux_2_34_x86_64"),
        manifest_sha256="7f544eb169437fda264c0ac07f65a7e5e01a630bfa7867cab55e3a3aaab92b73",
        builds=(("sglang", "build"),),
    ),
}


class FetchError(RuntimeError):
    """A wheel could not be had, or is not the pinned one, or the cache no longer holds its bytes."""


Log = type(print)


def cache_root() -> Path:
    """The engine cache: K3NUM_ENGINE_CACHE (a machine's setting, read at the process boundary), else
    ~/.cache/k3-numerics/engines."""
    return Path(env.get("K3NUM_ENGINE_CACHE") or Path.home() / ".cache" / "k3-numerics" / "engines")


@dataclass(frozen=True)
class Source:
    """Where one engine's files are read from: the hash-checked cache of its pin (`local` None), or a
    local tree laid out like the installed package (`--engine-src NAME=PATH`: a checkout, a patch),
    whose files are hashed as read and whose version reads `<pin>+local`. Every function below that
    reads an engine's files takes one (or a pin name, meaning its cache), so which bytes a subject was
    built from is an argument all the way down, never the environment at that moment."""

    engine: str
    local: Path | None = None

    def __post_init__(self) -> None:
        if self.engine not in PINS:
            raise ValueError(f"unknown engine {self.engine!r}; pinned: {sorted(PINS)}")

    @property
    def root(self) -> Path:
        if self.local is not None:
            return self.local
        pin = PINS[self.engine]
        return cache_root() / f"{pin.engine}-{pin.version}"

    @property
    def version(self) -> str:
        """The version the records carry: the pin's, or `<pin>+local` for a local tree."""
        pin = PINS[self.engine]
        return f"{pin.version}+local" if self.local is not None else pin.version


def source(src: "Source | str") -> Source:
    """A Source, or a pin name meaning its pinned cache."""
    return src if isinstance(src, Source) else Source(src)


def source_of(engine: str, sources: "dict[str, Path] | None") -> Source:
    """The Source of pin `engine` in a run whose local trees are `sources` (pin name -> tree)."""
    return Source(engine, (sources or {}).get(engine))


def parse_sources(items: "Sequence[str] | str") -> dict[str, Path]:
    """{engine: local tree} from NAME=PATH items (or one comma-separated string); ValueError naming the
    bad item."""
    out: dict[str, Path] = {}
    flat = [items] if isinstance(items, str) else list(items)
    for item in (s.strip() for part in flat for s in part.split(",")):
        if not item:
            continue
        name, sep, path = item.partition("=")
        if not sep or not name.strip() or not path.strip():
            raise ValueError(f"expected NAME=PATH[,NAME=PATH...], got {item!r}")
        name = name.strip()
        if name not in PINS:
            raise ValueError(f"unknown engine {name!r} in {item!r}; known: {sorted(PINS)}")
        root = Path(path.strip()).expanduser()
        if not root.is_dir():
            raise ValueError(f"{name}={path.strip()} is not a directory")
        out[name] = root.resolve()
    return out


def pinned_files(src: "Source | str", files: tuple[str, ...]) -> bool:
    """Whether each of `files` is the pinned bytes in the source used: always for the cache (checked
    against its pins before use); for a local tree, each file's sha256 against the pinned manifest (no
    verified manifest to compare with: not the pinned bytes as far as anyone can tell)."""
    src = source(src)
    pin = PINS[src.engine]
    unknown = [f for f in files if f not in pin.files]
    if unknown:
        raise ValueError(f"{src.engine}: {unknown} are not files of the pin")
    if src.local is None:
        return True
    pinned = _pinned_manifest(pin)
    if pinned is None:
        return False
    return all((src.local / rel).is_file() and sha256_of(src.local / rel) == pinned.get(rel) for rel in files)


def _pinned_manifest(pin: Pin) -> dict[str, str] | None:
    """The cache's MANIFEST.json when its own sha256 is the pinned one, else None."""
    path = cache_root() / f"{pin.engine}-{pin.version}" / MANIFEST
    try:
        if not pin.manifest_sha256 or sha256_of(path) != pin.manifest_sha256:
            return None
        return dict(json.loads(path.read_text()))
    except (OSError, ValueError):
        return None


def missing_files(src: "Source | str") -> list[str]:
    """The pinned files the engine's source lacks (a local tree, or a cache not fetched)."""
    src = source(src)
    return missing_in(src.engine, src.root)


def missing_in(engine: str, root: Path) -> list[str]:
    """The engine's pinned files missing from the tree at `root` (empty when all are there)."""
    return [f for f in PINS[engine].files if not (root / f).is_file()]


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def manifest(src: "Source | str") -> dict[str, str]:
    """{relative path: sha256} as MANIFEST.json records it, or {} when not fetched; for a local tree,
    the hashes of the files it has, computed now. Unchecked: source mode binds through
    `verified_manifest`."""
    src = source(src)
    if src.local is not None:
        return {f: sha256_of(src.local / f) for f in PINS[src.engine].files if (src.local / f).is_file()}
    path = src.root / MANIFEST
    if not path.exists():
        return {}
    return dict(json.loads(path.read_text()))


MANIFEST = "MANIFEST.json"


def manifest_text(hashes: dict[str, str]) -> str:
    """The bytes MANIFEST.json holds for these hashes (what `Pin.manifest_sha256` pins)."""
    return json.dumps(hashes, indent=1, sort_keys=True)


def cache_problems(engine: str) -> list[str] | None:
    """What in the engine's cache differs from the pinned bytes, one line per file ("PATH: expected
    sha256 X, found Y"); [] when all is as pinned; None when nothing was ever fetched."""
    pin, root = PINS[engine], Source(engine).root
    mpath = root / MANIFEST
    present = [f for f in pin.files if (root / f).exists()]
    if not mpath.exists():
        return None if not present else [f"{mpath}: missing (expected sha256 {pin.manifest_sha256 or '?'})"]
    problems: list[str] = []
    found = sha256_of(mpath)
    if pin.manifest_sha256 and found != pin.manifest_sha256:
        # an edited manifest vouches for nothing: every file is unverified
        return [f"{mpath}: expected sha256 {pin.manifest_sha256}, found {found}"]
    try:
        recorded = dict(json.loads(mpath.read_text()))
    except ValueError as e:
        return [f"{mpath}: not JSON ({e})"]
    for rel in pin.files:
        want, path = recorded.get(rel), root / rel
        got = sha256_of(path) if path.is_file() else "none (the file is missing)"
        if want is None:
            problems.append(f"{path}: not in {MANIFEST}")
        elif got != want:
            problems.append(f"{path}: expected sha256 {want}, found {got}")
    return problems


_VERIFIED: dict[tuple[str, Path], dict[str, str]] = {}


def forget_verified() -> None:
    """Drop the per-process record of verified caches (tests that edit a cache call this)."""
    _VERIFIED.clear()


def _warn(msg: str) -> None:
    print(msg, file=sys.stderr)


# --- writes and repairs that other processes may watch ------------------------------------------------
#
# Several processes share one cache (xdist workers, two CI jobs on one runner, `k3num fetch` during a run).
# Every file is written through a temporary file in its own folder and `os.replace`, so a reader opening
# a path sees the old bytes or the new, never a part (an open file keeps the bytes it had); a process
# killed mid-write leaves only a temporary file, which the next repair removes. Extractions and repairs
# are serialised by a lock file per tree (`cache_lock`), and a process that waited checks again before it
# repairs anything.

TMP_SUFFIX = ".k3num-tmp"
LOCK_WAIT_S = 900.0  # a repair or a build that holds a lock longer than this is stuck, not slow


def atomic_write(target: Path, data: bytes) -> None:
    """`target` holds `data` afterwards; at no moment does it hold a part of it (see above)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=TMP_SUFFIX, dir=target.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def remove_temporaries(root: Path) -> list[Path]:
    """Delete the temporary files a killed writer left under `root`; the paths removed."""
    gone = sorted(root.rglob(f".*{TMP_SUFFIX}")) if root.is_dir() else []
    for p in gone:
        p.unlink(missing_ok=True)
    return gone


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: it exists
        return True
    return True


@contextmanager
def cache_lock(name: str, *, log: Log | None = None, wait_s: float = LOCK_WAIT_S) -> Iterator[None]:
    """Hold `<cache>/.locks/<name>.lock` exclusively (fcntl.flock) for the block.

    The holder's pid is written into the file and cleared on release, so a pid found there by the
    next holder is one that died holding the lock (the kernel released its flock): that is said in
    one line. A lock held longer than `wait_s` by a live process is an error naming it."""
    import fcntl

    say = log or _warn
    locks = cache_root() / ".locks"
    locks.mkdir(parents=True, exist_ok=True)
    path = locks / f"{name}.lock"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        start, told = time.monotonic(), False
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                holder = os.pread(fd, 32, 0).decode(errors="replace").strip()
                waited = time.monotonic() - start
                if waited > wait_s:
                    raise FetchError(f"{path}: held by process {holder or '?'} for over {wait_s:.0f} s; if it "
                                     "is stuck, end it (the lock is released when it exits)") from None
                if not told and waited > 1.0:
                    say(f"[fetch] {name}: waiting for process {holder or '?'}, which holds {path}")
                    told = True
                time.sleep(0.05)
        prev = os.pread(fd, 32, 0).decode(errors="replace").strip()
        if prev.isdigit() and int(prev) != os.getpid() and not _alive(int(prev)):
            say(f"[fetch] {name}: took over {path} from process {prev}, which died holding it; what it left "
                "half-done is checked and repaired now")
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        try:
            yield
        finally:
            os.ftruncate(fd, 0)
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


def verified_manifest(src: "Source | str", *, log: Log = _warn) -> dict[str, str]:
    """{relative path: sha256} of the bytes source mode will run; {} when nothing was ever fetched.

    A local tree (--engine-src) is hashed as read. The cache is checked once per process:
    any difference from the pinned bytes is repaired by re-extracting from the cached wheel
    (re-checked against its pin), or refused with FetchError naming each file, the sha256
    expected and the sha256 found. The edited bytes never run under the pinned version."""
    src = source(src)
    if src.local is not None:
        return manifest(src)
    engine, root = src.engine, src.root
    key = (engine, root)
    if key in _VERIFIED:
        return _VERIFIED[key]
    problems = cache_problems(engine)
    if problems is None:
        return {}
    if problems:
        pin = PINS[engine]
        with cache_lock(_tree_name(pin), log=log):
            # another process may have repaired it while this one waited for the lock
            problems = cache_problems(engine) or []
            if problems:
                wheels = cache_root() / "wheels"
                found = {w: _find_wheel(w, wheels) if wheels.exists() else None for w in pin.wheels()}
                lacking = [w for w, path in found.items() if path is None]
                if lacking:
                    raise FetchError(
                        f"{engine}: the cache does not hold the pinned {pin.version} bytes, and the wheel is not in "
                        f"{wheels} to re-extract them from ({', '.join(f'{w.dist}=={w.version}' for w in lacking)}): "
                        f"{'; '.join(problems)}. Run `k3num fetch {engine}` to restore them, or "
                        f"--engine-src {engine}=PATH to test modified files on purpose")
                for w, path in found.items():
                    _check_wheel(w, path, delete=False)
                _extract(pin, found, root)
                names = ", ".join(path.name for path in found.values())
                log(f"[fetch] {engine}: the cache differed from the pinned bytes ({'; '.join(problems)}); "
                    f"re-extracted from the verified wheel {names}")
                left = cache_problems(engine)
                if left:
                    raise FetchError(f"{engine}: still differs after re-extracting from {names}: "
                                     f"{'; '.join(left)}")
            recorded = manifest(engine)
    else:
        recorded = manifest(engine)
    _VERIFIED[key] = recorded
    return _VERIFIED[key]


def _tree_name(pin: Pin) -> str:
    """The name of the engine's extracted tree in the cache (and of its lock)."""
    return f"{pin.engine}-{pin.version}"


def _find_wheel(pin: Pin, wheels: Path) -> Path | None:
    prefix = f"{pin.dist.replace('-', '_')}-{pin.version}-"
    found = sorted(p for p in wheels.glob("*.whl") if p.name.startswith(prefix))
    return found[0] if found else None


def _download(pin: Pin, wheels: Path, log: "Log") -> Path:
    wheels.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check", "-d", str(wheels),
           f"{pin.dist}=={pin.version}", *pin.pip_args]
    log(f"[fetch] {pin.engine}: downloading {pin.dist}=={pin.version} (pip download --no-deps)")
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wheel = _find_wheel(pin, wheels)
    if proc.returncode != 0 or wheel is None:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        raise FetchError(
            f"{pin.engine}: could not download {pin.dist}=={pin.version} from the package index "
            f"(no network, or the index refused): {' | '.join(tail)}"
        )
    return wheel



def _check_wheel(pin: Pin, wheel: Path, *, delete: bool) -> None:
    got = sha256_of(wheel)
    if got != pin.sha256:
        if delete:
            wheel.unlink()
        raise FetchError(f"{pin.engine}: {wheel.name} has sha256 {got}, the pin is {pin.sha256}: refused"
                         + (" and deleted" if delete else ""))


def _extract(pin: Pin, wheels: dict[Pin, Path], root: Path) -> dict[str, str]:
    """Write the pinned files and their MANIFEST.json from the checked wheels (`wheels`: the pin's own
    and its companions', each file from `Pin.wheel_of`); the manifest must hash to its pin (else the
    pin's file list and its manifest_sha256 disagree: a harness bug).

    Called under the tree's `cache_lock`. Each file is replaced atomically (`atomic_write`) and the
    manifest is written last, so a process killed midway leaves correct files, temporary files and
    a manifest that does not vouch for them: the next process repairs the tree."""
    root.mkdir(parents=True, exist_ok=True)
    remove_temporaries(root)
    blobs: dict[str, bytes] = {}
    for w, wheel in wheels.items():
        with zipfile.ZipFile(wheel) as zf:
            names = set(zf.namelist())
            for rel in (f for f in pin.files if pin.wheel_of(f) is w):
                if rel not in names:
                    raise FetchError(f"{pin.engine}: {rel} is not in {wheel.name}")
                blobs[rel] = zf.read(rel)
    hashes = {rel: hashlib.sha256(blobs[rel]).hexdigest() for rel in pin.files}
    text = manifest_text(hashes)
    got = hashlib.sha256(text.encode()).hexdigest()
    if pin.manifest_sha256 and got != pin.manifest_sha256:
        raise FetchError(f"{pin.engine}: the manifest of {', '.join(w.name for w in wheels.values())}'s pinned files "
                         f"has sha256 {got}, Pin.manifest_sha256 is {pin.manifest_sha256} (supply/fetch.py: update "
                         "the pin together with its file list)")
    for rel in pin.files:
        target = root / rel
        if not target.is_file() or sha256_of(target) != hashes[rel]:
            atomic_write(target, blobs[rel])
    atomic_write(root / MANIFEST, text.encode())
    return hashes


def fetch(engine: str, *, log: Log = print) -> Path:
    """Make the engine's pinned source available in the cache; return its source directory."""
    if engine not in PINS:
        raise FetchError(f"unknown engine {engine!r}; pinned: {sorted(PINS)}")
    pin = PINS[engine]
    root = Source(engine).root

    def current() -> bool:
        return cache_problems(engine) == [] and set(manifest(engine)) == set(pin.files)

    if current():
        log(f"[fetch] {engine} {pin.version}: up to date in {root} ({len(pin.files)} files, hashes checked)")
        return root
    with cache_lock(_tree_name(pin), log=log):
        if current():  # another process fetched it while this one waited
            log(f"[fetch] {engine} {pin.version}: up to date in {root} (fetched by another process)")
            return root
        wheels = cache_root() / "wheels"
        found: dict[Pin, Path] = {}
        for w in pin.wheels():
            wheel = _find_wheel(w, wheels) if wheels.exists() else None
            if wheel is None:
                wheel = _download(w, wheels, log)
            _check_wheel(w, wheel, delete=True)
            found[w] = wheel
        hashes = _extract(pin, found, root)
    _VERIFIED.pop((engine, root), None)
    log(f"[fetch] {engine} {pin.version}: wheel sha256 ok ({', '.join(w.name for w in found.values())}); extracted "
        f"{len(hashes)} files to {root}")
    for rel, h in sorted(hashes.items()):
        log(f"         {rel}  sha256 {h[:16]}...")
    return root


# --- compiled libraries inside a pinned wheel (run on a GPU, never read as source) ---------------------


@dataclass(frozen=True)
class BinaryPin:
    """A compiled library shipped inside a pinned wheel (`wheel`, one of `PINS[engine].wheels()`),
    by its member path and sha256 (the wheel's RECORD). Extracted, on demand, to
    `<cache>/<engine>-<version>-bin/<member>`, which a GPU run carries like the source tree."""

    engine: str
    name: str
    dist: str
    member: str
    sha256: str


BINARIES: dict[str, BinaryPin] = {
    # tokenspeed-kernel's CUDA RoPE (apply_k_rope's PERFORMANT kernel on NVIDIA), loaded through tvm_ffi
    "tokenspeed:rope": BinaryPin("tokenspeed", "rope", "tokenspeed-kernel",
                                 "tokenspeed_kernel/thirdparty/cuda/objs/rope/rope.so",
                                 "601544a49efada1abe8362cde5a099fa4cfde3f90ef65447dcf1777c6747da5b"),
}


def binary_dir(engine: str) -> Path:
    pin = PINS[engine]
    return cache_root() / f"{pin.engine}-{pin.version}-bin"


def binary(key: str, *, extract: bool = True, log: Log = _warn) -> Path:
    """The path of the pinned library `key` ("ENGINE:NAME"), its sha256 checked now; extracted from the
    cached wheel (itself checked against its pin) when missing or different and `extract` is set.
    FetchError names what is missing or wrong."""
    b = BINARIES[key]
    target = binary_dir(b.engine) / b.member
    if target.is_file() and sha256_of(target) == b.sha256:
        return target
    found = sha256_of(target) if target.is_file() else "none (the file is missing)"
    wheel_pin = next((w for w in PINS[b.engine].wheels() if w.dist == b.dist), None)
    wheels = cache_root() / "wheels"
    wheel = _find_wheel(wheel_pin, wheels) if wheel_pin is not None and wheels.exists() else None
    if not extract or wheel is None:
        raise FetchError(f"{key}: {target} expected sha256 {b.sha256}, found {found}; the wheel {b.dist} is not in "
                         f"{wheels} to extract it from (run `k3num fetch {b.engine}` on a machine with network, then "
                         "carry the -bin folder)")
    with cache_lock(target.parent.name, log=log):
        _check_wheel(wheel_pin, wheel, delete=False)
        with zipfile.ZipFile(wheel) as zf:
            data = zf.read(b.member)
        got = hashlib.sha256(data).hexdigest()
        if got != b.sha256:
            raise FetchError(f"{key}: {b.member} in {wheel.name} has sha256 {got}, BinaryPin says {b.sha256}")
        atomic_write(target, data)
        os.chmod(target, 0o755)
    log(f"[fetch] {key}: extracted {b.member} ({len(data) // 1024} KiB, sha256 ok) to {target}")
    return target


# --- the source distribution's CUDA sources (vLLM's compiled ops, built by `k3num build-ops`) ---------


@dataclass(frozen=True)
class SdistPin:
    """A source distribution pinned by its sha256, and the C++/CUDA files taken from it: `roots` and
    every file they `#include "..."`, transitively (the include closure is found in the archive)."""

    engine: str
    filename: str
    sha256: str
    roots: tuple[str, ...]
    manifest_sha256: str = ""
    index: str = "https://pypi.org/simple/"


SDISTS: dict[str, SdistPin] = {
    "vllm": SdistPin(
        "vllm", "vllm-0.33.0.tar.gz", "f4c33c2503d52bb411146afa9618a4f48bed68912f617e6803ac8d76e4c74112",
        ("csrc/layernorm_kernels.cu", "csrc/pos_encoding_kernels.cu", "csrc/cache_kernels.cu",
         "csrc/torch_bindings.cpp", "csrc/ops.h",
         # the SM100-only AttnRes kernel (supply/cuda_ops.py builds it on a 10.0-family GPU only)
         "csrc/kimi_k3/attn_res_kernel.cu"),
        manifest_sha256="0e0146bd86212a356bc61fcf26f4af664554d17f50abe446846cd73a8cb07de1",
    ),
}


def csrc_dir(engine: str) -> Path:
    pin = PINS[engine]
    return cache_root() / f"{pin.engine}-{pin.version}-csrc"


_INCLUDE = re.compile(r'^\s*#\s*include\s*"([^"]+)"', re.M)


def include_closure(read: Callable[[str], str | None], roots: Sequence[str], base: str = "csrc") -> list[str]:
    """The files `roots` include with `#include "..."`, transitively, as archive paths under `base`.

    An include resolves against the including file's folder first, then `base` (the compiler's -I);
    one found in neither is a system or toolkit header and is left out. `read(path)` gives a file's
    text or None when the archive has no such file."""
    seen: dict[str, None] = {}
    todo = list(roots)
    while todo:
        path = todo.pop()
        if path in seen:
            continue
        text = read(path)
        if text is None:
            raise FetchError(f"{path} is not in the source distribution")
        seen[path] = None
        for inc in _INCLUDE.findall(text):
            for cand in (posixpath.normpath(posixpath.join(posixpath.dirname(path), inc)),
                         posixpath.normpath(posixpath.join(base, inc))):
                if cand not in seen and read(cand) is not None:
                    todo.append(cand)
                    break
    return sorted(seen)


def _download_sdist(pin: SdistPin, target: Path, log: Log) -> None:
    """The file itself from the index's JSON simple API (pip would build its metadata, which says
    +cpu or +empty on a machine without CUDA, and then discard the file as inconsistent)."""
    import urllib.request

    req = urllib.request.Request(f"{pin.index.rstrip('/')}/{pin.engine}/",
                                 headers={"Accept": "application/vnd.pypi.simple.v1+json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            files = json.loads(r.read())["files"]
        url = next((f["url"] for f in files if f["filename"] == pin.filename), None)
        if url is None:
            raise FetchError(f"{pin.engine}: the index lists no {pin.filename}")
        log(f"[fetch] {pin.engine}: downloading {pin.filename}")
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=TMP_SUFFIX, dir=target.parent)
        try:  # a download cut short leaves a temporary file, not a truncated archive under its name
            with urllib.request.urlopen(url, timeout=300) as r, os.fdopen(fd, "wb") as out:
                shutil.copyfileobj(r, out)
            os.replace(tmp, target)
        finally:
            Path(tmp).unlink(missing_ok=True)
    except OSError as e:
        raise FetchError(f"{pin.engine}: could not download {pin.filename} from {pin.index} (no network, or the "
                         f"index refused): {e}") from e


def fetch_csrc(engine: str, *, log: Log = print) -> Path:
    """The engine's pinned C++/CUDA sources in `csrc_dir(engine)`: the sdist downloaded (or found in
    <cache>/sdists), checked against its pin, and its include closure of `SdistPin.roots`
    extracted with a MANIFEST.json whose own sha256 is pinned. Idempotent; repairs a changed tree."""
    if engine not in SDISTS:
        raise FetchError(f"{engine}: no pinned source distribution; pinned: {sorted(SDISTS)}")
    root = csrc_dir(engine)
    if not csrc_problems(engine):
        log(f"[fetch] {engine} csrc: up to date in {root} (hashes checked)")
        return root
    with cache_lock(root.name, log=log):
        if not csrc_problems(engine):  # another process extracted it while this one waited
            log(f"[fetch] {engine} csrc: up to date in {root} (extracted by another process)")
            return root
        return _extract_csrc(engine, root, log)


def _extract_csrc(engine: str, root: Path, log: Log) -> Path:
    """The include closure written from the checked sdist (under the tree's lock; files replaced
    atomically, the manifest last: see `atomic_write`)."""
    pin = SDISTS[engine]
    remove_temporaries(root)
    archive = cache_root() / "sdists" / pin.filename
    if not archive.exists():
        _download_sdist(pin, archive, log)
    got = sha256_of(archive)
    if got != pin.sha256:
        archive.unlink()
        raise FetchError(f"{engine}: {pin.filename} has sha256 {got}, the pin is {pin.sha256}: refused and deleted")
    prefix = pin.filename.removesuffix(".tar.gz") + "/"
    with tarfile.open(archive, "r:gz") as tf:
        members = {m.name.removeprefix(prefix): m for m in tf.getmembers() if m.isfile()}

        def read(path: str) -> str | None:
            m = members.get(path)
            fh = tf.extractfile(m) if m is not None else None
            return fh.read().decode("utf-8", "replace") if fh is not None else None

        files = include_closure(read, pin.roots)
        blobs: dict[str, bytes] = {}
        for rel in files:
            fh = tf.extractfile(members[rel])
            assert fh is not None
            blobs[rel] = fh.read()
    hashes = {rel: hashlib.sha256(data).hexdigest() for rel, data in blobs.items()}
    text = manifest_text(hashes)
    msha = hashlib.sha256(text.encode()).hexdigest()
    if pin.manifest_sha256 and msha != pin.manifest_sha256:
        raise FetchError(f"{engine}: the csrc manifest has sha256 {msha}, SdistPin.manifest_sha256 is "
                         f"{pin.manifest_sha256} (supply/fetch.py: update the pin together with its roots)")
    for rel, data in blobs.items():
        target = root / rel
        if not target.is_file() or sha256_of(target) != hashes[rel]:
            atomic_write(target, data)
    atomic_write(root / MANIFEST, text.encode())
    log(f"[fetch] {engine} csrc: {pin.filename} sha256 ok; extracted {len(hashes)} files "
        f"({sum((root / f).stat().st_size for f in hashes) // 1024} KiB) to {root}")
    return root


def csrc_problems(engine: str) -> list[str]:
    """What in the extracted csrc tree differs from its pinned manifest ([] when all is as pinned)."""
    pin, root = SDISTS[engine], csrc_dir(engine)
    mpath = root / MANIFEST
    if not mpath.exists():
        return [f"{mpath}: missing (run `k3num fetch {engine}-csrc`)"]
    found = sha256_of(mpath)
    if pin.manifest_sha256 and found != pin.manifest_sha256:
        return [f"{mpath}: expected sha256 {pin.manifest_sha256}, found {found}"]
    recorded = json.loads(mpath.read_text())
    problems = [f"{root / r}: a root of the pin, not extracted (run `k3num fetch {engine}-csrc`)"
                for r in pin.roots if r not in recorded]
    for rel, want in recorded.items():
        got = sha256_of(root / rel) if (root / rel).is_file() else "none (the file is missing)"
        if got != want:
            problems.append(f"{root / rel}: expected sha256 {want}, found {got}")
    return problems
