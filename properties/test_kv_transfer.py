"""The draft-KV transfer between a prefill and a decode of other TP sizes (seed 003): SGLang's released
KV path (engines/sglang_adapter/transfer.py, lifted from mooncake/conn.py and run on synthetic pointers with a
recording transfer function) against refmodel/transfer_plan.py's head-aware plan.

The statement: for any prefill/decode TP sizes, KV heads, page size, page layout, PP stage and layer
ids, the copies a sender plans for the decode rank it serves are exactly the head-aware plan's
(every byte to its address, nothing else), or the transfer is refused, writing nothing. Both ways the
decode's item lengths can reach the sender are drawn: not published (the worker's `send_kvcache`, given
only `dst_kv_item_len`) and published (`dst_item_lens`). The worker's routing rule picks the path:
the target (K3) is MLA, so the manager is an MLA backend.
"""

from __future__ import annotations

import pytest
from hypothesis import example, given

from k3num.fixtures.strategies import SEED_003_TRANSFER, KVTransferCase, kv_transfer_cases
from k3num.harness import judges, ledger_models, ledger_run


def _transfer(engine):
    kv = engine.extras.get("kv_transfer")
    if kv is None:
        why = engine.extras.get("kv_transfer_missing", "not implemented by this engine")
        pytest.skip(f"engine {engine.name} {engine.version} has no KV transfer to check: {why}")
    return kv


def _send(kv, case: KVTransferCase):
    """What the sender does for `case`: (route, Sent)."""
    route = kv.route(True, False, case.src_tp, case.dst_tp)
    s, d = judges.transfer_sender(case), case.dst_rank
    src, dst = judges.transfer_layouts(case, 0)
    ids = list(case.stage) if case.publish_ids else None
    manager = kv.manager(pp_size=1 if len(case.stage) == case.layers else 2, is_mla=True,
                         prefill_start_layer=case.stage[0])
    sent = manager.send([judges.transfer_buffer("src", s, layer) for layer in case.stage], [src.page_bytes] * len(
        case.stage), ids, [judges.transfer_buffer("dst", d, layer) for layer in range(case.layers)],
        list(range(case.layers)) if case.publish_ids else None, list(case.src_pages), list(case.dst_pages),
        dst_kv_item_len=dst.page_bytes, dst_item_lens=[dst.page_bytes] * case.layers if case.publish_lens else None)
    return route, sent


@given(case=kv_transfer_cases())
@example(case=SEED_003_TRANSFER)
def test_kv_transfer_copies_exactly_the_head_aware_plan_or_is_refused(engine, case: KVTransferCase) -> None:
    kv = _transfer(engine)
    route, sent = _send(kv, case)
    assert route == "send_kvcache", f"an MLA backend's KV took {route}"
    if sent.ret != 0:
        assert not sent.blocks, f"refused ({sent.failure}) after planning {sent.blocks[:3]}"
        return
    src, _ = judges.transfer_layouts(case, 0)
    got = judges.transfer_items(sent.blocks, src.item_bytes)
    want = judges.transfer_oracle(case)
    if got != want:
        ledger_run.observe(ledger_models.KV_TRANSFER, (case,), list(sent.blocks))  # for the ledger's bug model
        wrong = sorted((got or set()) - want)[:2]
        missed = sorted(want - (got or set()))[:2]
        raise AssertionError(
            f"{case}: {'not refused and ' if sent.ret == 0 else ''}planned {sent.blocks[:3]}"
            f"{'...' if len(sent.blocks) > 3 else ''}; the head-aware plan copies {len(want)} chunks of "
            f"{src.item_bytes} bytes, this plan {len(got or ())}: first wrong (src, dst) {wrong}, first missed "
            f"{missed}")
