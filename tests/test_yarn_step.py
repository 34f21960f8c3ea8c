"""YaRN in the draft step (issue 40 item 3): the DSpark step's rotation takes YaRN's frequencies and cos/sin factor
(refmodel/rope.py, checked against HF in tests/test_oracle_vs_transformers.py) and its softmax scale YaRN's
mscale(factor, mscale_all_dim)^2, as DeepSeek-V3's MLA attention does; the bf16 remainder does the same; a draft
checkpoint's `rope_scaling` of type yarn is read, and any other, or a bad factor, is refused naming the key."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch

from k3num.engines.mirror import draft_step as bf16_step
from k3num.fixtures.builders import draft_step_inputs
from k3num.fixtures.checkpoint import CheckpointError, open_checkpoint, write_checkpoint
from k3num.fixtures.draft_checkpoint import dspark_step
from k3num.fixtures.strategies import DraftStepCase
from k3num.harness.judges import up
from k3num.oracles import budgets
from k3num.refmodel import draft_step as ref
from k3num.refmodel import mla, rope
from k3num.refmodel.geometry import RopeSpec, YarnScaling

F64 = torch.float64
K3_YARN = YarnScaling(factor=32.0, original_max_position=32768)  # refmodel/geometry.py's K3 preset (mscale 1, 1)


def test_the_softmax_factor_is_deepseeks_closed_form_and_hfs() -> None:
    """mscale(s, m) = 0.1 m ln s + 1, squared, with m = mscale_all_dim: K3's factor 32 gives (0.1 ln 32 + 1)^2;
    no YaRN, or a config without mscale_all_dim (0), gives 1; HF's DeepSeek-V3 attention scales the same."""
    k3 = RopeSpec(64, 50000.0, "gptj", K3_YARN)
    assert rope.softmax_scale_factor(k3) == (0.1 * math.log(32.0) + 1.0) ** 2
    assert math.isclose(rope.softmax_scale_factor(k3), 1.813260, rel_tol=1e-6)  # 1.3465736^2
    assert rope.softmax_scale_factor(RopeSpec(64, 50000.0, "gptj", None)) == 1.0
    assert rope.softmax_scale_factor(RopeSpec(64, 50000.0, "gptj", dataclasses.replace(K3_YARN, mscale_all_dim=0.0))) \
        == 1.0
    hf = pytest.importorskip("transformers.models.deepseek_v3.modeling_deepseek_v3", reason="test extra")
    for y in (K3_YARN, YarnScaling(factor=40.0, original_max_position=4096, mscale=0.707, mscale_all_dim=0.5)):
        params = {"rope_type": "yarn", "factor": y.factor, "mscale_all_dim": y.mscale_all_dim}
        want = hf.yarn_apply_mscale(params, 192 ** -0.5)  # qk head dim 128 + 64
        got = rope.softmax_scale_factor(RopeSpec(64, 50000.0, "gptj", y)) / math.sqrt(192)
        assert math.isclose(got, want, rel_tol=4 * budgets.U64), (y, got, want)


def _case() -> DraftStepCase:
    return DraftStepCase(kind="dspark", hidden=32, num_layers=2, num_heads=4, head_dim=8, kv_heads=1, kv_lora=16,
                         rotary_dim=8, window=0, vocab=64, taps=2, tokens=6, block=4, seed=5, logit_scale=8.0)


def _logits(g: ref.DraftStepGeometry, w: ref.DraftWeights, bf16: bool = False) -> torch.Tensor:
    inp = draft_step_inputs(_case(), F64, "cpu")
    ctx = torch.randn(len(inp.ctx_positions), g.hidden, generator=torch.Generator().manual_seed(1), dtype=F64)
    kv_c, k_pe = mla.context_kv(ctx, up(inp.kv_a), up(inp.kv_norm), inp.ctx_positions, g.rope, g.eps)
    if not bf16:
        return ref.dspark_step(kv_c, k_pe, inp.ctx_positions, up(inp.block_hidden), inp.block_positions, w, g)
    low = dataclasses.replace(w, **{f.name: getattr(w, f.name).to(torch.bfloat16) for f in dataclasses.fields(w)
                                    if getattr(w, f.name) is not None})
    return bf16_step.dspark_step(kv_c.bfloat16(), k_pe.bfloat16(), inp.ctx_positions,
                                 inp.block_hidden.to(torch.bfloat16), inp.block_positions, low, g).double()


def test_yarns_softmax_factor_is_exactly_a_rescaled_query_in_the_step() -> None:
    """Closed form: with the same YaRN frequencies and cos/sin factor (mscale = mscale_all_dim, so their ratio is
    1), the step with mscale_all_dim = 1 equals the step with no softmax factor (mscale = mscale_all_dim = 0)
    whose query weight is multiplied by that factor (the query enters the scores linearly, the rotation too)."""
    base = _case().geometry()
    with_factor = dataclasses.replace(base, rope=dataclasses.replace(base.rope, yarn=K3_YARN))
    no_factor = dataclasses.replace(base, rope=dataclasses.replace(
        base.rope, yarn=dataclasses.replace(K3_YARN, mscale=0.0, mscale_all_dim=0.0)))
    assert rope.attention_scaling(with_factor.rope) == rope.attention_scaling(no_factor.rope) == 1.0
    assert torch.equal(rope.inv_freq(with_factor.rope), rope.inv_freq(no_factor.rope))
    w = draft_step_inputs(_case(), F64, "cpu").weights
    m2 = rope.softmax_scale_factor(with_factor.rope)
    scaled = dataclasses.replace(w, q_proj=w.q_proj * m2)
    want = _logits(no_factor, scaled)
    got = _logits(with_factor, w)
    assert float((got - want).abs().max()) <= 64 * budgets.U64 * float(want.abs().max())
    plain = _logits(dataclasses.replace(base, rope=dataclasses.replace(base.rope, yarn=None)), w)
    assert float((got - plain).abs().max()) > 1e-3 * float(plain.abs().max())  # YaRN does move the logits


def test_the_bf16_remainder_applies_yarns_softmax_factor_as_the_oracle_does(monkeypatch: pytest.MonkeyPatch) -> None:
    """The bf16 step under K3's YaRN tracks the float64 step (within the remainder's bf16 error), and without its
    softmax factor (the planted slip: the factor left out of the mirror) it does not."""
    base = _case().geometry()
    g = dataclasses.replace(base, rope=dataclasses.replace(base.rope, yarn=K3_YARN))
    w = draft_step_inputs(_case(), F64, "cpu").weights
    want = _logits(g, w)
    err = float((_logits(g, w, bf16=True) - want).abs().max())
    monkeypatch.setattr(bf16_step, "softmax_scale_factor", lambda spec: 1.0)
    slipped = float((_logits(g, w, bf16=True) - want).abs().max())
    # the existing remainder test's bound (tests/test_draft_checkpoint.py): 5% of the largest logit; measured here
    # err 0.41, the slip 12.0, of 25.7
    assert err < 0.05 * float(want.abs().max()) < slipped, (err, slipped, float(want.abs().max()))


def _ckpt(root: Path, rope_scaling: object) -> Path:
    root = write_checkpoint(root, draft_layers=2, hidden=128, kv_lora=32, rope_dim=16, q_lora=48,
                            step=dict(heads=2, head_dim=16, mlp=96, vocab=128, taps=2, lm_head=True))
    cfg = json.loads((root / "config.json").read_text())
    cfg["rope_scaling"] = rope_scaling
    (root / "config.json").write_text(json.dumps(cfg))
    return root


def test_a_yarn_draft_config_is_read_into_the_steps_rope(tmp_path: Path) -> None:
    root = _ckpt(tmp_path / "c", {"type": "yarn", "factor": 32, "original_max_position_embeddings": 32768,
                                  "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0})
    g = dspark_step(open_checkpoint(root), None, 7, torch.bfloat16, "cpu").geometry
    assert g.rope.yarn == K3_YARN
    root = _ckpt(tmp_path / "d", {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64})
    y = dspark_step(open_checkpoint(root), None, 7, torch.bfloat16, "cpu").geometry.rope.yarn
    assert y == YarnScaling(factor=4.0, original_max_position=64, mscale_all_dim=0.0)  # DeepSeek's absent key: 0


@pytest.mark.parametrize("rope_scaling, says", [
    ({"type": "linear", "factor": 2.0}, r"rope_scaling.type = \"linear\": expected \"yarn\""),
    ({"type": "yarn", "factor": 0, "original_max_position_embeddings": 64}, r"rope_scaling.factor = 0: expected a "
                                                                              r"finite number in \[1, 1024\]"),
    ({"type": "yarn", "factor": -4.0, "original_max_position_embeddings": 64}, r"rope_scaling.factor = -4.0"),
    ({"type": "yarn", "factor": float("nan"), "original_max_position_embeddings": 64}, r"rope_scaling.factor = NaN"),
    ({"type": "yarn", "factor": float("inf"), "original_max_position_embeddings": 64},
     r"rope_scaling.factor = Infinity"),
    ({"type": "yarn", "original_max_position_embeddings": 64}, r"rope_scaling.factor = null"),
    ({"type": "yarn", "factor": 4.0}, r"rope_scaling.original_max_position_embeddings = null"),
    ({"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "mscale": -1},
     r"rope_scaling.mscale = -1: expected a finite number >= 0"),
    ({"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "attention_factor": 1.2},
     r"rope_scaling.attention_factor = 1.2: expected 1 \(another value is not modelled\)"),
    ({"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "long_factor": [1.0]},
     r"rope_scaling.long_factor = \[1.0\]: expected no such key"),
    ("yarn", r"rope_scaling = \"yarn\": expected an object"),
])
def test_a_bad_rope_scaling_is_refused_naming_config_json_and_the_key(tmp_path: Path, rope_scaling: object,
                                                                      says: str) -> None:
    root = _ckpt(tmp_path / "c", rope_scaling)
    with pytest.raises(CheckpointError, match=r"config\.json: " + says):  # at open, as path 1's reader does
        dspark_step(open_checkpoint(root), None, 7, torch.bfloat16, "cpu")


def test_impact_runs_a_yarn_draft_checkpoint_through_the_step(tmp_path: Path) -> None:
    """`k3num impact --checkpoint` on a DSpark draft whose config has K3's YaRN: it runs (the CLI refused any
    rope_scaling before), and its rows are the draft's."""
    import io
    import subprocess
    import sys

    import pandas as pd

    root = _ckpt(tmp_path / "c", {"type": "yarn", "factor": 32, "original_max_position_embeddings": 32768,
                                  "mscale": 1.0, "mscale_all_dim": 1.0})
    r = subprocess.run([sys.executable, "-m", "k3num.harness.cli", "impact", "--device", "cpu", "--checkpoint",
                        str(root), "--engine", "mirror", "--cases", "2", "--format", "csv"],
                       cwd=Path(__file__).resolve().parents[1], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr[-2000:]
    rows = pd.read_csv(io.StringIO(r.stdout)).set_index("drafter")
    assert rows.loc["dspark", "positions"] == 14 and rows.loc["dspark", "block"] == 7, r.stdout
