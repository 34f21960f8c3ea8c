"""Call vLLM's built CUDA ops directly, one way per run (GPU run 16, docs/gpu-run.md).

    python scripts/probe_built_ops.py VARIANT     (after `k3num build-ops`; K3NUM_ENGINE_CACHE as for the build)

VARIANT: norm (grouped ops.rms_norm), default / pos / kw / contig (concat_and_cache_mla_grouped with
its defaults, positional, keyword, a contiguous slot mapping), scales (the grouped insert given
kv_scales for a bf16 cache, which vLLM's C++ refuses with STD_TORCH_CHECK: on torch 2.11 the refusal
kills the process with SIGSEGV instead of raising). Each run prints the op's schema, then
"VARIANT ok" and whether the cache was written.
"""

import faulthandler
import sys

import torch

sys.path.insert(0, __file__.rsplit("/scripts/", 1)[0])
from k3num.supply import cuda_ops  # noqa: E402

faulthandler.enable()
so, why = cuda_ops.load()
if so is None:
    raise SystemExit(f"probe_built_ops: {why}")
v = sys.argv[1]
dev = 'cuda'
L, N, C, R = 2, 3, 512, 64
kv_c = torch.randn(L, N, C, device=dev).bfloat16()
k_pe = torch.randn(L, N, R, device=dev).bfloat16()
caches = [torch.zeros(4, 16, C + R, device=dev, dtype=torch.bfloat16) for _ in range(L)]
ptrs = torch.tensor([c.data_ptr() for c in caches], dtype=torch.int64, device=dev)
slots = torch.arange(N, device=dev).expand(L, N)
op = torch.ops._C_cache_ops.concat_and_cache_mla_grouped
print("schema:", op.default._schema, flush=True)
if v == "pos":
    op(kv_c, k_pe, ptrs, slots, 16, caches[0].stride(0), caches[0].stride(1), None, "auto")
elif v == "kw":
    op(kv_c, k_pe, ptrs, slots, 16, caches[0].stride(0), caches[0].stride(1), kv_scales=None, kv_cache_dtype="auto")
elif v == "default":
    op(kv_c, k_pe, ptrs, slots, 16, caches[0].stride(0), caches[0].stride(1))
elif v == "contig":
    op(kv_c, k_pe, ptrs, slots.contiguous(), 16, caches[0].stride(0), caches[0].stride(1), None, "auto")
elif v == "scales":
    op(kv_c, k_pe, ptrs, slots, 16, caches[0].stride(0), caches[0].stride(1), torch.ones(L), "auto")
elif v == "norm":
    out = torch.empty(L, N, C, device=dev, dtype=torch.bfloat16)
    torch.ops._C.rms_norm(out, kv_c, torch.ones(L, C, device=dev, dtype=torch.bfloat16), 1e-5)
torch.cuda.synchronize()
print(v, "ok", bool((caches[0][0, :N] != 0).any()), flush=True)
