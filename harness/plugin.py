"""The k3num pytest plugin: the property suite's options, fixtures, hypothesis profiles and markers.

Registered by an install of this package through its `pytest11` entry point (`k3num`), so that
`pytest --pyargs k3num.properties --engine vllm` runs the suite from any directory; in a checkout
that was never installed the root conftest.py loads it. `-p no:k3num` turns it off.

It is careful in a foreign test suite (an engine's own CI, where the package is installed): the
ledger's strict xfails, the `gpu` skips and the `dev` profile apply to the harness's own tests
only (`run_scope.ours`), the `engine` parametrization only to tests that use this plugin's `engine`
fixture, and a profile is loaded only when asked for or when the session holds tests of ours.

Profiles: harness/profiles.py (pick with --hypothesis-profile NAME; default "dev", in force before the first
test module of ours is imported). They are the same whether or not the CI environment variable is set.

On a machine without CUDA the plugin sets TRITON_INTERPRET=1 when it is imported (before triton
is first imported anywhere): there the engines' Triton kernels can only run under the interpreter.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from k3num.harness import scaleout
from k3num.supply import env

# pytest-xdist: each worker sees one GPU, chosen before CUDA starts in this process (the controller
# exported the GPUs it may use; see harness/scaleout.py). Only this choice reads the worker's name from
# the environment, because it must come before anything can start CUDA. Everything else asks the config
# (`run_scope.worker_id`): a pytest that a worker's test starts inherits the variable, but is no worker.
_WORKER = env.get("PYTEST_XDIST_WORKER")
if _WORKER and env.get("K3NUM_GPUS"):
    if "torch" in sys.modules and sys.modules["torch"].cuda.is_initialized():
        raise RuntimeError(f"xdist worker {_WORKER}: CUDA was initialised before the k3num plugin could choose "
                           "its GPU (a plugin imported torch and touched CUDA); run without -n or drop that plugin")
    env.put("CUDA_VISIBLE_DEVICES", scaleout.gpu_for_worker(_WORKER, (env.get("K3NUM_GPUS") or "").split(",")))

import pytest
import torch
from hypothesis import settings
from hypothesis.errors import InvalidArgument

from k3num.engines import registry
from k3num.harness import accounting, around, isolation, profiles, run, run_scope
from k3num.harness import session_state as state
from k3num.oracles import drift, ledger

# the plugin's other halves: what a failed test leaves behind and a lost CUDA context (run_isolation), and
# the run's account per engine with the block that ends the log (run_summary)
pytest_plugins = ["k3num.harness.run_isolation", "k3num.harness.run_summary", "k3num.harness.pairing_run",
                  "k3num.harness.ledger_run"]

if not _WORKER and torch.cuda.is_available():
    env.put("K3NUM_GPUS", ",".join(scaleout.visible_gpus(env.get("CUDA_VISIBLE_DEVICES"), torch.cuda.device_count())))
if not torch.cuda.is_available():
    # Triton kernels of the real engines run under the interpreter here; it must be chosen
    # before triton is first imported (see engines.triton_support.require_interpreter)
    env.put_default("TRITON_INTERPRET", "1")

DEFAULT_PROFILE = profiles.DEFAULT

MARKERS = (
    "gpu: needs a CUDA device (skipped with a reason where there is none)",
    "nightly: full K3 shapes; run by the nightly job",
    "shardable: a costly-example property whose example budget --shards N splits into N tests",
)


RUN = state.RUN  # the run's context (harness/run.py), built in pytest_configure


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("k3-numerics")
    group.addoption(
        "--engine",
        default=None,
        help="comma-separated engines to test (default: every engine available)",
    )
    group.addoption(
        "--device",
        default=None,
        metavar="DEV",
        help="device of the small-shape properties: cuda[:N] where CUDA is available (the default there), "
        "else cpu (the default); sets K3NUM_DEVICE (the gpu-marked K3-shape properties always run on cuda)",
    )
    group.addoption(
        "--engine-src",
        action="append",
        default=[],
        metavar="NAME=PATH",
        help="read engine NAME (vllm, sglang, tokenspeed) from PATH, a tree laid out like the installed "
        "package (PATH/vllm/models/kimi_k3/...), instead of the fetched cache: a checkout or a patch; "
        "repeatable; joins K3NUM_ENGINE_SRC",
    )
    group.addoption(
        "--engine-mode",
        default=None,
        choices=["auto", "import", "source"],
        help="how the real engines are bound: auto (the default: the installed engine with its compiled ops "
        "where it is installed at the pinned version on a CUDA machine, else the fetched source), import "
        "(the installed engine or a skip naming why not), source (the fetched files even where installed); "
        "sets K3NUM_ENGINE_MODE",
    )
    group.addoption(
        "--checkpoint",
        default=None,
        metavar="DIR",
        help="run properties/test_checkpoint.py on the checkpoint in DIR (Hugging Face layout: config.json, "
        "model.safetensors.index.json, safetensors shards), checked against its config before the run; sets "
        "K3NUM_CHECKPOINT",
    )
    group.addoption(
        "--golden",
        default=None,
        metavar="DIR",
        help="judge the golden properties (properties/test_golden.py) against the stored float64 outputs of the set "
        "in DIR (written by `k3num golden write`); a tampered or mismatched set is refused; sets K3NUM_GOLDEN",
    )
    group.addoption(
        "--repro-dir",
        default=None,
        metavar="DIR",
        help="write DIR/<property>-<engine>-<seed>.safetensors for every failing comparison: the subject's inputs, "
        "its output and the oracle's, with the engine, budget, node id and command (replay: `k3num replay FILE`)",
    )
    group.addoption(
        "--repro-all",
        action="store_true",
        help="with --repro-dir, also write the worst comparison of each property (<property>-<engine>-worst)",
    )
    group.addoption(
        "--drift-dir",
        default=None,
        metavar="DIR",
        help="write this run's records to DIR/runs/drift-<UTC time>.csv (and its .meta.json) and point the link "
        "DIR/drift.csv at it: a run never overwrites another's (scripts/run_properties.sh's default: out)",
    )
    group.addoption(
        "--shards",
        default=None,
        metavar="N",
        help="split the example budget of each `shardable` property (the repeat-call hunts) into N tests, each "
        "max_examples/N rounded up and drawn at random (not under a derandomized profile), so that N xdist "
        "workers run it side by side "
        f"(default: ${scaleout.SHARDS_ENV} or 1, which leaves every test and node id as it is)",
    )
    group.addoption(
        "--threads",
        default=None,
        metavar="N",
        help="torch's CPU threads in this process and in each process it starts (xdist workers, a check's sides): "
        "default 1, or $K3NUM_THREADS; where OMP_NUM_THREADS is set, torch's own choice (harness/run.py)",
    )
    group.addoption(
        "--run-limit",
        default=None,
        type=float,
        metavar="SECONDS",
        help="the wall-clock limit a wrapper interrupts this run at (scripts/gpu_nightly.sh passes K3NUM_TIMEOUT): "
        "a run interrupted after it is reported as cut by that limit, not as crashed workers",
    )
    group.addoption(
        "--ledger-on-edited-files",
        action="store_true",
        default=False,
        help="keep the ledger's entries on a tree whose files differ from the pinned bytes (k3num mutate: the "
        "pinned tree with one mutant): a known bug's failure stays known where its signature and model explain it",
    )
    group.addoption(
        "--drift-csv",
        default=None,
        metavar="PATH",
        help="write every oracle comparison record of the session to PATH (CSV)",
    )


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config: pytest.Config) -> None:
    """Bad input stops before the run, one line each naming the flag and the fix (pytest's usage error,
    exit 4): an unknown hypothesis profile, a drift CSV or folder that cannot be written (an unknown
    engine: pytest_sessionstart). Runs before any plugin's pytest_configure (hypothesis' would raise an
    internal error)."""
    profile = config.getoption("hypothesis_profile", None)
    if profile:
        try:
            profiles.check(profile)
        except ValueError as e:
            raise pytest.UsageError(str(e)) from None
    for flag, target in (("--drift-csv", config.getoption("--drift-csv")),
                         ("--drift-dir", config.getoption("--drift-dir"))):
        if target:
            folder = Path(target) if flag == "--drift-dir" else Path(target).parent
            why = _unwritable(folder / "runs" if flag == "--drift-dir" else folder)
            if why:
                raise pytest.UsageError(f"{flag} {target}: cannot write there ({why}); give a path in a writable "
                                        "folder")
    return None


@pytest.hookimpl(tryfirst=True)
def pytest_sessionstart(session: pytest.Session) -> None:
    """An unknown --engine is a usage error before collection (here, once every plugin's pytest_configure
    has registered its engines: tests.mutants registers its own)."""
    if not hasattr(session.config, "workerinput"):
        run_scope.engine_names(session.config)


def _unwritable(folder: Path) -> str:
    """"" when a file can be created in `folder` (made if missing), else why not."""
    import tempfile

    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".k3num-probe-", dir=folder)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        return f"{type(e).__name__}: {e.strerror or e}"
    return ""


def pytest_configure(config: pytest.Config) -> None:
    import datetime

    for marker in MARKERS:
        config.addinivalue_line("markers", marker)
    if run_scope.is_controller(config):
        config.pluginmanager.register(_WorkerDeaths(config), "k3num-worker-deaths")
    ctx = config.stash[RUN] = run.install(_context(config))  # a bad value fails here, before collection
    run.apply_threads(ctx)
    from k3num.harness import literal_pool

    config.stash[state.POOL_FAILED] = literal_pool.pin()  # before the first draw (harness/literal_pool.py)
    if not run_scope.worker_id(config):  # xdist's workers and a test's subprocesses start with this environment
        env.put("K3NUM_THREADS", str(ctx.threads) if ctx.threads else "")
    config.stash[state.DRIFT] = drift.DriftCollector()
    _resolve_drift_dir(config)

    config.stash[state.STARTED] = datetime.datetime.now(datetime.timezone.utc)
    csv = config.getoption("--drift-csv")
    if csv and run_scope.is_controller(config):  # partial files of an earlier run must not join this one
        for p in scaleout.partial_paths(csv):
            p.unlink()
    if run_scope.is_controller(config) and not env.get("K3NUM_RUNDIR"):  # before xdist starts workers
        import tempfile

        env.put("K3NUM_RUNDIR", tempfile.mkdtemp(prefix="k3num-run-"))
    if ctx.checkpoint and not hasattr(config, "workerinput"):
        from k3num.fixtures import checkpoint

        try:
            checkpoint.open_checkpoint(ctx.checkpoint).validate()
        except checkpoint.CheckpointError as e:
            raise pytest.UsageError(f"--checkpoint: {e}") from e
    if ctx.golden and not hasattr(config, "workerinput"):
        from k3num.fixtures import golden

        try:
            golden.load_manifest(Path(ctx.golden))
        except golden.GoldenError as e:
            raise pytest.UsageError(f"--golden: {e}") from e


def _context(config: pytest.Config) -> run.RunContext:
    """The run's context: the options, over what this process was started with (a process another
    started: harness/run.py's from_env); a bad value is a usage error naming the option."""
    import dataclasses

    from k3num.fixtures import device
    from k3num.supply import fetch

    try:
        started = run.RunContext.from_env()
    except ValueError as e:
        raise pytest.UsageError(str(e)) from e
    try:
        sources = {**started.sources, **fetch.parse_sources(config.getoption("--engine-src") or [])}
    except ValueError as e:
        raise pytest.UsageError(f"--engine-src: {e}") from e
    try:  # --engine vllm@0.34.0: that release's verified cache is pin vllm's source in this run
        named = run_scope.engine_releases(config.getoption("--engine"))
    except ValueError as e:
        raise pytest.UsageError(f"--engine: {e}") from e
    given = fetch.parse_sources(config.getoption("--engine-src") or [])
    clash = [pin for pin in named if pin in given]
    if clash:
        raise pytest.UsageError(f"--engine {named[clash[0]]} and --engine-src {clash[0]}=...: a run reads one tree "
                                "per engine (a pinned release, or a local tree)")
    sources.update({pin: fetch.release_root(spec) for pin, spec in named.items()})
    for pin, tree in sources.items():  # a local tree is judged as the release it says, or refused before the run
        try:
            note = fetch.check_tree(pin, tree)
        except ValueError as e:
            raise pytest.UsageError(f"--engine-src {pin}={tree}: {e}") from None
        if note and not hasattr(config, "workerinput"):
            print(f"[k3num] --engine-src {pin}={tree}: {note}", file=sys.stderr)
    repro_dir = config.getoption("--repro-dir")
    if config.getoption("--repro-all") and repro_dir is None:
        raise pytest.UsageError("--repro-all: needs --repro-dir DIR")
    raw_shards = config.getoption("--shards")
    try:
        shards = started.shards if raw_shards is None else int(raw_shards)
    except ValueError:
        shards = 0
    if shards < 1:
        raise pytest.UsageError(f"--shards / $K3NUM_SHARDS: expected a positive int, got {raw_shards!r}")
    raw_threads = config.getoption("--threads")
    try:
        threads = started.threads if raw_threads is None else run.parse_threads(raw_threads, "--threads")
    except ValueError as e:
        raise pytest.UsageError(str(e)) from e
    opt = {k: config.getoption(f) for k, f in (("engine_mode", "--engine-mode"), ("checkpoint", "--checkpoint"),
                                               ("golden", "--golden"), ("device", "--device"))}
    try:
        ctx = dataclasses.replace(started, sources=sources, shards=shards, threads=threads,
                                  **{k: v for k, v in opt.items() if v is not None},
                                  **({"repro_dir": repro_dir} if repro_dir is not None else {}),
                                  repro_all=bool(config.getoption("--repro-all")) or started.repro_all)
    except ValueError as e:
        raise pytest.UsageError(f"--engine-mode: {e}") from e
    try:
        return dataclasses.replace(ctx, device=device.resolve(ctx.device))
    except ValueError as e:
        raise pytest.UsageError(f"--device: {e}") from e


@pytest.fixture(scope="session")
def k3num_run(request: pytest.FixtureRequest) -> run.RunContext:
    """The run's context (harness/run.py): the engines' sources, the engine mode, the device, ..."""
    return request.config.stash[RUN]


def _uses_our_engine_fixture(metafunc: pytest.Metafunc) -> bool:
    """Whether the test's `engine` argument is this plugin's fixture (a foreign suite may have its own)."""
    defs = getattr(getattr(metafunc.definition, "_fixtureinfo", None), "name2fixturedefs", {}).get("engine")
    if not defs:
        return True  # pytest's internals moved: assume ours, as before
    func = getattr(defs[-1], "func", None)
    return getattr(func, "__module__", None) == __name__ and getattr(func, "__name__", None) == "engine"


def _check_release(config: pytest.Config, engine: str) -> str:
    """The release whose ledger a check's base is filed under: a base tree's (`--check-base PATH`), else the
    release this side's tree is judged as (`--check-base pinned` reads that release's cache; a side of a
    two-process check reads its own tree)."""
    from k3num.supply import fetch

    spec = config.getoption("--check-base", None)
    if spec and spec != "pinned" and not spec.startswith("engine:"):
        return fetch.Source(engine, Path(spec)).pin.version
    return config.stash[RUN].source(engine).pin.version


def _checking(config: pytest.Config) -> bool:
    """A side of `k3num check` (either form): the pairing tells known from new."""
    return bool(config.getoption("--check-base", None) or config.getoption("--check-side", None))


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "engine" in metafunc.fixturenames and _uses_our_engine_fixture(metafunc):
        names = run_scope.engine_names(metafunc.config)
        # a known divergence's region, judged around its fix too (under `k3num check` on both sides: the base's
        # variant is the base tree with the same fix, harness/pairing_run.base_for)
        names = names + around.variants(names, metafunc.function.__name__)
        metafunc.parametrize("engine", names, ids=names, indirect=True, scope="session")
    n = metafunc.config.stash[RUN].shards
    if n > 1 and "shard" in metafunc.fixturenames and metafunc.definition.get_closest_marker("shardable"):
        shards = [scaleout.Shard(i, n) for i in range(n)]
        metafunc.parametrize("shard", shards, ids=[s.id for s in shards])


@pytest.fixture
def shard() -> scaleout.Shard:
    """The part of a `shardable` property's example budget this test runs (all of it without --shards)."""
    return scaleout.Shard()


def _split_budgets(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under --shards N, each shard of a `shardable` property runs max_examples/N (rounded up) examples."""
    n = config.stash[RUN].shards
    if n <= 1:
        return
    done: set[int] = set()
    for item in items:
        fn = getattr(item, "obj", None)
        if item.get_closest_marker("shardable") is None or fn is None or id(fn) in done:
            continue
        done.add(id(fn))
        current = settings.default  # the run's profile: a shardable property carries no @settings of its own
        if current.derandomize:
            raise pytest.UsageError(
                f"--shards {n}: the hypothesis profile is derandomized, so every shard of {item.originalname} "
                "would draw the same examples; shard under a profile that draws at random (nightly, nightly-1k)")
        try:  # hypothesis's public decorator, applied after @given: the test then runs under these settings
            settings(parent=current, max_examples=scaleout.Shard(0, n).examples(current.max_examples))(fn)
        except InvalidArgument as e:
            raise pytest.UsageError(f"--shards {n}: {item.originalname} is shardable but carries its own @settings, "
                                    f"which the shards' budget would replace ({str(e).splitlines()[0]})") from None


@pytest.fixture(scope="session")
def engine(request: pytest.FixtureRequest):
    """The engine under test (from --engine); unavailable engines skip with the reason."""
    ctx = request.config.stash[RUN]
    try:
        if around.SEP in request.param:
            return around.engine(request.param, ctx.sources, ctx.engine_mode)
        return registry.get(request.param, ctx.sources, ctx.engine_mode)
    except (registry.EngineUnavailable, around.Unavailable) as e:
        pytest.skip(f"engine {request.param} unavailable: {e}")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    """Through a test's setup, call and teardown: its records go to the run's drift collector
    (oracles.drift.collecting), keep their compared tensors under --repro-dir (oracles.records.keeping_tensors),
    and the property helpers keep their state in the run's Book (harness/recording.scoped)."""
    from k3num.harness import recording
    from k3num.oracles import records

    with drift.collecting(item.config.stash[state.DRIFT]), recording.scoped(state.book(item.config)), \
            records.keeping_tensors(bool(item.config.stash[RUN].repro_dir)):
        yield


@pytest.fixture(autouse=True)
def _ledger_context(request: pytest.FixtureRequest):
    """Tag the drift records with the test's node id, and those of a ledger-listed case with its entry id."""
    collector = request.config.stash[state.DRIFT]
    collector.ledger = getattr(request.node, "k3num_ledger", "")
    collector.node = request.node.nodeid
    yield
    collector.ledger = collector.node = ""


def _csv_target(config: pytest.Config) -> str | None:
    """Where this process writes its records: the --drift-csv path, or a worker's partial file beside it."""
    path = config.getoption("--drift-csv")
    worker = run_scope.worker_id(config)
    if path and worker:
        return str(scaleout.partial_path(path, worker))
    return path


# tryfirst: xdist's own implementation (the CPU count) must not answer before this one, whichever
# of the two plugins was registered first
@pytest.hookimpl(optionalhook=True, tryfirst=True)
def pytest_xdist_auto_num_workers(config: pytest.Config) -> int | None:
    """`-n auto`: one worker per visible GPU (times K3NUM_WORKERS_PER_GPU); xdist's default on a CPU machine."""
    gpus = env.get("K3NUM_GPUS") or ""
    try:
        return scaleout.auto_workers(len([g for g in gpus.split(",") if g]), env.get("K3NUM_WORKERS_PER_GPU"))
    except ValueError as e:
        raise pytest.UsageError(str(e)) from e


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    outcome = yield
    rep = outcome.get_result()
    if rep.when == "call" or (rep.when == "setup" and rep.outcome != "passed"):
        item.stash[state.OUTCOME] = rep.outcome
    if not run_scope.ours(item):
        return
    if rep.skipped and isinstance(rep.longrepr, tuple) and len(rep.longrepr) == 3:
        # hypothesis appends "Failing explicit example: ..." to a skip raised inside an @example: a skip
        # is not a failure, and must not read as one
        path, line, reason = rep.longrepr
        rep.longrepr = (path, line, accounting.short_reason(reason))
    callspec = getattr(item, "callspec", None)
    name = callspec.params.get("engine") if callspec else None
    if rep.when == "setup" and name is not None:  # the run's account (xdist sends user_properties to the controller)
        tag = ("k3num_engine", str(name))
        item.user_properties.append(tag)  # the call and teardown reports copy it from the item
        rep.user_properties.append(tag)


def pytest_runtest_teardown(item: pytest.Item) -> None:
    """Rewrite the drift CSV after every test that added records, so a run cut short (a job's time
    limit, SIGINT, a worker replaced after a lost CUDA context) keeps what it measured; the session end
    writes it once more."""
    config = item.config
    path = _csv_target(config)
    written = config.stash.get(state.WRITTEN, 0)
    collector = config.stash[state.DRIFT]
    if path and len(collector.records) != written:
        collector.write_csv(path)
        config.stash[state.WRITTEN] = len(collector.records)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    config = session.config
    collector = config.stash[state.DRIFT]
    if hasattr(config, "workerinput"):  # an xdist worker: its records stay in its partial file
        if _csv_target(config):
            collector.write_csv(_csv_target(config))
        config.workeroutput["k3num_bound"] = run_scope.bound_engines()  # type: ignore[attr-defined]
        config.workeroutput["k3num_gpu"] = env.get("CUDA_VISIBLE_DEVICES") or ""  # type: ignore[attr-defined]
        config.workeroutput["k3num_examples"] = dict(state.book(config).examples)  # type: ignore[attr-defined]
        return
    path = config.getoption("--drift-csv")
    if not path:
        return
    if run_scope.is_controller(config):  # merge every worker's partial file into the one CSV, then drop them
        import pandas as pd

        from k3num.oracles.drift import COLUMNS, read_csv

        parts = scaleout.partial_paths(path)
        frames = [read_csv(p) for p in parts]
        frames = [f for f in frames if not f.empty]
        df = pd.concat(frames, ignore_index=True) if frames else pd.DataFrame(columns=COLUMNS)
        written = collector.write_frame(df[COLUMNS], path)
        for p in parts:
            p.unlink()
        config.stash[state.FRAME] = df
        config.stash[state.CSV] = (written, len(df))
        _write_meta(config, path, config.stash.get(state.EXAMPLES, {}),
                    list(config.stash.get(state.BOUND, {}).values()))
        _link_latest(config, path)
        return
    written = collector.write_csv(path)
    _write_meta(config, path, state.book(config).examples, list(run_scope.bound_engines().values()))
    config.stash[state.CSV] = (written, len(collector.records))
    _link_latest(config, path)




def pytest_report_header(config: pytest.Config) -> list[str]:
    threads = config.stash[RUN].threads
    lines = [f"k3-numerics: torch CPU threads per process: {torch.get_num_threads()} "
             + ("(--threads / K3NUM_THREADS; default 1: harness/run.py)" if threads else
                "(torch's own choice: OMP_NUM_THREADS is set)")]
    failed = config.stash.get(state.POOL_FAILED, [])
    if failed:
        lines.append(f"k3-numerics: hypothesis's literal pool lacks {len(failed)} module(s) that did not import here "
                     f"(harness/literal_pool.py): {'; '.join(failed)[:500]}")
    return lines + _contract_lines(config)


def _contract_lines(config: pytest.Config) -> list[str]:
    """Where the run reads another tree than the default pins (a release named ENGINE@VERSION, a local tree):
    the release each selected engine reads and one line per subject whose contract that tree breaks, before
    any test runs (the tests of those subjects then skip with the same reason)."""
    ctx = config.stash[RUN]
    if not ctx.sources:
        return []
    lines = []
    for name in run_scope.engine_names(config):
        pin = registry.pin_of(name)
        if pin is None or pin not in ctx.sources:
            continue
        try:
            engine = registry.get(name, ctx.sources, ctx.engine_mode)
        except (registry.EngineUnavailable, ValueError) as e:
            lines.append(f"k3-numerics: {name}: unavailable: {e}")
            continue
        lines.append(f"k3-numerics: {name} {engine.version} ({engine.mode}) from {ctx.source(pin).root}")
        lines += [f"k3-numerics: {name} {engine.version}: {subject}: {why}"
                  for subject, why in sorted(engine.missing.items()) if why.startswith("contract changed")]
    return lines


def _resolve_drift_dir(config: pytest.Config) -> None:
    """--drift-dir DIR: this run's CSV is DIR/runs/drift-<UTC time>.csv (chosen once, by the controller)."""
    ddir = config.getoption("--drift-dir")
    if not ddir:
        return
    if config.getoption("--drift-csv"):
        raise pytest.UsageError("--drift-dir and --drift-csv: give one (--drift-csv names the file itself)")
    if run_scope.worker_id(config) and env.get("K3NUM_RUN_CSV"):  # the controller's choice, for its xdist workers
        config.option.drift_csv = env.get("K3NUM_RUN_CSV")
        return
    import datetime

    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%S%fZ")
    config.option.drift_csv = str(Path(ddir) / "runs" / f"drift-{stamp}.csv")
    env.put("K3NUM_RUN_CSV", config.option.drift_csv)


def _link_latest(config: pytest.Config, csv: str) -> None:
    """--drift-dir DIR: DIR/drift.csv and DIR/drift.meta.json link to this run's files (a regular file left
    there by an older harness is kept, moved into DIR/runs/)."""
    ddir = config.getoption("--drift-dir")
    if not ddir:
        return
    from k3num.oracles.history import meta_path

    for link, target in ((Path(ddir) / "drift.csv", Path(csv)), (meta_path(Path(ddir) / "drift.csv"), meta_path(csv))):
        if link.is_symlink():
            link.unlink()
        elif link.exists():
            link.rename(target.parent / f"{link.stem}-before-{target.stem.removeprefix('drift-')}{link.suffix}")
        if target.exists():
            link.symlink_to(os.path.relpath(target, link.parent))
    config.stash[state.LATEST] = str(Path(ddir) / "drift.csv")


def _last_lines(text: str, n: int = 3) -> str:
    """The last `n` lines of a worker's error that say something (its exception line among them)."""
    lines = [ln.strip().removeprefix("E").strip() for ln in str(text).splitlines() if ln.strip()]
    lines = [ln for ln in lines if not ln.startswith(("INTERNALERROR>", "^", "~"))] or lines
    return " | ".join(lines[-n:])[:400]


class _WorkerDeaths:
    """xdist controller: a worker's internal error (it died before or between tests) is kept with its last lines
    for the closing block (harness/run_summary.py: every worker lost before a test ran). A plugin object that
    holds its config, registered in pytest_configure: pytest_internalerror is a hook without one."""

    def __init__(self, config: pytest.Config) -> None:
        self.config = config

    def pytest_internalerror(self, excrepr, excinfo) -> None:
        if getattr(excinfo, "typename", "") != "AssertionError":  # xdist re-raises a worker's error so
            return
        text = "\n".join(ln for ln in str(excinfo.value).splitlines() if ln.strip() != "assert False")
        state.book(self.config).deaths.append(("a worker", _last_lines(text)))


def pytest_testnodedown(node, error) -> None:
    """xdist controller: keep each worker's account of how it bound the engines (for the summary), and what a
    worker that went down with an error died of."""
    if error:
        state.book(node.config).deaths.append((node.gateway.id, _last_lines(str(error))))
    node.config.stash.setdefault(state.BOUND, {}).update(getattr(node, "workeroutput", {}).get("k3num_bound", {}))
    node.config.stash.setdefault(state.EXAMPLES, {}).update(
        getattr(node, "workeroutput", {}).get("k3num_examples", {}))
    gpu = getattr(node, "workeroutput", {}).get("k3num_gpu")
    node.config.stash.setdefault(state.GPUS, {})[node.gateway.id] = gpu if gpu else "-"


@pytest.hookimpl(hookwrapper=True, trylast=True)
def pytest_runtest_call(item: pytest.Item):
    """Count each hypothesis test's examples for the run's metadata (hypothesis reports its statistics
    through a callback the pytest plugin installs around this call; this wraps that callback)."""
    from hypothesis.statistics import collector

    outer = collector.value

    def note(stats: dict) -> None:
        try:
            n = sum(1 for phase in ("reuse", "generate", "target")
                    for case in stats.get(f"{phase}-phase", {}).get("test-cases", [])
                    if case.get("status") in ("valid", "interesting"))
            state.book(item.config).examples[item.nodeid] = n  # generate, reuse and target phases
        finally:
            if outer is not None:
                outer(stats)

    with collector.with_value(note):
        yield


def _run_meta(config: pytest.Config, examples: dict[str, int], bound: list[str]) -> dict:
    """The run's metadata, written beside the drift CSV (oracles.history reads it)."""
    import datetime
    import platform
    import subprocess

    from hypothesis import settings as hsettings

    root = os.path.dirname(os.path.abspath(__file__))
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True,
                                timeout=10).stdout.strip()
        dirty = bool(subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                                    capture_output=True, text=True, timeout=10).stdout.strip())
    except (OSError, subprocess.SubprocessError):
        commit, dirty = "", False
    dev = config.stash[RUN].device
    if dev.startswith("cuda") and torch.cuda.is_available():
        device_name = torch.cuda.get_device_name(0)
    else:
        device_name = f"cpu {platform.machine()}"
        try:  # the CPU's model where Linux names it ("cpu x86_64 AMD EPYC ...")
            model = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")),
                         "")
        except OSError:
            model = ""
        device_name = f"{device_name} {model}".strip()
    started = config.stash.get(state.STARTED, None) or datetime.datetime.now(datetime.timezone.utc)
    return {
        "date": started.strftime("%Y-%m-%dT%H:%M:%SZ"),
        "harness_commit": commit + ("-dirty" if dirty else ""),
        # get_current_profile_name is newer than some hypothesis releases this package accepts
        "profile": (getattr(hsettings, "get_current_profile_name", None) or (lambda: hsettings._current_profile))()
        or "",
        "device_name": device_name,
        "torch": torch.__version__,
        "command": " ".join(["pytest", *config.invocation_params.args]),
        "engines": sorted(bound),
        "repro_dir": config.stash[RUN].repro_dir,
        "examples": dict(sorted(examples.items())),
    }


def _write_meta(config: pytest.Config, csv: str, examples: dict[str, int], bound: list[str]) -> None:
    import json

    from k3num.oracles.history import meta_path

    target = meta_path(csv)
    tmp = target.with_name(f".{target.name}.tmp")
    tmp.write_text(json.dumps(_run_meta(config, examples, bound), indent=1))
    os.replace(tmp, target)


def _checkpoint_hits(ctx: run.RunContext, entry_id: str) -> bool:
    """Whether the run's checkpoint (none: no) is inside the entry's checkpoint rule."""
    from k3num.fixtures import checkpoint
    from k3num.harness import ledger_cases

    c = checkpoint.opened(ctx.checkpoint)
    return c is not None and bool(ledger_cases.CHECKPOINT_RULES[entry_id].inside(c))


def _default_profile(config: pytest.Config) -> None:
    """Load DEFAULT_PROFILE when no --hypothesis-profile was given (once per process). It must be in force
    before the first module of ours is imported: `@given` takes `settings.default` when it decorates a test,
    so a profile loaded after the import (at collection's end) leaves hypothesis's own 200 ms deadline on
    every property (a red run on correct code under plain `pytest`; tests/test_plain_pytest.py)."""
    if config.getoption("hypothesis_profile", None) or config.stash.get(state.DEFAULT_LOADED, False):
        return
    settings.load_profile(DEFAULT_PROFILE)
    config.stash[state.DEFAULT_LOADED] = True


def pytest_collectstart(collector: pytest.Collector) -> None:
    """A test module of ours is about to be imported: the suite's default profile first (`_default_profile`).
    A foreign suite's modules collected before ours keep hypothesis's own default."""
    if isinstance(collector, pytest.Module) and run_scope.own_path(str(collector.path)):
        _default_profile(collector.config)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    from k3num.harness import ledger_cases, ledger_models, ledger_run
    from k3num.supply import installed
    from k3num.supply.fetch import PINS, pinned_files

    ours = [item for item in items if run_scope.ours(item)]
    if ours:
        _default_profile(config)
    _split_budgets(config, ours)
    # on a GPU, a failing example's tensors go when the example ends, not when the test does
    # (harness/isolation.py); --pdb and --showlocals keep them, to be looked at
    if torch.cuda.is_available() and not (config.getoption("usepdb", False) or config.getoption("showlocals", False)):
        for item in ours:
            h = getattr(getattr(item, "obj", None), "hypothesis", None)
            if h is not None and hasattr(h, "inner_test"):
                h.inner_test = isolation.releasing(h.inner_test)

    applies: dict[str, bool] = {}  # entry id -> its files are the pinned bytes here
    # k3num check (either form): the pairing tells known from new
    checking = _checking(config)
    for item in ours:  # known divergences: strict xfail, so an upstream fix turns the case red
        callspec = getattr(item, "callspec", None)
        name = callspec.params.get("engine") if callspec else None
        if name is None:
            continue
        param = name  # the engine object's name: the entries' key in the ledgered body
        name, fix = around.split(name)  # a variant: the entries its fix does not edit apply as on its engine
        pin = PINS.get(name.split("-")[0])
        # the mode the engine's build takes here (ledger entries can be limited to modes)
        ctx = config.stash[RUN]
        mode = installed.expected_mode(ctx.source(pin.engine), ctx.engine_mode) if pin else "reference"
        test = getattr(item, "originalname", item.name)
        # the release read (a check pairs against the entries of the pinned base it names)
        release = ((_check_release(config, pin.engine) if checking else ctx.source(pin.engine).pin.version)
                   if pin else "")
        found = ledger.lookup_all(name, release, test, mode) if pin else []
        if fix is not None:  # a variant around a fix: the entries the fix edits do not apply there
            found = around.unfixed_entries(fix, found)
        if checking:  # the entry filed on the pinned release names a known failure; nothing is marked
            item.k3num_check_ledger = found[0].id if found else ""  # type: ignore[attr-defined]
            h = getattr(getattr(item, "obj", None), "hypothesis", None)
            if found and h is not None and hasattr(h, "inner_test"):  # a failure its bug model rejects is new
                h.inner_test = ledger_run.modelled(h.inner_test)
                h.inner_test._k3num_model_entries[param] = found  # type: ignore[attr-defined]
            continue
        # an entry applies while its files are the pinned bytes: a tree that changed one of them (a fix, a
        # patch) is judged plainly, a tree that changed only other files of the engine keeps the entry
        keep = config.getoption("--ledger-on-edited-files")
        found = [d for d in found if pin is not None
                 and (keep or applies.setdefault(d.id, pinned_files(ctx.source(pin.engine), d.files)))]
        # a user's checkpoint hits an entry or not, decided once from its config and scales
        by_ckpt = [d for d in found if ledger_cases.CHECKPOINT_RULES.get(d.id, None) is not None
                   and ledger_cases.CHECKPOINT_RULES[d.id].test == test]
        found = [d for d in found if d not in by_ckpt]
        hit = [d for d in by_ckpt if _checkpoint_hits(ctx, d.id)]
        if hit:
            d = hit[0]
            item.k3num_ledger = d.id  # type: ignore[attr-defined]
            # strict, and only with the entry's own exception (its failure signature for the test): an error of
            # another kind on the user's checkpoint fails the test, not xfails it
            raises = ledger_cases.exception_types(ledger_cases.CASES[d.id].failure_signature(test))
            model = ledger_models.models().get(d.id)
            if model is not None:  # known only where the model explains what the test observed
                item.obj = ledger_run.checkpoint_modelled(item.obj, d.id)
            item.add_marker(pytest.mark.xfail(strict=True, raises=raises or None, reason=(
                f"{d.id} ({d.upstream}): your checkpoint {ctx.checkpoint} is inside it: "
                f"{ledger_cases.CHECKPOINT_RULES[d.id].meaning} (raising "
                f"{', '.join(t.__name__ for t in raises) or 'any exception'}"
                + (f"; the entry's bug model: {model.what}" if model else "") + ")")))
            continue
        if not found:
            continue
        item.k3num_ledger = found[0].id  # type: ignore[attr-defined]  # read by _ledger_context
        h = getattr(getattr(item, "obj", None), "hypothesis", None)
        if all(d.id in ledger_cases.CASES for d in found) and h is not None and hasattr(h, "inner_test"):
            # the entries cover the cases their rules name; the others are judged plainly, and each
            # reproducer is a strict case (properties/test_ledger_reproducers.py; harness/ledger_run.py)
            h.inner_test = ledger_run.ledgered(h.inner_test)
            h.inner_test._k3num_entries[param] = found  # type: ignore[attr-defined]
        else:  # no case rule: the whole test is the entry's, strictly
            entry = found[0]
            item.add_marker(pytest.mark.xfail(strict=True, reason=f"{entry.id} ({entry.upstream}): {entry.what}"))
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device; torch.cuda.is_available() is False here")
    for item in ours:
        if "gpu" in item.keywords:
            item.add_marker(skip)
