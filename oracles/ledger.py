"""The known-divergence ledger: where a real engine disagrees with the oracle or breaks a contract.

Nothing is loosened for these. An entry covers, in its (engine, version,
property test[, mode]) and the tests in `also`, only the drawn cases its rule
names (harness/ledger_cases.py): a failing case inside is the known
divergence (the test is reported xfailed, naming the entry) only where the
entry's bug model explains what the engine computed (harness/ledger_models.py;
an entry without one says why in ledger_cases' `no_model`), any other failing
case fails the test (harness/ledger_run.py). A reproducer reproduces only with
its entry's signature (a regex on the failure) and model. Strictness is the reproducer's:
each entry's minimal case runs as a strict case
(properties/test_ledger_reproducers.py), so an upstream fix turns it red and
the entry must then be removed. An entry applies while its `files` are the
pinned bytes: a tree that changed other files of the engine keeps it, a tree
that changed one of its files is judged plainly. Each entry carries the minimal reproducer hypothesis found and the
upstream issue. `modes` limits an entry to the modes it was seen in (a race on
the GPU does not happen under the sequential Triton interpreter); empty means
every mode.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Divergence:
    id: str
    engine: str
    version: str
    subject: str
    test: str  # the property test's function name
    what: str
    reproducer: str
    upstream: str
    # the engine files (paths inside the pinned release; `csrc/...` inside its pinned source distribution, the
    # compiled ops) the finding lives in: the entry applies while these are the pinned bytes, however the rest of
    # the engine's tree changed (supply.fetch.pinned_files)
    files: tuple[str, ...] = ()
    modes: tuple[str, ...] = ()
    # other property tests the same finding fails (a race shows in every property that repeats or
    # judges the racy call)
    also: tuple[str, ...] = ()
    # a race: the same case fails on some calls only, and on one module instance and not another (GPU
    # run 34: the pinned vLLM bytes, loaded twice, failed K3N-004's case four times in a row on one and
    # passed four times on the other); `k3num check` cannot tell a head's failure in its tests from it
    race: bool = False
    # the releases the finding is confirmed on besides `version` (the one it was filed on): its reproducer
    # run there, in CI. On a release it is not confirmed on, the entry does not apply (its failures are
    # judged plainly) and its reproducer, where it still reproduces, fails asking for the confirmation
    also_releases: tuple[str, ...] = ()
    # the entry's case class through the draft step (`k3num impact --ledger`): a name in harness/token_cases.py
    # CASES, and the hidden size it runs at where not the drawn one (its reproducer's); an entry the step cannot
    # reach has no case class and says why in token_why
    token_case: str = ""
    token_hidden: int = 0
    token_why: str = ""

    @property
    def releases(self) -> tuple[str, ...]:
        """Every release the entry is confirmed on, the one it was filed on first."""
        return (self.version, *self.also_releases)


LEDGER: tuple[Divergence, ...] = (
    Divergence(
        id="K3N-001", token_case="as_drawn",
        files=("vllm/models/kimi_k3/amd/linear.py", "vllm/models/kimi_k3/nvidia/model.py"),
        engine="vllm-rocm", version="0.33.0", also_releases=("0.34.0",), subject="aux_capture",
        test="test_branch1_tap_mixes_with_the_next_layers_weights_and_blocks",
        what="the ROCm aux tap (amd/linear.py _maybe_add_hidden_state) returns the prefix sum and ignores "
             "VLLM_KIMI_K3_AUX_ATTN_RES_STREAM, so with the flag on it is not the next layer's mixture",
        reproducer="TapCase(num_layers=2, block_size=1, stage_end=2, layer_idx=0, tokens=1, hidden=16, seed=0): "
                   "max_abs 0.70 vs budget 0.013, cosine 0.956",
        upstream="vllm#56434 (open)",
        # the tap taken on a stage that holds layer i + 1 is branch 1 on the ROCm model too; the draft step's taps
        # are branch-1 taps, so what the draft proposes from them is this entry's too (harness/draft_step.py)
        also=("test_a_stage_end_tap_taken_by_the_next_stage_mixes_with_its_weights",
              "test_a_decided_token_never_flips", "test_a_block_without_a_near_tie_is_accepted_whole"),
    ),
    Divergence(
        id="K3N-002", token_case="last_tap",
        files=("vllm/models/kimi_k3/amd/linear.py", "vllm/models/kimi_k3/nvidia/model.py"),
        engine="vllm-rocm", version="0.33.0", also_releases=("0.34.0",), subject="aux_capture",
        test="test_branch2_tap_on_the_last_rank_mixes_with_the_output_weights",
        what="same cause as K3N-001 after the last layer: the output mixture is never formed",
        reproducer="TapCase(num_layers=2, block_size=1, stage_end=1, layer_idx=0, tokens=1, hidden=16, seed=0): "
                   "max_abs 1.39 vs budget 0.010, cosine 0.777",
        upstream="vllm#56434 (open); see also vllm#50815 (the tap after the last layer)",
    ),
    Divergence(
        id="K3N-003", token_case="split_at_a_stage_end",
        files=("vllm/models/kimi_k3/amd/linear.py", "vllm/models/kimi_k3/nvidia/model.py"),
        engine="vllm-rocm", version="0.33.0", also_releases=("0.34.0",), subject="aux_capture",
        test="test_branch3_non_final_stage_raises_when_configured_to",
        what="at the end of a non-final PP stage the ROCm tap returns the prefix where the NVIDIA path "
             "of the same release refuses (RuntimeError): the two platforms disagree on branch 3",
        reproducer="TapCase(num_layers=2, block_size=1, stage_end=1, layer_idx=0, tokens=1, hidden=16, seed=0): "
                   "no exception raised",
        upstream="vllm#56434 (open)",
    ),
    Divergence(
        id="K3N-004", token_case="race_written_in_the_mix", token_hidden=32,
        files=("vllm/models/kimi_k3/nvidia/ops/attn_res.py",),
        engine="vllm", version="0.33.0", also_releases=("0.34.0",), subject="attn_res",  # 0.34.0: GPU run 77
        test="test_a_block_written_in_the_call_is_mixed_with_its_written_value",
        what="nvidia/ops/attn_res.py _attn_res_kernel stores the prefix into bank row block_write_idx and then "
             "loads the sources with another thread layout; the tl.debug_barrier() between them is only "
             "emitted when HAS_DELTA, so without a delta a write inside [0, num_blocks) races with the loads "
             "and the mixture sometimes uses the old row (GPU run 112: its softmax normalizer takes the row's score "
             "from before the store, and at hidden 128 its values too in some 32-element segments). Seen at small "
             "hidden sizes (hidden 32, 1 token, "
             "num_blocks 2: 7 of 200 calls over budget, 2 distinct outputs for one input); not seen in 200 calls "
             "at hidden 7168. The same input passes on a re-run (hypothesis: FlakyFailure). KimiK3DecoderLayer "
             "always writes at num_blocks, so the model's own calls are not affected. Fix shown on the H200 (run 19): "
             "the barrier under HAS_DELTA or WRITE_BLOCK (harness/fixes.py)",
        reproducer="AttnResCase(tokens=1, hidden=32, bank=2, num_blocks=2, block_write_idx=0, with_delta=False, "
                   "with_output_norm=False, seed=0, scale=0.01, outliers=30.0): ratio 139.7 on the first call, "
                   "within budget on the re-run (H200, triton 3.6.0); scripts/repro_attn_res_write_race.py counts it",
        upstream="none found (not reported yet)",
        modes=("source-gpu", "import"), race=True,
        # the rounding contract judges the same racy call (GPU run 88: a write at 0 of 1 block, no delta)
        also=("test_attn_res_repeated_calls_are_bitwise_identical", "test_attn_res_rounds_only_where_its_code_says"),
    ),
    Divergence(
        id="K3N-005", token_case="race_written_in_the_mix", token_hidden=32,
        files=("vllm/models/kimi_k3/amd/ops/attn_res.py",),
        engine="vllm-rocm", version="0.33.0", also_releases=("0.34.0",), subject="attn_res",  # 0.34.0: GPU run 77
        test="test_a_block_written_in_the_call_is_mixed_with_its_written_value",
        what="same race as K3N-004 in amd/ops/attn_res.py (the ROCm Triton kernel, run on the H200)",
        reproducer="AttnResCase(tokens=1, hidden=32, bank=2, num_blocks=2, block_write_idx=0, with_delta=False, "
                   "with_output_norm=False, seed=7, scale=1.0, outliers=30.0): 64 of 200 calls over budget (worst "
                   "ratio 86), 3 distinct outputs (scripts/repro_attn_res_write_race.py, H200)",
        upstream="none found (not reported yet)",
        modes=("source-gpu", "import"), race=True,
        also=("test_attn_res_repeated_calls_are_bitwise_identical",),
    ),
    Divergence(
        id="K3N-006", token_case="cancelling_taps",
        files=("tokenspeed/runtime/models/kimi_k3_dspark.py", "tokenspeed/runtime/execution/dspark_context.py"),
        engine="tokenspeed", version="0.1.1", subject="finalize_projection",
        test="test_sharded_adds_no_rounding_beyond_its_partials_when_taps_cancel",
        what="K3DSparkModel.project_target_tap returns linear(hidden, weight) in bf16, so every tap's "
             "projection is rounded to bf16 before it enters the fp32 stage accumulator (add_capture), and "
             "finalize_target_projection rounds the fp32 sum to bf16 before the norm; the stage partials travel "
             "in fp32 but carry u_bf16 * |p_i| per tap. When taps cancel, that is far above the unsharded "
             "path's one rounding of the sum (project_target_hidden: one GEMM over all taps). The accuracy "
             "property counts these declared roundings (extras['projection_roundings']) and passes; this one "
             "does not count them",
        reproducer="ProjectionCase(taps=2, tokens=1, hidden=16, hidden_out=16, stages=((0, 1),), order=(0,), "
                   "seed=0, scale=0.01, outliers=0.0) with cancelling taps (fixtures.builders."
                   "cancelling_projection_inputs): max_abs 1.19e-02 vs budget 5.5e-04 (ratio 21.6); on the H200 a "
                   "random case (seed 141, 6 taps x 32, 1 token, 16 out) reached ratio 1.05 of the plain budget",
        upstream="none found (not reported yet)",
    ),
    Divergence(
        id="K3N-007", token_case="race_raced_layer_input", token_hidden=128,
        files=("vllm/models/kimi_k3/amd/ops/attn_res.py",),
        engine="vllm-rocm", version="0.33.0", also_releases=("0.34.0",), subject="attn_res",  # 0.34.0: GPU run 77
        test="test_attn_res_within_rounding_budget_of_oracle",
        what="amd/ops/attn_res.py _attn_res_kernel races with itself when it has a delta: it stores prefix + delta "
             "back into the prefix in place (warps 0-3, the row layout) with no barrier before the store, while the "
             "compiled kernel (hidden 128, 8 warps, BLOCK_L 4) issues the prefix and delta loads a second time in the "
             "source tile's layout for the prefix source. When the store lands between the two reads, the tile's "
             "prefix is read already updated and gets delta again: every wrong output equals a reference in which "
             "one or more 32-element segments of the prefix are bf16(bf16(p + d) + d) (one or two in runs 11-19; three "
             "at 7 blocks, run 80). A tl.debug_barrier() before "
             "the prefix store gives one output in 200 calls (harness/fixes.py, scripts/prove_fixes.py). "
             "compute-sanitizer's racecheck reports no hazard (the race is on global memory, which it does not "
             "check). Needs the delta, the 4-source tile (fewer than 256 tokens, num_blocks >= 2); seen on the H200 "
             "only (a race; whether ROCm hardware's code generation reloads the prefix the same way needs AMD)",
        reproducer="AttnResCase(tokens=1, hidden=128, bank=4, num_blocks=4, block_write_idx=-1, with_delta=True, "
                   "with_output_norm=True, seed=0, scale=0.01, outliers=30.0): 49 of 300 calls over budget (ratio up "
                   "to 107, cosine 0.991), 4 distinct outputs (run 11); 49 of 200, 3 distinct, each equal to the "
                   "delta-twice reference (scripts/repro_attn_res_flaky.py, H200, run 19)",
        upstream="none found (not reported yet)",
        modes=("source-gpu", "import"), race=True,
        also=("test_attn_res_repeated_calls_are_bitwise_identical",
              "test_attn_res_in_place_prefix_rewrite_is_deterministic",
              "test_attn_res_writes_every_output_element_and_nothing_outside_its_rows",
              # the batch, reversed and alone are three calls: the race fires in one (GPU run 115, H100)
              "test_attn_res_row_alone_is_the_row_in_its_batch_and_at_another_position_bitwise"),
    ),
    Divergence(
        id="K3N-008", token_case="unwritten_layer_input",
        files=("sglang/srt/layers/attn_residual.py",),
        engine="sglang", version="0.5.23", subject="attn_res_residual",
        test="test_model_aggregation_off_grid_hidden_within_budget_or_refused",
        what="srt/layers/attn_residual.py: the model's aggregation path (AttnResidual.forward -> _aggregate -> "
             "_aggregate_fused -> _mix_fused) has no guard for hidden % 1024 != 0, unlike the public "
             "aggregate_stream (which falls back to eager there). _score_kernel loads whole 1024-element chunks "
             "without a mask, so it reads past each row (the next bank row or token, or past the buffer), and "
             "_mix_fused launches H // 1024 column blocks, so for H < 1024 no output element is written and for "
             "H = 1536 the last 512 columns of every row stay torch.empty. Off the model's path (K3 has H = 7168); "
             "any model or test with another hidden size gets uninitialised memory back, with no error",
        reproducer="tokens=1, hidden=96, nvb=1, seed=0: 96 of 96 output elements are the poisoned allocation (NaN); "
                   "hidden=1536, nvb=2: columns 1024-1535 unwritten (properties/test_off_path_shapes.py, CPU, "
                   "Triton interpreter; the same on the H200)",
        upstream="none found (not reported yet)",
    ),
    Divergence(
        id="K3N-009", token_case="bank_one_block_short",
        files=("vllm/models/kimi_k3/nvidia/ops/attn_res.py",),
        engine="vllm", version="0.33.0", also_releases=("0.34.0",), subject="attn_res",
        test="test_attn_res_bank_indices_outside_the_bank_are_refused",
        what="nvidia/ops/attn_res.py attn_res accepts num_blocks > blocks.shape[1] and block_write_idx >= "
             "blocks.shape[1]: the bounds it checks gate only the SM100 native op, and the Triton fallback then "
             "reads the next token's bank rows (or past the buffer) as sources, or writes the prefix there. The "
             "model's own calls stay inside the bank; a caller that sizes the bank wrong gets a silent wrong mixture",
        reproducer="bank=2, num_blocks=3, 3 tokens, hidden 32: the last token's mixture reads past the bank into the "
                   "guard band (32 of 96 outputs NaN); block_write_idx=2 writes the next token's row or past the "
                   "buffer (properties/test_off_path_shapes.py)",
        upstream="none found (not reported yet)",
    ),
    Divergence(
        id="K3N-011", token_case="merged_loader_fp8",
        files=("vllm/model_executor/layers/linear.py", "vllm/model_executor/parameter.py"),
        engine="vllm", version="0.33.0", also_releases=("0.34.0",), subject="block_fp8_loading",
        test="test_block_fp8_merged_shards_dequantize_to_the_per_layer_weights",
        what="a block-FP8 DSpark draft loads into the merged context_kv_proj with misplaced block scales: each "
             "layer's 576 rows are 4.5 blocks of 128, the merged layer allows the block-shape mismatch "
             "(linear.py _maybe_allow_fp8_block_shape_mismatch), and MergedColumnParallelLinear.weight_loader_v2 puts "
             "layer l's scale rows at ceil(576 l / 128) (adjust_block_scale_shard) while the block GEMM reads row r "
             "with scale row r // 128; a merged block also straddles two layers that have two scales. Layers 1 and "
             "3 dequantize wrong in 320 of 576 rows, and the scale rows layers 2 and 4 share with 1 and 3 hold "
             "whichever shard arrived last. With an even number of layers the last layer's scale rows, placed at "
             "ceil(576 (L-1) / 128) for ceil(576 / 128) rows, run past the merged scale's ceil(576 L / 128) rows, "
             "and the loader's narrow raises (2 layers: RuntimeError 'start (5) + length (5) exceeds dimension "
             "size (9)', seen by the entry's failure signature). Shards that are whole blocks (W % 128 == 0) load "
             "right in any order",
        reproducer="5 layers x 576 rows, hidden 256, per-layer block scales (refmodel.quant.quantize_fp8_block), "
                   "arrival order 0..4: rows wrong per layer [0, 320, 0, 320, 0]; order [2, 0, 1] with 3 layers: "
                   "[0, 320, 128] (properties/test_quantized_loading.py, CPU, vLLM's own loader code)",
        upstream="none found (not reported yet)",
        # a user's block-FP8 checkpoint whose layers are not whole blocks (harness/ledger_cases.CHECKPOINT_RULES)
        also=("test_checkpoint_quantized_shards_load_as_the_per_layer_weights",),
    ),
    Divergence(
        id="K3N-012", token_case="merged_loader_nvfp4",
        files=("vllm/model_executor/layers/linear.py",
               "vllm/model_executor/layers/quantization/compressed_tensors/schemes/compressed_tensors_w4a4_nvfp4.py",
               "vllm/model_executor/layers/quantization/modelopt.py"),
        engine="vllm", version="0.33.0", also_releases=("0.34.0",), subject="nvfp4_loading",
        test="test_nvfp4_merged_shards_dequantize_to_the_per_layer_weights",
        what="an NVFP4 DSpark draft whose layers carry their own per-tensor scales loads into the merged "
             "context_kv_proj with one scale for all, with only a warning: compressed-tensors "
             "(CompressedTensorsW4A4Fp4.process_weights_after_loading) keeps max(weight_global_scale), a divisor, "
             "so every other layer is scaled by g_l / g_max < 1; ModelOpt (modelopt.py KNvfp4Static.process) keeps "
             "max(weight_scale_2), a multiplier, so every other layer is scaled by s_max / s_l > 1 (kv_c survives "
             "its RMSNorm up to eps; k_pe, which is not normed, does not)",
        reproducer="5 layers x 576 rows, hidden 64, each layer quantized on its own (refmodel.quant.quantize_nvfp4; "
                   "global scales differ): rows wrong per layer [0, 576, 576, 576, 576], median ratios 1.0, 0.43, "
                   "0.33, 0.26, 0.18 (compressed-tensors) and 5.63, 2.43, 1.88, 1.46, 1.0 (ModelOpt) "
                   "(properties/test_quantized_loading.py, CPU, vLLM's own loader and scheme code); shards sharing "
                   "one per-tensor scale load exactly",
        upstream="none found (not reported yet)",
        # a user's NVFP4 checkpoint whose layers carry their own scales (harness/ledger_cases.CHECKPOINT_RULES)
        also=("test_checkpoint_quantized_shards_load_as_the_per_layer_weights",),
    ),
    Divergence(
        id="K3N-010", token_case="bank_one_block_short",
        files=("vllm/models/kimi_k3/amd/ops/attn_res.py",),
        engine="vllm-rocm", version="0.33.0", also_releases=("0.34.0",), subject="attn_res",
        test="test_attn_res_bank_indices_outside_the_bank_are_refused",
        what="same as K3N-009 in amd/ops/attn_res.py, which checks no bound at all",
        reproducer="as K3N-009",
        upstream="none found (not reported yet)",
    ),
    Divergence(
        id="K3N-013", token_case="transfer_between_tp_sizes",
        files=("sglang/srt/disaggregation/mooncake/conn.py",),
        engine="sglang", version="0.5.23", subject="kv_transfer",
        test="test_kv_transfer_copies_exactly_the_head_aware_plan_or_is_refused",
        what="disaggregation/mooncake/conn.py: the draft KV of a prefill and a decode whose KV heads per rank "
             "differ (other attention TP sizes) is written at the wrong address with the wrong length. "
             "transfer_worker routes every MLA (or hybrid-MLA) backend to send_kvcache whatever the two TP "
             "sizes; send_kvcache hands the decode's registered item length (dst_kv_item_len) only to the "
             "unified-memory check and calls _send_kvcache_generic without dst_item_lens, so "
             "_state_stride_mismatch never runs; the plan then addresses the decode as dst_ptr + dst_index * "
             "src_item_len and copies src_item_len bytes a page. Seed 003's bug, still in the release. With "
             "dst_item_lens passed, the same transfer is refused",
        reproducer="8 KV heads x 128 (bf16), page 64, P TP4 -> D TP32, layer 0's K, P base 1000000, D base 2000000, "
                   "page 0 -> page 2, paired by layer id: planned (1000000, 2065536, 32768); the head-aware plan "
                   "writes 16384 bytes at 2032768 (properties/test_kv_transfer.py, the released methods lifted and "
                   "run on synthetic pointers with a recording _transfer_data)",
        upstream="none found (not reported yet)",
    ),
    Divergence(
        id="K3N-014", token_case="through_an_fp8_cache",
        # the defect's own line is in the compiled insert (csrc: the release's pinned sdist, supply.fetch.pinned_files)
        files=("vllm/models/kimi_k3/nvidia/dspark_mla.py", "vllm/_custom_ops.py", "csrc/cache_kernels.cu"),
        engine="vllm", version="0.33.0", also_releases=("0.34.0",),  # 0.34.0: GPU run 97, its own csrc's ops
        subject="context_kv_ops", modes=("source-gpu", "import"),
        test="test_fp8_insert_with_a_zero_or_nonfinite_scale_refuses_or_poisons_visibly",
        what="an FP8 KV cache whose layer scale (_k_scale) is 0 or infinite is written without a refusal: "
             "concat_and_cache_mla and concat_and_cache_mla_grouped (csrc/cache_kernels.cu, fp8::scaled_convert) "
             "divide by the scale and saturate, so every entry of that layer becomes +-448 (e4m3; +-57344 e5m2) "
             "for a zero scale and +-0 for an infinite one: plausible bytes, no error. The Python that hands the "
             "scales to the kernels (dspark_mla.py stacks each attention's _k_scale into kv_scales; the "
             "_custom_ops.py wrappers) checks nothing either. A NaN scale writes NaN everywhere (visible)",
        reproducer="one layer, one token, fp8_e4m3, scale 0.0, the per-layer insert: all 576 bytes of the slot are "
                   "0x7E or 0xFE (+-448), no exception (GPU run 44; run 45's table covers both inserts, both "
                   "formats and 0, -0, inf, -inf, NaN: scripts/fp8_bad_scale_probe.py)",
        upstream="none found (not reported yet); whether vLLM's KV-cache quantization loader rejects such "
                 "scales before they reach the model is not checked here (its file is not pinned)",
    ),
)


def by_id(entry_id: str) -> Divergence | None:
    return next((d for d in LEDGER if d.id == entry_id), None)


def lookup_all(engine: str, version: str, test: str, mode: str) -> list[Divergence]:
    """Every entry filed for this test (two races share the ROCm repeat property: K3N-005, K3N-007);
    `mode` is the mode the engine's kernels run in here."""
    # a mode's variant (source-gpu+ops: the same kernels, with compiled ops built here) matches its base
    return [d for d in LEDGER if d.engine == engine and version in d.releases and (d.test == test or test in d.also)
            and (not d.modes or mode in d.modes or mode.split("+", 1)[0] in d.modes)]


def lookup(engine: str, version: str, test: str, mode: str) -> Divergence | None:
    """The first entry for this test, if any (lookup_all: every one)."""
    found = lookup_all(engine, version, test, mode)
    return found[0] if found else None
