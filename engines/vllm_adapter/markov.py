"""vLLM 0.34.0's fused Markov draft steps (vllm/models/kimi_k3/nvidia/specialized_decode/drafter/markov.py,
`FusedMarkov`: per step a Triton step kernel, the bias GEMV on the tensor cores, the add, the cache write and the
Gumbel-max per program, then a select kernel), and the loop they replace (vllm/v1/worker/gpu/spec_decode/dspark/
speculator.py `_sample_markov_chain` over `_sample_logits` and vllm/v1/worker/gpu/sample/gumbel.py's
`gumbel_sample`), under engines/mirror/markov.py's interface (`markov_steps`).

The three kernel files are loaded as modules with stubs for their few vLLM imports: draft_logits.py (its
`draft_logits_row`), gumbel.py (murmur3, the step seed, the Gumbel keys), markov.py. The loop's methods are lifted
from the speculator with a stand-in speculator holding the batch's buffers and a stand-in model whose Markov head
is DSparkMarkovHead's: `markov_w1[prev]` (nn.Embedding) and `F.linear(embed, markov_w2)` (the unquantized,
unscaled LogitsProcessor, which `why_not` requires of the fused path).

On a GPU everything runs as released. Under the interpreter (no CUDA) three declared adaptations apply:
triton_support.ADD_RN_ADAPTATION (markov.py's inline-PTX add), triton_support.BF16_DOT_ADAPTATION (the step
kernel's bf16 tl.dot) and STREAM_ADAPTATION (the noise's side stream).
"""

from __future__ import annotations

import types
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from k3num.engines import source, triton_support
from k3num.engines.mirror.markov import MarkovBatch

MARKOV_PY = "vllm/models/kimi_k3/nvidia/specialized_decode/drafter/markov.py"
GUMBEL_PY = "vllm/v1/worker/gpu/sample/gumbel.py"
DRAFT_LOGITS_PY = "vllm/v1/worker/gpu/spec_decode/draft_logits.py"
SPECULATOR_PY = "vllm/v1/worker/gpu/spec_decode/dspark/speculator.py"
# what the adapter calls by position (CONTRACT: a re-signed function is named before any test runs)
SIGNATURES = {
    MARKOV_PY: {"FusedMarkov.__init__": ["self", "vocab", "rank", "max_rows", "device", "use_fp64"],
                "FusedMarkov.run": ["self", "spec", "num_reqs", "base_logits", "w1", "w2", "noise"],
                "FusedMarkov.fork_noise": ["self", "spec", "num_reqs", "n_spec"],
                "FusedMarkov.join": ["self"], "FusedMarkov.noise_rows": ["self", "num_reqs", "n_spec"]},
    GUMBEL_PY: {"gumbel_sample": ["logits", "expanded_idx_mapping", "temperature", "seed", "pos",
                                  "apply_temperature", "is_drafting", "logits_cache", "logits_cache_col",
                                  "use_fp64", "logits_cache_source", "logits_cache_row_mapping", "bias"]},
    SPECULATOR_PY: {"DSparkSpeculator._sample_markov_chain": ["self", "base_logits", "hidden", "prev", "idx_map",
                                                             "sample_pos", "out_tokens"],
                    "DSparkSpeculator._sample_logits": ["self", "logits", "idx_map", "sample_pos", "step", "bias"],
                    "DSparkSpeculator._markov_step": ["self", "prev", "draft_hidden", "state"]},
}
ABSENT = "vLLM 0.33.0 has no specialized_decode/drafter/markov.py (0.34.0 added the fused Markov steps)"
STREAM_ADAPTATION = (
    "interpreter adaptation: FusedMarkov.fork_noise's side stream is the one stream there is (torch.cuda's "
    "Stream, current_stream and stream stand in as no-ops in markov.py's namespace): the noise launch runs in order")

# what the interpreter runs differently (the engine's mode note lists them where the steps are bound)
ADAPTATIONS = (triton_support.ADD_RN_ADAPTATION, triton_support.BF16_DOT_ADAPTATION, STREAM_ADAPTATION)


class _OneStream:
    """torch.cuda's stream calls where there is no CUDA (STREAM_ADAPTATION)."""

    class Stream:
        def __init__(self, device: Any = None) -> None:
            self.device = device

        def wait_stream(self, other: Any) -> None:
            return None

    @staticmethod
    def current_stream(device: Any = None) -> Any:
        return _OneStream.Stream(device)

    @staticmethod
    def stream(s: Any) -> Any:
        from contextlib import nullcontext

        return nullcontext()


def _torch_one_stream() -> types.ModuleType:
    """A module that is torch but for `cuda` (STREAM_ADAPTATION)."""
    mod = types.ModuleType("k3num_torch_one_stream")
    mod.__dict__.update({k: getattr(torch, k) for k in dir(torch) if not k.startswith("__")})
    mod.cuda = _OneStream
    return mod


def _stubs(tl: Any, triton: Any) -> dict[str, types.ModuleType]:
    names = ("vllm", "vllm.v1", "vllm.v1.worker", "vllm.v1.worker.gpu", "vllm.v1.worker.gpu.sample",
             "vllm.v1.worker.gpu.spec_decode", "vllm.distributed", "vllm.utils")
    stubs = {n: source.stub(n) for n in names}
    stubs["vllm.triton_utils"] = source.stub("vllm.triton_utils", tl=tl, triton=triton)
    stubs["vllm.logger"] = source.stub("vllm.logger", init_logger=lambda name: types.SimpleNamespace(
        info_once=lambda *a, **k: None, info=lambda *a, **k: None, warning_once=lambda *a, **k: None))
    # draft_logits.py's imports that the kernels never reach (the cache's host-side bookkeeping)
    stubs["vllm.distributed.parallel_state"] = source.stub("vllm.distributed.parallel_state",
                                                           get_tp_group=lambda: None)
    stubs["vllm.utils.math_utils"] = source.stub("vllm.utils.math_utils", cdiv=lambda a, b: -(-a // b))
    stubs["vllm.v1.worker.gpu.input_batch"] = source.stub("vllm.v1.worker.gpu.input_batch", InputBatch=object)
    stubs["vllm.v1.worker.gpu.sample.batch_shard"] = source.stub(
        "vllm.v1.worker.gpu.sample.batch_shard", shard_owner=None, shard_owners=None, shard_row=None, shard_rows=None)
    return stubs


def load(root: Path, interpret: bool, markov_path: Path | None = None) -> tuple[Any, Any]:
    """(markov.py, gumbel.py) of the tree under `root` as modules (markov.py from `markov_path` if given: a
    planted copy, scripts/markov_plants.py)."""
    triton, tl = triton_support.triton_modules("vllm")
    stubs = _stubs(tl, triton)
    stubs["vllm.v1.worker.gpu.spec_decode.draft_logits"] = source.load_kernel_module(
        root / DRAFT_LOGITS_PY, "k3num_engine.vllm.draft_logits", stubs, interpret=interpret)
    gumbel = source.load_kernel_module(root / GUMBEL_PY, "k3num_engine.vllm.gumbel", stubs, interpret=interpret)
    stubs["vllm.v1.worker.gpu.sample.gumbel"] = gumbel
    path = markov_path or root / MARKOV_PY
    markov = source.load_kernel_module(
        path, "k3num_engine.vllm.markov", stubs, interpret=interpret,
        interpreter_rewrite=lambda text, name: triton_support.replace_add_rn(text, name, "_add_rn"))
    if interpret:
        triton_support.dot_bf16_by_value()
        markov.torch = _torch_one_stream()
    return markov, gumbel


class _Model:
    """The stand-in model of the loop: DSparkMarkovHead's embed (nn.Embedding) and bias (the LogitsProcessor over
    markov_w2, unquantized, scale 1, no soft cap): in the weights' dtype, or with an fp32 head (the logits fp32)
    an fp32 GEMM of them, as LogitsProcessor._apply_head computes with head_dtype float32."""

    def __init__(self, w1: torch.Tensor, w2: torch.Tensor, head_dtype: torch.dtype) -> None:
        self.w1, self.w2, self.head_dtype = w1, w2, head_dtype

    def markov_embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(token_ids, self.w1)

    def markov_bias(self, embed: torch.Tensor) -> torch.Tensor:
        if self.head_dtype == embed.dtype:
            return F.linear(embed, self.w2)
        return F.linear(embed.to(self.head_dtype), self.w2.to(self.head_dtype))


class _NoRowMarked:
    """A stand-in draft watermarker (vllm/v1/watermarking/spec_decode.py `DraftWatermarker`, whose `sample`
    signature this one takes) that marks no row: it samples with the release's `gumbel_sample` from exactly the
    arguments the speculator's watermarker branch hands it. What it judges is the branch's own part: the key
    position (P - 1), the temperature, the seeds, the cache and its column, as the plain branch passes them. The
    real watermarker receives no cache row mapping, and neither does this one."""

    def __init__(self, gumbel_sample: Any) -> None:
        self.gumbel_sample = gumbel_sample

    def sample(self, logits: torch.Tensor, idx_mapping: torch.Tensor, temperature: torch.Tensor, seed: torch.Tensor,
               pos: torch.Tensor, apply_temperature: bool, is_drafting: bool, logits_cache: Any = None,
               logits_cache_col: Any = None, use_fp64: bool = False, logits_cache_source: Any = None,
               num_steps: int = 1) -> torch.Tensor:
        if num_steps != 1:
            raise NotImplementedError("the stand-in watermarker samples one step at a time")
        return self.gumbel_sample(logits, idx_mapping, temperature, seed, pos, apply_temperature, is_drafting,
                                  logits_cache, logits_cache_col, use_fp64, logits_cache_source, None, None)


class RealMarkovSteps:
    """The release's fused steps, its loop and its sampler under engines/mirror/markov.py's interface."""

    def __init__(self, root: Path, interpret: bool, markov_path: Path | None = None) -> None:
        self.markov, self.gumbel = load(root, interpret, markov_path)
        spec_path = root / SPECULATOR_PY
        names = {"torch": torch, "gumbel_sample": self.gumbel.gumbel_sample,
                 "greedy_argmax": None}  # greedy drafts (no logits cache) never reach the fused steps
        self._chain = source.lift(spec_path, "DSparkSpeculator._sample_markov_chain", names)
        self._sample_logits = source.lift(spec_path, "DSparkSpeculator._sample_logits", names)
        self._markov_step = source.lift(spec_path, "DSparkSpeculator._markov_step", names)

    def _speculator(self, b: MarkovBatch, fuse_bias: bool = False) -> Any:
        """The speculator's buffers as FusedMarkov.run and the loop read them (flat [R * k] sample maps)."""
        spec = types.SimpleNamespace(
            sample_idx_mapping=b.idx_map.reshape(-1).contiguous(), sample_pos=b.sample_pos.reshape(-1).contiguous(),
            draft_logits=types.SimpleNamespace(values=b.cache, row_mapping=b.row_mapping),
            draft_tokens=b.tokens, input_buffers=types.SimpleNamespace(input_ids=b.input_ids),
            _anchor_idx=b.anchor_idx, temperature=b.temperature, seeds=b.seeds, max_num_reqs=b.seeds.shape[0],
            use_fp64_gumbel=b.use_fp64, num_speculative_steps=b.steps, use_confidence_head=False,
            _fuse_markov_bias=fuse_bias, _d2t_scatter_index=None, draft_watermarker=None,
            acceptance_estimator=None, model=_Model(b.w1, b.w2, b.base.dtype),
            _step_cols=torch.arange(b.steps, dtype=torch.int32, device=b.base.device))
        spec._maybe_predict_acceptance = lambda *a: None  # no acceptance estimator (why_not's condition)
        spec._sample_logits = types.MethodType(self._sample_logits, spec)
        spec._markov_step = types.MethodType(self._markov_step, spec)
        return spec

    def fused(self, b: MarkovBatch) -> None:
        spec = self._speculator(b)
        rank = b.w1.shape[1]
        fused = self.markov.FusedMarkov(b.w2.shape[0], rank, b.seeds.shape[0], b.base.device, b.use_fp64)
        noise = None
        if b.noise:
            if not fused.noise_rows(b.rows, b.steps):
                raise ValueError(f"noise: the release precomputes noise only for fp32 keys and at most "
                                 f"{self.markov.NOISE_ROWS} sampled rows, not {b.rows} x {b.steps}"
                                 f"{' with fp64 keys' if b.use_fp64 else ''}")
            noise = fused.fork_noise(spec, b.rows, b.steps)
            fused.join()
        fused.run(spec, b.rows, b.base, b.w1, b.w2, noise)

    def loop(self, b: MarkovBatch, fuse_bias: bool = False, watermarked: bool = False) -> None:
        """The speculator's loop; `watermarked`: through its draft-watermarker branch, with a stand-in
        watermarker that marks no row (_NoRowMarked)."""
        spec = self._speculator(b, fuse_bias)
        if watermarked:
            spec.draft_watermarker = _NoRowMarked(self.gumbel.gumbel_sample)
        prev = b.input_ids[b.anchor_idx]
        hidden = torch.zeros(b.rows * b.steps, 1, device=b.base.device)
        self._chain(spec, b.base, hidden, prev, b.idx_map, b.sample_pos, b.tokens[: b.rows])

    def sample(self, logits: torch.Tensor, b: MarkovBatch, step: int) -> torch.Tensor:
        scratch = torch.empty(b.seeds.shape[0], b.steps, logits.shape[-1], dtype=logits.dtype, device=logits.device)
        col = torch.tensor(step, dtype=torch.int32, device=logits.device)
        return self.gumbel.gumbel_sample(logits.contiguous(), b.idx_map[:, step].contiguous(), b.temperature,
                                         b.seeds, b.sample_pos[:, step] - 1, True, True, scratch, col, b.use_fp64,
                                         None, None, None)


def bind(root: Path, interpret: bool) -> RealMarkovSteps:
    return RealMarkovSteps(root, interpret)
