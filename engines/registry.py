"""Engine registry: name -> factory. Real engines and test-only engines register here.

`available()` lists the engines whose factories succeed on this machine, with
the reason for each that does not, so a missing engine is reported, never
silently dropped.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from k3num.engines.base import Engine
from k3num.supply import EngineUnavailable

__all__ = ["EngineUnavailable", "register", "defaults", "known", "get", "built", "build", "pin_of"]

# a factory of an engine that reads no engine files (the mirror, the self-tests' mutants) takes no
# argument; one of a real engine (registered with its pin) takes (src: supply.fetch.Source, mode: str),
# the tree its files are read from and the requested engine mode (--engine-mode)
Factory = Callable[..., Engine]
_FACTORIES: dict[str, Factory] = {}
_PINS: dict[str, str] = {}  # registry name -> the pin its files come from (real engines only)
DEFAULT_ENGINES: list[str] = ["mirror"]


def register(name: str, factory: Factory, *, default: bool = False, pin: str | None = None) -> None:
    _FACTORIES[name] = factory
    if pin is None:
        _PINS.pop(name, None)
    else:
        _PINS[name] = pin
    if default and name not in DEFAULT_ENGINES:
        DEFAULT_ENGINES.append(name)


def defaults() -> list[str]:
    """The engines a plain run tests (mirror and the real engines; unavailable ones skip with a reason)."""
    _load_builtin()
    return list(DEFAULT_ENGINES)


def known() -> list[str]:
    _load_builtin()
    return sorted(_FACTORIES)


def pinned() -> list[str]:
    """The real engines (those whose files come from a pin), in the order they were registered."""
    _load_builtin()
    return [n for n in _FACTORIES if n in _PINS]


def adapters() -> list[str]:
    """The real engines' adapter packages (each has `coverage_rows()`), one per package."""
    return list(dict.fromkeys(module for _, module, _ in _real().values()))


def pin_of(name: str) -> str | None:
    """The pin whose files the engine reads (None: it reads none)."""
    _load_builtin()
    return _PINS.get(name)


_CACHE: dict[tuple[str, Any, str], Engine] = {}


def get(name: str, sources: Mapping[str, Path] | None = None, mode: str = "auto") -> Engine:
    """Build (once per name, source tree and mode) and return the engine; `sources` maps a pin name to the
    local tree its files are read from (--engine-src; absent: the pinned cache), `mode` is --engine-mode.
    EngineUnavailable says why it cannot be built."""
    _load_builtin()
    if name not in _FACTORIES:
        raise ValueError(f"--engine: unknown engine {name!r}; known: {sorted(_FACTORIES)}")
    pin = _PINS.get(name)
    key = (name, (sources or {}).get(pin) if pin else None, mode if pin else "")
    if key not in _CACHE:
        _CACHE[key] = build(name, sources, mode)
    return _CACHE[key]


def built() -> list[Engine]:
    """The engines `get` has built so far in this process."""
    return list(_CACHE.values())


def build(name: str, sources: Mapping[str, Path] | None = None, mode: str = "auto") -> Engine:
    """A fresh engine, not cached (what `get` caches); EngineUnavailable says why it cannot be built."""
    _load_builtin()
    if name not in _FACTORIES:
        raise ValueError(f"unknown engine {name!r}; known: {sorted(_FACTORIES)}")
    pin = _PINS.get(name)
    if pin is None:
        return _FACTORIES[name]()
    from k3num.supply import fetch

    src = fetch.source_of(pin, dict(sources or {}))
    missing = fetch.missing_files(src)
    if src.local is not None and missing:
        raise EngineUnavailable(f"{pin}: the local tree {src.local} (--engine-src) lacks {missing}")
    try:  # source mode checks the cache against its pins (supply.fetch.verified_manifest)
        return _FACTORIES[name](src, mode)
    except fetch.FetchError as e:
        raise EngineUnavailable(str(e)) from e


def _real() -> dict[str, tuple[str, str, str]]:
    """The real engines: registry name -> (pin, adapter module, factory), from each pin's `builds`
    (supply/fetch.py PINS); built only when first asked for."""
    from k3num.supply import fetch

    return {name: (pin.engine, f"k3num.engines.{pin.engine}_adapter", attr)
            for pin in fetch.PINS.values() for name, attr in pin.builds}


def _load_builtin() -> None:
    if "mirror" not in _FACTORIES:
        from k3num.engines import mirror

        register("mirror", mirror.build)
    for name, (pin, module, attr) in _real().items():
        if name not in _FACTORIES:
            register(name, _lazy(module, attr), default=True, pin=pin)


def _lazy(module: str, attr: str) -> Factory:
    def factory(src: Any, mode: str) -> Engine:
        import importlib

        return getattr(importlib.import_module(module), attr)(src, mode)

    return factory
