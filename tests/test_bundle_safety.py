"""A repro bundle from a stranger is data (issue 22): opening one imports and calls nothing it names,
and its verdict comes from this harness's oracle and budget, not from numbers in the file.

Every crafted bundle below is refused with its message, or judged with the recomputed budget; none
runs code: a sentinel file is never created, and no module appears in sys.modules."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file

from k3num.engines import base, registry
from k3num.fixtures.builders import attn_res_inputs
from k3num.fixtures.strategies import AttnResCase
from k3num.harness import judges, repro
from k3num.oracles.records import judge

CASE = AttnResCase(tokens=2, hidden=32, bank=3, num_blocks=2, block_write_idx=2, with_delta=True,
                   with_output_norm=True, seed=3, scale=1.0, outliers=30.0)
PROPERTY = "attn_res_within_rounding_budget"


def _delta_twice(prefix, delta, blocks, *args):
    """tests/mutants.py's attn_res_delta_twice: the delta added before the kernel and again inside."""
    from k3num.engines.mirror import attn_res as m_attn

    if delta is not None:
        prefix.copy_((prefix.float() + delta.float()).to(prefix.dtype))
    return m_attn.attn_res(prefix, delta, blocks, *args)


@pytest.fixture(scope="module", autouse=True)
def _mutant_engine() -> None:
    from k3num.engines import mirror

    registry.register("bundle-mutant", lambda: dataclasses.replace(
        mirror.build(), name="bundle-mutant", subjects={base.ATTN_RES: _delta_twice}))


def _write_bundle(path: Path, engine_name: str) -> tuple[Path, dict]:
    """A bundle as properties.support writes one: the subject's cloned inputs, its output, the oracle's."""
    engine = registry.get(engine_name)
    inp = attn_res_inputs(CASE, torch.bfloat16, "cpu")
    args = (inp.prefix, inp.delta, inp.blocks, inp.norm, inp.qk, inp.out_norm, CASE.num_blocks,
            CASE.block_write_idx, judges.EPS, judges.OUT_EPS)
    cloned = tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in args)
    want, budget = judges.attn_res_oracle(engine, *args[:8])
    out = engine.subject(base.ATTN_RES)(*args)
    rec = judge(property=PROPERTY, engine=engine, subject=base.ATTN_RES, actual=out, reference=want,
                budget=budget, seed=CASE.seed)
    meta = {k: getattr(rec, k) for k in ("engine", "engine_version", "mode", "source_sha256", "subject", "property",
                                         "detail", "seed", "budget", "budget_rule", "max_abs", "ratio", "verdict",
                                         "ledger")}
    meta["node_id"] = "tests/test_bundle_safety.py"
    repro.write(path, call=(cloned, {}, out, args, {}), actual=out, reference=want, meta=meta)
    return path, _meta(path)


def _meta(path: Path) -> dict:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as fh:
        return json.loads(fh.metadata()["k3num"])


def _rewrite(path: Path, meta: dict, out: Path, tensors: dict | None = None) -> Path:
    _, stored = repro.load(path)
    save_file(tensors if tensors is not None else stored, str(out), metadata={"k3num": json.dumps(meta)})
    return out


@pytest.fixture(scope="module")
def good(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    repro.arg_types()  # the table's own modules (the harness's argument types) are imported from here on
    return _write_bundle(tmp_path_factory.mktemp("bundle") / "good.safetensors", "mirror")


@pytest.fixture(scope="module")
def failing(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    path, meta = _write_bundle(tmp_path_factory.mktemp("bundle") / "bad.safetensors", "bundle-mutant")
    assert meta["verdict"] == "fail"
    return path, meta


def test_a_bundle_of_the_harness_replays_with_its_recomputed_budget(good) -> None:
    passed, line = repro.replay(good[0])
    assert passed and line.startswith("PASS") and "differs" not in line and "not recomputed" not in line, line


CODE = {
    "subprocess:run": {"args": "touch {sentinel}", "shell": True},
    "os:system": {"command": "touch {sentinel}"},
    "builtins:eval": {"source": "open({sentinel!r}, 'w')"},
    # a harness module's function that is not an argument type
    "k3num.harness.fixes:patched_tree": {"engine": "vllm", "out": "{sentinel}"},
}


@pytest.mark.parametrize("name", sorted(CODE))
def test_an_argument_naming_code_is_refused_before_anything_runs(good, tmp_path: Path, name: str) -> None:
    sentinel = tmp_path / "sentinel"
    meta = dict(good[1])
    fields = {k: (v.format(sentinel=str(sentinel)) if isinstance(v, str) else v) for k, v in CODE[name].items()}
    meta["args"] = [{"dataclass": name, "fields": fields}, *meta["args"][1:]]
    bundle = _rewrite(good[0], meta, tmp_path / "crafted.safetensors")
    before = set(sys.modules)
    with pytest.raises(repro.NotReplayable, match=rf"not a repro bundle: arg\.0 names an unknown type '{name}'"):
        repro.replay(bundle)
    assert not sentinel.exists()
    assert set(sys.modules) == before


def test_a_field_naming_code_inside_a_known_type_is_refused(good, tmp_path: Path) -> None:
    meta = dict(good[1])
    rope = {"dataclass": "k3num.refmodel.geometry:RopeSpec",
            "fields": {"rotary_dim": 8, "theta": 1e4, "style": "gptj",
                       "yarn": {"dataclass": "subprocess:Popen", "fields": {"args": ["true"]}}}}
    meta["args"] = [*meta["args"], rope]
    with pytest.raises(repro.NotReplayable, match=r"arg\.10\.yarn names an unknown type 'subprocess:Popen'"):
        repro.replay(_rewrite(good[0], meta, tmp_path / "nested.safetensors"))


def test_a_dtype_must_be_a_torch_dtype_not_any_attribute_of_torch(good, tmp_path: Path) -> None:
    meta = dict(good[1])
    meta["args"] = [*meta["args"], {"dtype": "load"}]
    with pytest.raises(repro.NotReplayable, match=r"arg\.10 names an unknown dtype 'load'"):
        repro.replay(_rewrite(good[0], meta, tmp_path / "dtype.safetensors"))


def test_a_deeply_nested_argument_is_refused_as_a_decode_bomb(good, tmp_path: Path) -> None:
    deep: object = 0
    for _ in range(200):
        deep = {"list": [deep]}
    meta = dict(good[1])
    meta["args"] = [*meta["args"], deep]
    with pytest.raises(repro.NotReplayable, match=r"nests deeper than the format's 16 levels"):
        repro.replay(_rewrite(good[0], meta, tmp_path / "deep.safetensors"))
    wide = {"list": [{"list": list(range(100))} for _ in range(200)]}
    meta["args"] = [*good[1]["args"], wide]
    with pytest.raises(repro.NotReplayable, match=r"past the format's 10000 entries"):
        repro.replay(_rewrite(good[0], meta, tmp_path / "wide.safetensors"))


def test_metadata_too_deep_for_json_is_refused(good, tmp_path: Path) -> None:
    raw = json.dumps(good[1])[:-1] + ', "x": ' + "[" * 100_000 + "]" * 100_000 + "}"
    _, stored = repro.load(good[0])
    save_file(stored, str(tmp_path / "json.safetensors"), metadata={"k3num": raw})
    with pytest.raises(repro.NotReplayable, match="not a repro bundle"):
        repro.replay(tmp_path / "json.safetensors")


def test_an_enormous_declared_shape_is_refused(good, tmp_path: Path) -> None:
    """A header that declares a [2^40] tensor over 8 bytes of data: safetensors' own check, as a refusal."""
    header = json.dumps({"__metadata__": {"k3num": json.dumps(good[1])},
                         "actual": {"dtype": "F32", "shape": [1 << 40], "data_offsets": [0, 8]}}).encode()
    path = tmp_path / "shape.safetensors"
    path.write_bytes(len(header).to_bytes(8, "little") + header + b"\0" * 8)
    with pytest.raises(repro.NotReplayable, match="not a repro bundle"):
        repro.replay(path)


def test_a_tensor_the_file_does_not_hold_is_refused_by_its_entry(good, tmp_path: Path) -> None:
    meta = dict(good[1])
    meta["args"] = [{"tensor": "arg.99"}, *meta["args"][1:]]
    with pytest.raises(repro.NotReplayable, match=r"arg\.0 names a tensor 'arg\.99' the file does not hold"):
        repro.replay(_rewrite(good[0], meta, tmp_path / "missing.safetensors"))


def test_an_edited_budget_does_not_turn_a_failure_into_a_pass(failing, tmp_path: Path) -> None:
    passed, line = repro.replay(failing[0])
    assert not passed and "differs" not in line, line
    meta = dict(failing[1], budget=1e9)
    passed, line = repro.replay(_rewrite(failing[0], meta, tmp_path / "budget.safetensors"))
    assert not passed, line
    assert "the bundle's budget differs from this harness's (recorded 1.000000e+09, computed" in line, line


def test_an_edited_reference_is_refused_as_tampered(failing, tmp_path: Path) -> None:
    _, stored = repro.load(failing[0])
    forged = dict(stored, reference=stored["actual"].double())  # the subject's output as its own oracle
    with pytest.raises(repro.NotReplayable, match="tampered or foreign bundle"):
        repro.replay(_rewrite(failing[0], failing[1], tmp_path / "reference.safetensors", tensors=forged))


def test_a_property_without_a_judge_here_says_its_budget_was_not_recomputed(good, tmp_path: Path) -> None:
    meta = dict(good[1], property="some_older_property", budget_rule="an older rule")
    passed, line = repro.replay(_rewrite(good[0], meta, tmp_path / "older.safetensors"))
    assert passed and "budget not recomputed" in line and "an older rule" in line, line


def _json() -> st.SearchStrategy:
    leaf = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True) | st.text(max_size=12)
    return st.recursive(leaf, lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=8), c, max_size=4),
                        max_leaves=20)


FIELDS = ("format", "engine", "subject", "property", "judged", "budget", "budget_rule", "args", "kwargs",
          "replayable", "engine_version", "mode", "max_abs", "detail")


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(edits=st.dictionaries(st.sampled_from(FIELDS), _json(), max_size=4),
       arg_edits=st.dictionaries(st.integers(0, 9), _json(), max_size=3), drop=st.booleans())
def test_any_metadata_either_replays_or_is_refused_and_imports_nothing(good, tmp_path: Path, edits: dict,
                                                                      arg_edits: dict, drop: bool) -> None:
    repro.replay(good[0])  # what a valid bundle imports is imported now
    meta = dict(good[1])
    if drop and edits:
        for k in edits:
            meta.pop(k, None)
    else:
        meta.update(edits)
    if isinstance(meta.get("args"), list):
        meta["args"] = [arg_edits.get(i, a) for i, a in enumerate(meta["args"])]
    path = _rewrite(good[0], meta, tmp_path / "fuzz.safetensors")
    before = set(sys.modules)
    try:
        repro.replay(path)
    except repro.NotReplayable:
        pass
    assert set(sys.modules) - before == set()


# --- the other files a user may receive: golden sets, checkpoints, histories ---------------------------


def test_a_golden_manifest_naming_a_path_outside_the_set_is_refused(tmp_path: Path) -> None:
    from k3num.fixtures import golden

    root = golden.write("tiny-attnres", 1, tmp_path / "set", log=lambda *_: None)
    m = json.loads((root / golden.MANIFEST).read_text())
    for name in ("../../etc/passwd", "/etc/passwd", "sub/case-0000.safetensors", "case-0000.py"):
        forged = dict(m, files={**m["files"], name: "0" * 64})
        (root / golden.MANIFEST).write_text(json.dumps(forged))
        with pytest.raises(golden.GoldenError, match="not a case file of the set"):
            golden.load_manifest(root)
    (root / golden.MANIFEST).write_text(json.dumps(dict(m, kind="exec")))
    with pytest.raises(golden.GoldenError, match="is not one this harness writes"):
        golden.load_manifest(root)


def test_a_checkpoint_index_naming_a_file_outside_the_checkpoint_is_refused(tmp_path: Path) -> None:
    from k3num.fixtures import checkpoint as ckpt

    root = ckpt.write_checkpoint(tmp_path / "draft", draft_layers=2)
    index = json.loads((root / ckpt.INDEX).read_text())
    first = next(iter(index["weight_map"]))
    (tmp_path / "outside.safetensors").write_bytes((root / index["weight_map"][first]).read_bytes())
    for target in ("../outside.safetensors", str(tmp_path / "outside.safetensors"), "..", "shard.py"):
        forged = dict(index, weight_map={**index["weight_map"], first: target})
        (root / ckpt.INDEX).write_text(json.dumps(forged))
        with pytest.raises(ckpt.CheckpointError, match="not a .safetensors file of the checkpoint's own directory"):
            ckpt.open_checkpoint(root)


def test_a_history_puts_nothing_but_quoted_words_into_the_replay_commands_it_shows() -> None:
    import shlex

    from k3num.harness.nightly import report

    evil = "properties/x.py::t'; touch /tmp/pwned; echo '"
    run = {"meta": {"repro_dir": ""}, "worst": [{"engine": "mirror; rm -rf ~", "subject": "attn_res",
                                                 "property": "p$(id)", "ratio": 2.0, "max_abs": 1.0, "budget": 0.5,
                                                 "shape": "1", "seed": 0, "ledger": "", "node": evil}]}
    cmd = report.worst_cases(run)["replay"].iloc[0]
    first, second = cmd.split("; k3num replay ")
    words = shlex.split(first)
    assert words[:4] == ["python", "-m", "pytest", evil] and words[5] == "mirror; rm -rf ~", words
    assert shlex.split(second) == ["R/p$(id)-mirror; rm -rf ~-worst.safetensors"], second
