"""The run context: one frozen record of a run's settings, built once where the process starts.

The plugin builds it from the options (and, for a process another started, the variables
`to_env` wrote) in `pytest_configure` and keeps it in `config.stash[RUN]`; fixtures hand it down
(`k3num_run`, the `engine` fixture's `registry.get(name, ctx.sources)`), the CLI builds one from its
own flags. Settings cross a process boundary only through `to_env` / `from_env` (the variables and who
may read them: supply/env.py).

    option            field          reaches
    --engine-src      sources        registry.get -> the adapter's build(Source) -> supply.fetch
    --engine-mode     engine_mode    registry.get -> supply.installed.select
    --device          device         the properties' tensors (properties.support.DEVICE)
    --repro-dir/-all  repro_dir/all  the properties' recorder (properties.support)
    --checkpoint      checkpoint     the checkpoint properties (fixtures.checkpoint.opened)
    --golden          golden         the golden-set properties
    --shards          shards         the plugin's parametrization of `shardable` properties
    --threads         threads        torch's CPU threads in this process (`apply_threads`)

Threads. Every process the harness starts (the main job, the test command, each xdist worker, each side
of `k3num check`) runs one torch CPU thread unless the user says otherwise: `--threads N`, K3NUM_THREADS,
or OMP_NUM_THREADS (torch's own variable; then torch's choice is left alone). The suite's tensors are small:
torch's default of one thread per core only adds OpenMP's hand-offs, and processes that share the cores
(xdist workers, two CI jobs) oversubscribe them (docs/performance.md: the main job and the test command
with the default threads and with one).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path

from k3num.supply import env, fetch

MODES = ("auto", "import", "source")


@dataclass(frozen=True)
class RunContext:
    sources: dict[str, Path] = field(default_factory=dict)  # pin name -> local tree (--engine-src)
    engine_mode: str = "auto"  # auto | import | source (--engine-mode)
    device: str = ""  # "" until resolved: cuda where CUDA is, else cpu
    repro_dir: str = ""
    repro_all: bool = False
    checkpoint: str = ""
    golden: str = ""
    shards: int = 1
    threads: int = 1  # torch's CPU threads in this process; 0: leave torch's own choice (OMP_NUM_THREADS)

    def __post_init__(self) -> None:
        if self.engine_mode not in MODES:
            raise ValueError(f"engine mode: unknown {self.engine_mode!r}; expected one of {list(MODES)}")
        if self.shards < 1:
            raise ValueError(f"shards: expected a positive int, got {self.shards!r}")
        if self.threads < 0:
            raise ValueError(f"threads: expected a positive int (0: torch's own choice), got {self.threads!r}")

    def source(self, engine: str) -> fetch.Source:
        """Where pin `engine`'s files are read from in this run."""
        return fetch.source_of(engine, self.sources)

    def with_source(self, engine: str, tree: Path | None) -> RunContext:
        """This context with pin `engine` read from `tree` (None: its pinned cache): a check's base."""
        sources = {k: v for k, v in self.sources.items() if k != engine}
        if tree is not None:
            sources[engine] = tree
        return replace(self, sources=sources)

    def to_env(self) -> dict[str, str]:
        """The variables that carry this context to a process this one starts (supply.env.child)."""
        out = {"K3NUM_ENGINE_SRC": ",".join(f"{k}={v}" for k, v in sorted(self.sources.items())),
               "K3NUM_ENGINE_MODE": self.engine_mode, "K3NUM_REPRO_ALL": "1" if self.repro_all else "",
               "K3NUM_THREADS": str(self.threads)}
        for name, value in (("K3NUM_DEVICE", self.device), ("K3NUM_REPRO_DIR", self.repro_dir),
                            ("K3NUM_CHECKPOINT", self.checkpoint), ("K3NUM_GOLDEN", self.golden)):
            out[name] = value
        return out

    @classmethod
    def from_env(cls) -> RunContext:
        """The context a process was started with (the variables `to_env` writes; each absent one takes
        its default); ValueError naming the variable that holds a bad value."""
        try:
            sources = fetch.parse_sources(env.get("K3NUM_ENGINE_SRC") or "")
        except ValueError as e:
            raise ValueError(f"K3NUM_ENGINE_SRC: {e}") from None
        raw_shards = env.get("K3NUM_SHARDS") or "1"
        try:
            shards = int(raw_shards)
        except ValueError:
            shards = 0
        if shards < 1:
            raise ValueError(f"K3NUM_SHARDS: expected a positive int, got {raw_shards!r}")
        mode = (env.get("K3NUM_ENGINE_MODE") or "auto").strip() or "auto"
        if mode not in MODES:
            raise ValueError(f"K3NUM_ENGINE_MODE: unknown engine mode {mode!r}; expected one of {list(MODES)}")
        return cls(sources=sources, engine_mode=mode, device=env.get("K3NUM_DEVICE") or "",
                   repro_dir=env.get("K3NUM_REPRO_DIR") or "", repro_all=env.get("K3NUM_REPRO_ALL") == "1",
                   checkpoint=env.get("K3NUM_CHECKPOINT") or "", golden=env.get("K3NUM_GOLDEN") or "",
                   shards=shards, threads=threads_from_env())


def parse_threads(raw: str, what: str) -> int:
    """A thread count as given (a positive int); ValueError naming `what`."""
    try:
        n = int(raw)
    except ValueError:
        n = 0
    if n < 1:
        raise ValueError(f"{what}: expected a positive int (torch's CPU threads per process), got {raw!r}")
    return n


def threads_from_env() -> int:
    """The threads a process was started with: K3NUM_THREADS, else 0 (torch's own choice) where the user set
    OMP_NUM_THREADS, else 1."""
    raw = env.get("K3NUM_THREADS")
    if raw:
        return parse_threads(raw, "K3NUM_THREADS")
    return 0 if env.get("OMP_NUM_THREADS") else 1


def apply_threads(ctx: RunContext) -> int:
    """Set torch's CPU threads in this process from the context (0 leaves them); the count in force."""
    import torch

    if ctx.threads and torch.get_num_threads() != ctx.threads:
        torch.set_num_threads(ctx.threads)
    return torch.get_num_threads()


_PROCESS: list[RunContext] = []  # the context this process was given (install), read by current()


def install(ctx: RunContext) -> RunContext:
    """Make `ctx` this process's context: the plugin calls it once, in pytest_configure, before any
    property module is imported. (The properties read it through `current()`; handing it to them as a
    fixture argument is the step still to take: docs/architecture.md.)"""
    _PROCESS[:] = [ctx]
    return ctx


def current() -> RunContext:
    """This process's context: the one the plugin installed, else the one it was started with."""
    if not _PROCESS:
        _PROCESS.append(RunContext.from_env())
    return _PROCESS[0]
