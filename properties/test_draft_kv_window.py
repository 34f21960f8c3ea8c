"""DSpark's verify-window write: the draft K/V of a window's committed columns, and nothing else.

When the draft has commit lengths, SGLang's `dspark.py` writes the whole verify window in one call
(`fused_kv_norm_rope_write(..., commit_lens=, locs_row_width=)`): `locs` is the flattened [B, row_width]
window of pool slots, and only the first `commit_lens[b]` columns of row b are written (the kernel's
HAS_COMMIT_LENS branch, in place of masking the tail's slots to -1 on the host); a slot < 0 is skipped.

The property is exact: each written slot holds bitwise the row the plain write (`draft_kv_write`, every token
at its own slot, which the accuracy and rounding properties judge) gives that token; every other slot of the
NaN-poisoned pools is untouched. It is drawn where the window's arithmetic can go wrong: rows of any width
(1 included, and widths that are not powers of two), commit lengths from 0 to the full width, slots in any
order, some of them < 0. Engines without the windowed write skip, saying so.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from k3num.fixtures.builders import draft_kv_inputs
from k3num.fixtures.strategies import DraftKVCase, draft_kv_cases
from k3num.harness.judges import EPS
from k3num.properties.support import DEVICE, LOW, assert_bitwise


@st.composite
def window_cases(draw: st.DrawFn) -> tuple[DraftKVCase, list[int], int, list[int], int]:
    """(case, commit_lens [B], row_width, locs [B*row_width] (< 0: skipped), pool slots S)."""
    rows, width = draw(st.integers(1, 4)), draw(st.integers(1, 5))
    case = draw(draft_kv_cases(tokens=st.just(rows * width)))
    commit = draw(st.lists(st.integers(0, width), min_size=rows, max_size=rows))
    slots = rows * width + draw(st.integers(0, 3))
    order = draw(st.permutations(range(slots)))[: rows * width]
    skipped = draw(st.lists(st.booleans(), min_size=rows * width, max_size=rows * width))
    locs = [-1 if s else loc for loc, s in zip(order, skipped)]
    return case, commit, width, locs, slots


@given(window=window_cases())
def test_verify_window_writes_exactly_the_committed_columns_of_each_row(engine, window) -> None:
    case, commit, row_width, locs, slots = window
    write_window = engine.extras.get("draft_kv_window_write")
    write_rows = engine.extras.get("draft_kv_write")
    if write_window is None or write_rows is None:
        pytest.skip(f"{engine.name} {engine.version}: no windowed draft K/V write bound (draft_kv_window_write)")
    inp = draft_kv_inputs(case, LOW, DEVICE)
    width = case.kv_heads * case.head_dim
    kv = torch.cat([torch.cat([torch.nn.functional.linear(inp.ctx, inp.k_weight[i]),
                               torch.nn.functional.linear(inp.ctx, inp.v_weight[i])], dim=-1)
                    for i in range(case.num_layers)], dim=-1).contiguous()
    k_rows, v_rows = write_rows(kv, inp.k_norm, inp.positions, case.rope, EPS, case.num_layers, width)
    poison = float("nan")
    k_pools = [torch.full((slots, width), poison, dtype=LOW, device=DEVICE) for _ in range(case.num_layers)]
    v_pools = [torch.full((slots, width), poison, dtype=LOW, device=DEVICE) for _ in range(case.num_layers)]
    want_k = torch.full((case.num_layers, slots, width), poison, dtype=LOW)
    want_v = want_k.clone()
    for t, loc in enumerate(locs):
        if loc >= 0 and t % row_width < commit[t // row_width]:
            want_k[:, loc] = k_rows[:, t].reshape(case.num_layers, width).cpu()
            want_v[:, loc] = v_rows[:, t].reshape(case.num_layers, width).cpu()
    write_window(kv, inp.k_norm, inp.positions, case.rope, EPS, case.num_layers, width,
                 torch.tensor(locs, dtype=torch.int64, device=DEVICE),
                 torch.tensor(commit, dtype=torch.int32, device=DEVICE), row_width, k_pools, v_pools)
    what = f"{engine.name} {engine.version} commit_lens={commit} row_width={row_width} locs={locs}"
    assert_bitwise(torch.stack(k_pools).cpu(), want_k, f"{what}: K pools")
    assert_bitwise(torch.stack(v_pools).cpu(), want_v, f"{what}: V pools")
