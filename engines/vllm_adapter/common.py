"""What the vLLM adapter binds: the pin, the bound files, the stand-in labels, the missing subjects."""

from __future__ import annotations

from k3num.engines import base
from k3num.supply import fetch

PIN = fetch.PINS["vllm"]
ATTN_RES_PY = "vllm/models/kimi_k3/nvidia/ops/attn_res.py"
MODEL_PY = "vllm/models/kimi_k3/nvidia/model.py"
DSPARK_PY = "vllm/models/kimi_k3/nvidia/dspark_mla.py"
UTILS_PY = "vllm/model_executor/models/utils.py"
CUSTOM_OPS_PY = "vllm/_custom_ops.py"
STANDIN_OPS = "stand-in: ops.rms_norm, ops.rotary_embedding, concat_and_cache_mla_grouped, do_kv_cache_update"
# the one op of the path that stays a stand-in in every mode: it is the attention backend's, not vLLM's _custom_ops
PER_LAYER_WRITE_STANDIN = ("stand-in: do_kv_cache_update (the attention backend's per-layer write, taken when a layer "
                           "has no slots)")
IMPORT_OPS = f"real: ops.rms_norm, ops.rotary_embedding, concat_and_cache_mla_grouped; {PER_LAYER_WRITE_STANDIN}"
# what import mode binds, and the compiled ops the bound code calls (vllm/_custom_ops.py)
IMPORT_MODULES = (ATTN_RES_PY, MODEL_PY, DSPARK_PY, UTILS_PY, CUSTOM_OPS_PY)
IMPORT_CUDA_OPS = (("_C", "rms_norm"), ("_C", "rotary_embedding"), ("_C_cache_ops", "concat_and_cache_mla_grouped"))


AMD_ATTN_RES_PY = "vllm/models/kimi_k3/amd/ops/attn_res.py"
AMD_LINEAR_PY = "vllm/models/kimi_k3/amd/linear.py"
ROCM_STANDINS = "stand-in: the Eagle mixin's _maybe_add_hidden_state (appends hidden_states [+ residual])"



# the mode label of source-gpu with vLLM's compiled ops built here (supply.cuda_ops)
OPS_SUFFIX = "+ops"


MISSING = {
    base.CONTEXT_KV_UNFUSED: "vLLM has only the fused path (the unfused one was removed before 0.33.0)",
    base.STAGE_PARTIAL: "vLLM has no PP partial projection (no pinned release has one)",
    base.FINALIZE_PROJECTION: "vLLM has no PP partial projection (no pinned release has one)",
    base.PROJECT_UNSHARDED: "not bound from vLLM",
    base.DRAFT_CONTEXT_KV: "not bound from vLLM",
}



ROCM_MISSING = {s: "the ROCm path binds only attn_res and the aux tap" for s in base.SUBJECTS
                if s not in (base.ATTN_RES, base.AUX_CAPTURE)}


def attn_res_tiling(tokens: int, num_blocks: int) -> str:
    """The source tiling vLLM's attn_res wrapper picks for a call (nvidia and amd ops/attn_res.py, "tuned on
    GB300"): one source per tile from 256 tokens or for one block, four below. A row's online softmax runs in
    another order under another tiling, so a row alone and the same row in a batch are bitwise equal only when
    both calls take the same tiling (properties/test_batch_composition.py reads this)."""
    return "BLOCK_L=1" if tokens >= 256 or num_blocks <= 1 else "BLOCK_L=4"
