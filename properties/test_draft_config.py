"""A draft's own cache configuration on K3 (vLLM 0.34.0's nvidia/dense_draft.py and nvidia/gqa_draft.py; the mirror's
statement is engines/mirror/draft_config.py): exact contracts, each stated here from first principles.

- A dense MLA draft on a KDA-hybrid (DSA) target gets an **fp8 KV cache by default** and the platform's dense MLA
  backend; a GQA draft FLASH_ATTN and the model dtype; what the user set is kept; other methods and targets are
  left alone. So on K3.1 an MLA draft's context and block KV go through the fp8 inserts by default, where a zero or
  non-finite `_k_scale` is K3N-014's path (properties/test_context_kv_ops.py).
- A GQA draft's block shrinks to the largest block that divides its own, stays on the 64-token alignment, and whose
  page fits under the target's largest page; none fitting is an error that names the page size.
- The draft's layers (attention, not MLA) are grouped apart from the target's, the target's specs untouched, the
  draft's fitted under the target's largest page before the planner unifies them; without a draft, without a
  target or with a block-outermost layout, every layer goes to the planner's default grouping as given.

An engine offers them as `extras["draft_config"]`; vLLM 0.33.0 has neither file and skips saying so.
"""

from __future__ import annotations

import types

import pytest
from hypothesis import given
from hypothesis import strategies as st

ALIGN = 64


def _config(engine):
    cfg = engine.extras.get("draft_config")
    if cfg is None:
        pytest.skip(f"engine {engine.name} {engine.version}: {engine.missing.get('draft_config', 'not bound')}")
    return cfg


@given(method=st.sampled_from(["dspark", "eagle3", "mtp", "ngram"]), hybrid=st.booleans(), mla=st.booleans(),
       rocm=st.booleans(), user_backend=st.booleans(),
       user_dtype=st.sampled_from([None, "", "auto", "fp8", "bfloat16"]))
def test_dense_draft_defaults_its_own_backend_and_cache_dtype_and_keeps_the_users(engine, method, hybrid, mla, rocm,
                                                                                   user_backend, user_dtype):
    cfg = _config(engine)
    draft_text = types.SimpleNamespace(kv_lora_rank=512) if mla else types.SimpleNamespace(num_key_value_heads=8)
    given_backend = "USER_BACKEND" if user_backend else None
    spec = types.SimpleNamespace(method=method, attention_backend=given_backend, kv_cache_dtype=user_dtype,
                                 draft_model_config=types.SimpleNamespace(hf_text_config=draft_text))
    target = types.SimpleNamespace(linear_attn_config={"kda_layers": [0]}) if hybrid else types.SimpleNamespace()
    cfg.configure_dense_draft(spec, target, rocm=rocm)
    if method not in ("dspark", "eagle3") or not hybrid:
        assert (spec.attention_backend, spec.kv_cache_dtype) == (given_backend, user_dtype), (
            f"{method} on a {'hybrid' if hybrid else 'plain'} target must be left alone")
        return
    want_backend = (cfg.Backend.ROCM_AITER_MLA if rocm else cfg.Backend.FLASHINFER_MLA) if mla else \
        cfg.Backend.FLASH_ATTN
    want_dtype = "fp8" if mla else "auto"
    assert spec.attention_backend == (given_backend or want_backend), (
        f"backend {spec.attention_backend}: want {given_backend or want_backend} ({'MLA' if mla else 'GQA'} draft, "
        f"{'ROCm' if rocm else 'CUDA'}, the user's {given_backend})")
    assert spec.kv_cache_dtype == (user_dtype or want_dtype), (
        f"cache dtype {spec.kv_cache_dtype!r}: want {user_dtype or want_dtype!r} ({'MLA' if mla else 'GQA'} draft, the "
        f"user's {user_dtype!r})")


def _largest_fit(block: int, per_token: int, page: int) -> int | None:
    """The largest b with b | block, (block - b) % 64 == 0 and b * per_token <= page (the page is linear in b)."""
    fits = [b for b in range(1, block + 1) if block % b == 0 and (block - b) % ALIGN == 0 and b * per_token <= page]
    return max(fits) if fits else None


@given(block=st.sampled_from([16, 64, 128, 192, 256, 384, 512, 1024]), heads=st.integers(1, 16),
       head_size=st.sampled_from([64, 128, 256]), dtype_size=st.sampled_from([1, 2]),
       page_tokens=st.integers(0, 1100), spare=st.integers(0, 1 << 16))
def test_gqa_draft_block_is_the_largest_aligned_divisor_whose_page_fits(engine, block, heads, head_size, dtype_size,
                                                                        page_tokens, spare):
    """The target's page is drawn as a number of the draft's tokens (0 to past the largest block) plus spare bytes
    short of one more token, so every fitting block size, and none, is drawn."""
    cfg = _config(engine)
    spec = cfg.Spec(block, heads, head_size, dtype_size)
    per_token = heads * 2 * head_size * dtype_size
    page = max(1, page_tokens * per_token + spare % per_token)
    want = _largest_fit(block, per_token, page)
    if want is None:
        with pytest.raises(ValueError, match=str(page)):
            cfg.fit_draft_page(spec, page)
        return
    got = cfg.fit_draft_page(spec, page)
    assert got == cfg.Spec(want, heads, head_size, dtype_size), f"fitted {got}, want block {want} (page {page})"
    assert got.page_size_bytes <= page and block % got.block_size == 0


@given(n_target=st.integers(0, 4), n_state=st.integers(0, 3), n_draft=st.integers(0, 5),
       target_block=st.sampled_from([64, 256]), draft_block=st.sampled_from([64, 128, 256]),
       draft_heads=st.sampled_from([1, 2, 4, 8]), block_outermost=st.booleans())
def test_gqa_draft_layers_are_grouped_apart_and_fit_under_the_targets_page(engine, n_target, n_state, n_draft,
                                                                           target_block, draft_block, draft_heads,
                                                                           block_outermost):
    cfg = _config(engine)
    target = {f"model.layers.{i}.mla": cfg.MLASpec(target_block, 1, 576, 2) for i in range(n_target)}
    target |= {f"model.layers.{i}.kda": cfg.StateSpec(target_block, 1 << 20) for i in range(n_state)}
    draft = {f"draft.layers.{i}.attn": cfg.Spec(draft_block, draft_heads, 128, 2) for i in range(n_draft)}
    specs = target | draft
    planner = cfg.Planner()
    if not draft or not target or block_outermost:
        assert cfg.kv_cache_groups(specs, block_outermost, planner) == [tuple(sorted(specs))]
        assert planner.unified == [] and planner.partitions == [tuple(sorted(specs))]
        return
    page = max(s.page_size_bytes for s in target.values())
    fit = _largest_fit(draft_block, draft_heads * 2 * 128 * 2, page)
    if fit is None:
        with pytest.raises(ValueError, match=str(page)):
            cfg.kv_cache_groups(specs, block_outermost, planner)
        return
    groups = cfg.kv_cache_groups(specs, block_outermost, planner)
    assert groups == [tuple(sorted(target)), tuple(sorted(draft))], f"groups {groups}: target first, then the draft"
    (unified,) = planner.unified
    assert {n: unified[n] for n in target} == target, "the target's specs must reach the planner unchanged"
    for name in draft:
        assert unified[name] == cfg.Spec(fit, draft_heads, 128, 2), f"{name}: {unified[name]}, want block {fit}"
        assert unified[name].page_size_bytes <= page
