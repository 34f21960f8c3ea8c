"""Checks shared by properties/test_context_kv.py and the property modules that reuse them: no test module
imports another, so they live here (moved from test_context_kv.py with their bodies unchanged; a name
another module uses is public)."""

from __future__ import annotations

import torch

from k3num.engines import base
from k3num.engines.mirror import context_kv as eager
from k3num.fixtures.builders import context_kv_inputs, paged_caches, same_views
from k3num.fixtures.strategies import ContextKVCase
from k3num.harness import judges
from k3num.harness.judges import EPS
from k3num.oracles.records import judge
from k3num.properties.support import LOW, assert_bitwise, report, subject


def check_fused_within_budget_of_unfused(engine, case: ContextKVCase, device: str) -> None:
    fused = subject(engine, base.CONTEXT_KV_FUSED)
    inp = context_kv_inputs(case, LOW, device)
    kv_c, k_pe = fused(inp.x, inp.kv_a, inp.norm, inp.positions, case.rope, EPS)
    baseline = eager.context_kv_unfused(inp.x, inp.fused_qkv_a, inp.norm, inp.positions, case.rope, EPS)
    want = judges.fused_context_kv(inp.x, inp.kv_a, inp.norm, inp.positions, case.rope, EPS, baseline)
    for name, out in (("kv_c", kv_c), ("k_pe", k_pe)):
        report(judge(property="fused_within_budget_of_unfused", engine=engine, subject=base.CONTEXT_KV_FUSED,
                     actual=out, reference=want[name].reference, budget=want[name].budget, seed=case.seed,
                     reduction_len=want[name].reduction_len,
                     detail=f"{name};L={case.num_layers};rope={case.rope.style};q_lora={case.q_lora}"))


def check_layer_outputs_follow_their_row_block(engine, case: ContextKVCase, device: str) -> None:
    fused = subject(engine, base.CONTEXT_KV_FUSED)
    inp = context_kv_inputs(case, LOW, device)
    perm = torch.roll(torch.arange(case.num_layers), 1).to(device)  # layer l's rows moved to block perm^-1(l)
    kv_c, k_pe = fused(inp.x, inp.kv_a, inp.norm, inp.positions, case.rope, 1e-5)
    p_c, p_pe = fused(inp.x, inp.kv_a[perm].contiguous(), inp.norm[perm].contiguous(), inp.positions,
                      case.rope, 1e-5)
    assert_bitwise(p_c, kv_c[perm], "kv_c with the layers' row blocks permuted")
    assert_bitwise(p_pe, k_pe[perm], "k_pe with the layers' row blocks permuted")


def check_layer_output_depends_only_on_its_rows(engine, case: ContextKVCase, device: str) -> None:
    fused = subject(engine, base.CONTEXT_KV_FUSED)
    inp = context_kv_inputs(case, LOW, device)
    kv_c, k_pe = fused(inp.x, inp.kv_a, inp.norm, inp.positions, case.rope, 1e-5)
    keep = case.seed % case.num_layers
    w2, n2 = inp.kv_a.clone(), inp.norm.clone()
    others = [i for i in range(case.num_layers) if i != keep]
    w2[others] = (-3.0 * w2[others]).to(w2.dtype)
    n2[others] = (0.5 * n2[others] + 1.0).to(n2.dtype)
    c2, pe2 = fused(inp.x, w2, n2, inp.positions, case.rope, 1e-5)
    assert_bitwise(c2[keep], kv_c[keep], f"kv_c of layer {keep} after changing the other layers")
    assert_bitwise(pe2[keep], k_pe[keep], f"k_pe of layer {keep} after changing the other layers")


def check_no_slot_mapping_writes_nothing(engine, case: ContextKVCase, device: str, layout: str) -> None:
    fused = subject(engine, base.CONTEXT_KV_FUSED)
    inp = context_kv_inputs(case, LOW, device)
    gen = torch.Generator().manual_seed(case.seed)
    caches, buf = paged_caches(case.num_layers, 3, 4, case.width, layout, gen, LOW, device)
    before = buf.clone()
    fused(inp.x, inp.kv_a, inp.norm, inp.positions, case.rope, 1e-5, caches, None)
    assert_bitwise(buf, before, f"{layout} caches after a call without slot mapping")
    skipped = torch.full((case.tokens,), -1, dtype=torch.int64, device=device)
    fused(inp.x, inp.kv_a, inp.norm, inp.positions, case.rope, 1e-5, caches, skipped)
    assert_bitwise(buf, before, f"{layout} caches after a call whose slots are all negative")


def check_cache_slots(engine, case: ContextKVCase, device: str, layout: str) -> None:
    """Each token's [kv_c | k_pe] lands at its slot's block and offset of its layer's cache, in the
    caches' own layout (stacked, or per-layer views of a padded buffer in permuted order), and no
    other element of the buffer they live in changes."""
    fused = subject(engine, base.CONTEXT_KV_FUSED)
    inp = context_kv_inputs(case, LOW, device)
    block_size, num_blocks = 4, -(-2 * case.tokens // 4)
    gen = torch.Generator().manual_seed(case.seed)
    caches, buf = paged_caches(case.num_layers, num_blocks, block_size, case.width, layout, gen, LOW, device)
    before = buf.clone()
    per_layer = case.seed % 2 == 1
    rows = case.num_layers if per_layer else 1
    slots = torch.stack([torch.randperm(num_blocks * block_size, generator=gen)[: case.tokens] for _ in range(rows)])
    slots[:, :: 3] = -1  # every third token skipped
    slots = slots.to(device)
    mapping = slots if per_layer else slots[0]
    kv_c, k_pe = fused(inp.x, inp.kv_a, inp.norm, inp.positions, case.rope, 1e-5, caches, mapping)
    expected = before.clone()
    views = same_views(caches, buf, expected)
    full = slots.expand(case.num_layers, case.tokens)
    for layer in range(case.num_layers):
        s = full[layer]
        keep = s >= 0
        entries = torch.cat([kv_c[layer], k_pe[layer]], dim=-1)[keep]
        views[layer][s[keep] // block_size, s[keep] % block_size] = entries
    assert_bitwise(buf, expected, f"the {layout} caches' buffer after the write")
