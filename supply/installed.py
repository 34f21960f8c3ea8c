"""Import mode: an engine's subjects bound from the installed package, with its compiled ops.

Where vLLM, SGLang or TokenSpeed is installed at the pinned version on a CUDA
machine, the adapters bind the real modules (imported for real, nothing
stubbed) and the compiled ops those modules call, instead of the fetched files
with stand-ins (source mode). `probe` checks, in this order, and names the
first thing that fails:

1. the distribution is installed at exactly the pinned version (package
   metadata only; nothing is imported yet);
2. CUDA is available (the compiled ops are CUDA ops);
3. no local tree is given for the engine (`--engine-src` means "test these
   files", which is source mode);
4. every module the adapter binds imports;
5. every compiled op the bound code calls is registered (`torch.ops.NS.OP`).

The mode is chosen by `--engine-mode` (harness/run.py's RunContext.engine_mode, handed to each build):
- `auto` (the default): import mode where `probe` passes, else source mode,
  with the reason kept in `Engine.mode_note` and printed in pytest's header;
- `import`: import mode or the engine is unavailable (its tests skip with the
  reason): for a GPU job that must test the installed engine;
- `source`: the fetched files (or `--engine-src`) even where the engine is
  installed.

In import mode a lifted method runs with its own module's globals (the real
ops, kernels and helpers); the adapter overrides only the names that need a
running server (the pipeline group, the workspace manager), and the per-call
objects it builds (a model namespace carrying the test's weights and caches)
are named in `real_ops`.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import types
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from k3num.supply import EngineUnavailable, fetch

MODES = ("auto", "import", "source")


class NotInstalled(RuntimeError):
    """Import mode cannot be used for this engine here (the message says why)."""


def requested(mode: str) -> str:
    """The requested engine mode, checked; ValueError for an unknown one."""
    mode = (mode or "auto").strip() or "auto"
    if mode not in MODES:
        raise ValueError(f"--engine-mode: unknown engine mode {mode!r}; expected one of {list(MODES)}")
    return mode


def cuda_available() -> bool:
    return torch.cuda.is_available()


def op_registered(namespace: str, name: str) -> bool:
    """Whether torch.ops.<namespace>.<name> resolves (an extension's op is registered when its
    library loaded)."""
    try:
        getattr(getattr(torch.ops, namespace), name)
    except (AttributeError, RuntimeError):
        return False
    return True


def module_name(rel: str) -> str:
    """'vllm/models/kimi_k3/nvidia/model.py' -> 'vllm.models.kimi_k3.nvidia.model'."""
    if not rel.endswith(".py"):
        raise ValueError(f"not a module file: {rel}")
    return rel[: -len(".py")].replace("/", ".").removesuffix(".__init__")


@dataclass(frozen=True)
class Installed:
    """The installed engine: its version, where its files are, and the modules the adapter binds."""

    engine: str
    version: str
    root: Path  # the directory that holds the package (site-packages)
    modules: dict[str, types.ModuleType] = field(default_factory=dict)  # relative path -> module

    def module(self, rel: str) -> types.ModuleType:
        return self.modules[rel]

    def file(self, rel: str) -> Path:
        return self.root / rel

    def sha256(self, rel: str) -> str:
        return fetch.sha256_of(self.file(rel))

    def namespace(self, rel: str, runtime: dict[str, Any]) -> dict[str, Any]:
        """Globals for code lifted from `rel`: the real module's, with the `runtime` names (state
        of a running server) replaced."""
        return {**vars(self.module(rel)), **runtime}


def probe(engine: str, modules: Sequence[str], ops: Sequence[tuple[str, str]], *, local: bool = False) -> Installed:
    """Import mode for `engine`: the pinned version installed, CUDA, no local tree, `modules`
    (relative paths) imported, `ops` ((namespace, name) pairs) registered; else NotInstalled."""
    pin = fetch.PINS[engine]
    try:
        got = importlib.metadata.version(pin.dist)
    except importlib.metadata.PackageNotFoundError:
        raise NotInstalled(f"{pin.dist} is not installed") from None
    if got != pin.version:
        raise NotInstalled(f"{pin.dist} {got} is installed; the pin is {pin.version}")
    if not cuda_available():
        raise NotInstalled(f"{pin.dist} {got} is installed but there is no CUDA device for its compiled ops")
    if local:
        raise NotInstalled(f"a local tree is given for {engine} (--engine-src)")
    spec = importlib.util.find_spec(pin.dist)
    if spec is None or not spec.submodule_search_locations:
        raise NotInstalled(f"{pin.dist} {got} is installed but its package cannot be found")
    root = Path(list(spec.submodule_search_locations)[0]).parent
    loaded: dict[str, types.ModuleType] = {}
    for rel in modules:
        try:
            loaded[rel] = importlib.import_module(module_name(rel))
        except Exception as e:  # noqa: BLE001 - any import failure means no import mode, named
            raise NotInstalled(f"{pin.dist} {got}: importing {module_name(rel)} failed: "
                               f"{type(e).__name__}: {e}") from e
        if not (root / rel).is_file():
            raise NotInstalled(f"{pin.dist} {got}: {rel} is not a file under {root}")
    absent = [f"torch.ops.{ns}.{name}" for ns, name in ops if not op_registered(ns, name)]
    if absent:
        raise NotInstalled(f"{pin.dist} {got}: compiled ops not registered: {', '.join(absent)}")
    return Installed(engine, got, root, loaded)


def expected_mode(src: fetch.Source, mode: str) -> str:
    """The mode the engine's build will likely take, without importing it (for matching ledger
    entries at collection time): import where the requested `mode`, version and CUDA allow it."""
    gpu = "source-gpu" if cuda_available() else "source-interpreter"
    engine = src.engine
    if requested(mode) == "source" or src.local is not None:
        return gpu
    pin = fetch.PINS[engine]
    try:
        installed = importlib.metadata.version(pin.dist) == pin.version
    except importlib.metadata.PackageNotFoundError:
        installed = False
    return "import" if installed and cuda_available() else gpu


def select(src: fetch.Source, mode: str, modules: Sequence[str],
           ops: Sequence[tuple[str, str]]) -> tuple[Installed | None, str]:
    """(Installed, "") in import mode, or (None, why not) for source mode; EngineUnavailable when
    import mode is required (`mode` "import", --engine-mode import) and cannot be had."""
    try:
        mode = requested(mode)
    except ValueError as e:
        raise EngineUnavailable(str(e)) from e
    if mode == "source":
        return None, "source mode requested (--engine-mode source)"
    try:
        return probe(src.engine, modules, ops, local=src.local is not None), ""
    except NotInstalled as e:
        if mode == "import":
            raise EngineUnavailable(f"{src.engine}: import mode requested (--engine-mode import) but {e}") from e
        return None, f"import mode not used: {e}"
