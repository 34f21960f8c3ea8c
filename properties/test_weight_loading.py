"""The weight-loading contract of the fused context-KV projection (vLLM), over arbitrary name streams."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from k3num.fixtures.strategies import checkpoint_streams
from k3num.oracles import weight_contract as contract
from k3num.oracles.drift import COLLECTOR
from k3num.oracles.records import INFO, Record

NUM_LAYERS = 5  # K3 DSpark


def _loading(engine):
    loading = engine.extras.get("weight_loading")
    if loading is None:
        pytest.skip(f"engine {engine.name} {engine.version} has no weight-loading contract to check")
    return loading


def _stream(names: list[str]) -> list[tuple[str, torch.Tensor]]:
    return [(n, torch.full((2, 3), float(i))) for i, n in enumerate(names)]


@given(names=checkpoint_streams(NUM_LAYERS))
def test_every_original_is_yielded_unchanged_and_in_order(engine, names: list[str]) -> None:
    loading = _loading(engine)
    stream = _stream(names)
    out = list(loading.duplicate(iter(stream), NUM_LAYERS))
    originals = [(n, t) for n, t in out if not n.startswith("context_kv_proj.")]
    assert [n for n, _ in originals] == names
    assert all(t is s for (_, t), (_, s) in zip(originals, stream)), "an original tensor was replaced"


@given(names=checkpoint_streams(NUM_LAYERS))
def test_exactly_one_copy_follows_each_in_range_kv_tensor_with_its_layer_as_shard_id(engine, names) -> None:
    loading = _loading(engine)
    out = list(loading.duplicate(iter(_stream(names)), NUM_LAYERS))
    got = [(n, getattr(t, "shard_id", None) if n.startswith("context_kv_proj.") else None) for n, t in out]
    assert got == contract.expected_duplicated(names, NUM_LAYERS)


@given(names=checkpoint_streams(NUM_LAYERS))
def test_each_copy_shares_storage_with_its_original_but_is_a_distinct_tensor(engine, names) -> None:
    loading = _loading(engine)
    out = list(loading.duplicate(iter(_stream(names)), NUM_LAYERS))
    for (name, t), nxt in zip(out, out[1:] + [("", None)]):
        if contract.kv_layer(name, NUM_LAYERS) is None:
            continue
        copy_name, copy = nxt
        assert copy_name.startswith("context_kv_proj.") and copy is not None
        assert copy is not t, f"{copy_name} is the original tensor object"
        assert copy.data_ptr() == t.data_ptr(), f"{copy_name} does not share the original's storage"


@given(names=checkpoint_streams(NUM_LAYERS))
def test_mapped_names_and_shard_ids_are_what_the_loader_expects(engine, names: list[str]) -> None:
    loading = _loading(engine)
    dup = list(loading.duplicate(iter(_stream(names)), NUM_LAYERS))
    want = []
    for (name, copy_shard) in contract.expected_duplicated(names, NUM_LAYERS):
        m = contract.expected_mapped(name, copy_shard)
        if m is not None:
            want.append(m)
    mapped = list(loading.mapper.apply(iter(dup)))
    got = [(n, getattr(t, "shard_id", None)) for n, t in mapped]
    assert got == want


@given(missing=st.integers(0, NUM_LAYERS - 1), param=st.sampled_from(["weight", "weight_packed"]))
def test_harness_reports_a_checkpoint_missing_a_layers_shard(engine, missing: int, param: str) -> None:
    loading = _loading(engine)
    names = [f"layers.{i}.self_attn.kv_a_proj_with_mqa.{param}" for i in range(NUM_LAYERS)]
    for dropped in (None, missing):
        stream = [n for i, n in enumerate(names) if i != dropped]
        mapped = [(n, getattr(t, "shard_id", None))
                  for n, t in loading.mapper.apply(loading.duplicate(iter(_stream(stream)), NUM_LAYERS))]
        holes = contract.missing_layers(mapped, NUM_LAYERS, param)
        assert holes == ([] if dropped is None else [dropped])
    COLLECTOR.add(Record(
        property="checkpoint_missing_layer_shard", engine=engine.name, engine_version=engine.version,
        mode=engine.mode, real_ops=engine.real_ops, source_sha256="", subject="weight_loading", device="cpu",
        dtype="", shape=f"layers={NUM_LAYERS}", reduction_len=0, seed=missing, max_abs=0.0, rel_fro=0.0,
        max_ulp=0.0, cosine=1.0, nonfinite_mismatch=0, worst="", baseline_err=float("nan"), budget=float("nan"),
        budget_rule="exact", ratio=0.0, verdict=INFO,
        detail=f"the engine loads without layer {missing}'s context_kv_proj.{param}; the harness reports it",
    ))
