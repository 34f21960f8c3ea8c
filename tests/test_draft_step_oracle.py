"""The draft step's float64 oracle (refmodel/draft_step.py) is proven like the rest of the oracle: closed
forms, an independent implementation of its attention (torch's scaled_dot_product_attention), an algebraic
identity of its MLA wiring (the absorbed form), the sliding window's reach; and the token judge
(oracles/tokens.py) on constructed logits."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from k3num.fixtures.builders import draft_step_inputs
from k3num.fixtures.strategies import DraftStepCase
from k3num.harness import draft_step as harness_step
from k3num.harness.judges import up
from k3num.oracles import tokens
from k3num.refmodel import draft_step as ref

F64 = torch.float64


def _rand(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=F64)


def test_attention_over_one_entry_is_that_entrys_value() -> None:
    q, k, v = _rand(3, 4, 8), _rand(1, 2, 8, seed=1), _rand(1, 2, 5, seed=2)
    out = ref.attention(q, k, v, torch.ones(3, 1, dtype=torch.bool), 0.3)
    want = v[0].repeat_interleave(2, dim=0).expand(3, 4, 5)  # heads 0-1 read KV head 0, 2-3 read 1
    assert torch.equal(out, want)


def test_attention_agrees_with_torchs_scaled_dot_product_attention() -> None:
    """An independent implementation: grouped heads, a mask, float64, to 1e-14."""
    b, m, nh, nkv, d = 5, 9, 4, 2, 16
    q, k, v = _rand(b, nh, d), _rand(m, nkv, d, seed=1), _rand(m, nkv, d, seed=2)
    allowed = torch.rand(b, m, generator=torch.Generator().manual_seed(3)) < 0.6
    allowed[:, 0] = True
    ours = ref.attention(q, k, v, allowed, 1 / math.sqrt(d))
    kk, vv = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)
    theirs = torch.nn.functional.scaled_dot_product_attention(
        q.permute(1, 0, 2), kk.permute(1, 0, 2), vv.permute(1, 0, 2), attn_mask=allowed[None]).permute(1, 0, 2)
    assert (ours - theirs).abs().max() < 1e-14


def test_a_one_hot_lm_head_gives_the_normed_hidden_coordinate() -> None:
    h = _rand(3, 8)
    head = torch.zeros(4, 8, dtype=F64)
    for v, j in enumerate((0, 3, 5, 7)):
        head[v, j] = 1.0
    logits = ref.lm_logits(h, torch.ones(8, dtype=F64), head, 0.0)
    rms = h.square().mean(-1, keepdim=True).sqrt()
    assert torch.allclose(logits, h[:, [0, 3, 5, 7]] / rms, rtol=1e-15, atol=0)


def test_a_closed_gate_mlp_adds_nothing() -> None:
    x = _rand(2, 6)
    assert torch.equal(ref.swiglu(x, torch.zeros(4, 6, dtype=F64), _rand(4, 6, seed=1), _rand(6, 4, seed=2)),
                       torch.zeros(2, 6, dtype=F64))


def _case(kind: str, **kw) -> DraftStepCase:
    base = dict(kind=kind, hidden=32, num_layers=2, num_heads=4, head_dim=8, kv_heads=2 if kind == "dflash" else 1,
                kv_lora=16 if kind == "dspark" else 0, rotary_dim=8, window=0, vocab=64, taps=2, tokens=6, block=4,
                seed=5, logit_scale=8.0)
    return DraftStepCase(**{**base, **kw})


def _f64(inp):
    return dataclasses.replace(inp.weights, **{f: up(getattr(inp.weights, f)) for f in inp.weights.__dataclass_fields__
                                                if getattr(inp.weights, f) is not None})


def test_the_mla_scores_equal_their_absorbed_form() -> None:
    """q_nope . (W_uk kv_c) per head equals (W_uk^T q_nope) . kv_c: the decompressed wiring of the DSpark
    step's attention, computed the other way round (the absorbed form serving engines use)."""
    case = _case("dspark", num_layers=1)
    g, inp = case.geometry(), draft_step_inputs(case, F64, "cpu")
    w = _f64(inp)
    nh, dn = g.num_heads, g.head_dim
    c = _rand(7, g.kv_lora_rank, seed=9)
    q = _rand(4, nh, dn, seed=10)
    decompressed = torch.einsum("bhd,mhd->hbm", q, (c @ w.w_uk[0].T).view(-1, nh, dn))
    absorbed = torch.einsum("bhc,mc->hbm", torch.einsum("bhd,hdc->bhc", q, w.w_uk[0].view(nh, dn, -1)), c)
    assert (decompressed - absorbed).abs().max() < 1e-13


def test_context_outside_the_sliding_window_changes_no_logit() -> None:
    case = _case("dflash", window=3, tokens=8)
    g, inp = case.geometry(), draft_step_inputs(case, F64, "cpu")
    w = _f64(inp)
    k, v = _rand(g.num_layers, 8, 2, 8, seed=1), _rand(g.num_layers, 8, 2, 8, seed=2)
    args = (inp.ctx_positions, up(inp.block_hidden), inp.block_positions, w, g)
    before = ref.dflash_step(k, v, *args)
    # the block follows the context: with a window of 3, a context entry 3 or more positions before the
    # block's first position is out of every block position's reach
    far = (inp.block_positions[-1] - inp.ctx_positions) >= 3
    far &= (inp.block_positions[0] - inp.ctx_positions) >= 3
    k2, v2 = k.clone(), v.clone()
    k2[:, far], v2[:, far] = 100.0, -100.0
    assert far.any() and torch.equal(ref.dflash_step(k2, v2, *args), before)
    near = ~((inp.block_positions[0] - inp.ctx_positions) >= 3)
    k3 = k.clone()
    k3[:, near] *= 3.0
    assert not torch.equal(ref.dflash_step(k3, v, *args), before)


def test_the_step_refuses_bad_input_naming_it() -> None:
    case = _case("dspark")
    g, inp = case.geometry(), draft_step_inputs(case, F64, "cpu")
    w = _f64(inp)
    kv_c, k_pe = _rand(2, 6, 16), _rand(2, 6, 8)
    with pytest.raises(ValueError, match="block_hidden"):
        ref.dspark_step(kv_c, k_pe, inp.ctx_positions, inp.block_hidden.float(), inp.block_positions, w, g)
    with pytest.raises(ValueError, match="kv_c"):
        ref.dspark_step(kv_c[:, :5], k_pe, inp.ctx_positions, up(inp.block_hidden), inp.block_positions, w, g)
    with pytest.raises(ValueError, match="dflash geometry given to the dspark step|a dspark geometry"):
        ref.dflash_step(kv_c, k_pe, inp.ctx_positions, up(inp.block_hidden), inp.block_positions, w, g)


def test_the_token_judge_labels_identical_tie_break_and_diverged() -> None:
    oracle = torch.tensor([[5.0, 1.0, 0.0], [2.0, 1.95, 0.0], [3.0, 0.0, 1.0], [1.0, 4.0, 0.0]], dtype=F64)
    subject = torch.tensor([[5.0, 1.0, 0.0], [1.9, 2.0, 0.0], [0.0, 3.0, 1.0], [1.0, 4.0, 0.0]])
    v = tokens.judge_block(subject, oracle, delta=0.2)
    assert v.labels == (tokens.IDENTICAL, tokens.TIE_BREAK, tokens.DIVERGED, tokens.IDENTICAL)
    assert v.agreement == 1 and v.decided == 3 and v.near_ties == 1
    assert tokens.judge_block(oracle, oracle, 0.2).kl == 0.0 and tokens.judge_block(oracle, oracle, 0.2).agreement == 4


def test_the_mirror_through_the_harness_step_flips_no_decided_token_and_judges_some() -> None:
    """The noise floor against itself: the mirror's step is the noise floor, so nothing diverges."""
    from k3num.engines import registry

    mirror = registry.get("mirror")
    for kind in ("dspark", "dflash"):
        r = harness_step.run(mirror, mirror, kind, _case(kind), "cpu")
        assert r.verdict.count(tokens.DIVERGED) == 0 and r.verdict.decided > 0
        assert r.verdict.labels == r.noise_verdict.labels


def test_a_drift_within_the_tensor_budget_flips_no_decided_token(tmp_path) -> None:
    """harness/fixes.py's DRIFTS (TokenSpeed's unsharded projection as two GEMMs, each rounded: within the
    tensor budget) through the token properties on TokenSpeed: no decided token flips. (The mutants that
    flip tokens are the self-test's: tests/test_mutants_are_caught.py.)"""
    import subprocess
    import sys
    from pathlib import Path

    from k3num.harness import fixes
    from k3num.supply import fetch

    if fetch.missing_files("tokenspeed"):
        pytest.skip("tokenspeed is not fetched (k3num fetch tokenspeed)")
    tree = fixes.patched_tree(fixes.by_id("split-context-projection"), tmp_path / "t")
    root = Path(__file__).resolve().parents[1]
    r = subprocess.run([sys.executable, "-m", "pytest", "properties/test_draft_tokens.py", "--engine", "tokenspeed",
                        "--engine-src", f"tokenspeed={tree}", "-q", "-p", "no:cacheprovider",
                        "--hypothesis-profile=ci"],
                       cwd=root, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0 and "4 passed" in r.stdout, r.stdout[-3000:]


def test_a_latent_drift_past_delta_fails_the_decided_token_property_though_no_token_flips(tmp_path) -> None:
    """harness/fixes.py LATENT `context-scaled` (TokenSpeed's normed context projection 3% off: no decided token
    flipped in 60 seeded blocks, 21 of them past delta): the decided-token property fails it on the logit error,
    its message giving the flips and the expected flip count."""
    import subprocess
    import sys
    from pathlib import Path

    from k3num.harness import fixes
    from k3num.supply import fetch

    if fetch.missing_files("tokenspeed"):
        pytest.skip("tokenspeed is not fetched (k3num fetch tokenspeed)")
    tree = fixes.patched_tree(fixes.by_id("context-scaled"), tmp_path / "t")
    root = Path(__file__).resolve().parents[1]
    r = subprocess.run([sys.executable, "-m", "pytest", "properties/test_draft_tokens.py", "--engine", "tokenspeed",
                        "--engine-src", f"tokenspeed={tree}", "-q", "-p", "no:cacheprovider", "-rfE",
                        "-k", "decided", "--hypothesis-profile=ci"],
                       cwd=root, capture_output=True, text=True, timeout=900, env={**__import__("os").environ,
                                                                                   "COLUMNS": "400"})
    out = r.stdout
    assert r.returncode == 1, out[-3000:]
    for kind in ("dspark", "dflash"):
        assert f"FAILED properties/test_draft_tokens.py::test_a_decided_token_never_flips[tokenspeed-{kind}]" in out
    assert "predicted_flips=" in out and "q99_err_over_delta=" in out, out[-3000:]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_the_one_pass_weight_draw_draws_the_two_pass_values_bit_for_bit(dtype) -> None:
    """draft_step_inputs draws its weights with Draw.normal_as (the scale and the rounding in one pass, GPU run 66:
    the K3-geometry draw 0.034-0.043 s -> 0.022-0.029 s); the values must be normal(...).to(dtype)'s, or every
    drawn case would change (scripts/draw_identity.py checks the same on a GPU)."""
    from k3num.fixtures.tensors import Draw

    bits = torch.int32 if dtype == torch.float32 else torch.int16
    for seed in (0, 7):
        for shape, scale in (((64, 48), 48**-0.5), ((3, 257, 129), 10.0 * 129**-0.5), ((5,), 1.0)):
            two = Draw(seed).normal(shape, scale).to(dtype)
            one = Draw(seed).normal_as(shape, scale, dtype)
            assert one.dtype == dtype and torch.equal(one.view(bits), two.view(bits)), (seed, shape)


# --- DSpark's Markov head in the draft step (refmodel.draft_step.markov_chain; harness/draft_step.run) --------


def test_markov_chain_adds_each_positions_previous_token_bias_and_takes_the_first_argmax() -> None:
    w = ref.DraftWeights(*(None,) * 9, markov_w1=torch.tensor([[0.0], [1.0], [2.0]], dtype=F64),
                         markov_w2=torch.tensor([[1.0], [0.0], [-1.0]], dtype=F64))
    logits = torch.tensor([[0.0, 0.0, 5.0], [3.0, 0.0, 0.0], [1.0, 1.0, 0.0]], dtype=F64)
    out, toks = ref.markov_chain(logits, w, anchor=0)
    # anchor 0: no bias, token 2; prev 2 adds [2, 0, -2]: token 0; prev 0: a tie, the first
    assert toks.tolist() == [2, 0, 0]
    assert torch.equal(out[1], torch.tensor([5.0, 0.0, -2.0], dtype=F64))
    with pytest.raises(ValueError, match="no Markov head"):
        ref.markov_chain(logits, dataclasses.replace(w, markov_w1=None), anchor=0)


def test_every_drawn_dspark_step_has_a_markov_head_and_dflash_none() -> None:
    for kind in ("dspark", "dflash"):
        inp = draft_step_inputs(_case(kind), torch.bfloat16, "cpu")
        has = inp.weights.markov_w1 is not None and inp.weights.markov_w2 is not None
        assert has == (kind == "dspark"), kind
        if has:
            assert inp.weights.markov_w1.shape == (64, 16) and 0 <= inp.markov_anchor < 64


def test_the_markov_head_moves_the_oracles_tokens_and_a_step_that_drops_it_is_seen(monkeypatch) -> None:
    """The head changes what the drafter proposes (the oracle's tokens with and without it differ), and a planted
    bug, the engine's block biased by the anchor at every position, diverges from the oracle where the correct
    head does not. (A head dropped on every bf16 side would widen the noise floor's budget instead: the
    decided-position count, asserted here for the correct run, is what shows that.)"""
    from k3num.engines import base, registry
    from k3num.engines.mirror import draft_step as bf16_step
    from k3num.harness import draft_step
    from k3num.oracles import tokens

    mirror = registry.get("mirror")
    label = {base.CONTEXT_KV_FUSED: (mirror.subject(base.CONTEXT_KV_FUSED), "the mirror's, as a subject")}
    cases = [_case("dspark", seed=s, block=6) for s in range(6)]
    inputs = [draft_step_inputs(c, torch.bfloat16, "cpu") for c in cases]
    right = [draft_step.run(mirror, mirror, "dspark", c, "cpu", subjects=label, inputs=i)
             for c, i in zip(cases, inputs)]
    assert all(r.verdict.count(tokens.DIVERGED) == 0 for r in right), [draft_step.detail(r) for r in right]
    assert sum(r.verdict.decided for r in right) >= len(cases), "too few decided positions to judge anything"
    headless = [draft_step.run(mirror, mirror, "dspark", c, "cpu", subjects=label, inputs=dataclasses.replace(
        i, weights=dataclasses.replace(i.weights, markov_w1=None, markov_w2=None))) for c, i in zip(cases, inputs)]
    assert any(not torch.equal(a.oracle.argmax(-1), b.oracle.argmax(-1)) for a, b in zip(right, headless))
    calls, real = [], bf16_step.markov_biased

    def stale_on_the_engines_side(logits, w, prev):  # run() biases the engine's block, the noise floor's, then
        calls.append(1)                              # the exact paths': only the first gets the anchor everywhere
        return real(logits, w, prev[:1].expand_as(prev) if len(calls) % 3 == 1 else prev)

    monkeypatch.setattr(bf16_step, "markov_biased", stale_on_the_engines_side)
    stale = [draft_step.run(mirror, mirror, "dspark", c, "cpu", subjects=label, inputs=i)
             for c, i in zip(cases, inputs)]
    assert sum(r.verdict.count(tokens.DIVERGED) for r in stale) > 0, [draft_step.detail(r) for r in stale]
