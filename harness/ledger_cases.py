"""The part of the input space each ledger entry (oracles/ledger.py) covers, and its reproducer: the machinery.
Each entry's own rule lives in its module, harness/ledger_entries/k3n_NNN.py (`CASES` reads them).

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

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from k3num.engines import base
from k3num.fixtures.strategies import AttnResCase, KVTransferCase

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
    # the signature of a failure inside the region, per test (its name -> a regex searched in "<Exception>:
    # <message>"); a test not named here: JUDGED, the property's own verdict on a judged record. A failure inside
    # the region that does not match (a TypeError, an IndexError, another assertion) is new, whatever its region
    failures: dict[str, str] = field(default_factory=dict)

    def failure_signature(self, test: str) -> str:
        """The regex a failure of `test` inside this entry's region must match to be the entry's."""
        return self.failures.get(test, JUDGED)

    def reproducer_view(self) -> Any:
        """What the rule reads for the reproducer (its drawn arguments, or the call they make)."""
        return AttnResCall.of_case(self.reproducer["case"]) if self.call else self.reproducer


# a judged property's own failure (oracles/records.failure_message): "<property> [<engine> <version>, <mode>]
# <subject> <dtype> <shape> seed=<seed>: ..." raised as an AssertionError by properties/support.report
JUDGED = r"^AssertionError: [\w:.-]+ \[[^\],]+, [^\]]+\] \S+ \S+ \S+ seed=-?\d+: "


def said(e: BaseException) -> str:
    """A failure as the signatures read it: "<Exception>: <message>" (pytest.fail's is "Failed")."""
    return f"{type(e).__name__}: {e}"


def signature_mismatch(entry_id: str, test: str, failure: str) -> str:
    """"" when `failure` ("<Exception>: <message>") matches the entry's failure signature for `test`, else why
    not, naming the entry: the failure is not the entry's, whatever region it fell in."""
    pattern = cases()[entry_id].failure_signature(test)
    if re.search(pattern, failure):
        return ""
    first = failure.strip().splitlines()[0] if failure.strip() else ""
    return (f"not {entry_id}'s failure: {first[:200]!r} does not match its signature for {test} /{pattern}/ "
            "(harness/ledger_cases.py)")


def exception_types(pattern: str) -> tuple[type[BaseException], ...]:
    """The exceptions a failure signature names (each alternative's "^Name:"), for pytest's xfail `raises=`:
    builtins by name, "Failed" as pytest.fail's; () when it names none."""
    import builtins

    import pytest

    named = dict.fromkeys(re.findall(r"\^(\w+):", pattern))
    found = [pytest.fail.Exception if n == "Failed" else getattr(builtins, n, None) for n in named]
    return tuple(t for t in found if isinstance(t, type) and issubclass(t, BaseException))


def every(_: dict[str, Any]) -> bool:
    """The rule of an entry whose finding is that the tested branch itself is wrong: every case is inside."""
    return True


def write_race(call: AttnResCall) -> bool:
    """A bank write inside the mixed rows, no delta (the kernels' barrier is emitted under HAS_DELTA only)."""
    return 0 <= call.block_write_idx < call.num_blocks and not call.with_delta


def delta_race(call: AttnResCall) -> bool:
    """A delta with the 4-source tile: at least two blocks, fewer than 256 tokens."""
    return call.with_delta and call.num_blocks >= 2 and call.tokens < 256


EVERY_TAP = "every case: the branch itself is wrong on ROCm (the tap ignores the stream flag / the stage end)"
EVERY_BANK = "every case: the test draws only bank indices outside the bank, which the wrapper accepts"
# the no_model reasons shared by entries: why the entry's region rule decides alone
RACE_NO_MODEL = ("no finite model explains every raced output (GPU run 112, scripts/collect_write_race.py): 300 "
                 "calls per case on vllm and vllm-rocm; the raced outputs are the mixture whose softmax normalizer "
                 "takes the written row's score from before the store (and, at hidden 128, its values and score "
                 "from before the store in a set of 32-element segments), which explains 61 of 65 distinct "
                 "outputs to bf16's rounding; the other 4 (hidden 32) need a normalizer between the stale and the "
                 "fresh score (partial sums of both), a continuum no enumeration of stale sets covers; so the "
                 "region rule (the call's flags) decides")
REFUSAL_NO_MODEL = "the finding is that no refusal was raised: the signature (the test's own refusal message) is it"


def __getattr__(name: str) -> Any:
    """`CASES` (entry id -> LedgerCase) and `CHECKPOINT_RULES` (entry id -> CheckpointRule): read from the entries'
    own modules (harness/ledger_entries), lazily, as those modules import this one."""
    if name == "CASES":
        return cases()
    if name == "CHECKPOINT_RULES":
        return checkpoint_rules()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def cases() -> dict[str, LedgerCase]:
    """Every entry's case rule, by entry id (harness/ledger_entries)."""
    from k3num.harness import ledger_entries

    return ledger_entries.rules()


def checkpoint_rules() -> dict[str, CheckpointRule]:
    """The entries' rules for a user's own checkpoint (`--checkpoint`), by entry id (harness/ledger_entries)."""
    from k3num.harness import ledger_entries

    return ledger_entries.checkpoint_rules()


@dataclass(frozen=True)
class CheckpointRule:
    """Where an entry's finding reaches a user's own checkpoint (`--checkpoint`): the checkpoint property it
    fails, whether a checkpoint is inside (decided at collection from its config and scales), and what
    that means for the checkpoint, in one line. A checkpoint inside is reported known, naming the entry;
    one outside is judged plainly."""

    test: str
    inside: Callable[[Any], bool]  # fixtures.checkpoint.Checkpoint -> bool
    meaning: str


def block_fp8_not_whole_blocks(c: Any) -> bool:
    """A block-FP8 DSpark draft with a second layer whose per-layer context-KV width is not whole 128-row blocks."""
    g = c.draft_geometry()
    return c.is_draft and c.quant == "fp8" and g.kv_width % 128 != 0 and g.num_layers >= 2


def nvfp4_per_layer_scales(c: Any) -> bool:
    """An NVFP4 DSpark draft whose layers carry their own global scales."""
    if not (c.is_draft and c.quant in ("nvfp4-ct", "nvfp4-modelopt")):
        return False
    key = "weight_global_scale" if c.quant == "nvfp4-ct" else "weight_scale_2"
    scales = {float(c.kv_shard(layer)[key].reshape(-1)[0]) for layer in range(c.draft_geometry().num_layers)}
    return len(scales) > 1


CHECKPOINT_TEST = "test_checkpoint_quantized_shards_load_as_the_per_layer_weights"


def heads_differ(case: KVTransferCase) -> bool:
    """The prefill's and the decode's KV heads per rank differ."""
    per_rank = lambda tp: max(1, case.heads // tp)  # noqa: E731 (refmodel.transfer_plan.KVLayout.heads_per_rank)
    return per_rank(case.src_tp) != per_rank(case.dst_tp)


def incomplete(entries, rules: dict[str, LedgerCase] | None = None) -> list[str]:
    """What each entry's record lacks: a case rule, a reproducer signature, a bug model
    (harness/ledger_models.py) or the reason it has none (tests/test_ledger_models.py holds the ledger to [])."""
    from k3num.harness import ledger_models

    rules = cases() if rules is None else rules
    out = []
    for d in entries:
        c = rules.get(d.id)
        if c is None:
            out.append(f"{d.id}: no case rule (its module in harness/ledger_entries)")
        elif not c.signature:
            out.append(f"{d.id}: no reproducer signature")
        elif d.id not in ledger_models.models() and not c.no_model:
            out.append(f"{d.id}: no bug model and no reason for none (no_model)")
    return out


def reads_the_drawn_case(entry_id: str) -> bool:
    """Whether the entry's rule reads the drawn arguments (not every case, not a call): its tests must run
    what they drew (tests/test_ledger_resolution.py)."""
    c = cases()[entry_id]
    return c.inside is not every and not c.call


def inside(entry_id: str, drawn: dict[str, Any], calls: dict[str, Any] | None = None) -> bool:
    """Whether a failing example, with these drawn arguments and (`calls`) the view of the last call it made
    to each subject of CALL_VIEWS, is one the entry covers (KeyError: an entry without a rule). An entry
    whose rule reads a call covers no example that never made that call."""
    c = cases()[entry_id]
    if not c.call:
        return bool(c.inside(drawn))
    made = (calls or {}).get(c.call)
    return made is not None and bool(c.inside(made))
