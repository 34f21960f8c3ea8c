"""Input validation shared by every oracle function.

Every failure is a ValueError that names the argument and says what was
expected, so a bad fixture fails at the boundary rather than deep inside an
einsum. Shape specs are tuples whose entries are ints (must match) or None
(any size); the caller binds symbolic sizes by reading them off one argument
and passing them as ints to the next.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

Shape = tuple[int | None, ...]


def float64(name: str, t: object, shape: Shape | None = None, *, finite: bool = True) -> torch.Tensor:
    """Check that `t` is a float64 tensor of `shape` (None entries free), with no NaN/Inf."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dtype != torch.float64:
        raise ValueError(f"{name}: expected dtype torch.float64, got {t.dtype}")
    _shape(name, t, shape)
    if finite:
        all_finite(**{name: t})
    return t


def all_finite(**tensors: torch.Tensor | None) -> None:
    """Check several float tensors for NaN/Inf with one device sync; the error names the first bad one."""
    d = Deferred()
    d.finite(**tensors)
    d.raise_first()


def integer(name: str, t: object, shape: Shape | None = None) -> torch.Tensor:
    """Check that `t` is an int32/int64 tensor of `shape`."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{name}: expected dtype torch.int64 or torch.int32, got {t.dtype}")
    _shape(name, t, shape)
    return t


def _shape(name: str, t: torch.Tensor, shape: Shape | None) -> None:
    if shape is None:
        return
    ok = t.dim() == len(shape) and all(
        want is None or want == got for want, got in zip(shape, t.shape)
    )
    if not ok:
        spec = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
        raise ValueError(f"{name}: expected shape {spec}, got {list(t.shape)}")


def same_device(**tensors: torch.Tensor | None) -> torch.device:
    """Check that all given tensors live on one device; return it."""
    present = {k: v for k, v in tensors.items() if v is not None}
    first_name, first = next(iter(present.items()))
    for name, t in present.items():
        if t.device != first.device:
            raise ValueError(
                f"{name}: expected device {first.device} (the device of {first_name}), "
                f"got {t.device}"
            )
    return first.device


def positive_float(name: str, value: float) -> float:
    """Check a strictly positive finite scalar such as an epsilon."""
    v = float(value)
    if not (v > 0.0 and v < float("inf")):
        raise ValueError(f"{name}: expected a finite value > 0, got {value}")
    return v


def nonnegative_float(name: str, value: float) -> float:
    """Check a finite scalar >= 0 (an output-norm epsilon may be 0)."""
    v = float(value)
    if not (v >= 0.0 and v < float("inf")):
        raise ValueError(f"{name}: expected a finite value >= 0, got {value}")
    return v


class Deferred:
    """Value checks that need the data (finiteness, ranges) resolved with ONE device sync.

    Hot oracle paths queue their checks, launch their arithmetic, then call
    `raise_first()` before returning, so on a GPU the checks never stall the
    work; a failing check still raises before any result is returned.
    """

    def __init__(self) -> None:
        self._flags: list[torch.Tensor] = []
        self._messages: list[Callable[[], str]] = []
        self._rechecks: list[Callable[[], None] | None] = []

    def require(self, ok: torch.Tensor, message: Callable[[], str]) -> None:
        """Queue a 0-d bool tensor that must be True; message() builds the error text."""
        self._flags.append(ok.reshape(()))
        self._messages.append(message)
        self._rechecks.append(None)

    def suspect(self, ok: torch.Tensor, recheck: Callable[[], None]) -> None:
        """Queue a cheap 0-d bool that is True whenever the exact check would pass (it may be False when
        that check passes too); where it is False, recheck() runs the exact check, which raises or returns."""
        self._flags.append(ok.reshape(()))
        self._messages.append(lambda: "")
        self._rechecks.append(recheck)

    def finite(self, **tensors: torch.Tensor | None) -> None:
        """Queue NaN/Inf checks of float tensors (aminmax: one pass, NaN propagates)."""
        for name, t in tensors.items():
            if t is None or not t.numel() or t.device.type == "meta":
                continue
            ok = torch.isfinite(torch.stack(torch.aminmax(t))).all()
            self.require(ok, _nonfinite_message(name, t))

    def raise_first(self) -> None:
        if not self._flags:
            return
        oks = torch.stack([f.to(self._flags[0].device) for f in self._flags]).tolist()  # the one sync
        for ok, message, recheck in zip(oks, self._messages, self._rechecks):
            if ok:
                continue
            if recheck is None:
                raise ValueError(message())
            recheck()


def _nonfinite_message(name: str, t: torch.Tensor) -> Callable[[], str]:
    return lambda: f"{name}: expected finite values, found {int((~torch.isfinite(t)).sum())} NaN/Inf"
