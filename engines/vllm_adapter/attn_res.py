"""ATTN_RES: the Triton attn_res kernels of nvidia/ops/attn_res.py and amd/ops/attn_res.py, loaded as
modules with stubs for their few vLLM imports (natively on a GPU, under the interpreter elsewhere)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from k3num.engines import source, triton_support


def _triton() -> tuple[Any, Any]:
    return triton_support.triton_modules("vllm")


class _Platform:
    """Stand-in for vllm.platforms.current_platform: the device's capability family as vLLM computes it
    (family 100: a 10.x GPU); PDL on Hopper and newer."""

    @staticmethod
    def is_device_capability_family(family: int) -> bool:
        if not torch.cuda.is_available():
            return False
        major, minor = torch.cuda.get_device_capability()
        return (major * 10 + minor) // 10 == family // 10

    @staticmethod
    def is_arch_support_pdl() -> bool:
        return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9


CUSTOM_OPS_PY = "vllm/_custom_ops.py"


def _load_attn_res(path: Path, interpret: bool) -> Any:
    """nvidia/ops/attn_res.py's `attn_res`. Its native branch (hidden 7168, dense rows, num_blocks <= 8, a
    10.x GPU, `torch.ops._C.kimi_k3_attn_res` registered) calls `ops.kimi_k3_attn_res`, lifted from
    vllm/_custom_ops.py: it runs where `k3num build-ops` built the SM100 kernel (supply/cuda_ops.build_plan),
    and nowhere else, exactly as the wrapper decides."""
    triton, tl = _triton()
    root = Path(str(path)[: -len("vllm/models/kimi_k3/nvidia/ops/attn_res.py")])
    custom = source.lift(root / CUSTOM_OPS_PY, "kimi_k3_attn_res", {"torch": torch})
    stubs = {
        "vllm": source.stub("vllm"),
        "vllm._custom_ops": source.stub("vllm._custom_ops", kimi_k3_attn_res=custom),
        "vllm.platforms": source.stub("vllm.platforms", current_platform=_Platform()),
        "vllm.triton_utils": source.stub("vllm.triton_utils", tl=tl, triton=triton),
    }
    return source.load_kernel_module(path, "k3num_engine.vllm.attn_res", stubs, interpret=interpret).attn_res



def _load_amd_attn_res(path: Path, interpret: bool) -> Any:
    triton, tl = _triton()
    quant = "vllm.model_executor.layers.quantization.utils.quant_utils"
    stubs = {name: source.stub(name) for name in (
        "vllm", "vllm.model_executor", "vllm.model_executor.layers", "vllm.model_executor.layers.quantization",
        "vllm.model_executor.layers.quantization.utils")}
    stubs[quant] = source.stub(quant, get_fp8_min_max=lambda *a, **k: (-448.0, 448.0))
    stubs["vllm.triton_utils"] = source.stub("vllm.triton_utils", tl=tl, triton=triton)
    return source.load_kernel_module(path, "k3num_engine.vllm_rocm.attn_res", stubs, interpret=interpret).attn_res


