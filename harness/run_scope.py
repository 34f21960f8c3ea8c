"""What a pytest run covers and which process this is: the plugin's halves (harness/plugin.py, run_summary.py,
run_isolation.py, ledger_run.py, pairing_run.py) and the property modules read these, so none of them imports
another's private names.

- `ours(item)` / `own_path(path)`: whether a test is one of the harness's own (the property package, the
  checkout, and K3NUM_OWN_TESTS's folders: people's own tests written against k3num.api), where the ledger,
  the gpu skips and the isolation apply;
- `engine_names(config)`: the engines --engine names (the defaults without it);
- `is_controller`, `worker_id`, `shares_its_gpu`: the process's part in a pytest-xdist run;
- `bound_engines()`: how each engine this process built was bound, for the run's account and metadata.
"""

from __future__ import annotations

import functools
import os

import pytest

from k3num.engines import registry
from k3num.supply import env


@functools.cache
def own_dirs() -> tuple[str, ...]:
    """The folders whose tests are the harness's own: the installed (or linked) property package, and,
    in a checkout, the repository (its tests/ and properties/)."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.find_spec("k3num.properties")
    dirs = [Path(p).resolve() for p in (spec.submodule_search_locations or [])] if spec else []
    # your own tests written against k3num.api: the ledger, the gpu skips and the isolation apply there too
    dirs += [Path(p).expanduser().resolve() for p in (env.get("K3NUM_OWN_TESTS") or "").split(os.pathsep) if p]
    checkout = Path(__file__).resolve().parents[1]
    if (checkout / "pyproject.toml").is_file() and (checkout / "k3num").is_dir():
        dirs.append(checkout)
    return tuple(str(d) + os.sep for d in dirs)


def ours(item: pytest.Item) -> bool:
    """Whether a collected test is one of the harness's own (the module docstring)."""
    return own_path(str(getattr(item, "path", "") or ""))


def own_path(path: str) -> bool:
    return bool(path) and any(os.path.realpath(path).startswith(d) for d in own_dirs())


def engine_names(config: pytest.Config) -> list[str]:
    """The engines --engine names (the defaults without it); a UsageError naming any unknown one."""
    opt = config.getoption("--engine")
    if not opt:
        return registry.defaults()
    # NAME@VERSION names a pinned release; the run reads it as its sources (engine_releases), the ids stay NAME
    names = list(dict.fromkeys(n.strip().partition("@")[0] for n in opt.split(",") if n.strip()))
    unknown = [n for n in names if n not in registry.known()]
    if unknown:
        raise pytest.UsageError(f"--engine {opt}: unknown engine(s) {', '.join(unknown)}; known: "
                                f"{', '.join(registry.known())}")
    return names


def engine_releases(opt: str | None) -> dict[str, str]:
    """{pin: ENGINE@VERSION} for each engine --engine names with a release (`vllm@0.34.0`, `vllm-rocm@0.34.0`);
    ValueError for a release not pinned (listing the pinned ones), an engine reading no pin, or two releases
    of one pin in one run (each release is a run of its own: the test ids name the engine, not the release)."""
    from k3num.supply import fetch

    out: dict[str, str] = {}
    for item in (n.strip() for n in (opt or "").split(",")):
        name, at, version = item.partition("@")
        if not at:
            continue
        pin = registry.pin_of(name)
        if pin is None:
            raise ValueError(f"{item}: {name} reads no pinned release" if name in registry.known() else
                             f"{item}: unknown engine {name!r}; known: {', '.join(registry.known())}")
        spec = fetch.spec_of(fetch.release_pin(f"{pin}@{version}"))  # ValueError listing the pinned releases
        if out.get(pin, spec) != spec:
            raise ValueError(f"{out[pin]} and {item}: one release of {pin} per run (run each in its own)")
        out[pin] = spec
    return out


def is_controller(config: pytest.Config) -> bool:
    """Whether this process hands the tests to pytest-xdist workers (and runs none itself)."""
    return not hasattr(config, "workerinput") and getattr(config.option, "dist", "no") != "no"


def worker_id(config: pytest.Config) -> str:
    """This process's xdist worker name (gw0, gw1, ...), "" where it is no worker."""
    return str(getattr(config, "workerinput", {}).get("workerid", ""))


def shares_its_gpu(config: pytest.Config) -> bool:
    """Whether this xdist worker shares its GPU with other workers (K3NUM_WORKERS_PER_GPU > 1, or more workers
    than GPUs): then the memory PyTorch caches after a test is memory the others cannot have."""
    gpus = [g for g in (env.get("K3NUM_GPUS") or "").split(",") if g]
    count = int(getattr(config, "workerinput", {}).get("workercount", 1))
    return bool(worker_id(config)) and bool(gpus) and count > len(gpus)


def bound_engines() -> dict[str, str]:
    """name -> 'name version: mode (note)' of every engine this process built, the mirror included."""
    from k3num.harness import around

    return {e.name: f"{e.name} {e.version}: {e.mode}" + (f" ({e.mode_note})" if e.mode_note else "")
            for e in registry.built() + around.built()}
