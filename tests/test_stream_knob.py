"""The aux stream as a knob (issue 40 item 4): a draft trained on one target stream (the AttnRes mixture, vLLM's
VLLM_KIMI_K3_AUX_ATTN_RES_STREAM=1, or the prefix sum, its default) served with the other. harness/draft_step.run
takes `trained` (what the float64 step and the noise floor read) and `served` (what the engine's taps read);
`k3num impact --stream-mismatch` reports both mismatches per engine and drafter, and a draft checkpoint's
declared stream (`aux_hidden_stream`, TokenSpeed's key) is compared with the served one."""

from __future__ import annotations

import dataclasses
import io
import json
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import torch

from k3num.engines import base, registry
from k3num.fixtures.checkpoint import CheckpointError, open_checkpoint, write_checkpoint
from k3num.fixtures.draft_checkpoint import aux_stream
from k3num.harness import draft_step, impact

ROOT = Path(__file__).resolve().parents[1]


def _cases(kind: str) -> list:
    return impact.sample_cases(kind, 4, 0)


def test_a_matched_stream_is_the_step_as_before_and_a_mismatch_moves_the_logits_past_delta() -> None:
    """trained == served == attn_res is the step of every earlier row, bit for bit; serving the prefix to a draft
    trained on the mixture (and the reverse) moves the logits far past the noise floor's delta on every drafter."""
    mirror = registry.get("mirror")
    for kind in ("dspark", "dflash"):
        worst = []
        for case in _cases(kind):
            plain = draft_step.run(mirror, mirror, kind, case, "cpu")
            same = draft_step.run(mirror, mirror, kind, case, "cpu", trained="attn_res", served="attn_res")
            assert torch.equal(plain.engine, same.engine) and torch.equal(plain.oracle, same.oracle)
            for trained, served in (("attn_res", "prefix"), ("prefix", "attn_res")):
                r = draft_step.run(mirror, mirror, kind, case, "cpu", trained=trained, served=served)
                worst.append(r.verdict.worst_err_over_delta)
            # the noise floor reads the trained stream: it stays the engine-free floor of that stream
            back = draft_step.run(mirror, mirror, kind, case, "cpu", trained="prefix", served="prefix")
            assert back.verdict.worst_err_over_delta < 1.0, kind
        assert min(worst) > 1.0, (kind, worst)


def test_a_tap_that_ignores_the_stream_flag_is_seen_by_the_mismatch_row() -> None:
    """Planted: an aux tap that always mixes, whatever `enabled` says (a served flag wired to nothing). Its
    mismatched row is its matched one (no logit moves past delta), where the honest tap's moves past it: the
    row measures the engine's own tap, not the harness's idea of it."""
    mirror = registry.get("mirror")
    tap = mirror.subject(base.AUX_CAPTURE)

    def always_mixes(*args, **kwargs):
        return tap(*args, **{**kwargs, "enabled": True})

    planted = dataclasses.replace(mirror, name="mutant-tap-ignores-enabled",
                                  subjects={**mirror.subjects, base.AUX_CAPTURE: always_mixes})
    for case in _cases("dspark")[:2]:
        honest = draft_step.run(mirror, mirror, "dspark", case, "cpu", trained="attn_res", served="prefix")
        blind = draft_step.run(planted, mirror, "dspark", case, "cpu", trained="attn_res", served="prefix")
        assert honest.verdict.worst_err_over_delta > 1.0 >= blind.verdict.worst_err_over_delta


def test_an_unknown_stream_is_refused() -> None:
    mirror = registry.get("mirror")
    with pytest.raises(ValueError, match="stream 'mixture': expected one of attn_res, prefix"):
        draft_step.run(mirror, mirror, "dspark", _cases("dspark")[0], "cpu", served="mixture")


def _impact(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "k3num.harness.cli", "impact", "--device", "cpu", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)


def test_impact_stream_mismatch_gives_both_mismatches_per_engine_and_drafter_and_exits_0() -> None:
    r = _impact("--engine", "mirror", "--cases", "2", "--stream-mismatch", "--format", "csv")
    assert r.returncode == 0, r.stdout + r.stderr[-2000:]
    t = pd.read_csv(io.StringIO(r.stdout))
    pairs = sorted(zip(t["drafter"], t["trained_stream"], t["served_stream"]))
    assert pairs == [("dflash", "attn_res", "prefix"), ("dflash", "prefix", "attn_res"),
                     ("dspark", "attn_res", "prefix"), ("dspark", "prefix", "attn_res")]
    assert (t["worst_err_over_delta"] > 1).all() and t["predicted_flips"].notna().all()
    r = _impact("--engine", "mirror", "--stream-mismatch", "--served-stream", "prefix")
    assert r.returncode == 2 and "--stream-mismatch runs both mismatched pairs itself" in r.stderr
    r = _impact("--engine", "mirror", "--served-stream", "both")
    assert r.returncode == 2 and "invalid choice: 'both'" in r.stderr


def _ckpt(root: Path, **config: object) -> Path:
    root = write_checkpoint(root, draft_layers=2, hidden=128, kv_lora=32, rope_dim=16, q_lora=48,
                            step=dict(heads=2, head_dim=16, mlp=96, vocab=128, taps=2, lm_head=True))
    cfg = json.loads((root / "config.json").read_text())
    cfg.update(config)
    (root / "config.json").write_text(json.dumps(cfg))
    return root


def test_a_checkpoints_declared_stream_is_read_and_a_bad_one_refused_naming_the_key(tmp_path: Path) -> None:
    assert aux_stream(open_checkpoint(_ckpt(tmp_path / "none"))) is None
    assert aux_stream(open_checkpoint(_ckpt(tmp_path / "p", aux_hidden_stream="Prefix"))) == "prefix"
    nested = _ckpt(tmp_path / "n", dflash_config={"aux_hidden_stream": "attn_res"})
    assert aux_stream(open_checkpoint(nested)) == "attn_res"
    with pytest.raises(CheckpointError, match=r"config\.json: aux_hidden_stream = \"mixture\": expected one of "
                                              r"attn_res, prefix"):
        aux_stream(open_checkpoint(_ckpt(tmp_path / "bad", aux_hidden_stream="mixture")))


def test_impact_compares_a_checkpoints_trained_stream_with_the_served_one_and_says_so(tmp_path: Path) -> None:
    root = _ckpt(tmp_path / "c", aux_hidden_stream="prefix")
    r = _impact("--checkpoint", str(root), "--engine", "mirror", "--cases", "2", "--format", "csv")
    assert r.returncode == 0, r.stdout + r.stderr[-2000:]
    assert ("the checkpoint's config says its draft was trained on the prefix stream (aux_hidden_stream); the "
            "engines serve another stream: attn_res (--served-stream); the rows measure that mismatch") in r.stderr
    t = pd.read_csv(io.StringIO(r.stdout)).set_index("drafter")
    assert (t.loc["dspark", "trained_stream"], t.loc["dspark", "served_stream"]) == ("prefix", "attn_res")
    r = _impact("--checkpoint", str(root), "--engine", "mirror", "--cases", "2", "--served-stream", "prefix",
                "--format", "csv")
    assert r.returncode == 0 and "the engines serve the same stream" in r.stderr, r.stderr[-2000:]
    assert "served_stream" not in pd.read_csv(io.StringIO(r.stdout))
    r = _impact("--checkpoint", str(root), "--engine", "mirror", "--trained-stream", "attn_res")
    assert r.returncode == 2 and "the checkpoint's config says the draft was trained on prefix" in r.stderr
