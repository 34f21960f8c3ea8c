"""The float64 oracle as a value: its entry points, passed to the judges rather than patched into refmodel.

`Oracle` holds the refmodel entry points that the judges (harness/judges.py), the draft step
(harness/draft_step.py) and the properties' own oracle helpers call. `PLAIN` is refmodel's functions
themselves. The judges and the draft step ask `current()` for it, which is PLAIN unless a caller has
scoped another oracle over a block of code with `using(o)`: the pre-merge check scopes its memo
(harness/oracle_memo.py) over each pass of a paired example, so the base's pass is answered from the
head's. Nothing replaces a refmodel function, and refmodel keeps no alias for anyone: the float64 reference
is the same code whoever runs it.

The scope is a contextvars.ContextVar: it ends with its `with` block (also on an exception), and a
thread or task started elsewhere sees PLAIN.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from k3num.refmodel import attn_res as ref_attn_res
from k3num.refmodel import mla
from k3num.refmodel import partial_projection as ref_projection


@dataclass(frozen=True)
class Oracle:
    """The oracle's entry points (each refmodel's signature and shapes: read its docstring)."""

    attn_res: Callable[..., Any]  # refmodel.attn_res.attn_res
    attn_res_with_sources: Callable[..., Any]  # refmodel.attn_res.attn_res_with_sources
    capture_aux_stream: Callable[..., Any]  # refmodel.attn_res.capture_aux_stream
    context_kv: Callable[..., Any]  # refmodel.mla.context_kv
    project_context: Callable[..., Any]  # refmodel.partial_projection.project_context
    draft_context_kv: Callable[..., Any]  # refmodel.partial_projection.draft_context_kv

    @classmethod
    def entry_points(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))

    def wrapped(self, wrap: Callable[[str, Callable[..., Any]], Callable[..., Any]]) -> Oracle:
        """This oracle with every entry point replaced by wrap(name, fn) (a memo, a counter)."""
        return Oracle(**{name: wrap(name, getattr(self, name)) for name in self.entry_points()})


PLAIN = Oracle(attn_res=ref_attn_res.attn_res, attn_res_with_sources=ref_attn_res.attn_res_with_sources,
               capture_aux_stream=ref_attn_res.capture_aux_stream, context_kv=mla.context_kv,
               project_context=ref_projection.project_context, draft_context_kv=ref_projection.draft_context_kv)

_CURRENT: contextvars.ContextVar[Oracle] = contextvars.ContextVar("k3num_oracle", default=PLAIN)


def current() -> Oracle:
    """The oracle scoped over the running code (`using`), else PLAIN."""
    return _CURRENT.get()


@contextlib.contextmanager
def using(oracle: Oracle) -> Iterator[Oracle]:
    """Within the block, `current()` is `oracle`."""
    token = _CURRENT.set(oracle)
    try:
        yield oracle
    finally:
        _CURRENT.reset(token)
