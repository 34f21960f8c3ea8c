"""The subject interfaces (one per path) and the Engine that bundles an implementation's subjects.

A subject is a callable with a fixed signature that runs the code under test
in its own precision; an engine declares which subjects it provides and what
it is (name, version, mode, which ops are real, the sha256 of each subject's
source). Properties ask an engine for a subject by name; a missing one skips
the test with a reason naming the engine and the subject.

Subject signatures (tensors in the engine's dtype, bf16 unless stated; typed, with each subject's K3 path
and oracle, in engines/subjects.py):
- CONTEXT_KV_FUSED(context_states [N,H], kv_a_weight [L,W,H], kv_norm_weight [L,kv_lora],
  positions [N] int, rope: RopeSpec, eps, caches [L,NB,BS,W] | list of L [NB,BS,W] | None,
  slot_mapping [N] | [L,N] | None) -> (kv_c [L,N,kv_lora], k_pe [L,N,W-kv_lora]);
  caches written in place at the slots (None: compute only); a list holds each layer's own
  cache, with any strides and any placement in memory (vLLM's pointer array).
- CONTEXT_KV_UNFUSED(context_states, fused_qkv_a_weight [L,Q+W,H], kv_norm_weight,
  positions, rope, eps) -> (kv_c, k_pe): per layer the full projection, Q discarded.
- ATTN_RES(prefix [T,H], delta [T,H] | None, blocks [T,NB,H], norm_weight [H],
  qk_weight [H], output_norm_weight [H] | None, num_blocks, block_write_idx, eps,
  output_norm_eps) -> output [T,H]; prefix and blocks updated in place (BRIEF §2).
- AUX_CAPTURE(layer_idx, prefix_sum [T,H], pending [T,H] | None, bank [T,NB,H], *,
  enabled, weights: AttnResWeights | None, block_size, end_layer, num_layers,
  is_last_rank, eps, non_final_stage) -> tap [T,H].
- STAGE_PARTIAL(taps [K,N,H], fc_weight [H_out,K*H], members: list[int]) -> [N,H_out]:
  one PP stage's projection of its own taps (no norm).
- FINALIZE_PROJECTION(partials: list of [N,H_out], norm_weight [H_out], eps,
  transfer_dtype, order: list[int]) -> ctx [N,H_out]: partials summed in the
  transfer dtype in `order`, then the norm, once.
- PROJECT_UNSHARDED(taps, fc_weight, norm_weight, eps) -> ctx: the one-stage baseline.
- DRAFT_CONTEXT_KV(ctx [N,H], k_weight [L,KVH*D,H], v_weight [L,KVH*D,H],
  k_norm_weight [L,D], positions [N], rope, eps) -> (k, v) [L,N,KVH,D].
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

CONTEXT_KV_FUSED = "context_kv_fused"
CONTEXT_KV_UNFUSED = "context_kv_unfused"
ATTN_RES = "attn_res"
AUX_CAPTURE = "aux_capture"
STAGE_PARTIAL = "stage_partial"
FINALIZE_PROJECTION = "finalize_projection"
PROJECT_UNSHARDED = "project_unsharded"
DRAFT_CONTEXT_KV = "draft_context_kv"
# the read-only pre-norm AttnRes mixture (SGLang's aggregate_stream family):
# (prefix [T,H], bank [T,NB,H], nvb, norm_weight [H], proj_weight [H], eps) -> mixture [T,H]
ATTN_RES_MIX = "attn_res_mix"  # the public entry point (dispatches on shape and platform)
ATTN_RES_MIX_TRITON = "attn_res_mix_triton"  # the Triton score + combine kernels
ATTN_RES_MIX_EAGER = "attn_res_mix_eager"  # the eager PyTorch reference of the engine
# the model-level aggregation point (SGLang's AttnResidual.forward): (prefix [T,H], bank [T,NB,H], nvb,
# norm_weight [H], proj_weight [H], out_norm_weight [H], eps) -> out_norm(mixture) [T,H]; the bank's
# first nvb rows are inherited (as from the previous PP rank), the rest are not read
ATTN_RES_RESIDUAL = "attn_res_residual"


def __getattr__(name: str) -> Any:
    """`SUBJECTS`: every subject's name, in its record's order (engines/subjects.py `SUBJECT_RECORDS`): a subject
    is named once, in its record, and read here lazily (the records import this module's names)."""
    if name == "SUBJECTS":
        from k3num.engines.subjects import SUBJECT_RECORDS

        return tuple(SUBJECT_RECORDS)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


Subject = Callable[..., Any]


@dataclass(frozen=True)
class PPTapPlan:
    """The plan of extras["pp_taps"] (the aux taps across pipeline-parallel stages):
    (plan, embeddings [T,H], weights: AttnResWeights, layer_scale [L,H], eps) -> the taps the last
    stage hands the draft, in order (list of [T,H]); StageRefused when the engine refuses the plan.

    num_layers decoder layers; taps: aux tap ids (t = the stream after layer t - 1; 0 = the
    embeddings); stage_ends: the stage boundaries, e.g. (3, 5) for stages [0,3) [3,5) [5,L) (empty:
    one stage); block_size: the AttnRes block size; aux_stream: VLLM_KIMI_K3_AUX_ATTN_RES_STREAM (taps
    mixed with the consuming layer's weights) or prefix taps."""

    num_layers: int
    taps: tuple[int, ...]
    stage_ends: tuple[int, ...]
    block_size: int
    aux_stream: bool

    def stages(self) -> list[tuple[int, int]]:
        cuts = [0, *self.stage_ends, self.num_layers]
        return list(zip(cuts[:-1], cuts[1:]))


class StageRefused(RuntimeError):
    """The engine refused a PP plan while setting it up (its own check, with its message)."""


class SubjectMissing(LookupError):
    """The engine does not provide this subject (the reason says why)."""


@dataclass(frozen=True, repr=False)
class Engine:
    """An implementation under test.

    mode: how its code runs ("reference" for our mirror; "import", "source-gpu",
    "source-interpreter", "source-lifted" for real engines; supply.installed says
    when import mode is taken). mode_note: why a real engine is not in import mode
    ("" when it is, or for the mirror). real_ops: which compiled ops were the
    engine's own and which were stand-ins ("" when none are involved). source_sha256: subject name ->
    sha256 of the source file it came from. missing: subject name -> why it is
    not provided (so a skip always carries a reason).
    """

    name: str
    version: str
    mode: str
    subjects: dict[str, Subject]
    real_ops: str = ""
    source_sha256: dict[str, str] = field(default_factory=dict)
    missing: dict[str, str] = field(default_factory=dict)
    # float32 -> storage-dtype rounding the engine's platform performs (None: round to nearest
    # even, as torch and the GPU do); the Triton interpreter truncates instead (BRIEF §4 quirk a)
    storage_rounding: Callable[[Any], Any] | None = None
    rounding: str = "nearest"  # the mode of storage_rounding, for oracles.budgets.unit_roundoff
    # engine-specific contracts and facts outside the subject interfaces (e.g. vLLM's weight loading):
    # engines/subjects.py Capabilities, given as one or as a dict of its field names (converted, and an
    # undeclared name refused, when the engine is built)
    extras: Any = field(default_factory=dict)
    mode_note: str = ""

    def __post_init__(self) -> None:
        from k3num.engines import subjects  # the records import this module's names

        object.__setattr__(self, "extras", subjects.Capabilities.of(self.name, self.extras))

    def __repr__(self) -> str:
        """One line (name, version, mode): hypothesis prints the engine in every falsifying example."""
        return f"Engine({self.name} {self.version}, {self.mode})"

    def _repr_pretty_(self, printer, cycle: bool) -> None:  # noqa: ANN001  (hypothesis' pretty printer)
        printer.text(repr(self))

    def subject(self, name: str) -> Subject:
        known = __getattr__("SUBJECTS")
        if name not in known:
            raise ValueError(f"subject: unknown name {name!r}; known: {list(known)}")
        try:
            return self.subjects[name]
        except KeyError:
            why = self.missing.get(name, "not implemented by this engine")
            raise SubjectMissing(f"engine {self.name} {self.version} has no subject {name}: {why}") from None

    def provides(self, name: str) -> bool:
        return name in self.subjects
