"""The part of the input space each ledger entry (oracles/ledger.py) covers, and its reproducer.

An entry's `inside` says whether a failing example of one of its tests is one its finding explains. A
rule reads either the test's drawn arguments by name (`case`, `hidden`, `layers`, ...) with its
parameters (`transfer`, `naming`), or, where the finding is a property of the kernel call (the attn_res
races: a delta with the 4-source tile, a write inside the mixed rows), the last call the example made
to that subject, as the kernel saw it (`call`: an `AttnResCall`). A test body may turn its drawn case
into another call before it makes it (the in-place prefix rewrite test adds a delta); a rule over the
call judges the call that ran, where a rule over the drawn case judged another (issue 32: K3N-007's race
reported FAILED in the nightly, on a drawn case without a delta that ran with one). The plugin
(harness/ledger_run.py, `ledgered`) judges every case outside plainly, on the pinned release too, so a
second bug in the same test fails it; a failing case inside is the
known divergence (the test is reported xfailed, naming the entry and how many cases). Where the
finding is that the tested branch itself is wrong, every case is inside, and the rule says so.

Strictness stays with the reproducer: properties/test_ledger_reproducers.py runs each entry's
`reproducer` (the arguments of its minimal case, through the body of its test) as an explicit strict
xfail. A fix turns that case red on the pinned release, and the entry must go.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from k3num.engines import base
from k3num.fixtures.strategies import SEED_003_TRANSFER, AttnResCase, KVTransferCase, ProjectionCase, TapCase

K3_WIDTH = 576  # a DSpark draft layer's context-KV rows (kv_lora 512 + rope 64)


@dataclass(frozen=True)
class AttnResCall:
    """An attn_res call as the kernel saw it (engines.base ATTN_RES's arguments): what the races need."""

    tokens: int
    hidden: int
    bank: int
    num_blocks: int
    block_write_idx: int
    with_delta: bool
    with_output_norm: bool

    @classmethod
    def of_args(cls, args: tuple, kwargs: dict[str, Any]) -> AttnResCall:
        """From attn_res(prefix, delta, blocks, norm_weight, qk_weight, output_norm_weight, num_blocks,
        block_write_idx, ...)'s positional or keyword arguments."""
        names = ("prefix", "delta", "blocks", "norm_weight", "qk_weight", "output_norm_weight", "num_blocks",
                 "block_write_idx")
        a = {**dict(zip(names, args)), **{k: v for k, v in kwargs.items() if k in names}}
        tokens, hidden = a["prefix"].shape
        return cls(tokens, hidden, a["blocks"].shape[1], int(a["num_blocks"]), int(a["block_write_idx"]),
                   a["delta"] is not None, a["output_norm_weight"] is not None)

    @classmethod
    def of_case(cls, case: AttnResCase) -> AttnResCall:
        """The call a case makes as drawn (a reproducer: its test calls it unchanged)."""
        return cls(case.tokens, case.hidden, case.bank, case.num_blocks, case.block_write_idx, case.with_delta,
                   case.with_output_norm)


# the subjects whose calls a rule can read, and how a call is seen (harness/ledger_run.py records the last
# call of each, no tensor kept)
CALL_VIEWS: dict[str, Callable[[tuple, dict[str, Any]], Any]] = {base.ATTN_RES: AttnResCall.of_args}


@dataclass(frozen=True)
class LedgerCase:
    rule: str  # the predicate in words (docs and the xfail reason say it)
    inside: Callable[[Any], bool]  # over the drawn arguments (a dict), or over `call`'s view
    test: str  # the test whose body the reproducer runs through
    reproducer: dict[str, Any] = field(default_factory=dict)  # its drawn arguments and parameters
    call: str = ""  # the subject whose last call the rule reads ("": the rule reads the drawn arguments)
    # the reproducer reproduces only with its own signature: this regex searched in "<Exception>: <message>"
    # (and, where the entry has one, its bug model: harness/ledger_models.py); any other failure is not it
    signature: str = ""
    # why the entry has no bug model in harness/ledger_models.py (its region rule alone decides known); an
    # entry with neither fails tests/test_ledger_records.py
    no_model: str = ""

    def reproducer_view(self) -> Any:
        """What the rule reads for the reproducer (its drawn arguments, or the call they make)."""
        return AttnResCall.of_case(self.reproducer["case"]) if self.call else self.reproducer


def _every(_: dict[str, Any]) -> bool:
    return True


def _write_race(call: AttnResCall) -> bool:
    return 0 <= call.block_write_idx < call.num_blocks and not call.with_delta


def _delta_race(call: AttnResCall) -> bool:
    return call.with_delta and call.num_blocks >= 2 and call.tokens < 256


K3N_004 = AttnResCase(tokens=1, hidden=32, bank=2, num_blocks=2, block_write_idx=0, with_delta=False,
                      with_output_norm=False, seed=0, scale=0.01, outliers=30.0)
K3N_005 = AttnResCase(tokens=1, hidden=32, bank=2, num_blocks=2, block_write_idx=0, with_delta=False,
                      with_output_norm=False, seed=7, scale=1.0, outliers=30.0)
K3N_007 = AttnResCase(tokens=1, hidden=128, bank=4, num_blocks=4, block_write_idx=-1, with_delta=True,
                      with_output_norm=True, seed=0, scale=0.01, outliers=30.0)
EVERY_TAP = "every case: the branch itself is wrong on ROCm (the tap ignores the stream flag / the stage end)"
EVERY_BANK = "every case: the test draws only bank indices outside the bank, which the wrapper accepts"
# the no_model reasons: why the entry's region rule decides alone
RACE_NO_MODEL = ("no finite model explains every raced output (GPU run 112, scripts/collect_write_race.py): 300 "
                 "calls per case on vllm and vllm-rocm; the raced outputs are the mixture whose softmax normalizer "
                 "takes the written row's score from before the store (and, at hidden 128, its values and score "
                 "from before the store in a set of 32-element segments), which explains 61 of 65 distinct "
                 "outputs to bf16's rounding; the other 4 (hidden 32) need a normalizer between the stale and the "
                 "fresh score (partial sums of both), a continuum no enumeration of stale sets covers; so the "
                 "region rule (the call's flags) decides")
REFUSAL_NO_MODEL = "the finding is that no refusal was raised: the signature (the test's own refusal message) is it"


CASES: dict[str, LedgerCase] = {
    "K3N-001": LedgerCase(EVERY_TAP, _every, "test_branch1_tap_mixes_with_the_next_layers_weights_and_blocks",
                          {"case": TapCase(2, 1, 2, 0, 1, 16, 0)},
                          signature=r"AssertionError: branch1_next_layer_mixture \[vllm-rocm .*\] aux_capture "),
    "K3N-002": LedgerCase(EVERY_TAP, _every, "test_branch2_tap_on_the_last_rank_mixes_with_the_output_weights",
                          {"case": TapCase(2, 1, 1, 0, 1, 16, 0)},
                          signature=r"AssertionError: branch2_output_mixture \[vllm-rocm .*\] aux_capture "),
    "K3N-003": LedgerCase(EVERY_TAP, _every, "test_branch3_non_final_stage_raises_when_configured_to",
                          {"case": TapCase(2, 1, 1, 0, 1, 16, 0)}, signature=r"^Failed: DID NOT RAISE",
                          no_model=REFUSAL_NO_MODEL),
    # the races: a repeat of the same call tells them apart from a one-off; the reproducer is the repeat
    # property (152 calls on the GPU), where K3N-004 fails 7 calls in 200
    "K3N-004": LedgerCase("a bank write inside [0, num_blocks), no delta (the barrier is emitted under HAS_DELTA "
                          "only)", _write_race, "test_attn_res_repeated_calls_are_bitwise_identical",
                          {"case": K3N_004}, call=base.ATTN_RES,
                          signature=r"deterministic_across_calls \[vllm .*\] attn_res .*distinct of",
                          no_model=RACE_NO_MODEL),
    "K3N-005": LedgerCase("a bank write inside [0, num_blocks), no delta (as K3N-004, ROCm kernel)", _write_race,
                          "test_attn_res_repeated_calls_are_bitwise_identical", {"case": K3N_005}, call=base.ATTN_RES,
                          signature=r"deterministic_across_calls \[vllm-rocm .*\] attn_res .*distinct of",
                          no_model=RACE_NO_MODEL),
    "K3N-006": LedgerCase("every case: the test's taps cancel by construction, and every tap's projection is "
                          "rounded to bf16", _every,
                          "test_sharded_adds_no_rounding_beyond_its_partials_when_taps_cancel",
                          {"case": ProjectionCase(taps=2, tokens=1, hidden=16, hidden_out=16, stages=((0, 1),),
                                                  order=(0,), seed=0, scale=0.01, outliers=0.0),
                           "transfer": "fp32"},
                          signature=r"AssertionError: sharded_adds_no_rounding_when_taps_cancel \[tokenspeed "),
    "K3N-007": LedgerCase("a delta with the 4-source tile: num_blocks >= 2, fewer than 256 tokens", _delta_race,
                          "test_attn_res_repeated_calls_are_bitwise_identical", {"case": K3N_007}, call=base.ATTN_RES,
                          signature=r"deterministic_across_calls \[vllm-rocm .*\] attn_res .*distinct of"),
    "K3N-008": LedgerCase("a hidden size off the 1024 grid (hidden % 1024 != 0)",
                          lambda a: a["hidden"] % 1024 != 0,
                          "test_model_aggregation_off_grid_hidden_within_budget_or_refused",
                          {"tokens": 1, "hidden": 96, "nvb": 1, "seed": 0},
                          signature=(r"off_path_shape_within_budget \[sglang .*\] attn_res_residual "
                                     r".*elements over budget")),
    "K3N-009": LedgerCase(EVERY_BANK, _every, "test_attn_res_bank_indices_outside_the_bank_are_refused",
                          {"bank": 2, "over": 1, "which": "num_blocks", "seed": 0},
                          signature=r"^Failed: vllm accepted (num_blocks|block_write_idx)=\d+ with a bank of \d+ rows",
                          no_model=REFUSAL_NO_MODEL),
    "K3N-010": LedgerCase(EVERY_BANK, _every, "test_attn_res_bank_indices_outside_the_bank_are_refused",
                          {"bank": 2, "over": 1, "which": "num_blocks", "seed": 0},
                          signature=r"^Failed: vllm-rocm accepted (num_blocks|block_write_idx)=\d+ with a bank of "
                                    r"\d+ rows", no_model=REFUSAL_NO_MODEL),
    "K3N-011": LedgerCase("shards that are not whole blocks (width % 128 != 0) and a second layer to misplace",
                          lambda a: a["width"] % 128 != 0 and a["layers"] >= 2,
                          "test_block_fp8_merged_shards_dequantize_to_the_per_layer_weights",
                          {"layers": 5, "width": K3_WIDTH, "hidden": 256, "data": None, "seed": 0},
                          # the entry's own pattern of wrong rows per layer (its `what`): the model, as the message
                          signature=r"differs from the per-layer weights in \[0, 320, 0, 320, 0\] rows per layer",
                          no_model="the reproducer's signature is the model: the rows wrong per layer that "
                                   "adjust_block_scale_shard's placement predicts, [0, 320, 0, 320, 0]; drawn cases "
                                   "other than the reproducer's are judged by the region rule"),
    "K3N-012": LedgerCase("per-layer scales (not shared) and a second layer to rescale",
                          lambda a: not a["shared"] and a["layers"] >= 2,
                          "test_nvfp4_merged_shards_dequantize_to_the_per_layer_weights",
                          {"layers": 5, "width": K3_WIDTH, "shared": False, "data": None, "seed": 0,
                           "naming": "compressed-tensors"},
                          signature=r"differs from the per-layer weights in \[0, 576, 576, 576, 576\] rows per layer",
                          no_model="the reproducer's signature is the model: every layer but the max-scale one "
                                   "rescaled, [0, 576, 576, 576, 576] rows wrong; drawn cases other than the "
                                   "reproducer's are judged by the region rule"),
    "K3N-013": LedgerCase("the prefill's and the decode's KV heads per rank differ and the decode's item lengths "
                          "are not published to the sender (the worker's send_kvcache path)",
                          lambda a: _heads_differ(a["case"]) and not a["case"].publish_lens,
                          "test_kv_transfer_copies_exactly_the_head_aware_plan_or_is_refused",
                          {"case": SEED_003_TRANSFER},
                          # the flat plan's first entry (src, dst, length): seed 003's numbers
                          signature=r"planned \[\(1000000, 2065536, 32768\)",
                          no_model="the reproducer's signature is the model: the flat plan (1000000, 2065536, "
                                   "32768) where the head-aware plan writes 16384 bytes at 2032768"),
    "K3N-014": LedgerCase("the bad scale is 0 or infinite (a NaN scale poisons every byte, visibly)",
                          lambda a: a["bad"] == 0.0 or math.isinf(a["bad"]),
                          "test_fp8_insert_with_a_zero_or_nonfinite_scale_refuses_or_poisons_visibly",
                          {"seed": 0, "layers": 1, "tokens": 1, "fmt": "fp8_e4m3", "bad": 0.0, "grouped": False},
                          signature=r"scale 0\.0 was taken: \d+ of \d+ bytes in its slots are not NaN"),
}


@dataclass(frozen=True)
class CheckpointRule:
    """Where an entry's finding reaches a user's own checkpoint (`--checkpoint`): the checkpoint property it
    fails, whether a checkpoint is inside (decided at collection from its config and scales), and what
    that means for the checkpoint, in one line. A checkpoint inside is reported known, naming the entry;
    one outside is judged plainly."""

    test: str
    inside: Callable[[Any], bool]  # fixtures.checkpoint.Checkpoint -> bool
    meaning: str


def _block_fp8_not_whole_blocks(c: Any) -> bool:
    g = c.draft_geometry()
    return c.is_draft and c.quant == "fp8" and g.kv_width % 128 != 0 and g.num_layers >= 2


def _nvfp4_per_layer_scales(c: Any) -> bool:
    if not (c.is_draft and c.quant in ("nvfp4-ct", "nvfp4-modelopt")):
        return False
    key = "weight_global_scale" if c.quant == "nvfp4-ct" else "weight_scale_2"
    scales = {float(c.kv_shard(layer)[key].reshape(-1)[0]) for layer in range(c.draft_geometry().num_layers)}
    return len(scales) > 1


CHECKPOINT_TEST = "test_checkpoint_quantized_shards_load_as_the_per_layer_weights"
CHECKPOINT_RULES: dict[str, CheckpointRule] = {
    "K3N-011": CheckpointRule(CHECKPOINT_TEST, _block_fp8_not_whole_blocks,
                              "vLLM 0.33.0 would load this block-FP8 draft's merged context-KV weight with block "
                              "scales misplaced (its per-layer width is not a multiple of 128): some layers' context "
                              "KV would come from wrongly scaled rows"),
    "K3N-012": CheckpointRule(CHECKPOINT_TEST, _nvfp4_per_layer_scales,
                              "vLLM 0.33.0 would keep one per-tensor scale for this NVFP4 draft's merged context-KV "
                              "weight while its layers carry their own: every layer but one is loaded rescaled"),
}


def _heads_differ(case: KVTransferCase) -> bool:
    per_rank = lambda tp: max(1, case.heads // tp)  # noqa: E731 (refmodel.transfer_plan.KVLayout.heads_per_rank)
    return per_rank(case.src_tp) != per_rank(case.dst_tp)


def incomplete(entries, cases: dict[str, LedgerCase] | None = None) -> list[str]:
    """What each entry's record lacks: a case rule, a reproducer signature, a bug model
    (harness/ledger_models.py) or the reason it has none (tests/test_ledger_models.py holds the ledger to [])."""
    from k3num.harness import ledger_models

    cases = CASES if cases is None else cases
    out = []
    for d in entries:
        c = cases.get(d.id)
        if c is None:
            out.append(f"{d.id}: no case rule in harness/ledger_cases.py")
        elif not c.signature:
            out.append(f"{d.id}: no reproducer signature")
        elif d.id not in ledger_models.MODELS and not c.no_model:
            out.append(f"{d.id}: no bug model and no reason for none (no_model)")
    return out


def reads_the_drawn_case(entry_id: str) -> bool:
    """Whether the entry's rule reads the drawn arguments (not every case, not a call): its tests must run
    what they drew (tests/test_ledger_resolution.py)."""
    c = CASES[entry_id]
    return c.inside is not _every and not c.call


def inside(entry_id: str, drawn: dict[str, Any], calls: dict[str, Any] | None = None) -> bool:
    """Whether a failing example, with these drawn arguments and (`calls`) the view of the last call it made
    to each subject of CALL_VIEWS, is one the entry covers (KeyError: an entry without a rule). An entry
    whose rule reads a call covers no example that never made that call."""
    c = CASES[entry_id]
    if not c.call:
        return bool(c.inside(drawn))
    made = (calls or {}).get(c.call)
    return made is not None and bool(c.inside(made))
