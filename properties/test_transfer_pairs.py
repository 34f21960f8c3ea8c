"""Prefill/decode transfer-entry pairing by layer id (SGLang `build_transfer_entry_pairs`)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st


def _pairs_fn(engine):
    fn = engine.extras.get("transfer_pairs")
    if fn is None:
        pytest.skip(f"engine {engine.name} {engine.version} has no transfer-entry pairing to check")
    return fn


ids = st.lists(st.integers(0, 9), max_size=12)


@st.composite
def peered_ids(draw: st.DrawFn) -> tuple[list[int], list[int]]:
    """Source ids (repeats allowed: K and V groups share ids) and a shuffled destination holding
    at least every source entry, possibly more (a peer with extra layers)."""
    src = draw(ids)
    dst = draw(st.permutations(src + draw(st.lists(st.integers(0, 12), max_size=4))))
    return src, list(dst)


def _check_pairing(src: list[int], dst: list[int], pairs: list[tuple[int, int]]) -> None:
    assert [i for i, _ in pairs] == list(range(len(src))), "every source entry paired once, in order"
    used = [j for _, j in pairs]
    assert len(used) == len(set(used)), f"a destination entry used twice: {pairs}"
    assert all(src[i] == dst[j] for i, j in pairs), f"pairs with different layer ids: {pairs}"


@given(peers=peered_ids())
def test_pairing_by_layer_id_is_one_to_one_with_matching_ids(engine, peers) -> None:
    fn = _pairs_fn(engine)
    src, dst = peers
    _check_pairing(src, dst, fn(src, dst, len(src), len(dst)))


@given(src=ids, dst=ids)
def test_any_layer_id_lists_give_a_valid_pairing_or_a_clear_error(engine, src, dst) -> None:
    fn = _pairs_fn(engine)
    try:
        pairs = fn(src, dst, len(src), len(dst))
    except RuntimeError as e:
        assert str(e), "the refusal must say why"
        return
    _check_pairing(src, dst, pairs)


@given(src=st.lists(st.integers(0, 9), min_size=2, max_size=8), extra=st.sampled_from([-1, 1, 2]),
       side=st.sampled_from(["src", "dst"]))
def test_metadata_length_mismatch_is_refused(engine, src, extra, side) -> None:
    fn = _pairs_fn(engine)
    n_src, n_dst = len(src) + (extra if side == "src" else 0), len(src) + (extra if side == "dst" else 0)
    with pytest.raises(RuntimeError):  # entries with no (or two) layer ids: refuse, never guess
        fn(src, list(src), n_src, n_dst)


@given(n_src=st.integers(1, 8), n_dst=st.integers(0, 8))
def test_pp_heterogeneous_peers_are_never_paired_positionally(engine, n_src, n_dst) -> None:
    fn = _pairs_fn(engine)
    if n_src == n_dst:
        assert fn([], [], n_src, n_dst) == [(i, i) for i in range(n_src)]
        return
    with pytest.raises(RuntimeError):
        fn([], [], n_src, n_dst)
