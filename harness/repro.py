"""Repro bundles: one safetensors file that replays a failing comparison, safe to open from a stranger.

With `--repro-dir DIR` (K3NUM_REPRO_DIR), properties.support records each subject call (its
arguments, cloned before the call, and its result) and, when a comparison fails, writes
`DIR/<property>-<engine>-<seed>.safetensors` (with `--repro-all`, also the worst comparison of each
property: `<property>-<engine>-worst.safetensors`). A bundle holds the subject's inputs, the tensor
it produced that was judged, and the oracle's output, as tensors; its metadata holds the engine,
version, mode, source sha256, subject, property, case, budget and rule, which output was judged,
the pytest node id and the command line.

Opening a bundle runs nothing it names. The arguments are stored by a small structural encoding:
tensors by key; None, bools, numbers and strings as JSON; lists and tuples; torch dtypes by name;
and dataclasses from a closed table of the harness's own argument types (`arg_types`: the case
dataclasses, the RoPE and AttnRes specs, the PP plan). There is no import by name and no call of
anything the file names: an entry outside the table, a dtype torch does not have, a tensor key the
file lacks, nesting deeper than MAX_DEPTH or more than MAX_ITEMS entries is refused, naming the
entry and the field, before any engine is built. Anything else at write time makes the call not
replayable, which the bundle then says instead of storing half a case.

The verdict is not taken from the file. `replay` rebuilds the engine (optionally from another tree:
`--engine-src NAME=PATH`) and, for the subject's properties that its record in the subject table says
replay (engines/subjects.py `replays`; harness/judges.py `REPLAYABLE` says how each is judged),
recomputes the oracle on the stored inputs and the budget with this harness's formula: a stored
reference that differs from the recomputed one beyond float64 rounding is refused as tampered or
foreign, and a recorded budget that differs from the computed one is said in the verdict line.
For any other property the stored reference and budget are used and the verdict line says so
("budget not recomputed"). The subject runs on the stored inputs under poisoned allocations
(oracles.hunt) and is judged: max |err| <= budget and no NaN/Inf disagreement. Pass or fail is a
bisection predicate.

Format k3num-repro-2 names dataclasses as `k3num.<module>:<class>`; k3num-repro-1 (written before
the k3num namespace) as `<module>:<class>` without it, and is still read where every name is in the
table. A bundle of either format that names any other type cannot be read (none that this harness
wrote does).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import re
import shlex
import sys
from pathlib import Path
from typing import Any

import torch

FORMAT = "k3num-repro-2"
# k3num-repro-1: the same layout, dataclasses named without the k3num namespace (before it existed)
READABLE = ("k3num-repro-1", FORMAT)
# what a bundle's metadata may hold: the harness writes depth <= 5 (args -> list -> dataclass -> field ->
# dataclass) and a few hundred entries; anything far past that is not a bundle but a decode bomb
MAX_DEPTH = 16
MAX_ITEMS = 10_000
MAX_META_CHARS = 1 << 20
# torch dtypes a stored argument may name (by torch's own name)
DTYPES = ("float64", "float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2", "int64", "int32", "int16",
          "int8", "uint8", "bool")
_JUDGED = re.compile(r"^(result|result\.\d{1,3}|arg\.\d{1,3}|kw\.[A-Za-z_]\w{0,63})$")


class NotReplayable(ValueError):
    """A bundle (or a call) that cannot be replayed, with the reason."""


@functools.cache
def arg_types() -> dict[str, type]:
    """The closed table of dataclasses a bundle may name, by the names both formats write."""
    from k3num.engines.base import PPTapPlan
    from k3num.fixtures.strategies import AttnResCase, ContextKVCase, DraftKVCase, ProjectionCase, TapCase
    from k3num.refmodel.attn_res import AttnResStream, AttnResWeights, LayerWiring
    from k3num.refmodel.geometry import AttnResGeometry, DFlashGeometry, MLADraftGeometry, RopeSpec, YarnScaling
    from k3num.refmodel.transfer_plan import KVLayout

    table: dict[str, type] = {}
    for cls in (RopeSpec, YarnScaling, MLADraftGeometry, AttnResGeometry, DFlashGeometry, AttnResWeights, LayerWiring,
                AttnResStream, KVLayout, PPTapPlan, ContextKVCase, AttnResCase, TapCase, ProjectionCase, DraftKVCase):
        name = f"{cls.__module__}:{cls.__qualname__}"
        table[name] = cls
        table[name.removeprefix("k3num.")] = cls  # format 1's name for it
    return table


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
        name = f"{cls.__module__}:{cls.__qualname__}"
        if arg_types().get(name) is not cls:
            raise NotReplayable(f"argument {key}: a {cls.__qualname__} is not one of the bundle format's types")
        return {"dataclass": name,
                "fields": {f.name: encode(getattr(value, f.name), f"{key}.{f.name}", tensors)
                           for f in dataclasses.fields(value)}}
    raise NotReplayable(f"argument {key}: a {type(value).__name__} cannot be stored")


class _Decoder:
    """Builds the stored arguments from their description, refusing anything outside the format."""

    def __init__(self, tensors: dict[str, torch.Tensor], device: str) -> None:
        self.tensors, self.device, self.items = tensors, device, 0

    def refuse(self, where: str, why: str) -> NotReplayable:
        return NotReplayable(f"not a repro bundle: {where} {why}")

    def __call__(self, desc: Any, where: str, depth: int = 0) -> Any:
        self.items += 1
        if self.items > MAX_ITEMS:
            raise self.refuse(where, f"is past the format's {MAX_ITEMS} entries")
        if depth > MAX_DEPTH:
            raise self.refuse(where, f"nests deeper than the format's {MAX_DEPTH} levels")
        if desc is None or isinstance(desc, (bool, str)):
            return desc
        if isinstance(desc, (int, float)):
            return desc
        if isinstance(desc, list):
            raise self.refuse(where, "is a bare JSON list (lists are stored as {\"list\": [...]})")
        if not isinstance(desc, dict) or len(desc) not in (1, 2):
            raise self.refuse(where, f"is not an entry of the format ({type(desc).__name__})")
        kind = next(iter(desc))
        if kind == "tensor" and len(desc) == 1:
            key = desc["tensor"]
            if not isinstance(key, str) or key not in self.tensors:
                raise self.refuse(where, f"names a tensor {key!r} the file does not hold")
            return self.tensors[key].to(self.device)
        if kind in ("list", "tuple") and len(desc) == 1:
            items = desc[kind]
            if not isinstance(items, list):
                raise self.refuse(where, f"holds a {kind} that is not a JSON list")
            out = [self(d, f"{where}.{i}", depth + 1) for i, d in enumerate(items)]
            return out if kind == "list" else tuple(out)
        if kind == "dtype" and len(desc) == 1:
            name = desc["dtype"]
            if name not in DTYPES:
                raise self.refuse(where, f"names an unknown dtype {name!r}")
            return getattr(torch, name)
        if kind == "dataclass" and set(desc) == {"dataclass", "fields"}:
            name = desc["dataclass"]
            cls = arg_types().get(name) if isinstance(name, str) else None
            if cls is None:
                raise self.refuse(where, f"names an unknown type {name!r}")
            fields = desc["fields"]
            if not isinstance(fields, dict):
                raise self.refuse(where, "has fields that are not a JSON object")
            declared = {f.name for f in dataclasses.fields(cls)}
            unknown = sorted(set(fields) - declared)
            if unknown:
                raise self.refuse(f"{where}.{unknown[0]}", f"is not a field of {cls.__qualname__}")
            values = {k: self(v, f"{where}.{k}", depth + 1) for k, v in fields.items()}
            try:
                return cls(**values)  # one of the harness's own frozen dataclasses: it only checks its fields
            except (TypeError, ValueError) as e:
                raise self.refuse(where, f"is not a valid {cls.__qualname__}: {e}") from None
        raise self.refuse(where, f"is not an entry of the format (keys {sorted(desc)[:4]})")


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
    """(metadata, tensors) of a bundle; NotReplayable for a file that is not one. Reads data only."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as fh:
            raw = (fh.metadata() or {}).get("k3num", "")
            if len(raw) > MAX_META_CHARS:
                raise NotReplayable(f"{path}: not a repro bundle (metadata of {len(raw)} characters, the format "
                                    f"holds at most {MAX_META_CHARS})")
            meta = json.loads(raw or "{}")
            if not isinstance(meta, dict):
                raise NotReplayable(f"{path}: not a repro bundle (its metadata is not a JSON object)")
            if meta.get("format") not in READABLE:
                raise NotReplayable(f"{path}: not a repro bundle (format {meta.get('format')!r}, expected one of "
                                    f"{list(READABLE)})")
            tensors = {k: fh.get_tensor(k) for k in fh.keys()}
    except NotReplayable:
        raise
    except RecursionError:
        raise NotReplayable(f"{path}: not a repro bundle (its metadata nests too deep to read)") from None
    except Exception as e:  # safetensors raises its own error types for a damaged file or a false header
        raise NotReplayable(f"{path}: not a repro bundle ({type(e).__name__}: {e})") from None
    return meta, tensors


def _field(meta: dict[str, Any], key: str, kind: type | tuple[type, ...], what: str) -> Any:
    value = meta.get(key)
    if isinstance(value, bool) or not isinstance(value, kind):  # JSON true is not a number here
        raise NotReplayable(f"not a repro bundle: its {key!r} is {type(value).__name__}, not {what}")
    return value


def _checked(meta: dict[str, Any], tensors: dict[str, torch.Tensor], device: str) -> dict[str, Any]:
    """Every field replay reads, checked against the format, and the arguments built (on `device`),
    before any engine or subject is touched."""
    from k3num.engines import base, registry

    if not meta.get("replayable"):
        raise NotReplayable(f"not replayable: {str(meta.get('why_not_replayable', 'the bundle says so'))[:300]}")
    engine = _field(meta, "engine", str, "an engine name")
    if engine not in registry.known():
        raise NotReplayable(f"not a repro bundle: engine {engine!r} is not one of {registry.known()}")
    subject = _field(meta, "subject", str, "a subject name")
    if subject not in base.SUBJECTS and not re.fullmatch(r"[a-z][a-z0-9_]{0,63}", subject):
        raise NotReplayable(f"not a repro bundle: subject {subject!r} is not a subject name")
    judged = _field(meta, "judged", str, "where the judged tensor came from")
    if not _JUDGED.match(judged):
        raise NotReplayable(f"not a repro bundle: judged {judged!r} is not result[.i], arg.i or kw.name")
    for key in ("property", "budget_rule", "engine_version", "mode"):
        _field(meta, key, str, "text")
    budget = _field(meta, "budget", (int, float), "a number")
    if not math.isfinite(budget) or budget < 0:
        raise NotReplayable(f"not a repro bundle: budget {budget!r} is not a finite non-negative number")
    for key in ("actual", "reference"):
        if key not in tensors:
            raise NotReplayable(f"not a repro bundle: the file holds no {key!r} tensor")
    args_desc = _field(meta, "args", list, "a JSON list")
    kwargs_desc = _field(meta, "kwargs", dict, "a JSON object")
    decode = _Decoder(tensors, device)
    args = [decode(a, f"arg.{i}") for i, a in enumerate(args_desc)]
    kwargs = {}
    for k, v in kwargs_desc.items():
        if not re.fullmatch(r"[A-Za-z_]\w{0,63}", k):
            raise NotReplayable(f"not a repro bundle: kwargs names {k[:40]!r}, not an argument name")
        kwargs[k] = decode(v, f"kw.{k}")
    return {"engine": engine, "subject": subject, "judged": judged, "budget": float(budget), "args": args,
            "kwargs": kwargs, "property": meta["property"], "detail": str(meta.get("detail", ""))}


def _pick(where: str, result: Any, args: list, kwargs: dict) -> Any:
    kind, _, rest = where.partition(".")
    if kind == "result":
        return result if not rest else (result[int(rest)] if isinstance(result, (list, tuple)) and int(rest) < len(
            result) else None)
    if kind == "arg":
        return args[int(rest)] if int(rest) < len(args) else None
    return kwargs.get(rest)


def f64_agrees(stored: torch.Tensor, computed: torch.Tensor, reduction_len: int) -> bool:
    """Whether a stored float64 oracle output is the oracle's up to float64 rounding: another device or
    BLAS sums in another order (gamma_n(u64) relative to the largest magnitude, n the reduction length)."""
    from k3num.oracles import budgets

    if stored.shape != computed.shape:
        return False
    both = stored.double(), computed.double()
    if not torch.equal(torch.isfinite(both[0]), torch.isfinite(both[1])):
        return False
    scale = both[1][torch.isfinite(both[1])].abs().max().item() if both[1].numel() else 0.0
    tol = budgets.f64_identity_rtol(max(reduction_len, 1)) * max(scale, 1e-300)
    diff = (both[0] - both[1]).nan_to_num(0.0).abs()
    return bool(diff.numel() == 0 or diff.max().item() <= tol)


def replay(path: Path, device: str = "cpu", sources: dict[str, Path] | None = None) -> tuple[bool, str]:
    """(passed, the verdict line) of the bundle's comparison rerun on the engine here, its files read from
    `sources` (pin name -> local tree, --engine-src; absent: the pinned cache)."""
    from k3num.engines import registry, subjects
    from k3num.harness import judges
    from k3num.oracles import hunt
    from k3num.oracles.metrics import compare

    meta, tensors = load(path)
    c = _checked(meta, tensors, device)  # nothing of the file is used before this has passed
    try:
        engine = registry.get(c["engine"], sources)
    except registry.EngineUnavailable as e:
        raise NotReplayable(f"engine {c['engine']} is not available here: {e}") from None
    fn = engine.subjects.get(c["subject"]) or engine.extras.get(c["subject"])
    if not callable(fn):
        raise NotReplayable(f"{engine.name} {engine.version} has no subject {c['subject']!r}")
    how = judges.REPLAYABLE[c["property"]] if subjects.replays(c["subject"], c["property"]) else None
    recorded = c["budget"]
    if how is not None:
        try:  # before the call: subjects write their inputs in place
            expected = how(engine, c["subject"], c["args"], c["kwargs"], c["detail"]).get(c["judged"])
        except Exception as e:  # the oracle refused the stored inputs (wrong types, shapes, NaN, ...)
            raise NotReplayable(f"the stored inputs are not a {c['property']} call: {type(e).__name__}: {e}") from None
        if expected is None:
            raise NotReplayable(f"{c['property']} judges no output at {c['judged']!r}")
        if not f64_agrees(tensors["reference"], expected.reference, expected.reduction_len):
            raise NotReplayable(f"{path}: the stored reference is not this harness's oracle on the stored inputs "
                                "(beyond float64 rounding): a tampered or foreign bundle")
        reference, budget, rule = expected.reference, expected.budget.value, expected.budget.rule
        same = math.isclose(budget, recorded, rel_tol=1e-9, abs_tol=0.0)
        budget_note = "" if same else (f"; the bundle's budget differs from this harness's (recorded {recorded:.6e}, "
                                       f"computed {budget:.6e})")
    else:
        reference, budget, rule = tensors["reference"], recorded, str(meta["budget_rule"])
        budget_note = (f"; budget not recomputed: this harness has no judge for {c['property']!r} (rule {rule}), "
                       "the bundle's own reference and budget were used")
    args, kwargs = c["args"], c["kwargs"]
    try:
        with hunt.poisoned_allocations():  # an element the subject leaves unwritten cannot pass by luck
            result = fn(*args, **kwargs)
    except Exception as e:  # the subject's own failure on the stored inputs is the verdict, not a crash
        return False, (f"FAIL: {c['property']} [{engine.name} {engine.version}, {engine.mode}] {c['subject']}: raised "
                       f"{type(e).__name__}: {str(e)[:300]}{budget_note}")
    actual = _pick(c["judged"], result, args, kwargs)
    if not isinstance(actual, torch.Tensor):
        return False, (f"FAIL: {c['property']} [{engine.name} {engine.version}, {engine.mode}] {c['subject']}: no "
                       f"tensor at {c['judged']} of the call{budget_note}")
    if actual.shape != reference.shape:
        return False, (f"FAIL: {c['property']} [{engine.name} {engine.version}, {engine.mode}] {c['subject']}: "
                       f"{c['judged']} has shape {tuple(actual.shape)}, the oracle {tuple(reference.shape)}"
                       f"{budget_note}")
    try:
        m = compare(actual, reference.to(actual.device))
    except Exception as e:  # an output of another dtype or layout than the oracle's
        return False, (f"FAIL: {c['property']} [{engine.name} {engine.version}, {engine.mode}] {c['subject']}: "
                       f"{c['judged']} cannot be compared with the oracle ({type(e).__name__}: {e}){budget_note}")
    passed = m.nonfinite_mismatch == 0 and m.max_abs <= budget
    line = (f"{'PASS' if passed else 'FAIL'}: {c['property']} [{engine.name} {engine.version}, {engine.mode}] "
            f"{c['subject']}: max_abs {m.max_abs:.3e} {'<=' if passed else '>'} budget {budget:.3e} ({rule}); "
            f"NaN/Inf mismatches {m.nonfinite_mismatch}; recorded: max_abs {_num(meta.get('max_abs'))} on "
            f"{meta['engine']} {meta['engine_version']} ({meta['mode']}){budget_note}")
    return passed, line


def _num(v: Any) -> str:
    return f"{float(v):.3e}" if isinstance(v, (int, float)) and not isinstance(v, bool) else "?"
