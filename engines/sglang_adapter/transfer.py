"""SGLang 0.5.23's released draft-KV transfer, lifted from the pinned wheel's files and run on synthetic
pointers (seed 003's method): what addresses and lengths a real transfer would write.

Bound (each lifted with `ast` from the file named, its globals injected here):
- `sglang/srt/disaggregation/mooncake/conn.py`: `MooncakeKVManager.send_kvcache` (the KV path),
  `_send_kvcache_generic` (the plan: per entry `dst_ptr + dst_index * src_item_len`, length
  `src_item_len * pages`), `_state_stride_mismatch` (the refusal when the decode publishes its item
  lengths), `_validate_envelope_kv_layout`, the module function `_uses_flat_entry_layout`, and the
  transfer worker's routing rule (which of `send_kvcache`, staging and `send_kvcache_slice` a backend
  and TP pair takes: the `if`/`elif` tests of `transfer_worker`, evaluated as written);
- `sglang/srt/disaggregation/common/conn.py`: `CommonKVManager.get_mla_kv_ptrs_with_pp` and
  `_mla_kv_entry_span_with_pp` (the PP slice of the decode's entries);
- `sglang/srt/disaggregation/common/utils.py`: `group_concurrent_contiguous`;
- `sglang/srt/disaggregation/utils.py`: `build_transfer_entry_pairs`, `is_elided_entry`;
- `sglang/srt/disaggregation/base/conn.py`: the `StateType` enum.

Stand-ins (not SGLang's code): the manager object holding the attributes those methods read, a
`_transfer_data` that records the (src, dst, length) blocks instead of an RDMA write and returns 0, a
`conclude_failure` that records the refusal, `get_memory()` (unified memory off) and the logger.

    manager(root, pp_size=1, is_mla=True) -> Manager
    Manager.send(kv_ptrs, item_lens, layer_ids, dst_ptrs, dst_layer_ids, src_pages, dst_pages, *,
                 dst_kv_item_len, dst_item_lens=None) -> Sent(ret, blocks, failure)
    routing_rule(root) -> route(is_mla, is_hybrid_mla, attn_tp_size, dst_attn_tp_size, ...) -> str

Shapes: pointers and lengths are ints (bytes); pages are int32 arrays of page indices.
"""

from __future__ import annotations

import ast
import concurrent.futures
import dataclasses
import enum
import functools
import logging
from collections import deque
from pathlib import Path
from types import SimpleNamespace
from typing import Any, List, NamedTuple, Optional, Sequence, Tuple

import numpy as np

from k3num.engines import source

MOONCAKE_PY = "sglang/srt/disaggregation/mooncake/conn.py"
COMMON_PY = "sglang/srt/disaggregation/common/conn.py"
COMMON_UTILS_PY = "sglang/srt/disaggregation/common/utils.py"
UTILS_PY = "sglang/srt/disaggregation/utils.py"
BASE_PY = "sglang/srt/disaggregation/base/conn.py"
FILES = (MOONCAKE_PY, COMMON_PY, COMMON_UTILS_PY, UTILS_PY, BASE_PY)

# the functions this module lifts, by file (the coverage table and the contract read these)
BOUND = {
    MOONCAKE_PY: ("MooncakeKVManager.send_kvcache", "MooncakeKVManager._send_kvcache_generic",
                  "MooncakeKVManager._state_stride_mismatch", "MooncakeKVManager._validate_envelope_kv_layout",
                  "_uses_flat_entry_layout", "MooncakeKVManager.transfer_worker"),
    COMMON_PY: ("CommonKVManager.get_mla_kv_ptrs_with_pp", "CommonKVManager._mla_kv_entry_span_with_pp"),
    COMMON_UTILS_PY: ("group_concurrent_contiguous",),
    UTILS_PY: ("build_transfer_entry_pairs", "is_elided_entry"),
    BASE_PY: ("StateType",),
}
ROUTES = ("send_kvcache", "staging", "send_kvcache_slice")
# the released code logs its refusals; Sent.failure keeps them
_LOG = logging.getLogger("k3num.sglang_adapter.transfer")
_LOG.addHandler(logging.NullHandler())
_LOG.propagate = False


class Sent(NamedTuple):
    ret: int  # what the released code returned (0: sent, -1: refused)
    blocks: list[tuple[int, int, int]]  # every (src_addr, dst_addr, length) it handed to the transfer engine
    failure: str  # the reason it concluded with, "" when none


class Manager:
    """The attributes of a MooncakeKVManager that the bound methods read, and the bound methods."""

    def __init__(self, lifted: dict[str, Any], *, pp_size: int, is_mla: bool, prefill_start_layer: int) -> None:
        self._lifted = lifted
        self.is_mla_backend, self.is_hybrid_mla_backend = is_mla, False
        self.pp_size = pp_size
        self.attn_tp_size = 1
        self.state_strides_validated: set[str] = set()
        self.enable_custom_mem_pool, self.custom_mem_pool_type = False, None
        self.max_transfer_batch_indices = 0
        self.kv_args = SimpleNamespace(kv_data_ptrs=[], kv_item_lens=[], kv_layer_ids=None,
                                       prefill_start_layer=prefill_start_layer, mla_compression_ratios=None,
                                       num_draft_entries=0)
        self.blocks: list[tuple[int, int, int]] = []
        self.failure = ""

    def __getattr__(self, name: str) -> Any:
        lifted = self.__dict__.get("_lifted", {})
        if name in lifted:
            return lifted[name].__get__(self)
        raise AttributeError(name)

    # stand-ins: the RDMA write and the failure report
    def _transfer_data(self, session: str, blocks: list[tuple[int, int, int]]) -> int:
        self.blocks.extend((int(s), int(d), int(n)) for s, d, n in blocks)
        return 0

    def conclude_failure(self, *, bootstrap_room: Any = None, failure_reason: str = "") -> None:
        self.failure = failure_reason or "concluded with a failure"

    def send(self, kv_ptrs: Sequence[int], item_lens: Sequence[int], layer_ids: Sequence[int] | None,
             dst_ptrs: Sequence[int], dst_layer_ids: Sequence[int] | None, src_pages: Sequence[int],
             dst_pages: Sequence[int], *, dst_kv_item_len: int, dst_item_lens: Sequence[int] | None = None) -> Sent:
        """The KV path as the transfer worker calls it: `send_kvcache(..., dst_kv_item_len=...)` (the
        decode's registered item length, which it hands only to the unified-memory check), or, with
        `dst_item_lens`, `_send_kvcache_generic` given them (what a caller publishing them gets)."""
        self.blocks, self.failure = [], ""
        self.kv_args.kv_data_ptrs, self.kv_args.kv_item_lens = list(kv_ptrs), list(item_lens)
        self.kv_args.kv_layer_ids = list(layer_ids) if layer_ids is not None else None
        src = np.asarray(src_pages, dtype=np.int32)
        dst = np.asarray(dst_pages, dtype=np.int32)
        dst_ids = list(dst_layer_ids) if dst_layer_ids is not None else None
        with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
            if dst_item_lens is None:
                ret = self.send_kvcache("session", src, list(dst_ptrs), dst, pool, dst_layer_ids=dst_ids,
                                        dst_kv_item_len=dst_kv_item_len)
            else:
                ret = self._send_kvcache_generic(
                    mooncake_session_id="session", src_data_ptrs=list(kv_ptrs), dst_data_ptrs=list(dst_ptrs),
                    item_lens=list(item_lens), prefill_data_indices=src, dst_data_indices=dst, executor=pool,
                    src_layer_ids=self.kv_args.kv_layer_ids, dst_layer_ids=dst_ids,
                    dst_item_lens=list(dst_item_lens), bootstrap_room=0)
        return Sent(int(ret), list(self.blocks), self.failure)


def _namespace(root: Path) -> dict[str, Any]:
    base_ns = {"enum": enum, "dataclasses": dataclasses, "List": List, "Optional": Optional}
    state_type = source.lift_class(root / BASE_PY, "StateType", base_ns)
    utils_ns = {"deque": deque, "List": List, "Tuple": Tuple, "Optional": Optional, "Sequence": Sequence}
    ns: dict[str, Any] = {
        "np": np, "npt": SimpleNamespace(NDArray=np.ndarray), "List": List, "Tuple": Tuple, "Optional": Optional,
        "concurrent": concurrent, "StateType": state_type, "logger": _LOG,
        "get_memory": lambda: SimpleNamespace(enable_unified_memory=False),
        "build_transfer_entry_pairs": source.lift(root / UTILS_PY, "build_transfer_entry_pairs", utils_ns),
        "is_elided_entry": source.lift(root / UTILS_PY, "is_elided_entry", utils_ns),
        "group_concurrent_contiguous": source.lift(root / COMMON_UTILS_PY, "group_concurrent_contiguous",
                                                   {"np": np, "npt": SimpleNamespace(NDArray=np.ndarray),
                                                    "List": List, "Tuple": Tuple}),
    }
    ns["_uses_flat_entry_layout"] = source.lift(root / MOONCAKE_PY, "_uses_flat_entry_layout", ns)
    return ns


@functools.lru_cache(maxsize=8)
def _lifted(root: Path, digest: str) -> dict[str, Any]:
    """The lifted methods of the tree at `root` (cached by the bound files' bytes: `digest`)."""
    ns = _namespace(root)
    return {
        name.split(".")[1]: source.lift_method(root / path, name, ns)
        for path, names in ((MOONCAKE_PY, BOUND[MOONCAKE_PY][:4]), (COMMON_PY, BOUND[COMMON_PY]))
        for name in names
    }


def manager(root: Path, *, pp_size: int = 1, is_mla: bool = True, prefill_start_layer: int = 0) -> Manager:
    """A manager whose transfer methods are the released ones from `root` (the engine's tree)."""
    missing = [rel for rel in FILES if not (root / rel).is_file()]
    if missing:
        raise source.SourceError(f"missing engine source {', '.join(missing)} under {root} (run `k3num fetch`)")
    digest = "".join(source.sha256_file(root / rel) for rel in FILES)
    return Manager(_lifted(root, digest), pp_size=pp_size, is_mla=is_mla, prefill_start_layer=prefill_start_layer)


def _calls(node: ast.AST) -> set[str]:
    return {n.func.attr for n in ast.walk(node) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
            and isinstance(n.func.value, ast.Name) and n.func.value.id == "self"}


def routing_rule(root: Path) -> Any:
    """The transfer worker's KV routing, evaluated from its released `if`/`elif` tests:

        route(is_mla, is_hybrid_mla, attn_tp_size, dst_attn_tp_size, enable_staging=False, staging=False) -> str

    one of ROUTES. The tests are the chain in `MooncakeKVManager.transfer_worker` whose branches call
    `self.send_kvcache`, `self._do_staging_transfer` and `self.send_kvcache_slice`; a chain not found (the
    worker changed) raises SourceError."""
    path = root / MOONCAKE_PY
    fn = source.find_def(ast.parse(path.read_text(), filename=str(path)), "MooncakeKVManager.transfer_worker")
    tests: dict[str, ast.expr] = {}
    def calls(body: list[ast.stmt]) -> set[str]:
        return _calls(ast.Module(body=body, type_ignores=[]))

    for node in ast.walk(fn):  # the If whose body sends, whose elif stages, whose else slices
        nxt = node.orelse[0] if isinstance(node, ast.If) and len(node.orelse) == 1 else None
        if (isinstance(nxt, ast.If) and "send_kvcache" in calls(node.body) and "_do_staging_transfer" in calls(nxt.body)
                and "send_kvcache_slice" in calls(nxt.orelse) and not tests):
            tests = {"send_kvcache": node.test, "staging": nxt.test, "send_kvcache_slice": ast.Constant(True)}
    if set(tests) != set(ROUTES):
        raise source.SourceError(f"{MOONCAKE_PY}: transfer_worker's send_kvcache / staging / send_kvcache_slice "
                                 f"chain not found (found {sorted(tests)})")
    compiled = {k: compile(ast.fix_missing_locations(ast.Expression(body=v)), str(path), "eval")
                for k, v in tests.items()}

    def route(is_mla: bool, is_hybrid_mla: bool, attn_tp_size: int, dst_attn_tp_size: int, *,
              enable_staging: bool = False, staging: bool = False) -> str:
        scope = {
            "self": SimpleNamespace(is_mla_backend=is_mla, is_hybrid_mla_backend=is_hybrid_mla,
                                    attn_tp_size=attn_tp_size, enable_staging=enable_staging),
            "target_rank_registration_info": SimpleNamespace(dst_attn_tp_size=dst_attn_tp_size,
                                                             staging_base_ptr=1 if staging else 0,
                                                             staging_total_size=1 if staging else 0),
            "staging_strategy": object() if staging else None,
        }
        for name in ROUTES:
            if eval(compiled[name], {}, scope):  # noqa: S307 (the released test expression, on our scope)
                return name
        raise AssertionError("unreachable: the last branch is unconditional")

    return route
