"""Compatibility name for the vLLM adapter, which is now the package engines.vllm_adapter (one
module per bound subject); kept so that `engines.vllm_engine.<name>` keeps working."""

from engines.vllm_adapter import *  # noqa: F401,F403
from engines.vllm_adapter import _build_imported, build, build_rocm  # noqa: F401
from engines.vllm_adapter.attn_res import _load_amd_attn_res, _load_attn_res  # noqa: F401
from engines.vllm_adapter.aux_capture import (  # noqa: F401
    _bind_capture,
    _bind_rocm_capture,
    _mixin_maybe_add_hidden_state,
)
from engines.vllm_adapter.common import *  # noqa: F401,F403
from engines.vllm_adapter.context_kv import (  # noqa: F401
    BUILT_OPS,
    _bind_precompute,
    _built_ops,
    _RealContextKVOps,
    _rotary_embedding,
)
from engines.vllm_adapter.weight_loading import _bind_weight_loading  # noqa: F401
