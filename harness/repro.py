"""Repro bundles: one safetensors file that replays a failing comparison.

With `--repro-dir DIR` (K3NUM_REPRO_DIR), properties.support records each subject call (its
arguments, cloned before the call, and its result) and, when a comparison fails, writes
`DIR/<property>-<engine>-<seed>.safetensors` (with `--repro-all`, also the worst comparison of each
property: `<property>-<engine>-worst.safetensors`). A bundle holds the subject's inputs, the tensor
it produced that was judged, and the oracle's output, as tensors; its metadata holds the engine,
version, mode, source sha256, subject, property, case, budget and rule, which output was judged,
the pytest node id and the command line.

`replay` rebuilds the engine (optionally from another tree: `--engine-src NAME=PATH`), calls the
subject on the stored inputs (under poisoned allocations, oracles.hunt), judges the same output
against the stored oracle output with the same budget (max |err| <= budget and no NaN/Inf
disagreement) and says pass or fail: a bisection predicate.

Arguments are stored by a small structural encoding (tensors by key; None, bools, numbers and
strings as JSON; lists and tuples; torch dtypes; dataclasses by their import path); anything else
makes the call not replayable, which the bundle then says instead of storing half a case.
Comparisons judged on a tensor that is neither an output nor an argument of the last call (a value
derived from several calls) are written too, marked not replayable.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import shlex
import sys
from pathlib import Path
from typing import Any

import torch

FORMAT = "k3num-repro-1"


class NotReplayable(ValueError):
    """A bundle (or a call) that cannot be replayed, with the reason."""


def encode(value: Any, key: str, tensors: dict[str, torch.Tensor]) -> Any:
    """A JSON-able description of `value`; its tensors go into `tensors` under keys from `key`."""
    if isinstance(value, torch.Tensor):
        tensors[key] = value.detach().to("cpu").contiguous().clone()
        return {"tensor": key}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return {"list" if isinstance(value, list) else "tuple":
                [encode(v, f"{key}.{i}", tensors) for i, v in enumerate(value)]}
    if isinstance(value, torch.dtype):
        return {"dtype": str(value).replace("torch.", "")}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        cls = type(value)
        return {"dataclass": f"{cls.__module__}:{cls.__qualname__}",
                "fields": {f.name: encode(getattr(value, f.name), f"{key}.{f.name}", tensors)
                           for f in dataclasses.fields(value)}}
    raise NotReplayable(f"argument {key}: a {type(value).__name__} cannot be stored")


def decode(desc: Any, tensors: dict[str, torch.Tensor], device: str) -> Any:
    if isinstance(desc, dict):
        if "tensor" in desc:
            return tensors[desc["tensor"]].to(device)
        if "list" in desc:
            return [decode(d, tensors, device) for d in desc["list"]]
        if "tuple" in desc:
            return tuple(decode(d, tensors, device) for d in desc["tuple"])
        if "dtype" in desc:
            return getattr(torch, desc["dtype"])
        if "dataclass" in desc:
            module, qual = desc["dataclass"].split(":")
            cls: Any = importlib.import_module(module)
            for part in qual.split("."):
                cls = getattr(cls, part)
            return cls(**{k: decode(v, tensors, device) for k, v in desc["fields"].items()})
    return desc


def _locate(actual: torch.Tensor, result: Any, args: tuple, kwargs: dict) -> str:
    """Where the judged tensor came from: "result", "result.i", "arg.i" / "kw.name" (in-place), or ""."""
    def same(t: Any) -> bool:
        return isinstance(t, torch.Tensor) and t.shape == actual.shape and t.dtype == actual.dtype and (
            t is actual or (t.numel() > 0 and t.data_ptr() == actual.data_ptr()))

    if same(result):
        return "result"
    if isinstance(result, (list, tuple)):
        for i, r in enumerate(result):
            if same(r):
                return f"result.{i}"
    for i, a in enumerate(args):
        if same(a):
            return f"arg.{i}"
    for k, a in kwargs.items():
        if same(a):
            return f"kw.{k}"
    return ""


def write(path: Path, *, call: tuple[tuple, dict, Any, tuple, dict] | None, actual: torch.Tensor,
          reference: torch.Tensor, meta: dict[str, Any]) -> Path:
    """Write a bundle. `call` = (cloned args, cloned kwargs, result, the original args, kwargs)."""
    from safetensors.torch import save_file

    tensors: dict[str, torch.Tensor] = {"actual": actual.detach().cpu().contiguous().clone(),
                                        "reference": reference.detach().cpu().contiguous().clone()}
    info = dict(meta, format=FORMAT, command=shlex.join(sys.argv))
    try:
        if call is None:
            raise NotReplayable("no subject call was recorded for this comparison")
        args, kwargs, result, orig_args, orig_kwargs = call
        where = _locate(actual, result, orig_args, orig_kwargs)
        if not where:
            raise NotReplayable("the judged tensor is not an output or an argument of the subject's last call")
        info["judged"] = where
        info["args"] = [encode(a, f"arg.{i}", tensors) for i, a in enumerate(args)]
        info["kwargs"] = {k: encode(v, f"kw.{k}", tensors) for k, v in kwargs.items()}
        info["replayable"] = True
    except NotReplayable as e:
        info["replayable"] = False
        info["why_not_replayable"] = str(e)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path), metadata={"k3num": json.dumps(info)})
    return path


def load(path: Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    from safetensors.torch import load_file

    try:
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as fh:
            meta = json.loads((fh.metadata() or {}).get("k3num", "{}"))
    except Exception as e:  # safetensors raises its own error types for a damaged file
        raise NotReplayable(f"{path}: not a repro bundle ({e})") from e
    if meta.get("format") != FORMAT:
        raise NotReplayable(f"{path}: not a repro bundle (format {meta.get('format')!r}, expected {FORMAT!r})")
    return meta, load_file(str(path))


def replay(path: Path, device: str = "cpu") -> tuple[bool, str]:
    """(passed, the verdict line) of the bundle's comparison rerun on the engine here."""
    from k3num.engines import registry
    from k3num.oracles.metrics import compare

    meta, tensors = load(path)
    if not meta.get("replayable"):
        raise NotReplayable(f"{path}: {meta.get('why_not_replayable', 'not replayable')}")
    engine = registry.get(meta["engine"])
    fn = engine.subject(meta["subject"]) if meta["subject"] in engine.subjects else engine.extras[meta["subject"]]
    args = [decode(a, tensors, device) for a in meta["args"]]
    kwargs = {k: decode(v, tensors, device) for k, v in meta["kwargs"].items()}
    from k3num.oracles import hunt

    with hunt.poisoned_allocations():  # an element the subject leaves unwritten cannot pass by luck
        result = fn(*args, **kwargs)
    where = meta["judged"]
    if where == "result":
        actual = result
    elif where.startswith("result."):
        actual = result[int(where.split(".")[1])]
    elif where.startswith("arg."):
        actual = args[int(where.split(".")[1])]
    else:
        actual = kwargs[where.split(".", 1)[1]]
    m = compare(actual, tensors["reference"].to(actual.device))
    budget = float(meta["budget"])
    passed = m.nonfinite_mismatch == 0 and m.max_abs <= budget
    line = (f"{'PASS' if passed else 'FAIL'}: {meta['property']} [{engine.name} {engine.version}, {engine.mode}] "
            f"{meta['subject']}: max_abs {m.max_abs:.3e} {'<=' if passed else '>'} budget {budget:.3e} "
            f"({meta['budget_rule']}); NaN/Inf mismatches {m.nonfinite_mismatch}; recorded: max_abs "
            f"{float(meta['max_abs']):.3e} on {meta['engine']} {meta['engine_version']} ({meta['mode']})")
    return passed, line
