"""Engine registry: name -> factory. Real engines and test-only engines register here.

`available()` lists the engines whose factories succeed on this machine, with
the reason for each that does not, so a missing engine is reported, never
silently dropped.
"""

from __future__ import annotations

from collections.abc import Callable

from k3num.engines.base import Engine
from k3num.supply import EngineUnavailable

__all__ = ["EngineUnavailable", "register", "defaults", "known", "get", "built", "build"]

Factory = Callable[[], Engine]
_FACTORIES: dict[str, Factory] = {}
DEFAULT_ENGINES: list[str] = ["mirror"]


def register(name: str, factory: Factory, *, default: bool = False) -> None:
    _FACTORIES[name] = factory
    if default and name not in DEFAULT_ENGINES:
        DEFAULT_ENGINES.append(name)


def defaults() -> list[str]:
    """The engines a plain run tests (mirror and the real engines; unavailable ones skip with a reason)."""
    _load_builtin()
    return list(DEFAULT_ENGINES)


def known() -> list[str]:
    _load_builtin()
    return sorted(_FACTORIES)


_CACHE: dict[str, Engine] = {}


def get(name: str) -> Engine:
    """Build (once) and return the engine; EngineUnavailable says why it cannot be built."""
    _load_builtin()
    if name not in _FACTORIES:
        raise ValueError(f"--engine: unknown engine {name!r}; known: {sorted(_FACTORIES)}")
    if name not in _CACHE:
        _CACHE[name] = _FACTORIES[name]()
    return _CACHE[name]


def built() -> list[Engine]:
    """The engines `get` has built so far in this process."""
    return list(_CACHE.values())


def build(name: str) -> Engine:
    """A fresh engine, not cached (what `get` caches); EngineUnavailable says why it cannot be built."""
    _load_builtin()
    if name not in _FACTORIES:
        raise ValueError(f"unknown engine {name!r}; known: {sorted(_FACTORIES)}")
    return _FACTORIES[name]()


# the real engines: registry name -> (adapter module, factory); built only when first asked for
_REAL = {
    "vllm": ("k3num.engines.vllm_adapter", "build"),
    "vllm-rocm": ("k3num.engines.vllm_adapter", "build_rocm"),
    "tokenspeed": ("k3num.engines.tokenspeed_engine", "build"),
    "sglang": ("k3num.engines.sglang_engine", "build"),
}


def _load_builtin() -> None:
    if "mirror" not in _FACTORIES:
        from k3num.engines import mirror

        register("mirror", mirror.build)
    for name, (module, attr) in _REAL.items():
        if name not in _FACTORIES:
            register(name, _lazy(module, attr, name.split("-")[0]), default=True)


def _lazy(module: str, attr: str, pin: str) -> Factory:
    def factory() -> Engine:
        import importlib

        from k3num.supply import fetch

        try:
            local = fetch.local_sources().get(pin)
        except ValueError as e:
            raise EngineUnavailable(str(e)) from e
        missing = fetch.missing_files(pin)
        if local is not None and missing:
            raise EngineUnavailable(f"{pin}: the local tree {local} (K3NUM_ENGINE_SRC) lacks {missing}")
        try:  # source mode checks the cache against its pins (supply.fetch.verified_manifest)
            return getattr(importlib.import_module(module), attr)()
        except fetch.FetchError as e:
            raise EngineUnavailable(str(e)) from e

    return factory
