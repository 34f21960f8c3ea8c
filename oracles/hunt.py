"""The rules of the hunt for what one comparison per call cannot see (races, unwritten memory,
reads and writes outside a buffer): how many repeats, what poison, how wide a guard band.

Repeats. A racy kernel gives a wrong (or just different) output on a fraction p of its calls. If
the calls are independent, n calls all agree with probability (1 - p)^n, so detecting a per-call
rate of at least p with confidence 1 - alpha takes

    n >= ln(alpha) / ln(1 - p)                                          (calls_to_detect)

calls on the same input. On the GPU the rates seen in this project were 3.5-40% (K3N-004: 7 of 200;
K3N-005: 64 of 200; K3N-007: 49 of 300), so P_GPU = 0.03 sits below the lowest of them and
ALPHA = 0.01 leaves a 1% chance of missing it: n = 152 calls per case. Calls on the GPU are not
strictly independent (the same warps are scheduled alike), so this is the rule for the number of
calls, not a proof of absence; the ledger's reproducers give the rates actually measured. On the
CPU every kernel runs under the sequential Triton interpreter or in eager torch, where a race
cannot happen; the repeats there prove the plumbing (a subject that keeps hidden state between
calls, or leaves an element unwritten, differs from the second call on), so P_CPU = 0.8 gives n = 3.

Poison. Before a call, every buffer the subject must write in full, and every region it must leave
alone, is filled with a sentinel: NaN for floating dtypes (a read of it poisons every sum it
enters, a kept NaN is checked bit for bit), 0x7F for float8 (NaN in e4m3fn; in e5m2 NaN too), and
a fixed bit pattern for integer dtypes. `PoisonAllocations` fills every tensor the subject itself
allocates with `torch.empty`, `torch.empty_like`, `torch.empty_strided` or `Tensor.new_empty`
during the call (its outputs and workspaces, the adapters' stand-in workspaces included), so an
element the subject forgets to write is a NaN, never a value left over from an earlier call:
without this, a fresh output could reuse the freed block of the previous call, which held the
right answer, and an unwritten element would pass.

Guard bands. `guarded` places a tensor inside a larger poisoned buffer (GUARD elements on each
side): a read past either end of the tensor reads NaN (and the output is not finite), a write
past it changes the guard (checked bit for bit).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

P_GPU = 0.03  # smallest per-call failure rate the GPU hunt is sized to detect
P_CPU = 0.8  # on the CPU nothing races: the repeats prove the plumbing
ALPHA = 0.01  # probability of missing a failure that occurs at rate P
# elements of poisoned guard on each side of a guarded tensor: at least one Triton tile of the
# widest unmasked load among the bound kernels (SGLang's BLOCK_H = 1024) so an over-read of a
# whole tile stays inside the guard
GUARD = 2048


def calls_to_detect(p: float, alpha: float = ALPHA) -> int:
    """The smallest n with (1 - p)^n <= alpha: calls needed to see a per-call failure rate p."""
    if not (0.0 < p < 1.0) or not (0.0 < alpha < 1.0):
        raise ValueError(f"calls_to_detect: need 0 < p < 1 and 0 < alpha < 1, got p={p}, alpha={alpha}")
    return math.ceil(math.log(alpha) / math.log1p(-p))


def repeats_for(device: str | torch.device) -> int:
    """The number of calls per case on `device` (GPU: the hunt; CPU: the plumbing)."""
    return calls_to_detect(P_GPU if torch.device(device).type == "cuda" else P_CPU)


INT_SENTINEL = 0x5A  # every byte of an integer buffer: 0x5A5A... (positive, not a valid slot or index)
FP8_SENTINEL = 0x7F  # NaN in float8_e4m3fn and float8_e5m2


def poison_(t: torch.Tensor) -> torch.Tensor:
    """Fill `t` in place with its dtype's sentinel (see the module docstring); returns `t`."""
    if t.numel() == 0:
        return t
    if t.dtype.is_floating_point and t.element_size() == 1:
        t.view(torch.uint8).fill_(FP8_SENTINEL)
    elif t.dtype.is_floating_point or t.dtype.is_complex:
        t.fill_(float("nan"))
    elif t.dtype == torch.bool:
        t.fill_(True)
    else:
        t.view(torch.uint8).fill_(INT_SENTINEL)
    return t


def is_sentinel(t: torch.Tensor) -> torch.Tensor:
    """Elementwise: does `t` still hold its dtype's sentinel (bool tensor of t's shape)."""
    if t.dtype.is_floating_point and t.element_size() == 1:
        return t.view(torch.uint8) == FP8_SENTINEL
    if t.dtype.is_floating_point:
        return t.isnan()
    ref = poison_(torch.empty_like(t))
    return t == ref


_ALLOCATORS = {torch.empty, torch.empty_like, torch.empty_strided, torch.Tensor.new_empty}


class PoisonAllocations(TorchFunctionMode):
    """Inside this mode, every tensor made by an uninitialised allocator is filled with its sentinel (or by
    `fill`, in place); `count` says how many were."""

    def __init__(self, fill: Callable[[torch.Tensor], Any] = poison_) -> None:
        super().__init__()
        self.count = 0
        self.fill = fill

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        out = func(*args, **(kwargs or {}))
        if func in _ALLOCATORS and isinstance(out, torch.Tensor):
            with torch.no_grad():
                self.fill(out)
            self.count += 1
        return out


@contextmanager
def poisoned_allocations(fill: Callable[[torch.Tensor], Any] = poison_) -> Iterator[PoisonAllocations]:
    mode = PoisonAllocations(fill)
    with mode:
        yield mode


@dataclass
class Guarded:
    """A tensor (`view`) inside a poisoned buffer with GUARD elements before and after it."""

    view: torch.Tensor
    buffer: torch.Tensor  # flat
    start: int
    numel: int

    def guards_intact(self) -> bool:
        before, after = self.buffer[: self.start], self.buffer[self.start + self.numel:]
        return bool(is_sentinel(before).all()) and bool(is_sentinel(after).all())

    def guard_damage(self) -> str:
        """Where a guard was written ('' when both are intact)."""
        parts = []
        for name, g in (("before", self.buffer[: self.start]), ("after", self.buffer[self.start + self.numel:])):
            bad = (~is_sentinel(g)).nonzero().flatten()
            if bad.numel():
                off = bad[0].item() - (self.start if name == "before" else 0)
                parts.append(f"{bad.numel()} element(s) written {name} the tensor (first at offset {off})")
        return "; ".join(parts)


def guarded(values: torch.Tensor, guard: int = GUARD) -> Guarded:
    """A contiguous copy of `values` placed between two poisoned guards of `guard` elements."""
    n = values.numel()
    buf = poison_(torch.empty(n + 2 * guard, dtype=values.dtype, device=values.device))
    view = buf[guard: guard + n].view(values.shape)
    view.copy_(values)
    return Guarded(view=view, buffer=buf, start=guard, numel=n)


def same(a: tuple[torch.Tensor, ...], b: tuple[torch.Tensor, ...]) -> bool:
    """Bitwise equality of two output tuples, on their device (NaN payloads compared as bits)."""
    return all(x.shape == y.shape and x.dtype == y.dtype and torch.equal(_bits(x), _bits(y)) for x, y in zip(a, b))


def all_same_as_first(outputs: list[tuple[torch.Tensor, ...]]) -> bool:
    """Whether every output tuple is bitwise the first (`same`), decided with one device sync: each output
    position's results are stacked and compared with the first's at once (the results are all kept anyway)."""
    if len(outputs) < 2:
        return True
    first = outputs[0]
    if any(len(o) != len(first) or any(x.shape != y.shape or x.dtype != y.dtype for x, y in zip(first, o))
           for o in outputs[1:]):
        return False
    flags = [(torch.stack([_bits(o[j]) for o in outputs[1:]]) == _bits(first[j])).all()
             for j in range(len(first)) if first[j].numel()]
    return not flags or bool(torch.stack([f.to(flags[0].device) for f in flags]).all())


def _bits(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().contiguous()
    if t.dtype == torch.bool:
        return t
    return t.view(torch.uint8)


def distinct(outputs: list[tuple[torch.Tensor, ...]]) -> int:
    """The number of bitwise-distinct output tuples (compared on their device: no host copies)."""
    uniques: list[tuple[torch.Tensor, ...]] = []
    for tup in outputs:
        if not any(same(tup, u) for u in uniques):
            uniques.append(tup)
    return len(uniques)


def first_difference(a: tuple[torch.Tensor, ...], b: tuple[torch.Tensor, ...], names: tuple[str, ...]) -> str:
    """'' when the tuples are bitwise equal, else which tensor differs first and where."""
    for name, x, y in zip(names, a, b):
        xb = x.detach().contiguous().view(torch.uint8) if x.element_size() == 1 else x.detach()
        yb = y.detach().contiguous().view(torch.uint8) if y.element_size() == 1 else y.detach()
        if x.shape != y.shape or x.dtype != y.dtype:
            return f"{name}: shape/dtype {tuple(x.shape)}/{x.dtype} vs {tuple(y.shape)}/{y.dtype}"
        if x.dtype.is_floating_point and x.element_size() > 1:
            same = (xb == yb) | (xb.isnan() & yb.isnan())
        else:
            same = xb == yb
        if not bool(same.all()):
            idx = (~same).nonzero()[0].tolist()
            return f"{name}: {int((~same).sum())} element(s) differ, first at {idx}"
    return ""


Invoke = Callable[[], tuple[tuple[torch.Tensor, ...], tuple[str, ...]]]
