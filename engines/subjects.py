"""One record per subject and per capability: what the harness knows about each name an engine binds.

A subject (engines/base.py `SUBJECTS`) is a callable every engine may bind under one signature; a
capability is a name in `Engine.extras`: a contract under test that only some engines have (vLLM's weight
loader, a PP forward loop, the KV transfer) or a fact an adapter declares about its subjects (the
roundings it performs, a precondition it admits). Each record says:
- `path`: the K3 path it belongs to ("1" the MLA context KV, "2" AttnRes and the aux tap, "3" the partial
  projection and what follows it; "-" a fact that belongs to no path): the coverage table's column
  (harness/coverage.py reads PATH_OF from here);
- subjects: `signature`, the typed call (a Protocol; shapes in its docstring) and `oracle`, the entry point
  of harness/oracle.py's `Oracle` the subject is judged against;
- capabilities: `kind` ("contract": a callable the properties judge; "fact": data the judges read) and
  `what` (its type and meaning).

`Capabilities` is the typed record of an engine's capabilities (`Engine.extras`): one optional field per
name, with its kind, path and meaning as the field's metadata, from which CAPABILITIES is read. An Engine
given a name no field declares is refused when it is built (base.Engine), so the vocabulary is this table
and nothing else. Tests: tests/test_subject_table.py.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field, fields
from typing import Any, Protocol

import torch

from k3num.engines import base


class ContextKVFused(Protocol):
    def __call__(self, context_states: torch.Tensor, kv_a_weight: torch.Tensor, kv_norm_weight: torch.Tensor,
                 positions: torch.Tensor, rope: Any, eps: float, caches: Any = None,
                 slot_mapping: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """context_states [N,H], kv_a_weight [L,W,H], kv_norm_weight [L,kv_lora], positions [N] ->
        (kv_c [L,N,kv_lora], k_pe [L,N,W-kv_lora]); caches [L,NB,BS,W] or a list of L [NB,BS,W] written at
        slot_mapping [N] or [L,N] (None: compute only)."""
        ...


class ContextKVUnfused(Protocol):
    def __call__(self, context_states: torch.Tensor, fused_qkv_a_weight: torch.Tensor,
                 kv_norm_weight: torch.Tensor, positions: torch.Tensor, rope: Any,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """As ContextKVFused with fused_qkv_a_weight [L,Q+W,H] (the Q rows discarded) and no cache."""
        ...


class AttnRes(Protocol):
    def __call__(self, prefix: torch.Tensor, delta: torch.Tensor | None, blocks: torch.Tensor,
                 norm_weight: torch.Tensor, qk_weight: torch.Tensor, output_norm_weight: torch.Tensor | None,
                 num_blocks: int, block_write_idx: int, eps: float, output_norm_eps: float) -> torch.Tensor:
        """prefix [T,H], delta [T,H] | None, blocks [T,NB,H] -> output [T,H]; prefix and blocks updated in
        place (BRIEF §2)."""
        ...


class AuxCapture(Protocol):
    def __call__(self, layer_idx: int, prefix_sum: torch.Tensor, pending: torch.Tensor | None,
                 bank: torch.Tensor, *, enabled: bool, weights: Any, block_size: int, end_layer: int,
                 num_layers: int, is_last_rank: bool, eps: float, non_final_stage: str = ...) -> torch.Tensor:
        """prefix_sum, pending [T,H], bank [T,NB,H] -> the tap [T,H]."""
        ...


class StagePartial(Protocol):
    def __call__(self, taps: torch.Tensor, fc_weight: torch.Tensor, members: list[int]) -> torch.Tensor:
        """taps [K,N,H], fc_weight [H_out,K*H] -> one PP stage's projection of its own taps [N,H_out] (no norm)."""
        ...


class FinalizeProjection(Protocol):
    def __call__(self, partials: list[torch.Tensor], norm_weight: torch.Tensor, eps: float,
                 transfer_dtype: torch.dtype, order: list[int]) -> torch.Tensor:
        """partials: [N,H_out] each, summed in transfer_dtype in `order`, then the norm once -> ctx [N,H_out]."""
        ...


class ProjectUnsharded(Protocol):
    def __call__(self, taps: torch.Tensor, fc_weight: torch.Tensor, norm_weight: torch.Tensor,
                 eps: float) -> torch.Tensor:
        """taps [K,N,H], fc_weight [H_out,K*H], norm_weight [H_out] -> ctx [N,H_out] (the one-stage baseline)."""
        ...


class DraftContextKV(Protocol):
    def __call__(self, ctx: torch.Tensor, k_weight: torch.Tensor, v_weight: torch.Tensor,
                 k_norm_weight: torch.Tensor, positions: torch.Tensor, rope: Any,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """ctx [N,H], k_weight, v_weight [L,KVH*D,H], k_norm_weight [L,D], positions [N] -> (k, v)
        [L,N,KVH,D]."""
        ...


class AttnResMix(Protocol):
    def __call__(self, prefix: torch.Tensor, bank: torch.Tensor, nvb: int, norm_weight: torch.Tensor,
                 proj_weight: torch.Tensor, eps: float) -> torch.Tensor:
        """prefix [T,H], bank [T,NB,H] (its first nvb rows read) -> the read-only pre-norm mixture [T,H]."""
        ...


class AttnResResidual(Protocol):
    def __call__(self, prefix: torch.Tensor, bank: torch.Tensor, nvb: int, norm_weight: torch.Tensor,
                 proj_weight: torch.Tensor, out_norm_weight: torch.Tensor, eps: float) -> torch.Tensor:
        """As AttnResMix, then the output norm -> [T,H] (SGLang's AttnResidual.forward)."""
        ...


@dataclass(frozen=True)
class SubjectRecord:
    """A subject's facts, named once: `SUBJECT_RECORDS` is the vocabulary (engines/base.py `SUBJECTS` reads its
    keys, so a new subject is a name here and nowhere else below the properties)."""
    name: str
    path: str
    signature: type
    oracle: str  # the harness/oracle.py Oracle entry point it is judged against
    # the properties whose repro bundles of this subject `k3num replay` judges with this harness's oracle and
    # budget (harness/judges.py REPLAYABLE says how, per property); a bundle of another property is replayed
    # against its recorded budget only (harness/repro.py)
    replays: tuple[str, ...] = ()
    # why the DSpark/DFlash draft step (`k3num impact`) does not call it, or "" where the step does (a drafter's
    # PATHS or a composed row in harness/draft_step.py): harness/draft_step.py `reach` refuses a bound subject
    # with neither, so none is silently absent from the token-level judgement
    not_in_step: str = ""


_ATTN_RES_REPLAYS = ("attn_res_within_rounding_budget", "written_block_mixed_with_written_value",
                     "checkpoint_attn_res_within_rounding_budget", "poisoned_output_fully_written",
                     "off_path_shape_within_budget")
_MIX_REPLAYS = ("read_only_mixture_within_rounding_budget", "off_path_shape_within_budget")
# in the order the subjects were first named (base.SUBJECTS iterates it: parametrizations keep their order)
SUBJECT_RECORDS: dict[str, SubjectRecord] = {r.name: r for r in (
    SubjectRecord(base.CONTEXT_KV_FUSED, "1", ContextKVFused, "context_kv", ("fused_within_budget_of_unfused",)),
    SubjectRecord(base.CONTEXT_KV_UNFUSED, "1", ContextKVUnfused, "context_kv", ("unfused_within_rounding_budget",)),
    SubjectRecord(base.ATTN_RES, "2", AttnRes, "attn_res_with_sources", _ATTN_RES_REPLAYS,
                  not_in_step="the engine binds no aux tap to call it (the step's path 2 is the tap)"),
    SubjectRecord(base.AUX_CAPTURE, "2", AuxCapture, "capture_aux_stream"),
    SubjectRecord(base.STAGE_PARTIAL, "3", StagePartial, "project_context",
                  not_in_step="the engine binds no finalize_projection to sum its stages with"),
    SubjectRecord(base.FINALIZE_PROJECTION, "3", FinalizeProjection, "project_context",
                  not_in_step="the engine binds no stage_partial to give it partials"),
    SubjectRecord(base.PROJECT_UNSHARDED, "3", ProjectUnsharded, "project_context",
                  ("unsharded_within_rounding_budget",)),
    SubjectRecord(base.DRAFT_CONTEXT_KV, "3", DraftContextKV, "draft_context_kv", ("draft_kv_within_rounding_budget",)),
    SubjectRecord(base.ATTN_RES_MIX, "2", AttnResMix, "attn_res_with_sources", _MIX_REPLAYS,
                  not_in_step="the engine binds its own aux tap, which the step's path 2 runs"),
    SubjectRecord(base.ATTN_RES_MIX_TRITON, "2", AttnResMix, "attn_res_with_sources", _MIX_REPLAYS,
                  not_in_step="the engine's public mixture entry (attn_res_mix) is not composed into a tap here"),
    SubjectRecord(base.ATTN_RES_MIX_EAGER, "2", AttnResMix, "attn_res_with_sources", _MIX_REPLAYS,
                  not_in_step="the eager reference: the model's dispatch takes it off the 1024 grid only, and K3's "
                              "hidden 7168 is on it (the mixture-tap rows run the dispatch at hidden 1024)"),
    SubjectRecord(base.ATTN_RES_RESIDUAL, "2", AttnResResidual, "attn_res_with_sources",
                  ("off_path_shape_within_budget",),
                  not_in_step="the model's aggregation point; it reaches the step only through the unwritten "
                              "layer input case class (`k3num impact --ledger`, SGLang's off-grid hidden)"),
)}


def replays(subject: str, prop: str) -> bool:
    """Whether `k3num replay` judges a bundle of `prop` on `subject` with this harness's oracle and budget."""
    record = SUBJECT_RECORDS.get(subject)
    return record is not None and prop in record.replays


@dataclass(frozen=True)
class Capability:
    name: str
    kind: str  # "contract" | "fact"
    path: str
    what: str


def _cap(kind: str, path: str, what: str) -> Any:
    return field(default=None, metadata={"kind": kind, "path": path, "what": what})


@dataclass(frozen=True, eq=False)
class Capabilities(Mapping[str, Any]):
    """An engine's capabilities (`Engine.extras`): one typed, optional field per capability (None: the engine
    does not have it). Read as a mapping of the ones it has: `extras["kv_transfer"]`, `extras.get(...)`,
    `name in extras`; a name no field declares is refused when the engine is built."""

    weight_loading: Any = _cap("contract", "1", "vLLM's merged context-KV weight loader (a namespace of callables)")
    block_fp8_loading: Callable[..., Any] | None = _cap("contract", "1",
                                                        "the FP8 block-scale loader of the merged projection")
    merged_loading_tp: Callable[..., Any] | None = _cap(
        "contract", "1", "a merged column-parallel layer's unquantized weight loaded on one TP rank of several")
    nvfp4_loading: Callable[..., Any] | None = _cap("contract", "1", "the compressed-tensors NVFP4 loader")
    nvfp4_modelopt_loading: Callable[..., Any] | None = _cap("contract", "1", "ModelOpt's NVFP4 loader")
    context_kv_ops: Any = _cap("contract", "1", "the context-KV ops one by one (engines.standins.ContextKVOps)")
    draft_config: Any = _cap("contract", "1", "a draft's own cache configuration on K3: the dense MLA draft's "
                                              "backend and fp8 cache by default, a GQA draft's page fitting and "
                                              "grouping (engines/mirror/draft_config.py)")
    markov_steps: Any = _cap("contract", "3", "the DSpark drafter's sequential Markov draft steps after path 3's "
                                              "context: fused, its own loop and its sampler "
                                              "(engines/mirror/markov.py)")
    mla_epilogue: Any = _cap("contract", "1", "the MLA layer's fused prefill epilogue: RoPE, key concat, latent cache "
                                              "insert, bf16 and fp8 (engines.standins.MlaEpilogue)")
    tap_owner: Callable[..., Any] | None = _cap("contract", "2", "which PP stage captures each aux tap")
    pp_taps: Callable[..., Any] | None = _cap("contract", "2", "the PP forward loop's taps (base.PPTapPlan)")
    capture_split: Callable[..., Any] | None = _cap("contract", "2", "which layers decline a fused AttnRes graph "
                                                                    "because they produce a captured tap")
    transfer_pairs: Callable[..., Any] | None = _cap("contract", "3",
                                                     "the draft-KV transfer's (sender, receiver) pairs")
    kv_transfer: Any = _cap("contract", "3", "the released KV transfer on synthetic pointers")
    draft_kv_materialize: Callable[..., Any] | None = _cap("contract", "3",
                                                           "the draft KV written from the projected context")
    project_unsharded_fc_norm: Callable[..., Any] | None = _cap("contract", "3",
                                                                "the unsharded projection with its norm as one call")
    segmented_rmsnorm: Callable[..., Any] | None = _cap("contract", "3", "the per-segment RMSNorm of the taps")
    fused_kv_norm_rope_write: Callable[..., Any] | None = _cap("contract", "3",
                                                               "SGLang's fused K norm, RoPE and cache write")
    context_proj_tp: Callable[..., Any] | None = _cap(
        "contract", "3", "the draft's context projection as one TP rank builds it (column-parallel, all-gathered)")
    draft_kv_write: Callable[..., Any] | None = _cap("contract", "3", "that write on given K/V rows, read back from "
                                                                      "its pools (the draft K/V rounding contract)")
    draft_kv_window_write: Callable[..., Any] | None = _cap(
        "contract", "3", "that write on a verify window: the first commit_lens[b] slots of each row, into given pools")
    pp_taps_hidden: bool | None = _cap("fact", "-", "bool: pp_taps also returns what the last stage hands on")
    pp_taps_standins: str | None = _cap("fact", "-", "str: which compiled ops pp_taps runs as stand-ins")
    attn_res_admits: Callable[[int, int, int], bool] | None = _cap(
        "fact", "-", "(num_blocks, block_write_idx, bank) -> bool: the engine's precondition on an AttnRes call")
    attn_res_roundings: dict[str, Any] | None = _cap("fact", "-", "dict: the roundings the engine's AttnRes performs")
    projection_roundings: dict[str, Any] | None = _cap("fact", "-",
                                                       "dict: the roundings of the stage partials it returns")
    aux_capture_owner_stage: bool | None = _cap("fact", "-", "bool: the aux tap is taken on its owner stage")
    attn_res_tiling: Callable[[int, int], str] | None = _cap(
        "fact", "-", "(tokens, num_blocks) -> the tiling its AttnRes call takes: rows are bitwise batch-invariant "
                     "between calls of one tiling (none declared: between any two calls)")
    batch_variant: dict[str, Callable[[int, int], str]] | None = _cap(
        "fact", "-", "dict: subject -> (tokens, batch tokens) -> why a call of that many rows takes another code path "
                     "than the batch's (\"\": the same path); a subject not named claims bitwise batch invariance")
    aux_capture_takes_pending: bool | None = _cap("fact", "-", "bool: whether its model takes the aux tap with the "
                                                  "pending MLP output (False: of the running prefix sum alone)")
    logit_dtype: dict[str, Any] | None = _cap("fact", "-",
                                              "dict: subject -> the dtype (or a rule) of its mixture's logits")
    kv_transfer_missing: str | None = _cap("fact", "-", "str: why kv_transfer is not bound")

    @classmethod
    def of(cls, engine: str, given: Mapping[str, Any]) -> Capabilities:
        """`given` (a dict, or Capabilities) as Capabilities; ValueError naming any name no field declares."""
        if isinstance(given, Capabilities):
            return given
        unknown = sorted(set(given) - set(CAPABILITIES))
        if unknown:
            raise ValueError(f"engine {engine}: extras {unknown} are not declared capabilities "
                             f"(engines/subjects.py Capabilities; known: {sorted(CAPABILITIES)})")
        return cls(**given)

    def __getitem__(self, name: str) -> Any:
        value = getattr(self, name) if name in CAPABILITIES else None
        if value is None:
            raise KeyError(name)
        return value

    def __iter__(self) -> Iterator[str]:
        return (n for n in CAPABILITIES if getattr(self, n) is not None)

    def __len__(self) -> int:
        return sum(1 for _ in self)


def gemm_by_row_count(tokens: int, batch: int) -> str:
    """A `batch_variant` rule: the subject's GEMM (torch.matmul / linear, on the CPU and under cuBLAS) picks its
    kernel and blocking by the row count, so a call of another row count may round a row's dot products in
    another order; two calls of one row count take one kernel (the rows at other positions stay bitwise)."""
    return "" if tokens == batch else f"the GEMM picks its kernel by the row count ({tokens} rows against {batch})"


def batched_matmul_by_position(tokens: int, batch: int) -> str:
    """A `batch_variant` rule: a batched torch matmul over [T, S, H] whose CPU kernel vectorises across the
    batch's rows, so a row's reduction depends on its place in the batch and on the batch's size."""
    return f"a batched matmul over the batch ({tokens} rows against {batch}): a row's reduction moves with its place"


# the capability records, read off the fields (coverage's path column, the docs)
CAPABILITIES: dict[str, Capability] = {f.name: Capability(f.name, **f.metadata) for f in fields(Capabilities)}

# subject or capability -> its K3 path (the coverage table's column)
PATH_OF: dict[str, str] = {**{n: r.path for n, r in SUBJECT_RECORDS.items()},
                           **{n: c.path for n, c in CAPABILITIES.items() if c.path != "-"}}
