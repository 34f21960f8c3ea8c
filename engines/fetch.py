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

K3NUM_ENGINE_SRC="NAME=PATH[,NAME=PATH...]" (pytest: --engine-src NAME=PATH)
points an engine at a local tree laid out like the installed package
(PATH/vllm/models/kimi_k3/...) instead of the cache: a checkout, or a patch
before it is merged. Its files are hashed as they are read; the engine's
version reads `<pin>+local`.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path


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
        ),
        manifest_sha256="5439ecd4a23011672b7746b83de7e83cb9685f77ca4df0d73b07627f2e9e4300",
    ),
    "sglang": Pin(
        "sglang", "sglang", "0.5.23", "00b3cd5b265ac76c64185fbb6b95424f324ddd9f428d0306b77bc9db9d859937",
        (
            "sglang/srt/layers/attn_residual.py",
            "sglang/kernels/ops/speculative/dspark/fused_kv_write.py",
            "sglang/srt/models/dflash.py",
            "sglang/srt/disaggregation/utils.py",
        ),
        # the wheel is cp311-only: ask for it explicitly from any Python
        ("--only-binary=:all:", "--python-version", "3.11", "--platform", "manylinux_2_34_x86_64"),
        manifest_sha256="a1cd6dcf7ada8d39d1ebf3140ab7b2fd9c5ca380a82f76ee578869aa3f18fcdc",
    ),
    "tokenspeed": Pin(
        "tokenspeed", "tokenspeed", "0.1.1", "c20d4e87830c821f0b36f665baff999c4d08603b38becc6be33dc2636b97fb19",
        ("tokenspeed/runtime/models/kimi_k3_dspark.py", "tokenspeed/runtime/execution/dspark_context.py"),
        manifest_sha256="4f49c1f74ac55e00d69efe3eed7d88db87afdac76707ab972dc92f6983da4ef1",
    ),
}


class FetchError(RuntimeError):
    """A wheel could not be had, or is not the pinned one, or the cache no longer holds its bytes."""


Log = type(print)


def cache_root() -> Path:
    return Path(os.environ.get("K3NUM_ENGINE_CACHE") or Path.home() / ".cache" / "k3-numerics" / "engines")


ENGINE_SRC_ENV = "K3NUM_ENGINE_SRC"


def local_sources() -> dict[str, Path]:
    """{engine: local tree} from K3NUM_ENGINE_SRC; ValueError naming the bad item."""
    out: dict[str, Path] = {}
    for item in (s.strip() for s in os.environ.get(ENGINE_SRC_ENV, "").split(",")):
        if not item:
            continue
        name, sep, path = item.partition("=")
        if not sep or not name.strip() or not path.strip():
            raise ValueError(f"{ENGINE_SRC_ENV}: expected NAME=PATH[,NAME=PATH...], got {item!r}")
        name = name.strip()
        if name not in PINS:
            raise ValueError(f"{ENGINE_SRC_ENV}: unknown engine {name!r} in {item!r}; known: {sorted(PINS)}")
        root = Path(path.strip()).expanduser()
        if not root.is_dir():
            raise ValueError(f"{ENGINE_SRC_ENV}: {name}={path.strip()} is not a directory")
        out[name] = root.resolve()
    return out


def source_dir(engine: str) -> Path:
    """Where the engine's files are read from: its local tree (K3NUM_ENGINE_SRC) or the cache."""
    local = local_sources().get(engine)
    if local is not None:
        return local
    pin = PINS[engine]
    return cache_root() / f"{pin.engine}-{pin.version}"


def version_label(engine: str) -> str:
    """The version the records carry: the pin's, or `<pin>+local` for a local tree."""
    pin = PINS[engine]
    return f"{pin.version}+local" if engine in local_sources() else pin.version


def missing_files(engine: str) -> list[str]:
    """The pinned files the engine's source lacks (a local tree, or a cache not fetched)."""
    root = source_dir(engine)
    return [f for f in PINS[engine].files if not (root / f).is_file()]


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def manifest(engine: str) -> dict[str, str]:
    """{relative path: sha256} as MANIFEST.json records it, or {} when not fetched; for a local tree,
    the hashes of the files it has, computed now. Unchecked: source mode binds through
    `verified_manifest`."""
    local = local_sources().get(engine)
    if local is not None:
        return {f: sha256_of(local / f) for f in PINS[engine].files if (local / f).is_file()}
    path = source_dir(engine) / MANIFEST
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
    pin, root = PINS[engine], source_dir(engine)
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


def verified_manifest(engine: str, *, log: Log = _warn) -> dict[str, str]:
    """{relative path: sha256} of the bytes source mode will run; {} when nothing was ever fetched.

    A local tree (K3NUM_ENGINE_SRC) is hashed as read. The cache is checked once per process:
    any difference from the pinned bytes is repaired by re-extracting from the cached wheel
    (re-checked against its pin), or refused with FetchError naming each file, the sha256
    expected and the sha256 found. The edited bytes never run under the pinned version."""
    if engine in local_sources():
        return manifest(engine)
    root = source_dir(engine)
    key = (engine, root)
    if key in _VERIFIED:
        return _VERIFIED[key]
    problems = cache_problems(engine)
    if problems is None:
        return {}
    if problems:
        pin = PINS[engine]
        wheels = cache_root() / "wheels"
        wheel = _find_wheel(pin, wheels) if wheels.exists() else None
        if wheel is None:
            raise FetchError(
                f"{engine}: the cache does not hold the pinned {pin.version} bytes, and the wheel is not in "
                f"{wheels} to re-extract them from: {'; '.join(problems)}. Run `k3num fetch {engine}` to restore "
                f"them, or --engine-src {engine}=PATH to test modified files on purpose")
        _check_wheel(pin, wheel, delete=False)
        _extract(pin, wheel, root)
        log(f"[fetch] {engine}: the cache differed from the pinned bytes ({'; '.join(problems)}); "
            f"re-extracted from the verified wheel {wheel.name}")
        left = cache_problems(engine)
        if left:
            raise FetchError(f"{engine}: still differs after re-extracting from {wheel.name}: {'; '.join(left)}")
    _VERIFIED[key] = manifest(engine)
    return _VERIFIED[key]


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


def _extract(pin: Pin, wheel: Path, root: Path) -> dict[str, str]:
    """Write the pinned files and their MANIFEST.json from a checked wheel; the manifest must hash to
    its pin (else the pin's file list and its manifest_sha256 disagree: a harness bug)."""
    root.mkdir(parents=True, exist_ok=True)
    hashes: dict[str, str] = {}
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        for rel in pin.files:
            if rel not in names:
                raise FetchError(f"{pin.engine}: {rel} is not in {wheel.name}")
            target = root / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(zf.read(rel))
            hashes[rel] = sha256_of(target)
    text = manifest_text(hashes)
    got = hashlib.sha256(text.encode()).hexdigest()
    if pin.manifest_sha256 and got != pin.manifest_sha256:
        raise FetchError(f"{pin.engine}: the manifest of {wheel.name}'s pinned files has sha256 {got}, "
                         f"Pin.manifest_sha256 is {pin.manifest_sha256} (engines/fetch.py: update the pin "
                         "together with its file list)")
    (root / MANIFEST).write_text(text)
    return hashes


def fetch(engine: str, *, log: Log = print) -> Path:
    """Make the engine's pinned source available in the cache; return its source directory."""
    if engine not in PINS:
        raise FetchError(f"unknown engine {engine!r}; pinned: {sorted(PINS)}")
    pin = PINS[engine]
    root = source_dir(engine)
    if cache_problems(engine) == [] and set(manifest(engine)) == set(pin.files):
        log(f"[fetch] {engine} {pin.version}: up to date in {root} ({len(pin.files)} files, hashes checked)")
        return root
    wheels = cache_root() / "wheels"
    wheel = _find_wheel(pin, wheels) if wheels.exists() else None
    if wheel is None:
        wheel = _download(pin, wheels, log)
    _check_wheel(pin, wheel, delete=True)
    hashes = _extract(pin, wheel, root)
    _VERIFIED.pop((engine, root), None)
    log(f"[fetch] {engine} {pin.version}: wheel sha256 ok; extracted {len(hashes)} files to {root}")
    for rel, h in sorted(hashes.items()):
        log(f"         {rel}  sha256 {h[:16]}...")
    return root


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="k3num", description="k3-numerics tools")
    sub = ap.add_subparsers(dest="cmd", required=True)
    f = sub.add_parser("fetch", help="download the pinned engine wheels and extract the sources the adapters need")
    f.add_argument("engines", nargs="*", default=sorted(PINS), help=f"default: all ({', '.join(sorted(PINS))})")
    args = ap.parse_args(argv)
    status = 0
    for name in args.engines:
        try:
            fetch(name)
        except FetchError as e:
            print(f"[fetch] ERROR: {e}", file=sys.stderr)
            status = 1
    return status


if __name__ == "__main__":
    raise SystemExit(main())
