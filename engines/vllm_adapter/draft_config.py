"""vLLM 0.34.0's draft-cache configuration on K3 (two files 0.34.0 added on path 1):

- `nvidia/dense_draft.py` `configure_dense_draft`: an EAGLE3/DSpark draft on a KDA-hybrid (DSA) target gets its own
  attention backend and KV cache dtype: an MLA draft FLASHINFER_MLA (ROCM_AITER_MLA on ROCm) and an fp8 cache by
  default, a GQA draft FLASH_ATTN and the model dtype; what the user set is kept. Lifted over stub configs, the
  platform and the backend enum;
- `nvidia/gqa_draft.py` `_fit_draft_page` (a GQA draft's block shrunk in steps of 64 tokens until its page fits
  under the target's) and `GQADraftKVCacheGrouping.get_kv_cache_groups` (the draft's layers, every attention layer
  that is not MLA, grouped apart from the target's, their pages fitted first). Lifted over the stand-in specs and
  planner of engines/mirror/draft_config.py (vLLM's kv_cache_planning is not pinned).

Shapes: none (configuration).
"""

from __future__ import annotations

import dataclasses
import sys
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

from k3num.engines import source
from k3num.engines.mirror.draft_config import Backend, MLASpec, Planner, Spec, StateSpec

DENSE_DRAFT_PY = "vllm/models/kimi_k3/nvidia/dense_draft.py"
GQA_DRAFT_PY = "vllm/models/kimi_k3/nvidia/gqa_draft.py"
SIGNATURES = {
    DENSE_DRAFT_PY: {"configure_dense_draft": ["spec_config", "text_config"]},
    GQA_DRAFT_PY: {"_fit_draft_page": ["spec", "page_size"],
                   "GQADraftKVCacheGrouping.get_kv_cache_groups": ["cls", "vllm_config", "kv_cache_spec"]},
}
ABSENT = "vLLM 0.33.0 has no dense_draft.py / gqa_draft.py (0.34.0 added them)"


def _dense(path: Path) -> Callable[..., Any]:
    """configure_dense_draft(spec_config, text_config, rocm=False): the release's function with the platform
    stubbed to say whether it is ROCm."""
    state = {"rocm": False}
    platform = types.SimpleNamespace(is_rocm=lambda: state["rocm"])
    fn = source.lift(path, "configure_dense_draft", {"current_platform": platform, "AttentionBackendEnum": Backend,
                                                     "Any": Any, "SpeculativeConfig": object})

    def configure(spec_config: Any, text_config: Any, rocm: bool = False) -> None:
        state["rocm"] = rocm
        fn(spec_config, text_config)

    return configure


def _grouping(path: Path) -> tuple[Callable[..., Any], Callable[..., Any]]:
    """(fit_draft_page(spec, page_size), kv_cache_groups(specs, block_outermost, planner)) of the release."""
    ns = {"replace": dataclasses.replace, "AttentionSpec": Spec, "MLAAttentionSpec": MLASpec,
          "_DRAFT_BLOCK_ALIGN": source.lift_value(path, "_DRAFT_BLOCK_ALIGN", {}), "VllmConfig": object,
          "KVCacheSpec": object, "KVCacheGroupSpec": object}
    fit = source.lift(path, "_fit_draft_page", ns)
    groups = source.lift(path, "GQADraftKVCacheGrouping.get_kv_cache_groups", {**ns, "_fit_draft_page": fit})

    def kv_cache_groups(specs: dict[str, Any], block_outermost: bool, planner: Planner) -> list[Any]:
        layout = types.SimpleNamespace(is_block_outermost=block_outermost)
        config = types.SimpleNamespace(cache_config=types.SimpleNamespace(get_resolved_kv_cache_layout=lambda: layout))
        planning = source.stub("vllm.v1.core.kv_cache_planning", get_kv_cache_groups=planner.get_kv_cache_groups,
                               unify_kv_cache_spec_page_size=planner.unify_kv_cache_spec_page_size)
        parents = {name: sys.modules.get(name) or source.stub(name) for name in ("vllm", "vllm.v1", "vllm.v1.core")}
        with source.stubbed({**parents, "vllm.v1.core.kv_cache_planning": planning}):
            return groups(None, config, specs)

    return fit, kv_cache_groups


def bind(root: Path) -> types.SimpleNamespace:
    """The capability `draft_config` of the tree under `root`: configure_dense_draft, fit_draft_page,
    kv_cache_groups (their stand-ins: Backend, Spec, MLASpec, StateSpec, Planner)."""
    fit, groups = _grouping(root / GQA_DRAFT_PY)
    return types.SimpleNamespace(configure_dense_draft=_dense(root / DENSE_DRAFT_PY), fit_draft_page=fit,
                                 kv_cache_groups=groups, Backend=Backend, Spec=Spec, MLASpec=MLASpec,
                                 StateSpec=StateSpec, Planner=Planner)
