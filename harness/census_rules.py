"""The census's declarations (harness/census.py): which wheel files are K3 files, which are off the three
paths and why, which pinned files are generic support, and every function of a pinned K3 file that no
binding reaches, with its kind and reason.

A rule is kept only while it matches something in some pinned release (tests/test_census.py): when a
release drops a function, its rule goes too, and a new function of a matching name is seen again.

Kinds:
- `off-path`: not one of the three paths (the target's MoE, KDA, multimodal, loading of the target...);
- `unbound`: on one of the paths and not run by any property: the reason says what binding it needs;
- `replaced`: run through the adapter's own stand-in (`stand_in`, "module:function"), with why the real
  code cannot run here.

Shapes: none.
"""

from __future__ import annotations

from dataclasses import dataclass

KINDS = ("off-path", "unbound", "replaced")


@dataclass(frozen=True)
class FileRule:
    engine: str
    glob: str  # over the wheel's file names
    why: str


@dataclass(frozen=True)
class Rule:
    engine: str
    file: str  # a pinned file
    pattern: str  # a regex over the qualname, matched whole
    kind: str  # one of KINDS
    why: str
    stand_in: str = ""  # kind "replaced": the adapter function that runs instead ("module:function")


# The K3 packages of each engine, as globs over the wheel's file names (fnmatch: `*` crosses `/`).
K3_FILES: dict[str, tuple[str, ...]] = {
    "vllm": ("vllm/models/kimi_k3/*.py",),
    "tokenspeed": ("tokenspeed/runtime/models/kimi_k3*.py", "tokenspeed/runtime/execution/dspark_context.py",
                   "tokenspeed/runtime/layers/segmented_rmsnorm.py", "tokenspeed_kernel/ops/residual/*.py"),
    "sglang": ("sglang/srt/layers/attn_residual.py", "sglang/kernels/ops/speculative/dspark/*.py",
               "sglang/kernels/ops/speculative/fused_kv_materialize.py", "sglang/srt/models/dflash.py",
               "sglang/kernels/ops/attention/attn_res*.py"),
}



_KDA = "KDA, the target's linear-attention layers: not one of the three paths"
_SM100 = "a CuTe-DSL kernel (SM100 only) of the fused decode, not one of the three paths' reference points"
OFF_PATH_FILES: tuple[FileRule, ...] = (
    FileRule("vllm", "vllm/models/kimi_k3/__init__.py", "the package's exports"),
    FileRule("vllm", "vllm/models/kimi_k3/*/__init__.py", "the package's exports"),
    FileRule("vllm", "vllm/models/kimi_k3/*/ops/__init__.py", "the package's exports"),
    FileRule("vllm", "vllm/models/kimi_k3/*/kda*.py", _KDA),
    FileRule("vllm", "vllm/models/kimi_k3/*/ops/kda_*.py", _KDA),
    FileRule("vllm", "vllm/models/kimi_k3/*/ops/third_party/*", _KDA + " (its vendored chunked kernels)"),
    FileRule("vllm", "vllm/models/kimi_k3/*/ops/cute_dsl/*", _SM100 + " (KDA GEMM, the latent-MoE tail)"),
    FileRule("vllm", "vllm/models/kimi_k3/*/ops/latent_moe_tail.py", "the latent MoE's tail: not one of the paths"),
    FileRule("vllm", "vllm/models/kimi_k3/*/latent_moe_runner.py", "the latent MoE: not one of the paths"),
    FileRule("vllm", "vllm/models/kimi_k3/*/mla.py", "the target's MLA attention: the draft's context KV is "
             "dspark_mla.py's"),
    FileRule("vllm", "vllm/models/kimi_k3/*/mtp.py", "the MTP head: a different speculative method"),
    FileRule("vllm", "vllm/models/kimi_k3/common/mtp.py", "the MTP head: a different speculative method"),
    FileRule("vllm", "vllm/models/kimi_k3/common/mm_preprocess.py", "multimodal preprocessing"),
    FileRule("vllm", "vllm/models/kimi_k3/amd/model.py", "ROCm's model assembly; its aux tap and PP branches are "
             "amd/linear.py's (pinned)"),
    FileRule("vllm", "vllm/models/kimi_k3/nvidia/model_state.py", "the model's runtime-state holder for CUDA graphs"),
    FileRule("vllm", "vllm/models/kimi_k3/nvidia/low_latency_gemm.py", "the target's small-batch GEMM selection"),
    FileRule("vllm", "vllm/models/kimi_k3/nvidia/ops/vision_fa4_warmup.py", "the vision tower's warm-up"),
    FileRule("vllm", "vllm/models/kimi_k3/nvidia/ops/recoverssm.py", "KDA state recovery on rejection"),
    FileRule("vllm", "vllm/models/kimi_k3/nvidia/recoverssm/*", "KDA state recovery on rejection"),
    # the specialized decode's DSpark drafter (0.34.0), before the fused target decode's rule below
    FileRule("vllm", "vllm/models/kimi_k3/nvidia/specialized_decode/drafter/linears.py",
             "UNBOUND, on paths 1 and 3 (0.34.0): every BF16 drafter linear (kv_a_proj_with_mqa and context_proj "
             "among them) on the CuTe-DSL warp split-K GEMM (cutedsl/gemm: SM100), cuBLAS otherwise; the "
             "summation order changes, the single bf16 rounding does not"),
    FileRule("vllm", "vllm/models/kimi_k3/nvidia/specialized_decode/drafter/comm.py",
             "the drafter's TP collectives on multicast symmetric memory (Lamport mailboxes): the context "
             "projection's all-gather among them (model.py's row); NCCL's all-gather where they are not built"),
    FileRule("vllm", "vllm/models/kimi_k3/nvidia/specialized_decode/drafter/attention.py",
             "the draft block's folded MLA decode attention: it reads the context KV cache, after path 1's write"),
    FileRule("vllm", "vllm/models/kimi_k3/*/specialized_decode/*",
             "the fused target decode (CuTe-DSL on SM100, a ROCm monolith): its AttnRes stage is coverage's "
             "'CuTe-DSL AttnRes decode' row (SM100 only)"),
    FileRule("vllm", "vllm/models/kimi_k3/*dsa*.py", "K3.1's DSA (sparse attention) indexer and its cache: "
             "the target's attention, not one of the paths"),
    FileRule("vllm", "vllm/models/kimi_k3/nvidia/ops/dsa_indexer*.py", "the DSA indexer's kernels"),
    FileRule("vllm", "vllm/models/kimi_k3/nvidia/index_rope.py", "the DSA indexer's RoPE (the indexer's heads, not "
             "the draft's context K)"),
    FileRule("vllm", "vllm/models/kimi_k3/nvidia/kv_balanced_mla/*", "the target's KV-balanced MLA decode backend"),
    FileRule("vllm", "vllm/models/kimi_k3/nvidia/ops/dcp_topk_merge/*", "decode-context-parallel top-k merge of the "
             "target's attention"),
    FileRule("tokenspeed", "tokenspeed_kernel/ops/residual/cuda.py", "the SM100 CUDA AttnRes's registration "
             "(coverage's cuda_attn_res_fwd row: never selected on SM90)"),
    FileRule("tokenspeed", "tokenspeed_kernel/ops/residual/gluon.py", "the AMD Gluon AttnRes's registration "
             "(needs tokenspeed_kernel_amd on gfx950/gfx1250)"),
    FileRule("tokenspeed", "tokenspeed_kernel/ops/residual/cute_fused.py", "the Blackwell gated-residual kernel "
             "(hyper-connections): not K3's AttnRes"),
    FileRule("tokenspeed", "tokenspeed_kernel/ops/residual/deep_gemm.py", "DeepGEMM residual registrations "
             "(hyper-connections): not K3's AttnRes"),
    FileRule("tokenspeed", "tokenspeed_kernel/ops/residual/triton.py", "Triton hyper-connection kernels: not K3's "
             "AttnRes (its Triton-free torch_attn_res_fwd is bound)"),
    FileRule("tokenspeed", "tokenspeed/runtime/models/kimi_k3_comm.py", "the target's tensor-parallel collectives"),
    FileRule("tokenspeed", "tokenspeed/runtime/models/kimi_k3_deepep.py", "DeepEP MoE dispatch"),
    FileRule("tokenspeed", "tokenspeed/runtime/models/kimi_k3_nextn.py", "the NextN (MTP) head: a different method"),
    FileRule("sglang", "sglang/kernels/ops/speculative/dspark/__init__.py", "the package's exports"),
    FileRule("sglang", "sglang/kernels/ops/speculative/dspark/*accept*.py", "acceptance of drafted tokens: after "
             "the three paths (the draft step's acceptance is the token properties')"),
    FileRule("sglang", "sglang/kernels/ops/speculative/dspark/blockwise_rejection.py", "rejection sampling"),
    FileRule("sglang", "sglang/kernels/ops/speculative/dspark/markov_sample.py", "Markov draft sampling"),
    FileRule("sglang", "sglang/kernels/ops/speculative/dspark/simulated_bonus.py", "the bonus-token simulation"),
    FileRule("sglang", "sglang/kernels/ops/speculative/dspark/commit_swa.py", "sliding-window cache commit"),
    FileRule("sglang", "sglang/kernels/ops/speculative/dspark/stage_commit.py", "staged commit of accepted tokens"),
    FileRule("sglang", "sglang/kernels/ops/speculative/dspark/dspark_schedule.py", "the draft scheduler"),
    FileRule("sglang", "sglang/kernels/ops/speculative/dspark/dspark_verify_window.py", "the verify window"),
    FileRule("sglang", "sglang/kernels/ops/speculative/dspark/dspark_attn_metadata.py",
             "the draft attention's metadata"),
    FileRule("sglang", "sglang/kernels/ops/speculative/dspark/dispatch.py", "kernel dispatch tables"),
    FileRule("sglang", "sglang/kernels/ops/speculative/dspark/dspark_draft_model.py",
             "UNBOUND: the DSpark draft model's fused helpers; the draft's context write is fused_kv_write.py's "
             "(bound)"),
    FileRule("sglang", "sglang/kernels/ops/attention/attn_res.py",
             "UNBOUND, on path 2: SGLang's AttnRes op wrapper around the SM100 JIT kernel (coverage's "
             "AttnResFusedTmaKernel row); the H200 runs srt/layers/attn_residual.py (bound)"),
    FileRule("sglang", "sglang/kernels/ops/attention/attn_res_hip.py", "UNBOUND, on path 2: the ROCm AttnRes op "
             "(needs a HIP build)"),
)

# Pinned files that are generic support, not K3 files: only their bound functions count.
SUPPORT_FILES: dict[str, dict[str, str]] = {
    "vllm": {
        "vllm/_version.py": "the release's name",
        "vllm/_custom_ops.py": "vLLM's registry of compiled ops: the four context-KV ops are bound",
        "vllm/model_executor/models/utils.py": "generic model helpers: the weights mapper is bound",
        "vllm/model_executor/utils.py": "generic executor helpers: refill_derived (0.34.0) is bound",
        "vllm/model_executor/models/interfaces.py": "every model's interfaces: the Eagle aux-state mixin is bound",
        "vllm/v1/worker/gpu/pp_utils.py": "the GPU worker's PP helpers: the aux relay is bound",
        "vllm/v1/worker/gpu/spec_decode/eagle/eagle3_utils.py": "Eagle-3 helpers: the relay keys are bound",
        "vllm/model_executor/layers/linear.py": "every linear layer: the merged-column loader is bound",
        "vllm/model_executor/parameter.py": "every parameter class: the merged and per-tensor loaders are bound",
        "vllm/model_executor/layers/quantization/compressed_tensors/schemes/compressed_tensors_w4a4_nvfp4.py":
            "the NVFP4 scheme: its weight creation and post-processing are bound",
        "vllm/model_executor/layers/quantization/modelopt.py": "ModelOpt quantization: its NVFP4 scheme is bound",
        "vllm/v1/worker/gpu/sample/gumbel.py": "the GPU sampler's Gumbel-max: the draw the fused Markov steps must "
                                               "reproduce (gumbel_sample and the hash it keys) is bound",
        "vllm/v1/worker/gpu/spec_decode/draft_logits.py": "the draft logits cache: the row its kernels write "
                                                          "(draft_logits_row) is bound",
        "vllm/v1/worker/gpu/spec_decode/dspark/speculator.py": "the DSpark speculator: the Markov loop the fused "
                                                               "steps replace is bound",
    },
    "tokenspeed": {
        "tokenspeed/version.py": "the release's name",
        "tokenspeed_kernel/ops/embedding/__init__.py": "generic RoPE dispatch: the K RoPE is bound",
        "tokenspeed_kernel/ops/embedding/triton.py": "generic Triton RoPE: the kernel the K3 draft takes is bound",
        "tokenspeed_kernel/ops/kvcache/triton.py": "generic cache writes: the MLA buffer write is bound",
        "tokenspeed_kernel/thirdparty/cuda/rope.py": "the CUDA RoPE wrapper: bound",
    },
    "sglang": {
        "sglang/_version.py": "the release's name",
        "sglang/srt/disaggregation/utils.py": "disaggregation helpers: the transfer pairs are bound",
        "sglang/srt/disaggregation/mooncake/conn.py": "the Mooncake transport: its KV send path is bound",
        "sglang/srt/disaggregation/common/conn.py": "the common transport: its MLA PP spans are bound",
        "sglang/srt/disaggregation/common/utils.py": "transport helpers: the contiguous grouping is bound",
        "sglang/srt/disaggregation/base/conn.py": "the transport's base types: StateType is bound",
    },
}



_V_MODEL = "vllm/models/kimi_k3/nvidia/model.py"
_V_ROCM = "vllm/models/kimi_k3/amd/linear.py"
_V_DSPARK = "vllm/models/kimi_k3/nvidia/dspark_mla.py"
_V_ATTN = "vllm/models/kimi_k3/nvidia/ops/attn_res.py"
_V_EPILOGUE = "vllm/models/kimi_k3/nvidia/ops/fused_mla_key_concat_kv_cache.py"
_T_K3 = "tokenspeed/runtime/models/kimi_k3.py"
_T_DSPARK = "tokenspeed/runtime/models/kimi_k3_dspark.py"
_T_CONTEXT = "tokenspeed/runtime/execution/dspark_context.py"
_T_RES = "tokenspeed_kernel/ops/residual/__init__.py"
_S_ATTN = "sglang/srt/layers/attn_residual.py"
_S_DFLASH = "sglang/srt/models/dflash.py"

_MOE = "the target's MLP and MoE (routing, experts, sequence-parallel sharding, fused GEMM collectives)"
_WRAPPER = ("the causal-LM and multimodal wrappers: embedding, logits, the KDA (Mamba-style) state hooks, vision, "
            "CUDA-graph capture, delegating forward")
_LOAD_TARGET = "loading the target's checkpoint (the draft's weight-loading contract is bound in dspark_mla.py)"
_ATTN_SITES = ("on path 2: the decoder layer's AttnRes call sites, where the layer's block count, its write index and "
               "the mixture's +1 after a write layer are computed: the adapter's attn_res subject takes those as "
               "arguments; binding needs the layer's methods lifted over a stub layer")
_DRAFT_QUERY = "the draft's query side (its decoder layers attend over the cache the context path wrote)"

_V_DRAFTER = "vllm/models/kimi_k3/nvidia/specialized_decode/drafter/model.py"  # 0.34.0's specialized drafter
_V_MARKOV = "vllm/models/kimi_k3/nvidia/specialized_decode/drafter/markov.py"  # its fused Markov steps
RULES: tuple[Rule, ...] = (
    # nvidia/ops/fused_mla_key_concat_kv_cache.py: the prefill epilogue's bf16 and fp8 inserts and the decode
    # epilogue (its bf16 and fp8 ops; the fp8_ds_mla one declared below) are bound
    # (mla_epilogue: engines/vllm_adapter/mla_epilogue.py, on the ops k3num build-ops builds)
    Rule("vllm", _V_EPILOGUE, r"fused_mla_key_concat_ds_mla_insert", "off-path",
         "the fp8_ds_mla cache (K3.1's DSA target layout, 656-byte self-scaled entries): a draft's cache is bf16 or "
         "plain fp8 (dense_draft.py), never fp8_ds_mla"),
    Rule("vllm", _V_EPILOGUE, r"_empty_full_key|fused_mla_kv_concat|fused_mla_kv_concat_quant_fp8|"
         r"fused_mla_kv_pack_quant_fp8", "off-path",
         "the chunked-context key pack: no cache insert and no RoPE, it reads back latents a prefill already wrote"),
    # nvidia/specialized_decode/drafter/model.py (0.34.0): context_proj and _gathered_linear are bound
    # (context_proj_tp: engines/vllm_adapter/context_proj.py)
    Rule("vllm", _V_DRAFTER, r"register|draft_shape", "off-path",
         "the specialized drafter's registration with vLLM's model registry and its load-time workspace sizes"),
    Rule("vllm", _V_DRAFTER, r"SpecializedK3DSparkModel\.forward|forward|_prepared_embedding", "off-path",
         "the draft's layers over the drafter's fused collectives (embedding all-reduce, all-reduce + RMSNorm): "
         "after path 3, the token properties run the harness's own draft step"),
    Rule("vllm", _V_DRAFTER, r"SpecializedK3DSparkForCausalLM\.(compute_draft_logits|sample_sequential)", "off-path",
         "the draft's logits (after path 3) and the hand-over to the fused Markov steps (markov.py, bound: "
         "markov_steps)"),
    # specialized_decode/drafter/markov.py (0.34.0): FusedMarkov and its kernels are bound (markov_steps:
    # engines/vllm_adapter/markov.py)
    Rule("vllm", _V_MARKOV, r"sample_sequential|why_not", "unbound",
         "after path 3: the entry the drafter model calls, which takes the fused launches when why_not's conditions "
         "hold (sampled drafts, no watermarker, a full vocabulary, no confidence head or acceptance estimator, "
         "unscaled logits, bf16 contiguous weights of a power-of-two rank <= 512), forks the noise where "
         "noise_rows says and runs FusedMarkov; the adapter drives FusedMarkov the same way inside those conditions "
         "(binding the entry itself needs the drafter model and its logits processor)"),
    Rule("vllm", _V_MARKOV, r"_loop_rest", "unbound",
         "after path 3: vLLM's loop from already computed base logits, the fallback when the base logits' dtype or "
         "layout refuses the fused launches; the loop judged is the speculator's own (_sample_markov_chain, bound)"),
    Rule("vllm", _V_MARKOV, r"_fused", "off-path",
         "the per-speculator cache of FusedMarkov scratch (keyed by device, vocabulary, rank and key width)"),
    Rule("vllm", _V_DRAFTER, r"install_draft_fold|_folded_impl|_build_dcp", "off-path",
         "the draft block's folded MLA decode and its DCP attention (attention.py): after path 1's cache write"),
    Rule("vllm", _V_DRAFTER, r"SpecializedK3DSparkForCausalLM\.(__init__|process_weights_after_loading)|"
         r"after_loading|install_collectives", "unbound",
         "on path 3: the model swaps in the column-parallel context_proj (bound) before the load, and after it "
         "routes every drafter linear to DraftGemm (linears.py: the SM100 warp split-K) and the projection's "
         "gather to the mailboxes (comm.py: multicast symmetric memory); binding needs vLLM's model construction"),
    Rule("vllm", _V_ATTN, "get_attn_res_triton_warmup_profiles", "off-path",
         "the shapes the Triton warm-up compiles ahead of serving; it computes nothing"),
    # nvidia/model.py
    Rule("vllm", _V_MODEL, r"shard_sequence_parallel_mlp|can_shard_sequence_parallel_shared_expert|"
         r"maybe_init_gemm_rs_ar|make_kimi_k3_mega_moe_expert_params_mapping|"
         r"(KimiMLP|KimiRoutedOutputTransform|KimiMoE)\..*", "off-path", _MOE),
    Rule("vllm", _V_MODEL, r"KimiDecoderLayer\.(__init__|_pre_attn_norm|_post_attn_norm)", "unbound", _ATTN_SITES),
    Rule("vllm", _V_MODEL, r"KimiDecoderLayer\.(forward|_run_self_attn)", "off-path",
         "the layer's attention and MLP around its two AttnRes sites"),
    Rule("vllm", _V_MODEL, r"KimiLinearModel\.__init__", "unbound",
         "on path 2: the model's AttnRes bank size and its aux stream are set up here; the pp_taps and aux_capture "
         "subjects build the model state themselves (binding needs vLLM's config and layer construction)"),
    Rule("vllm", _V_MODEL, r"KimiLinearModel\.make_empty_intermediate_tensors", "unbound",
         "on path 2's PP branch: the tensors a later stage receives (the prefix bank among them); binding needs "
         "vLLM's IntermediateTensors"),
    Rule("vllm", _V_MODEL, r"KimiLinearModel\.load_weights|get_spec_layer_idx_from_weight_name", "off-path",
         _LOAD_TARGET),
    Rule("vllm", _V_MODEL, r"(KimiLinearForCausalLM|KimiK3ForConditionalGeneration)\..*", "off-path", _WRAPPER),
    # amd/linear.py
    Rule("vllm", _V_ROCM, r"(KimiMLP|KimiRoutedOutputTransform|KimiMoE|KimiMLAAttention)\..*", "off-path",
         _MOE + "; the target's MLA attention"),
    Rule("vllm", _V_ROCM, r"KimiDecoderLayer\.(__init__|forward_attn_residual)", "unbound", _ATTN_SITES + " (ROCm)"),
    Rule("vllm", _V_ROCM, r"KimiDecoderLayer\.(forward|_run_self_attn)", "off-path",
         "the layer's attention and MLP around its AttnRes site"),
    Rule("vllm", _V_ROCM, r"KimiLinearModel\.(__init__|make_empty_intermediate_tensors)", "unbound",
         "on path 2 (ROCm): the bank and the PP stage's received tensors; as nvidia/model.py's"),
    Rule("vllm", _V_ROCM, r"KimiLinearModel\.load_weights", "off-path", _LOAD_TARGET),
    Rule("vllm", _V_ROCM, r"KimiLinearForCausalLM\..*", "off-path", _WRAPPER),
    # nvidia/dspark_mla.py
    Rule("vllm", _V_DSPARK, r"K3DSparkDecoderLayer\..*|K3DSparkModel\.(embed_input_ids|forward)|"
         r"K3DSparkForCausalLM\.(embed_input_ids|forward|compute_logits|compute_draft_logits|map_draft_to_target|"
         r"markov_embed|markov_bias|compute_confidence|get_draft_kv_cache_layer_names)", "off-path", _DRAFT_QUERY
         + ", its logits, Markov steps and confidence: the token properties run the harness's own draft step"),
    Rule("vllm", _V_DSPARK, r"K3DSparkModel\.__init__", "unbound",
         "on path 1: the draft's layers, context projection and norm are built here; the context_kv_fused subject "
         "builds stub layers with the same fields (binding needs vLLM's layer construction)"),
    Rule("vllm", _V_DSPARK, r"K3DSparkModel\.combine_hidden_states|K3DSparkForCausalLM\.combine_hidden_states",
         "unbound", "on path 3: the context projection and its norm, once (context_norm(context_proj(h))): vLLM's "
         "ReplicatedLinear and RMSNorm layers (custom ops); the harness binds this step from TokenSpeed and SGLang"),
    Rule("vllm", _V_DSPARK, r"K3DSparkModel\.precompute_and_store_context_kv|"
         r"K3DSparkForCausalLM\.precompute_and_store_context_kv", "off-path",
         "one-line delegations to _precompute_fused_context_kv (bound)"),
    Rule("vllm", _V_DSPARK, r"K3DSparkForCausalLM\.(__init__|load_weights|process_weights_after_loading)", "unbound",
         "on path 1's weight-loading contract: the loader around _duplicate_context_kv_weights and hf_to_vllm_mapper "
         "(both bound); binding needs vLLM's AutoWeightsLoader"),
    # tokenspeed models/kimi_k3.py
    Rule("tokenspeed", _T_K3, r"(KimiLinearMLP|KimiLinearMoEGate|KimiLinearMoE|KimiKDAMergedProj|KimiLinearKDA|"
         r"KimiLinearMLAAttention)\.(?!can_fuse_attnres_partials).*|_situ_betas|_dense_mlp_quant_config|"
         r"_fused_qkv_a_uses_fp8|_assemble_fp8_fused_qkv_a|_k3_local_moe_blocks|_shard_k3_latent_projection|"
         r"_k3_trtllm_situ_internal_activation_dtype|prepare_k3_all_reduce_buffers|_amd_moe_join_lane|"
         r"create_kimi_linear_moe", "off-path", _MOE + "; KDA; the target's MLA attention"),
    Rule("tokenspeed", _T_K3, r"(KimiLinearMLAAttention|KimiLinearKDA)\.can_fuse_attnres_partials|_sliced_scratch|"
         r"_attnres_mlp_slot|_attnres_scratch|KimiLinearDecoderLayer\.(__init__|_reduce_attn_accumulate|"
         r"_mix_into_attention|_fused_attnres_graph_available|_forward_fused_attnres_graph|"
         r"_prepare_next_fallback_attnres_partial|forward)", "unbound",
         "on path 2: the decoder layer's AttnRes sites and the fused-partials graph (attention output accumulated "
         "into the next mixture); the adapter drives _apply_attn_res and capture_attnres (bound) itself; binding "
         "needs the layer lifted over stub attention and MLP"),
    Rule("tokenspeed", _T_K3, r"KimiLinearModel\.(__init__|pp_stage_state_spec)", "unbound",
         "on path 2's PP branch: the bank and the state a stage hands on; the pp_taps subject builds them"),
    Rule("tokenspeed", _T_K3, r"KimiLinearModel\.get_input_embeddings|KimiK3Vision\..*|"
         r"KimiLinearForCausalLM\.(prepare_communication_runtime|load_weights|post_load_weights)|"
         r"KimiK3ForConditionalGeneration\..*", "off-path", _WRAPPER),
    Rule("tokenspeed", _T_K3, r"KimiLinearForCausalLM\.(set_eagle3_layers_to_capture|set_target_context_capture)",
         "unbound", "on path 2: the other capture set-ups (Eagle-3's, the target-context one) beside the DFlash "
         "one (bound)"),
    # tokenspeed models/kimi_k3_dspark.py
    Rule("tokenspeed", _T_DSPARK, r"K3DSparkAttention\._attn|K3DSparkDecoderLayer\..*|K3DSparkModel\.(forward|"
         r"_finalize_hidden)", "off-path", _DRAFT_QUERY),
    Rule("tokenspeed", _T_DSPARK, r"K3DSparkModel\.(__init__|configure_target|target_layer_ids|num_target_taps|"
         r"context_in_features|context_dtype)", "unbound",
         "on path 3: the draft's tap set-up (which target layers, how many, the projection's input width and "
         "dtype); the stage_partial and tap_owner subjects take the taps as arguments"),
    Rule("tokenspeed", _T_DSPARK, r"K3DSparkModel\.(checkpoint_weight_name_filter|load_weights|post_load_weights)",
         "unbound", "on path 3: the draft's loader, which slices each PP stage's context_proj columns (the adapter "
         "slices them as the loader does: engines/tokenspeed_adapter)"),
    # tokenspeed execution/dspark_context.py
    Rule("tokenspeed", _T_CONTEXT, r"DSparkContextProducer\.(__init__|set_cache_pool)", "off-path",
         "the rule that only the last stage owns the cache, and the pool's replacement"),
    Rule("tokenspeed", _T_CONTEXT, r"DSparkContextProducer\.write_context", "unbound",
         "on path 3: the last stage's finalize-then-write (finalize_target_projection and write_context_kv, both "
         "bound) with its shape checks; binding needs it lifted over the bound pair"),
    # tokenspeed_kernel ops/residual/__init__.py
    Rule("tokenspeed", _T_RES, r"attn_res_fwd_available", "unbound",
         "on path 2: whether the fused AttnRes is available to the model (select_attn_res_fwd_kernel is bound)"),
    Rule("tokenspeed", _T_RES, r"_flatten_rows|_same_tensor_contract|gated_residual_mix|gated_residual_combine|"
         r"mhc_mixes|mhc_pre|mhc_post|mhc_fused_hc|normalized_dot_gate", "off-path",
         "the other residual ops of the package (gated residuals, hyper-connections): not K3's AttnRes"),
    # sglang srt/layers/attn_residual.py
    Rule("sglang", _S_ATTN, r"AttnResidual\.forward_sp_(all_gather|reduce_scatter)", "unbound",
         "on path 2: the sequence-parallel AttnRes (its bank gathered or scattered over a process group); binding "
         "needs a group (harness/pp_ranks.py runs ranks for the PP paths only)"),
    # sglang srt/models/dflash.py
    Rule("sglang", _S_DFLASH, r"_radix_topk|_logical_linear_weight_shape|_project_candidate_logits|candidate_topk|"
         r"_score_edges|_follow_maps|CandidateSelector\..*|DFlash2DraftModel\..*", "off-path",
         "candidate selection of DFlash and DFlash-2 (logits, lattices): after the three paths"),
    Rule("sglang", _S_DFLASH, r"_get_dflash_attention_type|_get_dflash_layer_attention_params|"
         r"DFlashAttention\.(__init__|_build_qkv_proj|forward_prepare_npu|forward|apply_attention_output)|"
         r"DFlashMLP\..*|_grouped_conv|DFlashGroupedConv\..*|DFlashDecoderLayer\..*|"
         r"DFlashDraftModel\.(__init__|set_block_size|get_attention_sliding_window_size|get_input_embeddings|"
         r"forward|load_weights)", "off-path", _DRAFT_QUERY + ", its MLP and grouped convolution"),
    Rule("sglang", _S_DFLASH, r"DFlashAttention\.(apply_k_norm|apply_k_rope)", "unbound",
         "on path 1 (DFlash's GQA draft): the unfused K norm and RoPE, the fallback beside fused_kv_norm_rope_write "
         "(bound); binding needs SGLang's RMSNorm and rotary layers or stand-ins"),
    Rule("sglang", _S_DFLASH, r"DFlashDraftModel\.prepare_context_hidden_for_kv", "off-path",
         "the identity (a hook the Laguna variant overrides)"),
    Rule("sglang", _S_DFLASH, r"DFlashLaguna(Attention|ForCausalLM)\..*", "off-path",
         "the Laguna model's DFlash variant, not K3's"),
)
