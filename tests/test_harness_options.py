"""The harness's own plumbing: the device option, ledger scoping by mode, the drift CSV of a run
that never reaches its end."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from k3num.fixtures import device
from k3num.oracles import ledger

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("value", ["tpu", "mps", "not a device"])
def test_an_unusable_device_is_refused_with_its_name(value: str) -> None:
    with pytest.raises(ValueError, match=f"device {value!r}"):
        device.resolve(value)


def test_the_device_defaults_to_the_machines_device() -> None:
    import torch

    assert device.resolve("") == ("cuda" if torch.cuda.is_available() else "cpu")


def test_device_option_refuses_what_this_machine_cannot_run() -> None:
    import torch

    bad = "cpu" if torch.cuda.is_available() else "cuda"
    for value in (bad, "tpu"):
        proc = subprocess.run([sys.executable, "-m", "pytest", "properties/test_tap_owner.py", "--device", value,
                               "-q", "-p", "no:cacheprovider"], cwd=ROOT, capture_output=True, text=True)
        assert proc.returncode == 4, proc.stdout[-2000:] + proc.stderr[-2000:]  # pytest's usage error
        assert "--device" in proc.stderr


def test_a_gpu_only_ledger_entry_does_not_apply_under_the_interpreter() -> None:
    test = "test_a_block_written_in_the_call_is_mixed_with_its_written_value"
    gpu = ledger.lookup("vllm", "0.33.0", test, "source-gpu")
    assert gpu is not None and gpu.id == "K3N-004"
    assert ledger.lookup("vllm", "0.33.0", test, "source-interpreter") is None
    everywhere = ledger.lookup("vllm-rocm", "0.33.0", "test_branch1_tap_mixes_with_the_next_layers_weights_and_blocks",
                               "source-interpreter")
    assert everywhere is not None and everywhere.id == "K3N-001"


def test_ledger_entries_name_tests_that_exist() -> None:
    source = "\n".join(p.read_text() for p in (ROOT / "properties").glob("test_*.py"))
    for d in ledger.LEDGER:
        assert f"def {d.test}(" in source, f"{d.id} names {d.test}, which no property defines"


KILLED_RUN = '''
import os, signal
from k3num.properties.support import report
from k3num.oracles.records import judge
from k3num.oracles.budgets import Budget
import torch

class E:
    name, version, mode, real_ops, source_sha256 = "toy", "1", "reference", "", {}

def test_a_records():
    r = torch.zeros(3, dtype=torch.float64)
    report(judge(property="p", engine=E(), subject="s", actual=r, reference=r, budget=Budget(1.0, "b"), seed=1))

def test_b_dies():
    os.kill(os.getpid(), signal.SIGKILL)
'''


def test_the_drift_csv_keeps_the_finished_tests_of_a_killed_run(tmp_path: Path) -> None:
    test_file = tmp_path / "test_killed_run.py"
    test_file.write_text(KILLED_RUN)
    csv = tmp_path / "drift.csv"
    proc = subprocess.run([sys.executable, "-m", "pytest", str(test_file), "-p", "conftest", "-q", "-p",
                           "no:cacheprovider", "--rootdir", str(ROOT), "--drift-csv", str(csv)],
                          cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode < 0, "the run was meant to be killed"  # killed by a signal: no session end
    df = pd.read_csv(csv)
    assert list(df["property"]) == ["p"] and list(df["verdict"]) == ["pass"]


_PROFILES = {"dev": False, "ci": True, "nightly": False, "nightly-1k": False, "gpu-smoke": True,
             "ci-mutants": True, "gate-proof": False}  # name -> derandomized, as harness/plugin.py documents
_SHOW_PROFILES = ("import json; from hypothesis import settings; import k3num.harness.plugin; "
                  "print(json.dumps({n: [settings.get_profile(n).derandomize, settings.get_profile(n).max_examples, "
                  "settings.get_profile(n).database is None, settings.get_profile(n).print_blob] "
                  f"for n in {sorted(_PROFILES)!r}}}))")


def _profiles(ci: bool) -> dict[str, list]:
    import json
    import os

    env = {k: v for k, v in os.environ.items() if k not in ("CI", "TF_BUILD")}
    if ci:
        env["CI"] = "true"
    proc = subprocess.run([sys.executable, "-c", _SHOW_PROFILES], cwd=ROOT, capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout)


def test_profiles_draw_as_documented_whether_or_not_ci_is_set() -> None:
    """Hypothesis makes its derandomized CI profile the default where CI is set; ours must not inherit it
    (a nightly runner sets CI: the nightly would draw the same examples every night, --shards be refused)."""
    off, on = _profiles(ci=False), _profiles(ci=True)
    assert on == off
    assert {n: v[0] for n, v in on.items()} == _PROFILES
