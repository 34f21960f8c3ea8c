"""Engine registry: name -> factory. Real engines and test-only engines register here.

`available()` lists the engines whose factories succeed on this machine, with
the reason for each that does not, so a missing engine is reported, never
silently dropped.
"""

from __future__ import annotations

from collections.abc import Callable

from engines.base import Engine

Factory = Callable[[], Engine]
_FACTORIES: dict[str, Factory] = {}
DEFAULT_ENGINES: list[str] = ["mirror"]


class EngineUnavailable(RuntimeError):
    """An engine cannot be built here (missing source, wrong version, ...)."""


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


def _load_builtin() -> None:
    if "mirror" not in _FACTORIES:
        from engines import mirror

        register("mirror", mirror.build)
    if "vllm" not in _FACTORIES:
        def vllm() -> Engine:
            from engines import vllm_engine

            return vllm_engine.build()

        register("vllm", vllm, default=True)

        def vllm_rocm() -> Engine:
            from engines import vllm_engine

            return vllm_engine.build_rocm()

        register("vllm-rocm", vllm_rocm, default=True)

        def tokenspeed() -> Engine:
            from engines import tokenspeed_engine

            return tokenspeed_engine.build()

        register("tokenspeed", tokenspeed, default=True)

        def sglang() -> Engine:
            from engines import sglang_engine

            return sglang_engine.build()

        register("sglang", sglang, default=True)
