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

# where each engine's tree says its version (`tree_version`): a file every wheel and sdist of it ships,
# and so one of its pinned files
VERSION_FILES: dict[str, str] = {"vllm": "vllm/_version.py", "sglang": "sglang/_version.py",
                                 "tokenspeed": "tokenspeed/version.py"}

_VLLM_033 = Pin(
        "vllm", "vllm", "0.33.0", "4b6bdec4ab269990bf70d45a3c1e94c3760a27064513760193b26d6f0da883aa",
        (
            VERSION_FILES["vllm"],
            "vllm/models/kimi_k3/nvidia/ops/attn_res.py",
            "vllm/models/kimi_k3/amd/ops/attn_res.py",
            "vllm/models/kimi_k3/nvidia/model.py",
            "vllm/models/kimi_k3/amd/linear.py",
            "vllm/models/kimi_k3/nvidia/dspark_mla.py",
            "vllm/model_executor/models/utils.py",
            "vllm/model_executor/utils.py",  # 0.34.0's refill_derived (engines/vllm_adapter/context_kv.py)
            "vllm/_custom_ops.py",
            "vllm/model_executor/models/interfaces.py",
            "vllm/v1/worker/gpu/pp_utils.py",
            "vllm/v1/worker/gpu/spec_decode/eagle/eagle3_utils.py",
            "vllm/model_executor/layers/linear.py",
            "vllm/model_executor/parameter.py",
            "vllm/model_executor/layers/quantization/compressed_tensors/schemes/compressed_tensors_w4a4_nvfp4.py",
            "vllm/model_executor/layers/quantization/modelopt.py",
            # the MLA layer's fused prefill epilogue (the draft's own layers write their cache through it)
            "vllm/models/kimi_k3/nvidia/ops/fused_mla_key_concat_kv_cache.py",
        ),
        manifest_sha256="032c949305b0c0e7c5826b0f195c185d94def5e227cf064f65dcac2118d14ebf",
        builds=(("vllm", "build"), ("vllm-rocm", "build_rocm")),
    )

# 0.34.0 (2026-11-16): the same bound files (all present; attn_res.py both, pp_utils.py byte-identical), and
# the specialized decode's DSpark drafter, whose context projection is column-parallel at TP > 1
# (engines/vllm_adapter/context_proj.py)
DRAFTER_MODEL_PY = "vllm/models/kimi_k3/nvidia/specialized_decode/drafter/model.py"
MARKOV_PY = "vllm/models/kimi_k3/nvidia/specialized_decode/drafter/markov.py"
_VLLM_034 = Pin(
    "vllm", "vllm", "0.34.0", "79ca4b3cd74aec08c4bf476bdf0cb15735b605ae5368526a2faae1e30f044ca2",
    (*_VLLM_033.files, DRAFTER_MODEL_PY,
     # a dense MLA draft's cache configuration and a GQA draft's cache grouping on K3 (engines/vllm_adapter/
     # draft_config.py)
     "vllm/models/kimi_k3/nvidia/dense_draft.py", "vllm/models/kimi_k3/nvidia/gqa_draft.py",
     # the DSpark drafter's fused Markov steps, the sampler kernels they call, and vLLM's own loop they replace
     # (engines/vllm_adapter/markov.py)
     MARKOV_PY, "vllm/v1/worker/gpu/sample/gumbel.py", "vllm/v1/worker/gpu/spec_decode/draft_logits.py",
     "vllm/v1/worker/gpu/spec_decode/dspark/speculator.py"),
    manifest_sha256="5bd47a773bd86e8bc3ba8886e9c6fc71c62c20818a5e03e0972f272ae19ed122", builds=_VLLM_033.builds,
)

# each engine's default release: its newest pinned one (the issue on releases: a harness a release behind is one
# kernel authors stop running); the older ones are named ENGINE@VERSION (RELEASES)
PINS: dict[str, Pin] = {
    "vllm": _VLLM_034,
    "tokenspeed": Pin(
        "tokenspeed", "tokenspeed", "0.1.1", "c20d4e87830c821f0b36f665baff999c4d08603b38becc6be33dc2636b97fb19",
        (VERSION_FILES["tokenspeed"], "tokenspeed/runtime/models/kimi_k3_dspark.py",
         "tokenspeed/runtime/execution/dspark_context.py",
         "tokenspeed/runtime/models/kimi_k3.py", "tokenspeed/runtime/layers/segmented_rmsnorm.py",
         *TOKENSPEED_KERNEL_FILES),
        manifest_sha256="635fc0f24d5199a6b0b297509419a86d96c79f113d61cf7f392a272e85b034db",
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
            VERSION_FILES["sglang"],
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
        manifest_sha256="d2f7ea18b13227d5f64db63fe921867f748886593fee0435e895980ac25b8c9c",
        builds=(("sglang", "build"),),
    ),
}

# Every pinned release of each engine, oldest first. `PINS` holds each engine's default release: the one a
# run reads when it names no release (`--engine vllm`); another is named as ENGINE@VERSION (`--engine
# vllm@0.34.0`, `k3num fetch vllm@0.34.0`, `k3num check --head 0.34.0`). A new release is one Pin here.
RELEASES: dict[str, tuple[Pin, ...]] = {
    "vllm": (_VLLM_033, _VLLM_034),
    "tokenspeed": (PINS["tokenspeed"],),
    "sglang": (PINS["sglang"],),
}


def _releases_of(engine: str) -> tuple[Pin, ...]:
    """The engine's pinned releases: its RELEASES row, or its one PINS entry (a pin added to PINS alone, as the
    self-tests add a toy engine); ValueError for an engine not pinned."""
    if engine in RELEASES:
        return RELEASES[engine]
    if engine in PINS:
        return (PINS[engine],)
    raise ValueError(f"unknown engine {engine!r}; pinned: {sorted(PINS)}")


def releases(engine: str) -> list[str]:
    """The pinned versions of `engine`, oldest first (ValueError for an engine not pinned)."""
    return [p.version for p in _releases_of(engine)]


def release_pin(spec: str) -> Pin:
    """The Pin of ENGINE (its default release) or ENGINE@VERSION; ValueError listing the pinned releases."""
    engine, at, version = spec.partition("@")
    pins = _releases_of(engine)
    if not at:
        return PINS[engine]
    found = next((p for p in pins if p.version == version), None)
    if found is None:
        raise ValueError(f"{spec}: not a pinned release of {engine}; pinned: "
                         f"{', '.join(f'{engine}@{v}' for v in releases(engine))}")
    return found


def spec_of(pin: Pin) -> str:
    """ENGINE for the default release, ENGINE@VERSION for another (what `release_pin` reads back)."""
    return pin.engine if PINS[pin.engine] is pin else f"{pin.engine}@{pin.version}"


def all_release_specs() -> list[str]:
    """Every pinned release as a spec, engine by engine (the default's bare name, the others @VERSION)."""
    return [spec_of(p) for engine in PINS for p in _releases_of(engine)]


_VERSION_RE = re.compile(r"""^__version__\s*=\s*(?:version\s*=\s*)?['"]([^'"]+)['"]""", re.M)


class TreeVersionError(ValueError):
    """A local tree whose version cannot be read: the file it was looked for in is named."""


def tree_version(engine: str, root: Path) -> str:
    """The version a tree laid out like the installed package says it is, read from its version file
    (`VERSION_FILES`: `__version__ = '0.34.0'`, as every wheel and sdist of the engine writes it); never
    assumed from a pin. TreeVersionError names the file when it is missing or holds no version."""
    rel = VERSION_FILES[engine]
    path = root / rel
    try:
        text = path.read_text(errors="replace")
    except OSError:
        raise TreeVersionError(f"{root}: no {rel}, where {engine} says its version (a tree laid out like the "
                               "installed package has it: a wheel's, an sdist's, or a checkout after `pip install "
                               "-e .`)") from None
    m = _VERSION_RE.search(text)
    if m is None:
        raise TreeVersionError(f"{path}: no `__version__ = '...'` line to read {engine}'s version from")
    return m.group(1)



class FetchError(RuntimeError):
    """A wheel could not be had, or is not the pinned one, or the cache no longer holds its bytes."""


Log = type(print)


def cache_root() -> Path:
    """The engine cache: K3NUM_ENGINE_CACHE (a machine's setting, read at the process boundary), else
    ~/.cache/k3-numerics/engines."""
    return Path(env.get("K3NUM_ENGINE_CACHE") or Path.home() / ".cache" / "k3-numerics" / "engines")


@dataclass(frozen=True)
class Source:
    """Where one engine's files are read from: the hash-checked cache of a pinned release (`local` None;
    `release` None: the engine's default, `PINS`), or a local tree laid out like the installed package
    (`--engine-src NAME=PATH`: a checkout, a patch), whose files are hashed as read and whose version is
    read from the tree (`tree_version`) and marked `+local`. Every function below that reads an engine's
    files takes one (or a spec, ENGINE or ENGINE@VERSION, meaning that release's cache), so which bytes a
    subject was built from is an argument all the way down, never the environment at that moment.

    `engine` may be given as ENGINE@VERSION (then `release` is that version). A `local` path that is a
    pinned release's own cache tree is that release, verified against its pin like any cache: this is how
    a run names a release (`--engine vllm@0.34.0` maps pin vllm to that tree in the run's sources, which
    cross to other processes as K3NUM_ENGINE_SRC does)."""

    engine: str
    local: Path | None = None
    release: str | None = None

    def __post_init__(self) -> None:
        name, at, version = self.engine.partition("@")
        if at:
            object.__setattr__(self, "engine", name)
            object.__setattr__(self, "release", version)
        if self.engine not in PINS:
            raise ValueError(f"unknown engine {self.engine!r}; pinned: {sorted(PINS)}")
        if self.release is not None:
            release_pin(f"{self.engine}@{self.release}")  # ValueError listing the pinned ones
        if self.local is not None:
            held = release_of_tree(self.engine, self.local)
            if held is not None:
                object.__setattr__(self, "local", None)
                object.__setattr__(self, "release", held)

    @property
    def pin(self) -> Pin:
        """The pinned release read (the cache), or the one a local tree is judged as (`judged_as`: the release
        its version names, else the newest pinned one below it; TreeVersionError when every pin is newer). A
        tree that does not say its version is compared with the default release (and refused where it is run:
        the plugin, the commands)."""
        if self.local is None:
            return release_pin(self.spec)
        try:
            version = local_version(self.engine, self.local)
        except TreeVersionError:
            return PINS[self.engine]
        return judged_as(self.engine, version)[0]

    @property
    def spec(self) -> str:
        """ENGINE or ENGINE@VERSION: the release this source's cache is (a local tree: its engine)."""
        if self.local is not None or self.release is None or PINS[self.engine].version == self.release:
            return self.engine
        return f"{self.engine}@{self.release}"

    @property
    def root(self) -> Path:
        if self.local is not None:
            return self.local
        return cache_root() / _tree_name(self.pin)

    @property
    def version(self) -> str:
        """The version the records carry: the pinned release's, or a local tree's own (read from it) with
        `+local`. TreeVersionError where a complete local tree does not say it; a tree lacking pinned files
        (refused, or its subjects missing, by whoever reads them) is "unknown+local"."""
        if self.local is not None:
            try:
                return f"{local_version(self.engine, self.local)}+local"
            except TreeVersionError:
                if missing_files(self):
                    return "unknown+local"
                raise
        return self.pin.version


def _release_key(version: str) -> tuple[int, ...]:
    """The numeric release of a version string: "0.34.1.dev3+gabc" -> (0, 34, 1); () when it has none."""
    m = re.match(r"\s*v?(\d+(?:\.\d+)*)", version)
    return tuple(int(x) for x in m.group(1).split(".")) if m else ()


def judged_as(engine: str, version: str) -> tuple[Pin, str]:
    """The pinned release a tree of `version` is judged as, and a note ("" when it is that release): the pin
    of that version, else the newest pin at or below it (a patch release, a dev build, a checkout between
    releases: its files, subjects, ledger entries and budgets are that pin's). TreeVersionError when no pin
    is at or below it (a tree older than every pinned release: its files cannot be named)."""
    base = version.partition("+")[0]
    pins = _releases_of(engine)
    exact = next((p for p in pins if p.version == base), None)
    if exact is not None:
        return exact, ""
    key = _release_key(base)
    below = [p for p in pins if key and _release_key(p.version) <= key]
    if not below:
        raise TreeVersionError(f"{engine} {version}: no pinned release at or below it (pinned: "
                               f"{', '.join(p.version for p in pins)}); a tree is judged as the release it says "
                               "it is, and this one is older than every pin")
    pin = max(below, key=lambda p: _release_key(p.version))
    return pin, f"{engine} {version} is not a pinned release: judged as {pin.version}, the newest pin below it"


def check_tree(engine: str, root: Path) -> str:
    """A local tree given for `engine` (--engine-src, --head), checked before anything runs: it says its
    version (TreeVersionError naming the file), that version is judged as a pinned release (`judged_as`;
    TreeVersionError when every pin is newer) and the tree holds that release's bound files (ValueError naming
    the first missing ones). Returns judged_as's note ("" for a pinned version), for stderr. A pinned release's
    own cache tree is that release ("")."""
    if release_of_tree(engine, root) is not None:
        return ""
    pin = PINS[engine]
    try:
        version = local_version(engine, root)
    except TreeVersionError:
        missing = missing_in(engine, root)
        if len(missing) == len(pin.files):
            raise ValueError(f"{root}: holds none of {engine}'s bound files (nor {VERSION_FILES[engine]}): not a "
                             f"tree laid out like the installed package (a checkout's root, or `k3num tree "
                             f"{engine} DIR`)") from None
        raise
    release, note = judged_as(engine, version)
    missing = [f for f in release.files if not (root / f).is_file()]
    if missing:
        raise ValueError(f"{root}: says {engine} {version} and lacks {len(missing)} of {release.version}'s "
                         f"{len(release.files)} bound files: {', '.join(missing[:3])}"
                         f"{' ...' if len(missing) > 3 else ''}")
    return note


def local_version(engine: str, root: Path) -> str:
    """A local tree's version as read from it (`tree_version`; kept per path for the process)."""
    key = (engine, root)
    if key not in _TREE_VERSIONS:
        _TREE_VERSIONS[key] = tree_version(engine, root)
    return _TREE_VERSIONS[key]


_TREE_VERSIONS: dict[tuple[str, Path], str] = {}  # a per-process memo of files read, like _VERIFIED


def release_of_tree(engine: str, path: Path) -> str | None:
    """The version of the pinned release whose cache tree `path` is (None: another tree)."""
    try:
        resolved = path.expanduser().resolve()
    except OSError:
        return None
    for p in (_releases_of(engine) if engine in PINS else ()):
        if (cache_root() / _tree_name(p)).resolve() == resolved:
            return p.version
    return None


def release_root(spec: str) -> Path:
    """The cache tree of a pinned release (ENGINE or ENGINE@VERSION)."""
    return cache_root() / _tree_name(release_pin(spec))


def source(src: "Source | str") -> Source:
    """A Source, or a spec (ENGINE, ENGINE@VERSION) meaning that release's cache."""
    return src if isinstance(src, Source) else Source(src)


def source_of(engine: str, sources: "dict[str, Path] | None") -> Source:
    """The Source of pin `engine` in a run whose local trees are `sources` (pin name -> tree; a release's
    cache tree names that release)."""
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
    verified manifest to compare with: not the pinned bytes as far as anyone can tell). A `csrc/` path is a
    file of the release's pinned source distribution (its compiled ops, `csrc_dir`): a local tree without a
    `csrc/` folder builds its ops from that sdist (supply/cuda_ops.py `sources_for`), so its csrc files are the
    pinned bytes; one with its own `csrc/` is compared file by file with the pinned csrc's manifest."""
    src = source(src)
    pin = src.pin
    csrc = [f for f in files if f.startswith("csrc/")]
    known = _csrc_manifest(pin) if csrc else {}
    unknown = [f for f in files if f not in pin.files and not (f in csrc and (known is None or f in known))]
    if unknown:
        raise ValueError(f"{src.engine}: {unknown} are not files of the pin")
    if src.local is None:
        return True
    pinned = _pinned_manifest(pin)
    if pinned is None:
        return False
    if csrc and (src.local / "csrc").is_dir():
        if known is None:
            return False  # the pinned csrc is not fetched here: nothing to compare the tree's with
        if not all((src.local / rel).is_file() and sha256_of(src.local / rel) == known[rel] for rel in csrc):
            return False
    return all((src.local / rel).is_file() and sha256_of(src.local / rel) == pinned.get(rel)
               for rel in files if rel not in csrc)


def _csrc_manifest(pin: Pin) -> dict[str, str] | None:
    """The release's pinned csrc manifest (file -> sha256), None when that csrc is not extracted here or its
    manifest is not the pinned one; ValueError when the engine has no pinned source distribution."""
    spec = f"{pin.engine}@{pin.version}"
    try:
        spin = sdist_pin(spec)
    except FetchError as e:
        raise ValueError(f"{pin.engine} {pin.version}: csrc files need a pinned source distribution ({e})") from None
    return _verified_manifest(csrc_dir(spec) / MANIFEST, spin.manifest_sha256)


def _pinned_manifest(pin: Pin) -> dict[str, str] | None:
    """The cache's MANIFEST.json when its own sha256 is the pinned one, else None."""
    return _verified_manifest(cache_root() / _tree_name(pin) / MANIFEST, pin.manifest_sha256)


def _verified_manifest(path: Path, sha256: str) -> dict[str, str] | None:
    """A MANIFEST.json's file -> sha256 when the manifest's own sha256 is `sha256` (pinned), else None."""
    try:
        if not sha256 or sha256_of(path) != sha256:
            return None
        return dict(json.loads(path.read_text()))
    except (OSError, ValueError):
        return None


def missing_files(src: "Source | str") -> list[str]:
    """The pinned files the engine's source lacks (a local tree, or a cache not fetched)."""
    src = source(src)
    return [f for f in src.pin.files if not (src.root / f).is_file()]


def missing_in(engine: str, root: Path) -> list[str]:
    """The pinned files of `engine` (ENGINE or ENGINE@VERSION) missing from the tree at `root` (empty when all
    are there)."""
    return [f for f in release_pin(engine).files if not (root / f).is_file()]


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
        return {f: sha256_of(src.local / f) for f in src.pin.files if (src.local / f).is_file()}
    path = src.root / MANIFEST
    if not path.exists():
        return {}
    return dict(json.loads(path.read_text()))


MANIFEST = "MANIFEST.json"


def manifest_text(hashes: dict[str, str]) -> str:
    """The bytes MANIFEST.json holds for these hashes (what `Pin.manifest_sha256` pins)."""
    return json.dumps(hashes, indent=1, sort_keys=True)


def cache_problems(engine: str) -> list[str] | None:
    """What in the cache of `engine` (ENGINE or ENGINE@VERSION) differs from the pinned bytes, one line per
    file ("PATH: expected sha256 X, found Y"); [] when all is as pinned; None when nothing was ever fetched."""
    src = Source(engine)
    pin, root = src.pin, src.root
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
    """Drop the per-process record of verified caches and read tree versions (tests that edit a cache call
    this)."""
    _VERIFIED.clear()
    _TREE_VERSIONS.clear()


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
    engine, root = src.spec, src.root
    key = (engine, root)
    if key in _VERIFIED:
        return _VERIFIED[key]
    problems = cache_problems(engine)
    if problems is None:
        return {}
    if problems:
        pin = src.pin
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
    """Make a pinned release's source (ENGINE: the default release, or ENGINE@VERSION) available in the
    cache; return its source directory."""
    try:
        pin = release_pin(engine)
    except ValueError as e:
        raise FetchError(str(e)) from None
    root = Source(engine).root

    def current() -> bool:
        return cache_problems(engine) == [] and set(manifest(engine)) == set(pin.files)

    if current():
        log(f"[fetch] {pin.engine} {pin.version}: up to date in {root} ({len(pin.files)} files, hashes checked)")
        return root
    with cache_lock(_tree_name(pin), log=log):
        if current():  # another process fetched it while this one waited
            log(f"[fetch] {pin.engine} {pin.version}: up to date in {root} (fetched by another process)")
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

    @property
    def version(self) -> str:
        """The release it is (its file name: ENGINE-VERSION.tar.gz)."""
        return self.filename.removeprefix(f"{self.engine}-").removesuffix(".tar.gz")


_VLLM_CSRC_ROOTS = (
    "csrc/layernorm_kernels.cu", "csrc/pos_encoding_kernels.cu", "csrc/cache_kernels.cu",
    "csrc/torch_bindings.cpp", "csrc/ops.h",
    # the SM100-only AttnRes kernel (supply/cuda_ops.py builds it on a 10.0-family GPU only)
    "csrc/kimi_k3/attn_res_kernel.cu",
    # the MLA layer's fused prefill epilogue (RoPE, key concat, latent cache insert; byte-identical in both releases)
    "csrc/fused_kimi_k3_mla_key_concat_kv_cache_kernel.cu")
_VLLM_033_SDIST = SdistPin(
    "vllm", "vllm-0.33.0.tar.gz", "f4c33c2503d52bb411146afa9618a4f48bed68912f617e6803ac8d76e4c74112",
    _VLLM_CSRC_ROOTS, manifest_sha256="246565653826f170d4afaf6f6720794daa6c7c0ddec1b6ac38edb47249dc1cee")
# 0.34.0's csrc: layernorm, pos_encoding and the SM100 attn_res kernel byte-identical to 0.33.0's; cache_kernels.cu,
# torch_bindings.cpp and ops.h changed (an asymmetric-head reshape_and_cache, the MLA insert's optional RoPE tail)
_VLLM_034_SDIST = SdistPin(
    "vllm", "vllm-0.34.0.tar.gz", "fcad848b246a9d8652b47e6425af92334dc02492f9802720f54e27b823cf0113",
    _VLLM_CSRC_ROOTS, manifest_sha256="1604a8fe82639715b1ca3d4ba99056a21ab4d9f11728319bc49d52a166be88d3")

# Every pinned source distribution of each engine, by release (the compiled ops of a run are built from the csrc
# of the release it reads: `csrc_dir("vllm@0.33.0")`), and each engine's default one (`PINS`' release).
SDIST_RELEASES: dict[str, tuple[SdistPin, ...]] = {"vllm": (_VLLM_033_SDIST, _VLLM_034_SDIST)}
SDISTS: dict[str, SdistPin] = {e: next(p for p in pins if p.version == PINS[e].version)
                               for e, pins in SDIST_RELEASES.items()}


def sdist_pin(spec: str) -> SdistPin:
    """The SdistPin of ENGINE (its default release's) or ENGINE@VERSION; FetchError listing the pinned ones."""
    engine, at, version = spec.partition("@")
    if engine not in SDISTS:
        raise FetchError(f"{engine}: no pinned source distribution; pinned: {sorted(SDISTS)}")
    if not at:
        return SDISTS[engine]
    pins = (*SDIST_RELEASES.get(engine, ()), SDISTS[engine])
    found = next((p for p in pins if p.version == version), None)
    if found is None:
        raise FetchError(f"{spec}: no pinned source distribution of that release; pinned: "
                         f"{', '.join(sorted({f'{engine}@{p.version}' for p in pins}))}")
    return found


def csrc_specs() -> list[str]:
    """Every pinned csrc as a spec: the default's bare engine name, the others ENGINE@VERSION."""
    return [e if p is SDISTS[e] else f"{e}@{p.version}" for e in SDISTS
            for p in dict.fromkeys((*SDIST_RELEASES.get(e, ()), SDISTS[e]))]


def csrc_dir(spec: str) -> Path:
    """Where ENGINE[@VERSION]'s csrc subset is extracted: <cache>/ENGINE-VERSION-csrc."""
    pin = sdist_pin(spec)
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
    """The pinned C++/CUDA sources of `engine` (ENGINE, its default release, or ENGINE@VERSION) in
    `csrc_dir(engine)`: the sdist downloaded (or found in <cache>/sdists), checked against its pin, and its
    include closure of `SdistPin.roots` extracted with a MANIFEST.json whose own sha256 is pinned.
    Idempotent; repairs a changed tree."""
    spin = sdist_pin(engine)  # FetchError for an engine or release with no pinned sdist
    root = csrc_dir(engine)
    said = f"{engine.partition('@')[0]} {spin.version} csrc"
    if not csrc_problems(engine):
        log(f"[fetch] {said}: up to date in {root} (hashes checked)")
        return root
    with cache_lock(root.name, log=log):
        if not csrc_problems(engine):  # another process extracted it while this one waited
            log(f"[fetch] {said}: up to date in {root} (extracted by another process)")
            return root
        return _extract_csrc(engine, root, log)


def _extract_csrc(engine: str, root: Path, log: Log) -> Path:
    """The include closure written from the checked sdist (under the tree's lock; files replaced
    atomically, the manifest last: see `atomic_write`)."""
    pin = sdist_pin(engine)
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
    pin, root = sdist_pin(engine), csrc_dir(engine)
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
