"""A draft checkpoint through the draft step (fixtures/draft_checkpoint.py, `k3num impact --checkpoint`), DSpark's
and DFlash's: every weight the step reads is the file's tensor (exact), kv_b_proj splits per head into W_uk then
W_uv, the query's low-rank form and DFlash's query norm are what the oracle computes (metamorphic checks), the
geometry is the config's, a DFlash variant the step does not model is refused naming the key, and a bad or
incomplete checkpoint is refused naming the file and the tensor."""

from __future__ import annotations

import dataclasses
import io
import json
import re
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import torch
from safetensors.torch import load_file, save_file

from k3num.fixtures.builders import draft_step_inputs
from k3num.fixtures.checkpoint import CheckpointError, open_checkpoint, write_checkpoint, write_dflash_checkpoint
from k3num.fixtures.draft_checkpoint import dflash_step, dspark_step
from k3num.fixtures.strategies import DraftStepCase
from k3num.harness.judges import up
from k3num.refmodel import draft_step as ref
from k3num.refmodel import mla
from k3num.supply import fetch

ROOT = Path(__file__).resolve().parents[1]
F64 = torch.float64
STEP = dict(heads=2, head_dim=16, mlp=96, vocab=128, taps=2)


def _write(root: Path, quant_format: str = "none", lm_head: bool = True) -> Path:
    return write_checkpoint(root, draft_layers=2, hidden=128, kv_lora=32, rope_dim=16, q_lora=48,
                            quant_format=quant_format, step={**STEP, "lm_head": lm_head})


def _tensors(root: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(root.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def test_every_step_weight_is_the_checkpoints_tensor(tmp_path: Path) -> None:
    root = _write(tmp_path / "c")
    t = _tensors(root)
    s = dspark_step(open_checkpoint(root), None, 7, torch.bfloat16, "cpu")
    w, g = s.weights, s.geometry
    assert (g.hidden, g.num_layers, g.num_heads, g.head_dim, g.v_head_dim, g.kv_lora_rank, g.rope.rotary_dim,
            g.mlp_width, g.vocab, g.block, s.taps) == (128, 2, 2, 16, 16, 32, 16, 96, 128, 7, 2)
    assert w.q_proj is None
    layer_names = {"in_norm": "input_layernorm.weight", "post_norm": "post_attention_layernorm.weight",
                   "q_a": "self_attn.q_a_proj.weight", "q_a_norm": "self_attn.q_a_layernorm.weight",
                   "q_b": "self_attn.q_b_proj.weight", "kv_a": "self_attn.kv_a_proj_with_mqa.weight",
                   "kv_norm": "self_attn.kv_a_layernorm.weight", "o_proj": "self_attn.o_proj.weight",
                   "gate": "mlp.gate_proj.weight", "up": "mlp.up_proj.weight", "down": "mlp.down_proj.weight"}
    pairs = {field: "model.layers.{}." + name for field, name in layer_names.items()}
    for field, name in pairs.items():
        for layer in range(2):
            assert torch.equal(getattr(w, field)[layer], t[name.format(layer)]), (field, layer)
    assert torch.equal(w.final_norm, t["model.final_norm.weight"]) and torch.equal(w.lm_head, t["lm_head.weight"])
    assert torch.equal(s.fc, t["model.context_proj.weight"]) and torch.equal(s.fc_norm, t["model.context_norm.weight"])
    # path 1's weight is the layer's own (vLLM duplicates it)
    assert s.paths["kv_a"] is w.kv_a and s.paths["kv_norm"] is w.kv_norm


def test_the_checkpoints_kv_b_splits_per_head_into_w_uk_then_w_uv(tmp_path: Path) -> None:
    root = _write(tmp_path / "c")
    kv_b = _tensors(root)["model.layers.1.self_attn.kv_b_proj.weight"]  # [NH * (Dn + Dv), kv_lora]
    w = dspark_step(open_checkpoint(root), None, 7, torch.bfloat16, "cpu").weights
    assert w.w_uk is not None and w.w_uv is not None
    for head in range(2):
        rows = kv_b[head * 32:(head + 1) * 32]
        assert torch.equal(w.w_uk[1][head * 16:(head + 1) * 16], rows[:16])
        assert torch.equal(w.w_uv[1][head * 16:(head + 1) * 16], rows[16:])


def test_a_quantized_checkpoint_is_read_dequantized_then_rounded_once(tmp_path: Path) -> None:
    root = _write(tmp_path / "c", "fp8")
    ck = open_checkpoint(root)
    w = dspark_step(ck, None, 7, torch.bfloat16, "cpu").weights
    name = "model.layers.0.mlp.down_proj"
    assert torch.equal(w.down[0], ck.linear(name, 128, 96).to(torch.bfloat16))
    assert ck.tensor(f"{name}.weight").dtype == torch.float8_e4m3fn


def _case(kind: str) -> DraftStepCase:
    return DraftStepCase(kind=kind, hidden=32, num_layers=2, num_heads=4, head_dim=8, kv_heads=2 if kind == "dflash"
                         else 1, kv_lora=16 if kind == "dspark" else 0, rotary_dim=8, window=0, vocab=64, taps=2,
                         tokens=6, block=4, seed=11, logit_scale=8.0)


def _oracle_logits(kind: str, case: DraftStepCase, weights: ref.DraftWeights) -> torch.Tensor:
    inp = draft_step_inputs(case, F64, "cpu")
    g = case.geometry()
    n, b = len(inp.ctx_positions), g.block
    ctx = torch.randn(n, g.hidden, generator=torch.Generator().manual_seed(1), dtype=F64)
    if kind == "dspark":
        kv_c, k_pe = mla.context_kv(ctx, up(inp.kv_a), up(inp.kv_norm), inp.ctx_positions, g.rope, g.eps)
        return ref.dspark_step(kv_c, k_pe, inp.ctx_positions, up(inp.block_hidden), inp.block_positions, weights, g)
    k = torch.randn(g.num_layers, n, g.num_kv_heads, g.head_dim, generator=torch.Generator().manual_seed(2), dtype=F64)
    v = torch.randn(k.shape, generator=torch.Generator().manual_seed(3), dtype=F64)
    assert b == inp.block_positions.shape[0]
    return ref.dflash_step(k, v, inp.ctx_positions, up(inp.block_hidden), inp.block_positions, weights, g)


def _low_rank(case: DraftStepCase, q_lora: int = 12) -> ref.DraftWeights:
    w = draft_step_inputs(case, F64, "cpu").weights
    g = torch.Generator().manual_seed(3)
    width = w.q_proj.shape[1]
    # q_a at 1000/sqrt(fan-in): mean(a^2) near 1e6, so the norm's eps (1e-5) moves nothing above 1e-11 relative
    return dataclasses.replace(w, q_proj=None, q_a=torch.randn(2, q_lora, 32, generator=g, dtype=F64) * 1e3 / 32**0.5,
                               q_a_norm=1 + 0.1 * torch.randn(2, q_lora, generator=g, dtype=F64),
                               q_b=torch.randn(2, width, q_lora, generator=g, dtype=F64) / q_lora**0.5)


def test_the_low_rank_query_is_q_b_of_the_rms_normed_q_a() -> None:
    """Against the formula written out (q_b (w * a / sqrt(mean(a^2) + eps)), a = q_a x), and through the step: a
    positive scale of q_a leaves the logits (the norm removes it), a scale of q_b does not (it sharpens the
    scores): the norm sits between the two, where DeepSeek-V2's q_a_layernorm does."""
    case = _case("dspark")
    w = _low_rank(case)
    x = torch.randn(5, 32, generator=torch.Generator().manual_seed(4), dtype=F64)
    assert w.q_a is not None and w.q_a_norm is not None and w.q_b is not None
    a = x @ (w.q_a[1] / 1e3).T
    w = dataclasses.replace(w, q_a=w.q_a / 1e3)
    want = (w.q_a_norm[1] * a / torch.sqrt(a.square().mean(-1, keepdim=True) + 1e-5)) @ w.q_b[1].T
    assert (ref.dspark_query(x, w, 1, 1e-5) - want).abs().max() < 1e-13
    w = dataclasses.replace(w, q_a=w.q_a * 1e3)
    base = _oracle_logits("dspark", case, w)
    scaled_a = _oracle_logits("dspark", case, dataclasses.replace(w, q_a=w.q_a * 3.0))
    assert (scaled_a - base).abs().max() < 1e-9 * base.abs().max()
    scaled_b = _oracle_logits("dspark", case, dataclasses.replace(w, q_b=w.q_b * 3.0))
    assert (scaled_b - base).abs().max() > 1e-3


def test_dflash_with_a_query_norm_ignores_the_query_projections_scale() -> None:
    """With q_norm the query is normed per head before its rotation (SGLang 0.5.23's DFlash attention): a
    positive scale of q_proj leaves the logits; without it the same scale changes them."""
    case = _case("dflash")
    w = draft_step_inputs(case, F64, "cpu").weights
    # q_proj at 1000x: the norm's eps (1e-5) then moves nothing above 1e-11 relative
    q_norm = 1 + 0.1 * torch.randn(2, 8, generator=torch.Generator().manual_seed(5), dtype=F64)
    qn = dataclasses.replace(w, q_proj=w.q_proj * 1e3, q_norm=q_norm)
    base = _oracle_logits("dflash", case, qn)
    assert (_oracle_logits("dflash", case, dataclasses.replace(qn, q_proj=qn.q_proj * 3.0)) - base).abs().max() < (
        1e-9 * base.abs().max())
    plain = _oracle_logits("dflash", case, w)
    assert (_oracle_logits("dflash", case, dataclasses.replace(w, q_proj=w.q_proj * 3.0)) - plain).abs().max() > 1e-3


def test_the_step_refuses_a_partial_low_rank_query_naming_what_is_missing() -> None:
    case = _case("dspark")
    w = _low_rank(case)
    with pytest.raises(ValueError, match="needs all of q_a, q_a_norm, q_b; given only q_a, q_b"):
        _oracle_logits("dspark", case, dataclasses.replace(w, q_a_norm=None))
    with pytest.raises(ValueError, match="the dspark step needs q_proj"):
        _oracle_logits("dspark", case, dataclasses.replace(w, q_a=None, q_a_norm=None, q_b=None))


def _edit(root: Path, name: str, value: torch.Tensor | None) -> None:
    """Replace (or, with None, drop from the index) tensor `name` of the checkpoint in `root`."""
    index = json.loads((root / "model.safetensors.index.json").read_text())
    if value is None:
        del index["weight_map"][name]
        (root / "model.safetensors.index.json").write_text(json.dumps(index))
        return
    shard = root / index["weight_map"][name]
    tensors = load_file(str(shard))
    tensors[name] = value
    save_file(tensors, str(shard))


def test_a_bad_checkpoint_is_refused_naming_the_file_and_the_tensor(tmp_path: Path) -> None:
    root = _write(tmp_path / "c")
    _edit(root, "model.layers.1.mlp.up_proj.weight", None)
    with pytest.raises(CheckpointError, match="no tensor model.layers.1.mlp.up_proj.weight in the weight_map"):
        dspark_step(open_checkpoint(root), None, 7, torch.bfloat16, "cpu")
    root = _write(tmp_path / "n")
    nan = torch.ones(128, dtype=torch.bfloat16)
    nan[5] = float("nan")
    _edit(root, "model.final_norm.weight", nan)
    with pytest.raises(CheckpointError, match=r"model-\d+-of-\d+\.safetensors: tensor model.final_norm.weight holds 1 "
                                              r"non-finite value\(s\), the first at \(5,\)"):
        dspark_step(open_checkpoint(root), None, 7, torch.bfloat16, "cpu")
    root = _write(tmp_path / "s")
    _edit(root, "model.layers.0.self_attn.q_b_proj.weight", torch.zeros(64, 47, dtype=torch.bfloat16))
    with pytest.raises(CheckpointError, match=r"tensor model.layers.0.self_attn.q_b_proj.weight is \[64, 47\]"):
        dspark_step(open_checkpoint(root), None, 7, torch.bfloat16, "cpu")
    root = _write(tmp_path / "h", lm_head=False)
    with pytest.raises(CheckpointError, match="no lm_head.weight .*--lm-head DIR"):
        dspark_step(open_checkpoint(root), None, 7, torch.bfloat16, "cpu")
    cfg = json.loads((root / "config.json").read_text())
    del cfg["v_head_dim"]
    (root / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="config.json: the DSpark draft step needs v_head_dim"):
        dspark_step(open_checkpoint(root), None, 7, torch.bfloat16, "cpu")


def _impact(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "k3num.harness.cli", "impact", "--device", "cpu", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)


def test_impact_runs_a_draft_checkpoint_through_the_step_and_exits_2_on_a_bad_one(tmp_path: Path) -> None:
    if fetch.missing_files("vllm") or fetch.missing_files("tokenspeed"):
        pytest.skip("vllm and tokenspeed are not fetched (k3num fetch vllm tokenspeed)")
    draft, target = _write(tmp_path / "d", "fp8", lm_head=False), _write(tmp_path / "t")
    r = _impact("--checkpoint", str(draft), "--lm-head", str(target), "--engine", "vllm", "--cases", "2",
                "--format", "csv")
    assert r.returncode == 0, r.stdout + r.stderr[-2000:]
    rows = pd.read_csv(io.StringIO(r.stdout)).set_index("drafter")
    assert rows.loc["dspark", "paths"] == "aux_capture=engine;project_unsharded=mirror;context_kv_fused=engine"
    assert rows.loc["dspark", "positions"] == 14 and rows.loc["dspark", "block"] == 7, r.stdout  # 2 blocks of 7
    assert rows.loc["dflash", "paths"] == "not run: the checkpoint is a dspark draft"
    r = _impact("--checkpoint", str(draft), "--engine", "vllm", "--cases", "1")
    assert r.returncode == 2 and "no lm_head.weight" in r.stderr, r.stderr
    from k3num.fixtures import activations

    three = activations.save(tmp_path / "a.safetensors", torch.zeros(3, 4, 128, dtype=torch.bfloat16), torch.arange(4))
    r = _impact("--checkpoint", str(draft), "--lm-head", str(target), "--activations", str(three), "--engine", "vllm")
    assert r.returncode == 2 and "3 taps of width 128, but the checkpoint's draft reads 2 taps" in r.stderr, r.stderr
    two = activations.save(tmp_path / "b.safetensors", torch.ones(2, 4, 128, dtype=torch.bfloat16), torch.arange(4))
    r = _impact("--checkpoint", str(draft), "--lm-head", str(target), "--activations", str(two), "--engine",
                "tokenspeed", "--cases", "1", "--format", "csv")
    assert r.returncode == 0, r.stdout + r.stderr[-2000:]
    rows = pd.read_csv(io.StringIO(r.stdout)).set_index("drafter")
    assert rows.loc["dspark", "paths"].startswith("aux_capture=given taps;project_unsharded=engine")
    r = _impact("--lm-head", str(target), "--engine", "vllm")
    assert r.returncode == 2 and "--lm-head is read with a draft --checkpoint" in r.stderr
    r = _impact("--checkpoint", str(draft), "--ledger")
    assert r.returncode == 2 and "leave out --activations and --checkpoint" in r.stderr


@pytest.mark.parametrize("kind", ["dspark", "dflash"])
def test_the_bf16_remainder_reads_the_low_rank_query_and_the_query_norm_as_the_oracle_does(kind: str) -> None:
    """The mirror's step (engines/mirror/draft_step.py) with the checkpoint-only weights agrees with the oracle's
    to bf16's few roundings; q_a (dspark) and q_proj (dflash) are drawn at 1000x, so a remainder that skipped the
    norm after them would miss by orders of magnitude."""
    from k3num.engines.mirror import draft_step as bf16_step

    case = _case(kind)
    g = case.geometry()
    inp = draft_step_inputs(case, F64, "cpu")
    w = _low_rank(case) if kind == "dspark" else dataclasses.replace(
        inp.weights, q_proj=inp.weights.q_proj * 1e3,
        q_norm=1 + 0.1 * torch.randn(2, 8, generator=torch.Generator().manual_seed(5), dtype=F64))
    want = _oracle_logits(kind, case, w)
    low = dataclasses.replace(w, **{f: getattr(w, f).to(torch.bfloat16) for f in w.__dataclass_fields__
                                    if getattr(w, f) is not None})
    n = len(inp.ctx_positions)
    if kind == "dspark":
        ctx = torch.randn(n, g.hidden, generator=torch.Generator().manual_seed(1), dtype=F64)
        paths = mla.context_kv(ctx, up(inp.kv_a), up(inp.kv_norm), inp.ctx_positions, g.rope, g.eps)
    else:
        k = torch.randn(g.num_layers, n, g.num_kv_heads, g.head_dim, generator=torch.Generator().manual_seed(2),
                        dtype=F64)
        paths = (k, torch.randn(k.shape, generator=torch.Generator().manual_seed(3), dtype=F64))
    step = bf16_step.dspark_step if kind == "dspark" else bf16_step.dflash_step
    got = step(*(t.to(torch.bfloat16) for t in paths), inp.ctx_positions, inp.block_hidden.to(torch.bfloat16),
               inp.block_positions, low, g)
    assert (got.double() - want).abs().max() < 0.05 * want.abs().max()


@pytest.mark.parametrize("prefix", ["", "model."])
def test_every_dflash_step_weight_is_the_checkpoints_tensor_and_the_geometry_the_configs(tmp_path: Path,
                                                                                          prefix: str) -> None:
    """SGLang loads a DFlash draft's names with or without `model.`: both read the same; the context's K/V use
    each layer's own k_proj, v_proj and k_norm; window, block, taps, heads and eps come from the config."""
    root = write_dflash_checkpoint(tmp_path / "d", window=5, block=6, taps=3, prefix=prefix)
    t = _tensors(root)
    s = dflash_step(open_checkpoint(root), None, 16, torch.bfloat16, "cpu")
    g, w = s.geometry, s.weights
    assert (g.kind, g.hidden, g.num_layers, g.num_heads, g.num_kv_heads, g.head_dim, g.mlp_width, g.vocab, g.window,
            g.block, g.eps, g.rope.style, g.rope.rotary_dim, s.taps) == (
        "dflash", 64, 2, 4, 2, 16, 96, 128, 5, 6, 1e-6, "neox", 16, 3)
    names = {"in_norm": "input_layernorm.weight", "post_norm": "post_attention_layernorm.weight",
             "q_proj": "self_attn.q_proj.weight", "k_proj": "self_attn.k_proj.weight",
             "v_proj": "self_attn.v_proj.weight", "o_proj": "self_attn.o_proj.weight",
             "q_norm": "self_attn.q_norm.weight", "k_norm": "self_attn.k_norm.weight", "gate": "mlp.gate_proj.weight",
             "up": "mlp.up_proj.weight", "down": "mlp.down_proj.weight"}
    for field, name in names.items():
        for layer in range(2):
            assert torch.equal(getattr(w, field)[layer], t[f"{prefix}layers.{layer}.{name}"]), (field, layer)
    assert torch.equal(w.final_norm, t[f"{prefix}norm.weight"]) and torch.equal(w.lm_head, t["lm_head.weight"])
    assert torch.equal(s.fc, t[f"{prefix}fc.weight"]) and torch.equal(s.fc_norm, t[f"{prefix}hidden_norm.weight"])
    assert s.paths == {"k_weight": w.k_proj, "v_weight": w.v_proj, "k_norm": w.k_norm}
    full = dflash_step(open_checkpoint(write_dflash_checkpoint(tmp_path / "f", taps=2, extra={
        "dflash_config": {"target_layer_ids": [2, 5]}})), None, 16, torch.bfloat16, "cpu")
    assert (full.geometry.window, full.geometry.block, full.taps) == (0, 16, 2)  # no block_size: the preset's


@pytest.mark.parametrize("extra,says", [
    ({"use_gemma_norm": True}, "use_gemma_norm = true: the draft step does not model Gemma's RMSNorm"),
    ({"dflash_config": {"conv_kernel_size": 3, "conv_group_size": 4}}, "conv_kernel_size = 3"),
    ({"dflash_config": {"projector_type": "domino"}}, 'projector_type = "domino"'),
    ({"layer_types": ["full_attention", "sliding_attention"], "sliding_window": 4},
     "the step takes one attention type for all 2 layers"),
    ({"layer_types": ["sliding_attention"] * 2}, "sliding_attention layers without a sliding_window"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}},
     "the DFlash step rotates the whole head, unscaled (YaRN is modelled for DSpark's MLA only"),
    ({"draft_vocab_size": 64}, "a reduced draft vocabulary"),
])
def test_a_dflash_variant_the_step_does_not_model_is_refused_naming_the_key(tmp_path: Path, extra, says) -> None:
    root = write_dflash_checkpoint(tmp_path / "d", extra=extra)
    with pytest.raises(CheckpointError, match=re.escape(says)):
        dflash_step(open_checkpoint(root), None, 16, torch.bfloat16, "cpu")


def test_a_bad_dflash_checkpoint_is_refused_naming_the_tensor(tmp_path: Path) -> None:
    root = write_dflash_checkpoint(tmp_path / "d")
    _edit(root, "layers.1.self_attn.k_norm.weight", None)
    with pytest.raises(CheckpointError, match="no tensor layers.1.self_attn.k_norm.weight in the weight_map"):
        dflash_step(open_checkpoint(root), None, 16, torch.bfloat16, "cpu")
    root = write_dflash_checkpoint(tmp_path / "h", lm_head=False)
    with pytest.raises(CheckpointError, match="no lm_head.weight .SGLang's DFlash uses the target's LM head"):
        dflash_step(open_checkpoint(root), None, 16, torch.bfloat16, "cpu")


def test_impact_runs_a_dflash_checkpoint_through_the_step(tmp_path: Path) -> None:
    if fetch.missing_files("sglang"):
        pytest.skip("sglang is not fetched (k3num fetch sglang)")
    draft = write_dflash_checkpoint(tmp_path / "d", lm_head=False, window=4, block=5)
    target = write_dflash_checkpoint(tmp_path / "t")  # only its lm_head.weight is read
    r = _impact("--checkpoint", str(draft), "--lm-head", str(target), "--engine", "sglang", "--cases", "2",
                "--format", "csv")
    assert r.returncode == 0, r.stdout + r.stderr[-2000:]
    rows = pd.read_csv(io.StringIO(r.stdout)).set_index("drafter")
    assert rows.loc["dflash", "paths"] == "aux_capture=mirror;project_unsharded=engine;draft_context_kv=engine"
    assert rows.loc["dflash", "positions"] == 10 and rows.loc["dflash", "block"] == 5, r.stdout  # 2 blocks of 5
    assert rows.loc["dspark", "paths"] == "not run: the checkpoint is a dflash draft"
    neither = write_dflash_checkpoint(tmp_path / "n", extra={"architectures": []})
    cfg = json.loads((neither / "config.json").read_text())
    del cfg["dflash_config"]
    (neither / "config.json").write_text(json.dumps(cfg))
    r = _impact("--checkpoint", str(neither), "--engine", "sglang")
    assert r.returncode == 2 and "neither a DSpark draft (kv_lora_rank) nor a DFlash draft" in r.stderr, r.stderr
