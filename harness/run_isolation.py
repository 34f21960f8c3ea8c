"""The k3num plugin's isolation half (harness/isolation.py says why): each test's CUDA memory when asked
(K3NUM_MEMORY_LOG), a failed test's leftovers released, and a process whose CUDA context is lost running
nothing more: serially its later tests are not run, an xdist worker exits after its test and is replaced.
Registered by harness/plugin.py (`pytest_plugins`)."""

from __future__ import annotations

import os
import sys

import pytest
import torch

from k3num.harness import isolation
from k3num.harness import session_state as state
from k3num.harness.run_scope import ours, shares_its_gpu, worker_id
from k3num.oracles.records import not_run as not_run_record
from k3num.supply import env

# K3NUM_MEMORY_LOG=PATH: one CSV line per test with its CUDA memory (the GPU isolation proof,
# scripts/gpu_isolation.py): the peak allocated during the test, and what is still allocated after its
# teardown, before and after a garbage collection (memory a failed test keeps alive)
MEMORY_LOG_ENV = "K3NUM_MEMORY_LOG"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    path = env.get("K3NUM_MEMORY_LOG")
    cuda = bool(path) and torch.cuda.is_available()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    yield
    if not cuda:
        return
    import gc

    try:
        peak, held = torch.cuda.max_memory_allocated(), torch.cuda.memory_allocated()
        gc.collect()
        held_gc, reserved = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
    except Exception as e:  # a lost context answers nothing: say so in the log
        peak = held = held_gc = reserved = -1
        note = f"{type(e).__name__}: {str(e)[:120]}"
    else:
        note = ""
    outcome = item.stash.get(state.OUTCOME, "")
    with open(path, "a") as fh:
        fh.write(",".join(str(v).replace(",", ";") for v in (item.nodeid, outcome, peak, held, held_gc, reserved,
                                                              note)) + "\n")


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item: pytest.Item) -> None:
    """After a failed test of ours (and after the plugin's own teardown wrote the drift CSV): release what
    it keeps alive, and stop this process if its CUDA context is lost."""
    if item.stash.get(state.OUTCOME, "") == "failed" and ours(item):
        isolation.release_failure()
        why = isolation.context_lost()
        if why:
            _context_lost(item, why)
    if item.config.stash.get(state.LOST, None) and worker_id(item.config):
        _replace_this_worker(item.config)
    elif shares_its_gpu(item.config) and ours(item):
        _return_cached_memory()


def _return_cached_memory() -> None:
    """Hand the blocks PyTorch's allocator keeps after a test back to the driver. Each process caches up to its
    own peak, and caches of several processes on one GPU add up: GPU run 63 had eight K3-shape workers on one
    H200 holding 10-35 GiB each, and a test that needed 578 MiB more died of CUDA OOM."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


RUNDIR_ENV = isolation.RUNDIR_ENV


def _context_lost(item: pytest.Item, why: str) -> None:
    """This process's CUDA context is gone after `item`: nothing more runs here (isolation.LOST)."""
    item.config.stash[state.LOST] = (item.nodeid, why)
    sys.stderr.write(f"\n[k3num] CUDA context lost after {item.nodeid}: {why}\n")


def _replace_this_worker(config: pytest.Config) -> None:
    """An xdist worker whose context is lost leaves a note for the controller and exits after its test
    was reported: xdist starts a fresh worker and gives this one's queue to the others; the controller
    drops the crash report xdist makes for the test (pytest_handlecrashitem below): its own failure
    was reported already."""
    import json

    node, why = config.stash[state.LOST]
    rundir, worker = env.get("K3NUM_RUNDIR"), worker_id(config)
    if rundir:
        with open(os.path.join(rundir, f"lost-{worker}.json"), "w") as fh:
            json.dump({"worker": worker, "node": node, "why": why}, fh)
    sys.stderr.flush()
    sys.stdout.flush()
    os._exit(3)


@pytest.hookimpl(optionalhook=True)
def pytest_handlecrashitem(crashitem: str, report: pytest.TestReport, sched) -> None:
    """xdist controller: a worker that exited because its CUDA context was lost (its note says after
    which test) crashed on purpose; that test's failure stands, the crash report becomes a silent one."""
    import json

    rundir = env.get("K3NUM_RUNDIR")
    worker = getattr(getattr(getattr(report, "node", None), "gateway", None), "id", "")
    note = os.path.join(rundir, f"lost-{worker}.json") if rundir and worker else ""
    if not note or not os.path.exists(note):
        return
    with open(note) as fh:
        lost = json.load(fh)
    os.unlink(note)
    if lost.get("node") != crashitem:
        return
    report.outcome, report.when, report.longrepr = "passed", "teardown", None  # type: ignore[assignment]
    state.book(sched.config).replaced.append((worker, crashitem, lost.get("why", "")))  # xdist's scheduler's config


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """A test of ours in a process whose CUDA context is lost is not run, and says so (isolation.LOST)."""
    lost = item.config.stash.get(state.LOST, None)
    if lost is None or not ours(item):
        return
    node, why = lost
    callspec = getattr(item, "callspec", None)
    engine = str(callspec.params.get("engine", "")) if callspec else ""
    record = not_run_record(property=getattr(item, "originalname", item.name), engine=engine, node=item.nodeid,
                            why=f"{isolation.LOST} {node}: {why}")
    item.config.stash[state.DRIFT].add(record)
    pytest.skip(f"{isolation.LOST} {node}")
