"""One bug fails only its own tests (issue 20): what a failed test leaves behind, and a lost CUDA context.

Seen on the H200 (GPU run 29, scripts/gpu_isolation.py) before this module: a K3-shape mixture
property that failed left 45 GiB of CUDA tensors allocated after its teardown, garbage collection
included, and the next failing one raised the process to a 105 GiB peak; an illegal address in one
kernel failed the 33 tests after it with "CUDA error: an illegal memory access was encountered".

- `release_failure`: pytest keeps the last failure for post-mortem (sys.last_value and its traceback),
  and a traceback keeps every frame's locals alive: the test's tensors, the oracle's float64 copies,
  hypothesis' engine with its failing examples. After the failure has been reported (and after any
  --pdb session), the frames of the exception, of its causes and of the exceptions it groups are
  cleared and the references dropped; garbage is collected and the allocator's cached blocks returned.
  The oracle's per-device cached constants are dropped too (refmodel.drop_cached_constants): a failed
  test's kernel may have written outside its buffers into them (issue 32, GPU run 53: the planted
  `_combine_kernel` launched one 1024-wide H block over 96-wide rows and its stores reached the cached
  RoPE inverse frequencies; the DFlash writer's test that ran later read NaN cos/sin in its oracle). So are
  the bf16 mirror's kept RoPE tables (engines/mirror/context_kv.shared_rope_cache).
- `context_lost`: after a failed test on a CUDA process, a synchronize and one tiny kernel tell
  whether the context still works. An illegal address or an unknown error is sticky: every later CUDA
  call fails. Such a process runs nothing more: serially, its later tests are skipped as
  "not run: CUDA context lost after <node id>" (counted apart from failures and skips, with a record
  in the drift CSV); an xdist worker exits once its test is reported, xdist replaces it and hands its
  queue to the others, and the controller's crash report for it is dropped (the test's own failure
  stands).
"""

from __future__ import annotations

import gc
import sys
import traceback
from collections.abc import Iterator

LOST = "not run: CUDA context lost after"
RUNDIR_ENV = "K3NUM_RUNDIR"  # the xdist controller's folder where a worker that must go leaves its note


def _chain(exc: BaseException | None) -> Iterator[BaseException]:
    """The exception, its causes and contexts, and the exceptions a group holds (each once)."""
    seen: set[int] = set()
    todo = [exc] if exc is not None else []
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        yield e
        todo += [e.__cause__, e.__context__]
        todo += list(getattr(e, "exceptions", ()) or ())


def release_failure(exc: BaseException | None = None) -> None:
    """Drop what a reported failure keeps alive (module docstring); `exc` and sys.last_* both."""
    for e in (*_chain(exc), *_chain(getattr(sys, "last_value", None)), *_chain(getattr(sys, "last_exc", None))):
        if e.__traceback__ is not None:
            traceback.clear_frames(e.__traceback__)  # frames still executing are left as they are
    for name in ("last_type", "last_value", "last_traceback", "last_exc"):
        if hasattr(sys, name):
            setattr(sys, name, None)
    # the oracle's device-resident constants: the failed test's kernel may have written over them
    from k3num import refmodel
    from k3num.engines.mirror import context_kv as mirror_tables

    refmodel.drop_cached_constants()
    mirror_tables.drop_kept_tables()  # the bf16 mirror's RoPE tables, kept per device the same way
    gc.collect()
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        try:
            torch.cuda.empty_cache()
        except Exception:  # a lost context: context_lost says so
            pass


def releasing(inner):
    """`inner` (a hypothesis test's body, `test.hypothesis.inner_test`) wrapped so that an example that
    raises leaves no tensors behind: the frames it ran in have finished when the exception reaches the
    wrapper, and are cleared there (their code and line numbers stay for the report). Without it a
    property shrinking a failure keeps every failing example's tensors alive until the test ends (GPU
    run 30: a failing K3-shape mixture property peaked at 68 GiB where the passing one takes 17)."""
    import functools

    if getattr(inner, "_k3num_releasing", False):
        return inner

    @functools.wraps(inner)
    def body(*args, **kwargs):
        try:
            return inner(*args, **kwargs)
        except BaseException as e:
            if e.__traceback__ is not None and e.__traceback__.tb_next is not None:
                traceback.clear_frames(e.__traceback__.tb_next)
            raise

    body._k3num_releasing = True  # type: ignore[attr-defined]
    return body


def context_lost() -> str:
    """"" while this process's CUDA context works, else the error that says it does not."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return ""
    try:
        torch.cuda.synchronize()
        x = torch.ones(8, device="cuda")
        if float((x + x).sum().item()) != 16.0:
            return "a probe kernel computed a wrong sum"
        torch.cuda.synchronize()
    except Exception as e:  # torch.AcceleratorError, RuntimeError: the sticky error of the context
        return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]
    return ""
