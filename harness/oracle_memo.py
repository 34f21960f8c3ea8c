"""The oracle once per case in the pre-merge check (harness/pairing_run.py).

A paired example runs its body twice, head then base, on the same drawn case. Both passes build the
same inputs and ask the float64 oracle the same questions; the base's answers are the head's. Each
pass runs under a `Memo`'s `passing`, which scopes its oracle (harness/oracle.py's PLAIN with every entry
point wrapped) as the judges' oracle (`oracle.using`); nothing in refmodel is replaced. The check owns its
Memo (harness/pairing_run.py), so no state outlives the run. On the head's pass each
call computes and keeps (a copy of its arguments, its result); on a later pass of the same example
(the base, and the confirming reruns) the k-th call of an entry point is answered from the head's
k-th call of it, when its arguments are the same values (`same`: tensors by dtype, shape, device and
their bits; dataclasses field by field; containers item by item; the rest by `==`).
Any other call computes, and is counted as a miss. So a reused answer is the one the oracle would
give: the memo changes the time of a check, never a verdict.

Cost: a copy of every oracle input, kept for one example (the float64 inputs the property already
built); comparing them reads each input once, where the oracle reads it several times (a GEMM reads
its operands O(k) times, the AttnRes mix reads each source for the scores and again for the mix).

Shapes: none; the entry points' own.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch

from k3num.harness import oracle

_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _bits(t: torch.Tensor) -> torch.Tensor:
    """A float tensor as the integers of its bits (so -0.0 is not 0.0 and a NaN equals its own bits)."""
    t = torch.view_as_real(t) if t.is_complex() else t
    if t.is_floating_point():
        return t.view(_INT[t.element_size()])
    return t


def same(a: Any, b: Any) -> bool:
    """Whether two oracle arguments are the same values (bit for bit for tensors)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype
                and a.shape == b.shape and a.device == b.device and torch.equal(_bits(a), _bits(b)))
    if type(a) is not type(b):
        return False
    if dataclasses.is_dataclass(a) and not isinstance(a, type):
        return all(same(getattr(a, f.name), getattr(b, f.name)) for f in dataclasses.fields(a))
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    try:
        return bool(a == b)
    except Exception:  # an object whose == is not a truth value: not known to be the same
        return False


class Memo:
    """One check's memo (module docstring): `oracle` is PLAIN with every entry point wrapped; `passing` scopes
    it over one pass of an example's body; `stats` counts, over the check, the calls computed, reused and
    computed again on a replaying pass (`missed`). Per-run state: the check owns one (harness/pairing_run.py)."""

    def __init__(self) -> None:
        self.stats = {"computed": 0, "reused": 0, "missed": 0}
        self._kept: dict[str, list[tuple[Any, Any, Any]]] = {}  # entry point -> the head's (args, kwargs, result)
        self._seen: dict[str, int] = {}  # entry point -> calls made on the current pass
        self._recording = False
        self.oracle = oracle.PLAIN.wrapped(self._wrap)

    def _wrap(self, key: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def memo(*args: Any, **kwargs: Any) -> Any:
            k = self._seen[key] = self._seen.get(key, 0) + 1
            if self._recording:
                kept_args = copy.deepcopy((args, kwargs))  # before the call: a caller may mutate its inputs
                result = fn(*args, **kwargs)
                self._kept.setdefault(key, []).append((*kept_args, copy.deepcopy(result)))
                self.stats["computed"] += 1
                return result
            kept = self._kept.get(key, [])
            if k <= len(kept) and same(kept[k - 1][0], args) and same(kept[k - 1][1], kwargs):
                self.stats["reused"] += 1
                return copy.deepcopy(kept[k - 1][2])
            self.stats["missed"] += 1
            return fn(*args, **kwargs)

        return memo

    def new_example(self) -> None:
        """Forget the last example's calls: its inputs are never asked for again."""
        self._kept.clear()
        self._seen.clear()

    @contextlib.contextmanager
    def passing(self, recording: bool) -> Iterator[None]:
        """One pass of an example's body: the head's (recording) or a later one (replaying)."""
        self._seen.clear()
        self._recording = recording
        try:
            with oracle.using(self.oracle):
                yield
        finally:
            self._recording = False
            self._seen.clear()
