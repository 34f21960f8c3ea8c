"""A known divergence never hides a new one: a failure inside an entry's region is the entry's only where it has
the entry's signature (the exception and the assertion: harness/ledger_cases.py `failures`, default `JUDGED`)
and the entry's bug model explains it; the check compares how the two sides failed, not only that they did;
and a flaky failure is a known race only in a test whose entry is a race. Each demonstration that once came out
known is kept here and now comes out new."""

from __future__ import annotations

import dataclasses

import pandas as pd
import pytest

from k3num.harness import ledger_cases, ledger_run
from k3num.oracles import ledger, pairing

K3N_011_TEST = "test_block_fp8_merged_shards_dequantize_to_the_per_layer_weights"
K3N_009_TEST = "test_attn_res_bank_indices_outside_the_bank_are_refused"


@dataclasses.dataclass(frozen=True)
class _Engine:
    name: str
    subjects: dict = dataclasses.field(default_factory=dict)
    version: str = "0.34.0"
    mode: str = "reference"
    real_ops: str = ""


def _ledgered(test_name: str, raises: BaseException, entry_id: str):
    """A test body named `test_name` that raises `raises`, ledgered under `entry_id` for its engine."""

    def body(engine, **drawn):
        raise raises

    body.__name__ = test_name
    wrapped = ledger_run.ledgered(body)
    entry = ledger.by_id(entry_id)
    wrapped._k3num_entries[entry.engine] = [entry]
    return wrapped, _Engine(entry.engine)


def test_every_entry_has_a_failure_signature_for_each_of_its_tests():
    for d in ledger.LEDGER:
        for test in (d.test, *d.also):
            assert ledger_cases.cases()[d.id].failure_signature(test), (d.id, test)


@pytest.mark.parametrize("entry_id, test, drawn, error", [
    # a TypeError inside K3N-011's region (shards not whole blocks, two layers or more)
    ("K3N-011", K3N_011_TEST, {"layers": 5, "width": 576, "hidden": 256, "data": None, "seed": 0},
     TypeError("unsupported operand type(s) for +: 'Tensor' and 'NoneType'")),
    # an IndexError in K3N-009's test (its region is every case)
    ("K3N-009", K3N_009_TEST, {"bank": 2, "over": 1, "which": "num_blocks", "seed": 0},
     IndexError("index 3 is out of bounds for dimension 1 with size 2")),
    # another assertion in K3N-001's test (a guard band, not the tap's judged mixture)
    ("K3N-001", "test_branch1_tap_mixes_with_the_next_layers_weights_and_blocks", {"case": None},
     AssertionError("guard band changed: 3 of 4096 elements")),
])
def test_a_failure_of_another_kind_inside_an_entrys_region_is_new(entry_id, test, drawn, error):
    body, engine = _ledgered(test, error, entry_id)
    with ledger_run.counting() as known, pytest.raises(type(error)) as raised:
        body(engine=engine, **drawn)
    assert known == []  # not counted known
    assert f"not {entry_id}'s failure" in "\n".join(getattr(raised.value, "__notes__", [])), raised.value


def test_the_entrys_own_failure_inside_its_region_is_known():
    """The control: K3N-009's refusal message, as the property raises it, is the entry's (counted known)."""
    body, engine = _ledgered(K3N_009_TEST, pytest.fail.Exception("vllm accepted num_blocks=3 with a bank of 2 rows"),
                             "K3N-009")
    with ledger_run.counting() as known:
        body(engine=engine, bank=2, over=1, which="num_blocks", seed=0)
    assert known == ["K3N-009"]


def test_the_judged_signature_is_the_records_failure_message():
    import math

    from k3num.oracles import records

    nan = math.nan
    r = records.Record(property="branch1_next_layer_mixture", engine="vllm-rocm", engine_version="0.34.0",
                       mode="source-interpreter", real_ops="", source_sha256="", subject="aux_capture", device="cpu",
                       dtype="bfloat16", shape="2x16", reduction_len=16, seed=3, max_abs=1.0, rel_fro=0.5,
                       max_ulp=nan, cosine=0.9, nonfinite_mismatch=0, worst="", baseline_err=nan, budget=0.01,
                       budget_rule="2u", ratio=100.0, verdict="fail")
    said = f"AssertionError: {records.failure_message(r)}"
    assert ledger_cases.signature_mismatch("K3N-001", "test_a_decided_token_never_flips", said) == ""
    assert "does not match" in ledger_cases.signature_mismatch(
        "K3N-001", "test_a_decided_token_never_flips", "TypeError: " + records.failure_message(r))


def _examples(rows):
    return pd.DataFrame([dict(zip(pairing.EXAMPLE_COLUMNS, r)) for r in rows])


def test_the_check_calls_a_head_failure_of_another_kind_than_the_bases_new():
    found = pairing.outcomes(_examples([
        ("a[vllm]", 1, "fail", "fail", "TypeError: unsupported operand", "AssertionError: differs from", "K3N-011"),
        ("b[vllm]", 1, "fail", "fail", "AssertionError: differs in [0, 64]", "AssertionError: differs from", "K3N-011"),
    ])).set_index("node")
    assert found.loc["a[vllm]", ["new", "known", "status"]].tolist() == [1, 0, "new"]
    assert found.loc["b[vllm]", ["new", "known", "status"]].tolist() == [0, 1, "known"]


def test_a_flaky_failure_passes_the_check_only_in_a_race_entrys_test():
    found = pairing.outcomes(_examples([
        ("r[vllm]", 1, "flaky", "pass", "AssertionError: x", "", "K3N-004"),
        ("n[vllm]", 1, "flaky", "pass", "Failed: x", "", "K3N-009"),
    ])).set_index("node").reset_index()
    no_drift = pairing.paired_drift(pd.DataFrame(columns=list(pairing.RECORD_COLUMNS)))
    assert pairing.exit_code(found[found["node"] == "r[vllm]"], no_drift) == 0  # K3N-004 is a race
    assert pairing.exit_code(found[found["node"] == "n[vllm]"], no_drift) == 1  # K3N-009 is not


def test_a_deterministic_head_failure_is_confirmed_on_the_head_only():
    """A head failure the base passed is rerun on the head HEAD_CONFIRM times (never on the base, whose racy
    reruns once filed a deterministic head bug as known about 79% of the time at K3N-005's rate): a race at the
    highest measured rate (64 of 200 calls) fails all 1 + HEAD_CONFIRM runs with probability below 0.2%."""
    from k3num.harness import pairing_run

    assert (64 / 200) ** (1 + pairing_run.HEAD_CONFIRM) < 0.002


def test_a_checkpoint_inside_an_entry_xfails_only_with_the_entrys_own_exceptions():
    """The checkpoint rule's strict xfail names its exceptions (`raises=`), read from the entry's failure signature
    for the checkpoint test: K3N-011's misplaced rows (AssertionError) or its loader's narrow (RuntimeError)."""
    sig = ledger_cases.cases()["K3N-011"].failure_signature(ledger_cases.CHECKPOINT_TEST)
    assert ledger_cases.exception_types(sig) == (AssertionError, RuntimeError)
    assert ledger_cases.exception_types(ledger_cases.JUDGED) == (AssertionError,)
    assert ledger_cases.exception_types(r"^Failed: DID NOT RAISE") == (pytest.fail.Exception,)
