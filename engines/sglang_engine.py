"""SGLang 0.5.23's real code as subjects, in source mode (BRIEF §4).

Bound so far: `sglang/srt/disaggregation/utils.py::build_transfer_entry_pairs`, lifted
(a pure function), exposed as the `transfer_pairs` contract. Not bound yet, each
skipped with this reason: the AttnRes Triton kernels (`_mix_fused`,
`aggregate_stream`), `aggregate_stream_torch`, `fused_kv_norm_rope_write`, and DFlash
`project_target_hidden` / `kv_proj_only`.
"""

from __future__ import annotations

from collections import deque
from typing import List, Tuple

from engines import base, fetch, source
from engines.registry import EngineUnavailable

PIN = fetch.PINS["sglang"]
UTILS_PY = "sglang/srt/disaggregation/utils.py"
NOT_YET = "not bound from SGLang 0.5.23 yet (attn_residual, fused_kv_write and dflash are next)"


def build() -> base.Engine:
    root = fetch.source_dir("sglang")
    if not fetch.manifest("sglang"):
        raise EngineUnavailable(f"sglang {PIN.version} source is not in {root}: run `k3num fetch sglang`")
    path = root / UTILS_PY
    try:
        got = source.signature_of(path, "build_transfer_entry_pairs")
        if got != ["src_layer_ids", "dst_layer_ids", "n_src", "n_dst", "allow_positional_fallback"]:
            raise source.SourceError(f"build_transfer_entry_pairs signature changed: {got}")
        pairs = source.lift(path, "build_transfer_entry_pairs", {"deque": deque, "List": List, "Tuple": Tuple})
    except source.SourceError as e:
        raise EngineUnavailable(f"sglang {PIN.version}: {e}") from e
    return base.Engine(
        name="sglang", version=PIN.version, mode="source-lifted", subjects={},
        source_sha256={"transfer_pairs": fetch.manifest("sglang")[UTILS_PY]},
        missing={s: NOT_YET for s in base.SUBJECTS}, extras={"transfer_pairs": pairs},
    )
