"""`k3num build-ops` and the csrc it builds from, on a machine without CUDA (issue 10).

The build itself runs on a CUDA machine (docs/gpu-run.md, runs 14-16); here: the sdist's include
closure is extracted and pinned, a changed csrc tree is reported, the registration file takes its
schemas from the sdist's own bindings (a removed op is "contract changed"), compile errors are
reported by file and line, and without CUDA the mode is absent and says why.
"""

from __future__ import annotations

import io
import os
import re
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import torch

from k3num.supply import cuda_ops, fetch

ROOT = Path(__file__).resolve().parents[1]


def _sdist(path: Path, files: dict[str, str]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(path, "w:gz") as tf:
        for name, text in files.items():
            data = text.encode()
            info = tarfile.TarInfo(f"toy-1.0/{name}")
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    return path


TOY = {
    "csrc/kernels.cu": '#include "ops.h"\n#include "core/util.cuh"\n#include <cuda.h>\n#include "missing.h"\n',
    "csrc/ops.h": '#include "torch_utils.h"\n',
    "csrc/torch_utils.h": "// helpers\n",
    "csrc/core/util.cuh": '#include "../torch_utils.h"\n#include "near.h"\n',
    "csrc/core/near.h": "// found next to its includer\n",
    "csrc/unrelated.cu": "// never included\n",
}


@pytest.fixture
def toy_sdist(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("K3NUM_ENGINE_CACHE", str(tmp_path))
    archive = _sdist(tmp_path / "sdists" / "toy-1.0.tar.gz", TOY)
    monkeypatch.setitem(fetch.PINS, "toy", fetch.Pin("toy", "toy", "1.0", "0" * 64, ()))
    monkeypatch.setitem(fetch.SDISTS, "toy", fetch.SdistPin("toy", "toy-1.0.tar.gz", fetch.sha256_of(archive),
                                                            ("csrc/kernels.cu",)))
    return archive


def test_the_include_closure_of_the_roots_is_extracted_and_nothing_else(toy_sdist: Path) -> None:
    root = fetch.fetch_csrc("toy", log=lambda _: None)
    got = sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file() and p.name != fetch.MANIFEST)
    assert got == ["csrc/core/near.h", "csrc/core/util.cuh", "csrc/kernels.cu", "csrc/ops.h", "csrc/torch_utils.h"]
    assert fetch.csrc_problems("toy") == []


def test_a_changed_csrc_tree_is_named_and_fetch_restores_it(toy_sdist: Path) -> None:
    root = fetch.fetch_csrc("toy", log=lambda _: None)
    (root / "csrc/ops.h").write_text("// edited\n")
    problems = fetch.csrc_problems("toy")
    assert len(problems) == 1 and "csrc/ops.h: expected sha256" in problems[0]
    fetch.fetch_csrc("toy", log=lambda _: None)
    assert fetch.csrc_problems("toy") == [] and (root / "csrc/ops.h").read_text() == TOY["csrc/ops.h"]


def test_an_sdist_that_fails_its_pin_is_refused_and_deleted(toy_sdist: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(fetch.SDISTS, "toy", fetch.SdistPin("toy", "toy-1.0.tar.gz", "1" * 64, ("csrc/kernels.cu",)))
    with pytest.raises(fetch.FetchError, match="the pin is 1{64}: refused and deleted"):
        fetch.fetch_csrc("toy", log=lambda _: None)
    assert not toy_sdist.exists()


def test_a_manifest_that_differs_from_its_pin_is_refused(toy_sdist: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pin = fetch.SDISTS["toy"]
    monkeypatch.setitem(fetch.SDISTS, "toy", fetch.SdistPin(pin.engine, pin.filename, pin.sha256, pin.roots,
                                                            manifest_sha256="2" * 64))
    with pytest.raises(fetch.FetchError, match="SdistPin.manifest_sha256 is 2{64}"):
        fetch.fetch_csrc("toy", log=lambda _: None)


BINDINGS = '''
STABLE_TORCH_LIBRARY_FRAGMENT(_C, ops) {
  ops.def(
      "rms_norm(Tensor! result, Tensor input, Tensor? weight, float epsilon) "
      "-> ()");
  ops.def("rotary_embedding(Tensor positions, Tensor! query, Tensor!? key, int head_size,"
          " Tensor cos_sin_cache, bool is_neox) -> ()");
  ops.def("concat_and_cache_mla_grouped(Tensor a) -> ()");
  ops.def("fused_kimi_k3_mla_key_concat_kv_cache_insert(Tensor! q, Tensor k_nope) -> ()");
  ops.def("fused_kimi_k3_mla_qkv_quant_kv_cache_fp8_insert(Tensor q, Tensor! q_fp8) -> ()");
  ops.def("fused_kimi_k3_mla_decode_q_concat_kv_cache_insert(Tensor ql_nope, Tensor! mqa_q) -> ()");
  ops.def("fused_kimi_k3_mla_decode_q_concat_kv_cache_fp8_insert(Tensor ql_nope, Tensor! mqa_q) -> ()");
}
STABLE_TORCH_LIBRARY_FRAGMENT(_C_cache_ops, ops) {
  ops.def(
      "concat_and_cache_mla_grouped(Tensor kv_c, Tensor k_pe,"
      "                             Tensor kv_cache_ptrs) -> ()");
  ops.def("concat_and_cache_mla(Tensor kv_c, Tensor k_pe, Tensor! kv_cache) -> ()");
}
'''


def test_schemas_are_read_from_the_namespace_the_wrappers_call() -> None:
    sch = cuda_ops.schemas(BINDINGS)
    assert sch[("_C", "rms_norm")] == "rms_norm(Tensor! result, Tensor input, Tensor? weight, float epsilon) -> ()"
    # the _C namespace's homonym is not the cache op
    assert sch[("_C_cache_ops", "concat_and_cache_mla_grouped")] == (
        "concat_and_cache_mla_grouped(Tensor kv_c, Tensor k_pe, Tensor kv_cache_ptrs) -> ()")
    src = cuda_ops.registration_source(BINDINGS)
    for ns, op in cuda_ops.OPS:
        assert f'm.impl("{op}", TORCH_BOX(&{op}));' in src
    assert src.count("STABLE_TORCH_LIBRARY_FRAGMENT(") == 2 and '#include "ops.h"' in src


def test_a_bindings_file_without_an_op_is_a_changed_contract() -> None:
    with pytest.raises(cuda_ops.BuildError, match=r"contract changed: csrc/torch_bindings.cpp no longer declares "
                                                  r"\['_C::rotary_embedding'\]"):
        cuda_ops.schemas(BINDINGS.replace("rotary_embedding(", "rotary_embedding_v2("))


def test_the_pinned_sdists_bindings_declare_the_bound_ops() -> None:
    path = fetch.csrc_dir("vllm") / cuda_ops.BINDINGS
    if fetch.csrc_problems("vllm"):
        pytest.skip("vLLM's csrc is not fetched here: run `k3num fetch vllm-csrc`")
    sch = cuda_ops.schemas(path.read_text())
    assert sch[("_C_cache_ops", "concat_and_cache_mla_grouped")].startswith(
        "concat_and_cache_mla_grouped(Tensor kv_c, Tensor k_pe, Tensor kv_cache_ptrs, Tensor slot_mapping, "
        "int block_size, int block_stride, int entry_stride")


@pytest.mark.parametrize("log, want", [
    ("[1/4] nvcc ...\n/c/csrc/cache_kernels.cu(1483): error: namespace \"vllm::fp8\" has no member \"x\"\n"
     "/c/csrc/cache_kernels.cu(1490): error: later\n", "/c/csrc/cache_kernels.cu:1483: namespace \"vllm::fp8\" has no "
                                                      "member \"x\""),
    ("In file included from a.cpp:1:\n/c/csrc/ops.h:12:5: error: 'foo' was not declared\n",
     "/c/csrc/ops.h:12: 'foo' was not declared"),
    ("/c/k3num_registration.cpp:3:10: fatal error: ops.h: No such file or directory\n",
     "/c/k3num_registration.cpp:3: ops.h: No such file or directory"),
])
def test_the_first_compiler_error_is_named_by_file_and_line(log: str, want: str) -> None:
    assert str(cuda_ops.first_compile_error(log)) == want


def test_the_build_key_follows_sdist_torch_and_arch() -> None:
    assert cuda_ops.build_key("90") != cuda_ops.build_key("100")
    assert torch.__version__.replace("+", "_") in cuda_ops.build_key("90")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without CUDA")
def test_without_cuda_the_build_is_refused_and_the_mode_says_why() -> None:
    with pytest.raises(cuda_ops.BuildError, match="no CUDA device"):
        cuda_ops.build(log=lambda _: None)
    assert cuda_ops.load() == (None, "no CUDA device: the ops are CUDA kernels (torch.cuda.is_available() is False)")
    proc = subprocess.run([sys.executable, "-m", "k3num.harness.cli", "build-ops"], cwd=ROOT, capture_output=True,
                          text=True)
    assert proc.returncode == 2 and "[build-ops] ERROR: no CUDA device" in proc.stderr


def test_the_cli_lists_every_subcommand() -> None:
    proc = subprocess.run([sys.executable, "-m", "k3num.harness.cli", "--help"], cwd=ROOT, capture_output=True,
                          text=True)
    assert proc.returncode == 0 and "fetch" in proc.stdout and "build-ops" in proc.stdout


def test_the_vllm_csrc_pin_names_its_manifest() -> None:
    assert len(fetch.SDISTS["vllm"].manifest_sha256) == 64


# --- a checkout's csrc (`k3num build-ops --engine-src vllm=PATH`) ----------------------------------------


@pytest.fixture
def checkout(tmp_path: Path) -> Path:
    """A vLLM checkout's root: the pinned csrc closure under csrc/ (what `k3num fetch vllm-csrc` extracted)."""
    if fetch.csrc_problems("vllm"):
        pytest.skip("vLLM's csrc is not fetched here (k3num fetch vllm-csrc)")
    tree = tmp_path / "vllm-checkout"
    shutil.copytree(fetch.csrc_dir("vllm") / "csrc", tree / "csrc")
    return tree


def test_a_checkouts_csrc_is_built_as_local_and_cached_by_the_hash_of_its_files(checkout: Path) -> None:
    src = cuda_ops.checkout_sources(checkout)
    assert src.local and src.label == f"{fetch.PINS['vllm'].version}+local" and src.root == checkout
    assert cuda_ops.build_key("90", src) != cuda_ops.build_key("90")  # not the pinned build
    with open(checkout / "csrc" / "cache_kernels.cu", "a") as fh:
        fh.write("// a change of the head\n")
    assert cuda_ops.checkout_sources(checkout).digest != src.digest  # an edit is a new build


def test_a_checkout_missing_a_bound_file_is_refused_naming_it(checkout: Path) -> None:
    (checkout / "csrc" / "pos_encoding_kernels.cu").unlink()
    with pytest.raises(cuda_ops.BuildError, match=r"the checkout's csrc lacks csrc/pos_encoding_kernels.cu"):
        cuda_ops.checkout_sources(checkout)


def test_a_checkout_that_changed_a_bound_schema_is_refused_with_the_difference(checkout: Path) -> None:
    b = checkout / "csrc" / "torch_bindings.cpp"
    text = b.read_text()
    pinned = cuda_ops.schemas(text)[("_C", "rms_norm")]
    b.write_text(text.replace("float epsilon", "float epsilon, bool fast", 1))
    with pytest.raises(cuda_ops.BuildError, match=r"contract changed: csrc/torch_bindings.cpp: _C::rms_norm: "
                                                  rf"pinned `{re.escape(pinned)}`, checkout `.*bool fast"):
        cuda_ops.checkout_sources(checkout)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without CUDA")
def test_build_ops_of_a_checkout_without_cuda_says_why_and_leaves_nothing_in_the_cache(checkout: Path,
                                                                                      tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    proc = subprocess.run([sys.executable, "-m", "k3num.harness.cli", "build-ops", "--engine-src", f"vllm={checkout}"],
                          cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "K3NUM_ENGINE_CACHE": str(cache)})
    assert proc.returncode == 2 and "[build-ops] ERROR: no CUDA device" in proc.stderr, proc.stderr
    assert not (cache / "ops").exists()


def test_the_build_key_changes_with_the_registered_ops(monkeypatch) -> None:
    src = cuda_ops.CudaSources(Path("."), "0.33.0", "0" * 64, "test")
    key = cuda_ops.build_key("90", src)
    monkeypatch.setattr(cuda_ops, "OPS", cuda_ops.OPS[:-1])
    assert cuda_ops.build_key("90", src) != key  # a cached build of fewer ops is not taken for this one


@pytest.mark.parametrize(("capability", "cuda", "want"), [
    ((10, 0), "13.0", "-gencode=arch=compute_100f,code=sm_100f"),  # the exact base: vLLM keeps "10.0f"
    ((10, 3), "13.0", "-gencode=arch=compute_103,code=sm_103"),  # the family: the target's own value
    ((10, 0), "12.9", None),  # vLLM's CMake asks for CUDA >= 13.0
    ((9, 0), "13.0", None),  # the H200
    ((12, 0), "13.0", None),  # another major version: not the 10.0f family
    ((8, 0), None, None),
])
def test_the_build_plan_adds_the_sm100_attn_res_kernel_exactly_where_vllms_cmake_would(capability, cuda, want):
    units = cuda_ops.build_plan(capability, cuda)
    assert units[0] == cuda_ops.Unit(cuda_ops.LIB_NAME, cuda_ops.SOURCES, cuda_ops.OPS)
    if want is None:
        assert len(units) == 1, units
        return
    (sm100,) = units[1:]
    assert sm100.sources == ("csrc/kimi_k3/attn_res_kernel.cu",) and sm100.ops == (("_C", "kimi_k3_attn_res"),)
    assert sm100.gencode == (want,)
    assert set(sm100.cuda_flags) == {"--expt-relaxed-constexpr", "--expt-extended-lambda", "--use_fast_math"}


def test_the_sm100_kernels_sources_and_schema_are_in_the_pinned_csrc() -> None:
    root = fetch.csrc_dir("vllm")
    if fetch.csrc_problems("vllm"):
        pytest.skip("vLLM's csrc is not fetched here (k3num fetch vllm-csrc)")
    assert (root / "csrc/kimi_k3/attn_res_kernel.cu").is_file()
    schema = cuda_ops.schemas((root / cuda_ops.BINDINGS).read_text(), cuda_ops.SM100_OPS)[("_C", "kimi_k3_attn_res")]
    assert schema.startswith("kimi_k3_attn_res(") and "output" in schema
    reg = cuda_ops.registration_source((root / cuda_ops.BINDINGS).read_text(), cuda_ops.SM100_OPS)
    assert 'm.impl("kimi_k3_attn_res", TORCH_BOX(&kimi_k3_attn_res));' in reg and "rms_norm" not in reg


DISPATCH = r'''
import sys, torch
from k3num.engines import triton_support
triton_support.require_interpreter(); triton_support.round_bf16_to_nearest_even()
from k3num.engines.vllm_adapter import attn_res as adapter
from k3num.supply import fetch
adapter._Platform.is_device_capability_family = staticmethod(lambda family: family == 100)  # an SM100 GPU
calls = []
lib = torch.library.Library("_C", "FRAGMENT")
lib.define("kimi_k3_attn_res(Tensor prefix, Tensor? delta, Tensor! blocks, Tensor norm_weight, Tensor qk_weight, "
           "Tensor? output_norm_weight, Tensor! output, int num_blocks, int block_write_idx, float eps, "
           "float output_norm_eps) -> ()")
def native(prefix, delta, blocks, norm, qk, onorm, output, nb, write, eps, oeps):
    calls.append(nb)
    output.copy_(prefix)
lib.impl("kimi_k3_attn_res", native, "CPU")
fn = adapter._load_attn_res(fetch.Source("vllm").root / "vllm/models/kimi_k3/nvidia/ops/attn_res.py", True)
for hidden, nb, dense in [(7168, 3, True), (7168, 8, True), (7168, 9, True), (4096, 3, True), (7168, 3, False)]:
    t = 2
    big = torch.randn(t, hidden * (1 if dense else 2)).bfloat16()
    prefix = big[:, :hidden]  # not dense: a row stride of 2 * hidden
    blocks = torch.randn(t, 9, hidden).bfloat16()
    w = torch.ones(hidden).bfloat16()
    before = len(calls)
    fn(prefix, None, blocks, w, w, None, nb, -1, 1e-5, 1e-5)
    print(hidden, nb, dense, "native" if len(calls) > before else "triton")
'''


def test_the_vllm_attn_res_subject_takes_the_native_op_exactly_where_vllms_wrapper_would() -> None:
    """On a (simulated) SM100 GPU with `kimi_k3_attn_res` registered (a recording stand-in op, in a child
    process): the lifted wrapper calls it at hidden 7168, dense rows, num_blocks <= 8, and runs its Triton
    kernel otherwise. On this machine the platform's answer is the real one: no SM100."""
    if fetch.missing_files("vllm"):
        pytest.skip("vllm is not fetched (k3num fetch vllm)")
    proc = subprocess.run([sys.executable, "-c", DISPATCH], cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "TRITON_INTERPRET": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = proc.stdout.split("\n")
    assert got[:5] == ["7168 3 True native", "7168 8 True native", "7168 9 True triton", "4096 3 True triton",
                       "7168 3 False triton"], proc.stdout
    assert "needs SM100" in cuda_ops.native_attn_res_note()


def test_each_release_builds_its_ops_from_its_own_pinned_csrc() -> None:
    """A run reading vllm@0.33.0 builds (and loads) 0.33.0's ops, the default run the default release's: each
    release's sdist is pinned (fetch.SDIST_RELEASES), its csrc extracted beside the other's, its build cached by
    its own sha256; a release with no pinned sdist is refused listing the pinned ones."""
    default = fetch.PINS["vllm"].version
    assert fetch.SDISTS["vllm"].version == default == fetch.releases("vllm")[-1]
    assert fetch.csrc_specs() == ["vllm@0.33.0", "vllm"]
    old = cuda_ops.sources_of(fetch.Source("vllm@0.33.0"))
    new = cuda_ops.sources_of(fetch.Source("vllm"))
    assert (old.label, old.root.name, old.spec) == ("0.33.0", "vllm-0.33.0-csrc", "vllm@0.33.0")
    assert (new.label, new.root.name) == (default, f"vllm-{default}-csrc")
    assert old.digest == fetch.sdist_pin("vllm@0.33.0").sha256 != new.digest == fetch.SDISTS["vllm"].sha256
    assert cuda_ops.build_key("90", old) != cuda_ops.build_key("90", new)
    with pytest.raises(fetch.FetchError, match=r"vllm@0.32.0: no pinned source distribution of that release; "
                                               r"pinned: vllm@0.33.0, vllm@0.34.0"):
        fetch.sdist_pin("vllm@0.32.0")
    with pytest.raises(cuda_ops.BuildError, match="no pinned source distribution"):
        cuda_ops.pinned_sources("0.32.0")
