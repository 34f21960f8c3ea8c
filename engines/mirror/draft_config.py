"""A draft's own cache configuration on K3, the mirror's statement of it (vLLM 0.34.0's dense_draft.py and
gqa_draft.py are bound against the same interface: engines/vllm_adapter/draft_config.py), and the stand-ins both
run over:

- `configure_dense_draft(spec_config, text_config, rocm=False)`: an EAGLE3 or DSpark draft on a KDA-hybrid target
  (the text config has `linear_attn_config`) gets defaults for what the user left unset: an MLA draft (its text
  config has `kv_lora_rank`) the platform's dense MLA backend and an fp8 cache, a GQA draft FLASH_ATTN and the
  model dtype ("auto"); any other method or target is left as it is;
- `fit_draft_page(spec, page_size)`: the largest block b of the draft with b dividing its block B, B - b a multiple
  of the 64-token alignment, and b's page within `page_size`; ValueError naming the page size when none is;
- `kv_cache_groups(specs, block_outermost, planner)`: the draft's layers are the attention layers that are not
  MLA; with both a draft and a target, and a layout that is not block-outermost, the draft's specs are fitted under
  the target's largest page, the planner unifies target and fitted draft specs together, and groups each part on
  its own (target first); otherwise the planner groups all layers as given.

Shapes: none (configuration).
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any

ALIGN = 64  # K3.1's prefix-hash unit in tokens (gqa_draft.py's _DRAFT_BLOCK_ALIGN)


class Backend(enum.Enum):
    """The members of vLLM's AttentionBackendEnum the configuration names."""

    FLASHINFER_MLA = "FLASHINFER_MLA"
    ROCM_AITER_MLA = "ROCM_AITER_MLA"
    FLASH_ATTN = "FLASH_ATTN"


@dataclasses.dataclass(frozen=True)
class Spec:
    """A GQA attention layer's cache spec: page = block_size * num_kv_heads * (K + V head sizes) * dtype bytes
    (vLLM's AttentionSpec.unpadded_page_size_bytes with one state per token, head_size_v = head_size)."""

    block_size: int
    num_kv_heads: int
    head_size: int
    dtype_size: int

    @property
    def page_size_bytes(self) -> int:
        return self.block_size * self.num_kv_heads * 2 * self.head_size * self.dtype_size


@dataclasses.dataclass(frozen=True)
class MLASpec(Spec):
    """An MLA layer's spec (one latent row per token: num_kv_heads 1, head_size the latent width, no V)."""

    @property
    def page_size_bytes(self) -> int:
        return self.block_size * self.head_size * self.dtype_size


@dataclasses.dataclass(frozen=True)
class StateSpec:
    """A recurrent (KDA) layer's state: a page of fixed size whatever the block size; not an attention spec."""

    block_size: int
    page_size_bytes: int


@dataclasses.dataclass
class Planner:
    """A stand-in of vLLM's kv_cache_planning: `get_kv_cache_groups` makes one group (the sorted layer names) of
    every partition it is handed; `unify_kv_cache_spec_page_size` returns the specs as given and records them."""

    unified: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    partitions: list[tuple[str, ...]] = dataclasses.field(default_factory=list)

    def get_kv_cache_groups(self, vllm_config: Any, specs: dict[str, Any]) -> list[tuple[str, ...]]:
        names = tuple(sorted(specs))
        self.partitions.append(names)
        return [names]

    def unify_kv_cache_spec_page_size(self, specs: dict[str, Any]) -> dict[str, Any]:
        self.unified.append(dict(specs))
        return dict(specs)


# (is an MLA draft, on ROCm) -> the defaults an unset backend and cache dtype take
_DEFAULTS = {(True, False): (Backend.FLASHINFER_MLA, "fp8"), (True, True): (Backend.ROCM_AITER_MLA, "fp8"),
             (False, False): (Backend.FLASH_ATTN, "auto"), (False, True): (Backend.FLASH_ATTN, "auto")}


def configure_dense_draft(spec_config: Any, text_config: Any, rocm: bool = False) -> None:
    if spec_config.method not in ("eagle3", "dspark") or getattr(text_config, "linear_attn_config", None) is None:
        return
    mla = getattr(spec_config.draft_model_config.hf_text_config, "kv_lora_rank", None) is not None
    backend, dtype = _DEFAULTS[(mla, rocm)]
    if not spec_config.attention_backend:
        spec_config.attention_backend = backend
    if not spec_config.kv_cache_dtype:
        spec_config.kv_cache_dtype = dtype


def fit_draft_page(spec: Spec, page_size: int) -> Spec:
    fits = [b for b in range(spec.block_size, 0, -1) if spec.block_size % b == 0 and (spec.block_size - b) % ALIGN == 0
            and dataclasses.replace(spec, block_size=b).page_size_bytes <= page_size]
    if not fits:
        raise ValueError(f"no draft block fits the target's {page_size}-byte KV page: {spec}")
    return dataclasses.replace(spec, block_size=fits[0])


def kv_cache_groups(specs: dict[str, Any], block_outermost: bool, planner: Planner) -> list[Any]:
    draft = {n: s for n, s in specs.items() if isinstance(s, Spec) and not isinstance(s, MLASpec)}
    target = {n: s for n, s in specs.items() if n not in draft}
    if not draft or not target or block_outermost:
        return planner.get_kv_cache_groups(None, specs)
    page = max(s.page_size_bytes for s in target.values())
    fitted = {n: fit_draft_page(s, page) for n, s in draft.items()}
    unified = planner.unify_kv_cache_spec_page_size({**target, **fitted})
    return (planner.get_kv_cache_groups(None, {n: unified[n] for n in target})
            + planner.get_kv_cache_groups(None, {n: unified[n] for n in draft}))
