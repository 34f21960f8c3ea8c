"""`k3num coverage` (harness/coverage.py) cannot drift from the adapters: every pinned file has a row,
every bound row names a function its pinned file defines, every unbound row in a fetched file names
one that is there, and both formats carry the same rows."""

from __future__ import annotations

import ast
import io
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from k3num.harness import coverage
from k3num.supply import fetch

ROOT = Path(__file__).resolve().parents[1]


def _defines(path: Path, function: str) -> bool:
    """Whether the file defines `function` ("Class.method", a top-level def or class, "Class.ATTR = ...");
    a CUDA file: the name appears in it."""
    name = function.split(" ")[0]
    text = path.read_text(errors="replace")
    if path.suffix != ".py":
        return name in text
    parts = name.split(".")
    scope: list[ast.stmt] = ast.parse(text).body
    for i, part in enumerate(parts):
        found = None
        for node in scope:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name == part:
                found = node
            elif isinstance(node, (ast.Assign, ast.AnnAssign)) and i == len(parts) - 1:
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                if any(isinstance(t, ast.Name) and t.id == part for t in targets):
                    return True
        if found is None:
            return False
        scope = getattr(found, "body", [])
    return True


def _roots(engine: str, file: str) -> list[Path]:
    """The fetched, verified trees of every pinned release of `engine`'s pin (csrc: the extracted sources)."""
    pin = "vllm" if engine.startswith("vllm") else engine
    if file.startswith("csrc/"):
        root = fetch.csrc_dir("vllm")
        return [root] if (root / file).is_file() else []
    found = []
    for spec in (f"{pin}@{v}" for v in fetch.releases(pin)):
        if fetch.verified_manifest(spec, log=lambda *_: None):
            found.append(fetch.release_root(spec))
    return found


def _root(engine: str, file: str) -> Path | None:
    """The default pinned release's tree, if fetched."""
    roots = _roots(engine, file)
    default = fetch.Source("vllm" if engine.startswith("vllm") else engine).root
    return default if default in roots else (roots[0] if file.startswith("csrc/") and roots else None)


def test_every_pinned_file_has_a_row():
    table = coverage.table()
    files = set(table["file"])
    # a version file is read for the release's name (supply/fetch.py tree_version), never bound as code
    versions = set(fetch.VERSION_FILES.values())
    missing = [f"{e}: {f}" for e, pin in fetch.PINS.items() for f in pin.files if f not in files | versions]
    assert not missing, "pinned files the coverage table does not list:\n" + "\n".join(missing)


def test_every_row_in_a_fetched_file_names_a_function_the_file_defines():
    table = coverage.table()
    checked, wrong = 0, []
    for r in table.itertuples():  # a helper one release added (0.34.0's refill_derived) is defined by that one
        roots = [t for t in _roots(r.engine, r.file) if (t / r.file).is_file()]
        if not roots or r.file.endswith("/"):
            continue
        checked += 1
        if not any(_defines(t / r.file, r.function) for t in roots):
            wrong.append(f"{r.engine} {r.file}: {r.function}")
    if checked == 0:
        pytest.skip("no engine is fetched here (k3num fetch)")
    assert not wrong, "rows naming a function the pinned file lacks:\n" + "\n".join(wrong)


def test_a_row_naming_a_missing_function_is_caught(tmp_path):
    f = tmp_path / "m.py"
    f.write_text("class A:\n    def b(self):\n        pass\n    X = 1\ndef c():\n    pass\n")
    assert _defines(f, "A.b") and _defines(f, "c") and _defines(f, "A.X") and _defines(f, "A")
    assert not _defines(f, "A.d") and not _defines(f, "B.b") and not _defines(f, "d")


def test_bound_rows_name_the_properties_that_judge_them_and_unbound_rows_say_why():
    table = coverage.table()
    bound, unbound = table[table["bound"] == "yes"], table[table["bound"] == "no"]
    assert len(bound) > 50 and len(unbound) >= len(coverage.UNBOUND)
    assert (bound["properties"] != "").all(), bound[bound["properties"] == ""].to_string()
    assert (unbound["why_not"] != "").all()
    kv = bound[bound["function"] == "MooncakeKVManager._send_kvcache_generic"]
    assert "test_kv_transfer.py::test_kv_transfer_copies_exactly_the_head_aware_plan_or_is_refused" in \
        kv["properties"].iloc[0]
    sm100 = unbound[unbound["why_not"].str.contains("SM100")]
    assert set(sm100["engine"]) == {"vllm", "sglang", "tokenspeed"}


def test_the_cli_prints_markdown_and_csv_with_the_same_rows():
    md = subprocess.run([sys.executable, "-m", "k3num.harness.cli", "coverage"], cwd=ROOT, capture_output=True,
                        text=True, timeout=120)
    csv = subprocess.run([sys.executable, "-m", "k3num.harness.cli", "coverage", "--format", "csv"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert md.returncode == csv.returncode == 0, md.stderr + csv.stderr
    frame = pd.read_csv(io.StringIO(csv.stdout), keep_default_na=False)
    assert list(frame.columns) == list(coverage.COLUMNS)
    rows = [line for line in md.stdout.splitlines() if line.startswith("| ") and not line.startswith("| ---")]
    assert len(rows) - 1 == len(frame)  # the header row


def test_the_table_names_this_machines_gpu_or_says_there_is_none(monkeypatch) -> None:
    """Issue 32: the SM100 rows said "the device here is an H200 (SM90)" on a machine with no GPU."""
    import torch

    from k3num.harness import coverage

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    text = coverage.table()["why_not"].str.cat(sep="\n")
    assert "this machine has no CUDA device" in text and "the device here is" not in text
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=0: "NVIDIA B200")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i=0: (10, 0))
    assert "this machine's GPU is NVIDIA B200 (SM100)" in coverage.table()["why_not"].str.cat(sep="\n")


def test_the_table_says_what_runs_here() -> None:
    """issue 41: vLLM's CUDA-op rows read `bound: yes` on a machine without CUDA; the runs_here column says a
    stand-in runs there, Triton kernels say interpreter or native, and the K3-shape properties say they skip."""
    import torch

    from k3num.harness import coverage as cov

    assert cov.runs_here("cuda", True, cuda=False, ops_built=False) == "stand-in (the compiled op needs CUDA)"
    assert cov.runs_here("cuda", True, cuda=True, ops_built=False) == "stand-in (run `k3num build-ops`)"
    assert cov.runs_here("cuda", True, cuda=True, ops_built=True) == "yes (built ops)"
    assert cov.runs_here("triton", True, cuda=False, ops_built=False) == "yes (Triton's interpreter)"
    assert cov.runs_here("python", False, cuda=False, ops_built=False) == "no"
    t = cov.table()
    assert "runs_here" in t.columns and set(t.loc[t["bound"] == "no", "runs_here"]) == {"no"}
    if not torch.cuda.is_available():
        k3 = [p for p in "; ".join(t["properties"]).split("; ") if p.startswith(cov.GPU_ONLY)]
        assert k3 and all(p.endswith("(GPU only: skips here)") for p in k3)
        assert set(t.loc[t["language"] == "cuda", "runs_here"]) <= {"stand-in (the compiled op needs CUDA)", "no"}


def test_each_row_names_the_pinned_releases_that_hold_its_code() -> None:
    """The releases column: a function only 0.34.0 defines says 0.34.0, one both define says both, and a
    class or an assigned name counts as defined."""
    import ast

    from k3num.supply import fetch

    if fetch.missing_files("vllm") or fetch.missing_files("vllm@0.34.0"):
        pytest.skip("both vLLM releases are needed (k3num fetch)")
    t = coverage.table()
    by = {(r.file, r.function): r.releases for r in t.itertuples()}
    assert by[("vllm/models/kimi_k3/nvidia/specialized_decode/drafter/model.py", "context_proj")] == "0.34.0"
    assert by[("vllm/model_executor/utils.py", "refill_derived")] == "0.34.0"
    assert by[("vllm/models/kimi_k3/nvidia/ops/attn_res.py", "attn_res")] == "0.33.0, 0.34.0"
    tree = ast.parse("class A:\n    x = 1\n    def f(self): pass\ny: int = 2\n")
    assert all(coverage._defines(tree, q) for q in ("A", "A.x", "A.f", "y"))
    assert not any(coverage._defines(tree, q) for q in ("B", "A.g", "A.x.z"))
