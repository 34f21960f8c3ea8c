"""Import mode (supply.installed): when it is taken, why it is not, and what it binds.

No machine here has the engines installed with their compiled ops, so the
bound-from-the-installed-package half runs against `tests.fake_install`: the
released files laid out as an installed distribution, with placeholder modules
for the rest of the engine and our stand-ins as its "compiled" ops. Those tests
show that import mode binds the installed modules and files, labels every
record `import` with the installed file's sha256, and computes exactly what
source mode computes from the same files; whether the real compiled ops agree
with the oracle is for a GPU machine with the engine installed (docs/gpu-run.md).
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest
import torch

from k3num.engines import base, registry
from k3num.fixtures.builders import context_kv_inputs, draft_kv_inputs, projection_inputs, tap_inputs
from k3num.fixtures.strategies import ContextKVCase, DraftKVCase, ProjectionCase, TapCase
from k3num.oracles.drift import COLLECTOR
from k3num.refmodel.geometry import RopeSpec
from k3num.supply import fetch, installed
from tests.fake_install import TOPS, FakeInstall

LOW = torch.bfloat16


def _fetched(engine: str) -> bool:
    return bool(fetch.manifest(engine))


needs_sources = pytest.mark.skipif(not all(_fetched(e) for e in fetch.PINS),
                                   reason="the engine sources are not fetched (run `k3num fetch`)")


@pytest.fixture
def clean_imports(monkeypatch: pytest.MonkeyPatch):
    """Whatever a test imports from a fake install (the engines' packages) is gone afterwards; other
    modules first imported meanwhile (triton, ...) stay, since extension modules cannot be re-imported."""
    fakes = set().union(*TOPS.values())
    before = set(sys.modules)
    yield
    for name in set(sys.modules) - before:
        if name.split(".")[0] in fakes:
            del sys.modules[name]
    importlib.invalidate_caches()


def _install(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, engine: str, *, cuda: bool = True, ops: bool = True,
             **kw) -> FakeInstall:
    fake = FakeInstall(tmp_path / f"site-{engine}", engine, **kw)
    fake.activate(monkeypatch)
    importlib.invalidate_caches()
    monkeypatch.setattr(installed, "cuda_available", lambda: cuda)
    monkeypatch.setattr(installed, "op_registered", lambda ns, name: ops)
    return fake


def test_source_mode_is_kept_with_the_reason_when_the_engine_is_not_installed(clean_imports, monkeypatch) -> None:
    inst, note = installed.select(fetch.Source("vllm"), "auto", ["vllm/_custom_ops.py"], [])
    assert inst is None and note == "import mode not used: vllm is not installed"
    assert installed.select(fetch.Source("vllm"), "source", [], []) == (
        None, "source mode requested (--engine-mode source)")


def test_import_mode_when_required_and_impossible_makes_the_engine_unavailable_naming_why(clean_imports,
                                                                                        monkeypatch) -> None:
    with pytest.raises(registry.EngineUnavailable, match="import mode requested .* tokenspeed is not installed"):
        installed.select(fetch.Source("tokenspeed"), "import", [], [])


def test_an_unknown_engine_mode_is_refused(clean_imports, monkeypatch) -> None:
    with pytest.raises(registry.EngineUnavailable, match="unknown engine mode 'imported'"):
        installed.select(fetch.Source("vllm"), "imported", [], [])


@needs_sources
@pytest.mark.parametrize("broken, why", [
    ("version", "vllm 0.32.0 is installed; the pin is 0.34.0"),
    ("cuda", "vllm 0.34.0 is installed but there is no CUDA device for its compiled ops"),
    ("local", "a local tree is given for vllm (--engine-src)"),
    ("import", "vllm 0.34.0: importing vllm.models.kimi_k3.nvidia.ops.attn_res failed: RuntimeError: broken on "
               "purpose"),
    ("ops", "vllm 0.34.0: compiled ops not registered: torch.ops._C.rms_norm, torch.ops._C.rotary_embedding, "
            "torch.ops._C_cache_ops.concat_and_cache_mla_grouped"),
])
def test_each_precondition_of_import_mode_is_named_when_it_fails(clean_imports, monkeypatch, tmp_path, broken,
                                                                 why) -> None:
    from k3num.engines.vllm_adapter import common as vllm_engine

    kw: dict = {"version": "0.32.0"} if broken == "version" else {}
    if broken == "import":
        kw["overrides"] = {vllm_engine.ATTN_RES_PY: "raise RuntimeError('broken on purpose')\n"}
    _install(tmp_path, monkeypatch, "vllm", cuda=broken != "cuda", ops=broken != "ops", **kw)
    sources = {}
    if broken == "local":  # a copy of the pinned files (the cache's own tree would be the pinned release)
        tree = tmp_path / "local-tree"
        for rel in fetch.PINS["vllm"].files:
            (tree / rel).parent.mkdir(parents=True, exist_ok=True)
            (tree / rel).write_bytes((fetch.Source("vllm").root / rel).read_bytes())
        sources = {"vllm": tree}
    engine = registry.build("vllm", sources)
    # the note names why import mode was not taken first; an interpreter run declares its adaptation after it
    assert engine.mode != "import" and engine.mode_note.split("; interpreter adaptation")[0] == (
        f"import mode not used: {why}")
    with pytest.raises(registry.EngineUnavailable, match="import mode requested"):
        registry.build("vllm", sources, "import")


@needs_sources
@pytest.mark.parametrize("name", ["vllm", "vllm-rocm", "sglang", "tokenspeed"])
def test_an_installed_engine_is_bound_from_its_installed_files(clean_imports, monkeypatch, tmp_path, name) -> None:
    pin = fetch.PINS[name.split("-")[0]]
    fake = _install(tmp_path, monkeypatch, pin.engine)
    engine = registry.build(name)
    assert (engine.mode, engine.version, engine.mode_note) == ("import", pin.version, "")
    assert engine.real_ops.startswith("real: ")
    installed_sha = {fetch.sha256_of(fake.site / rel) for rel in pin.files if (fake.site / rel).exists()}
    assert set(engine.source_sha256.values()) <= installed_sha
    # the modules the subjects came from are the installed files, imported for real
    for mod in (sys.modules[installed.module_name(rel)] for rel in pin.files
                if installed.module_name(rel) in sys.modules and (fake.site / rel).exists()):
        assert Path(mod.__file__).is_relative_to(fake.site), mod.__file__


def _both(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str) -> tuple[base.Engine, base.Engine]:
    """(source-mode engine, import-mode engine on the fake install of the same files)."""
    src = registry.build(name, mode="source")
    _install(tmp_path, monkeypatch, name.split("-")[0])
    imp = registry.build(name, mode="import")
    assert (src.mode, imp.mode) == ("source-interpreter" if not torch.cuda.is_available() else "source-gpu", "import")
    return src, imp


def _same(a, b) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    elif isinstance(a, (tuple, list)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _same(x, y)
    else:
        assert a == b


def _run(engine: base.Engine, subject: str, make_args):
    return engine.subject(subject)(*make_args())


@needs_sources
@pytest.mark.parametrize("name", ["vllm", "vllm-rocm"])
def test_import_mode_computes_what_source_mode_computes_from_the_same_vllm_files(clean_imports, monkeypatch,
                                                                                 tmp_path, name) -> None:
    from k3num.engines.vllm_adapter import common as vllm_engine

    src, imp = _both(tmp_path, monkeypatch, name)
    # attn_res is the installed module's own function. Its Triton kernel cannot run here: a file-backed
    # kernel under the interpreter fails its source-tile loop (BRIEF §4 quirk b); source mode execs
    # the text instead. So the capture below calls it through a recorder that runs source mode's.
    kernel_py = vllm_engine.ATTN_RES_PY if name == "vllm" else vllm_engine.AMD_ATTN_RES_PY
    assert imp.subject(base.ATTN_RES) is sys.modules[installed.module_name(kernel_py)].attn_res
    calls: list[int] = []
    if name == "vllm":
        def recorder(*args, **kwargs):
            calls.append(1)
            return src.subject(base.ATTN_RES)(*args, **kwargs)

        monkeypatch.setattr(sys.modules[installed.module_name(vllm_engine.MODEL_PY)], "attn_res", recorder)
        imp = registry.build(name, mode="import")  # binds the capture again, with the module's (patched) globals
    tap = TapCase(num_layers=3, block_size=1, stage_end=3, layer_idx=1, tokens=2, hidden=16, seed=3)
    taps = []
    for e in (src, imp):
        inp = tap_inputs(tap, LOW, "cpu")
        taps.append(e.subject(base.AUX_CAPTURE)(
            tap.layer_idx, inp.prefix_sum, inp.pending, inp.bank, enabled=True, weights=inp.weights,
            block_size=tap.block_size, end_layer=tap.stage_end, num_layers=tap.num_layers, is_last_rank=True,
            eps=1e-5))
    _same(*taps)
    if name == "vllm-rocm":
        return
    assert calls == [1], "the imported capture did not call the attn_res of its own module"
    ckv = ContextKVCase(32, 2, 8, 16, RopeSpec(8, 10000.0, "neox", None), 3, 64, 1, 1.0, 30.0)
    inp = context_kv_inputs(ckv, LOW, "cpu")
    _same(*(_run(e, base.CONTEXT_KV_FUSED, lambda: (inp.x, inp.kv_a, inp.norm, inp.positions, ckv.rope, 1e-5))
            for e in (src, imp)))
    names = ["layers.0.self_attn.kv_a_proj_with_mqa.weight", "norm.weight",
             "layers.1.self_attn.kv_a_proj_with_mqa.weight_scale", "layers.7.self_attn.kv_a_proj_with_mqa.weight"]
    mapped = []
    for e in (src, imp):
        loading = e.extras["weight_loading"]
        dup = list(loading.duplicate(iter([(n, torch.zeros(1)) for n in names]), 2))
        mapped.append([(n, getattr(t, "shard_id", None)) for n, t in loading.mapper.apply(iter(dup))])
    assert mapped[0] == mapped[1] and len(mapped[0]) == len(names) + 2


@needs_sources
def test_import_mode_computes_what_source_mode_computes_from_the_same_sglang_files(clean_imports, monkeypatch,
                                                                                   tmp_path) -> None:
    src, imp = _both(tmp_path, monkeypatch, "sglang")
    g = torch.Generator().manual_seed(0)
    prefix, bank = torch.randn(3, 48, generator=g).to(LOW), torch.randn(3, 4, 48, generator=g).to(LOW)
    norm, proj = torch.rand(48, generator=g).to(LOW) + 0.5, torch.randn(48, generator=g).to(LOW)
    _same(*(_run(e, base.ATTN_RES_MIX_EAGER, lambda: (prefix, bank, 3, norm, proj, 1e-5)) for e in (src, imp)))
    pc = ProjectionCase(3, 4, 16, 16, ((0, 1, 2),), (0,), 2, 1.0, 30.0)
    pin = projection_inputs(pc, LOW, "cpu")
    _same(*(_run(e, base.PROJECT_UNSHARDED, lambda: (pin.taps, pin.fc, pin.norm, 1e-5)) for e in (src, imp)))
    dc = DraftKVCase(32, 2, 2, 16, RopeSpec(16, 10000.0, "gptj", None), 4, 7)
    dk = draft_kv_inputs(dc, LOW, "cpu")
    _same(*(_run(e, base.DRAFT_CONTEXT_KV, lambda: (dk.ctx, dk.k_weight, dk.v_weight, dk.k_norm, dk.positions,
                                                     dc.rope, 1e-5)) for e in (src, imp)))
    pairs = [e.extras["transfer_pairs"]([3, 4, 5], [5, 3, 4], 3, 3, False) for e in (src, imp)]
    assert pairs[0] == pairs[1]


@needs_sources
def test_import_mode_computes_what_source_mode_computes_from_the_same_tokenspeed_files(clean_imports, monkeypatch,
                                                                                       tmp_path) -> None:
    src, imp = _both(tmp_path, monkeypatch, "tokenspeed")
    pc = ProjectionCase(3, 4, 16, 16, ((0, 2), (1,)), (1, 0), 2, 1.0, 30.0)
    pin = projection_inputs(pc, LOW, "cpu")
    parts = [[e.subject(base.STAGE_PARTIAL)(pin.taps, pin.fc, list(m)) for m in pc.stages] for e in (src, imp)]
    _same(*parts)
    _same(*(e.subject(base.FINALIZE_PROJECTION)(p, pin.norm, 1e-5, torch.float32, list(pc.order))
            for e, p in zip((src, imp), parts)))
    _same(*(_run(e, base.PROJECT_UNSHARDED, lambda: (pin.taps, pin.fc, pin.norm, 1e-5)) for e in (src, imp)))
    ckv = ContextKVCase(32, 2, 8, 16, RopeSpec(8, 10000.0, "gptj", None), 3, 64, 1, 1.0, 30.0)
    inp = context_kv_inputs(ckv, LOW, "cpu")
    _same(*(_run(e, base.CONTEXT_KV_UNFUSED, lambda: (inp.x, inp.fused_qkv_a, inp.norm, inp.positions, ckv.rope,
                                                       1e-5)) for e in (src, imp)))
    owners = [[e.extras["tap_owner"](layer, 6, stream) for layer in range(6) for stream in ("attn_res", "prefix")]
              for e in (src, imp)]
    assert owners[0] == owners[1]


@needs_sources
def test_records_of_an_imported_engine_carry_import_mode_and_the_installed_files_sha256(clean_imports,
                                                                                         monkeypatch,
                                                                                         tmp_path) -> None:
    from k3num.properties.checks.context_kv import check_fused_within_budget_of_unfused

    fake = _install(tmp_path, monkeypatch, "vllm")
    engine = registry.build("vllm")
    case = ContextKVCase(32, 2, 8, 16, RopeSpec(8, 10000.0, "neox", None), 3, 64, 1, 1.0, 30.0)
    start = len(COLLECTOR.records)
    try:
        check_fused_within_budget_of_unfused(engine, case, "cpu")
        rows = [r.row() for r in COLLECTOR.records[start:]]
    finally:
        del COLLECTOR.records[start:]
    assert rows
    from k3num.engines.vllm_adapter import DSPARK_PY, IMPORT_OPS

    for row in rows:
        assert (row["engine"], row["engine_version"], row["mode"]) == ("vllm", "0.34.0", "import")
        assert (row["real_ops"], row["source_sha256"]) == (IMPORT_OPS, fetch.sha256_of(fake.site / DSPARK_PY))


@needs_sources
def test_ledger_matching_expects_import_mode_only_where_the_pinned_engine_is_installed_on_cuda(
        clean_imports, monkeypatch, tmp_path) -> None:
    monkeypatch.setattr(installed, "cuda_available", lambda: False)
    vllm = fetch.Source("vllm")
    assert installed.expected_mode(vllm, "auto") == "source-interpreter"  # not installed here
    _install(tmp_path, monkeypatch, "vllm")  # cuda_available -> True
    assert installed.expected_mode(vllm, "auto") == "import"
    assert installed.expected_mode(vllm, "source") == "source-gpu"
    assert installed.expected_mode(fetch.Source("vllm", tmp_path), "auto") == "source-gpu"  # a local tree
    _install(tmp_path / "old", monkeypatch, "tokenspeed", version="0.1.0")
    assert installed.expected_mode(fetch.Source("tokenspeed"), "auto") == "source-gpu"
