"""The TP-rank harness (harness/tp_ranks.py) on vLLM 0.34.0's column-parallel context projection: the pinned
release's ranks give the replicated projection bit for bit, and each mutant of the rank run (a gather in reverse
rank order, every rank loading rank 0's rows) is caught."""

from __future__ import annotations

import pytest

from k3num.harness import tp_ranks
from k3num.supply import fetch

pytestmark = pytest.mark.skipif(bool(fetch.missing_files("vllm@0.34.0")), reason="vllm 0.34.0 is not fetched "
                                "(k3num fetch)")
CASES = (tp_ranks.TpCase(1, 3, 5, 64, 128), tp_ranks.TpCase(2, 8, 3, 256, 512))


def _job(world: int, mutant: str = "") -> tp_ranks.TpJob:
    return tp_ranks.TpJob("vllm", world, CASES, sources=(("vllm", str(fetch.source_of("vllm@0.34.0", {}).root)),),
                          mutant=mutant)


@pytest.mark.parametrize("world", [2, 4])
def test_the_pinned_ranks_give_the_replicated_projection_and_each_mutant_is_caught(world: int) -> None:
    assert tp_ranks.compare(_job(world), tp_ranks.run_ranks(_job(world))) == []
    for mutant in tp_ranks.MUTANTS[1:]:
        problems = tp_ranks.compare(_job(world, mutant), tp_ranks.run_ranks(_job(world, mutant)))
        assert problems and all("differs from the replicated projection" in p for p in problems), (mutant, problems)


def test_a_tp_size_that_does_not_divide_the_output_and_an_unknown_mutant_are_refused() -> None:
    with pytest.raises(ValueError, match="TP 3 does not divide"):
        tp_ranks.TpJob("vllm", 3, CASES)
    with pytest.raises(ValueError, match="unknown 'nosuch'"):
        tp_ranks.TpJob("vllm", 2, CASES, mutant="nosuch")


def test_the_layer_is_vllms_gathered_column_parallel_one_and_tp_1_keeps_the_replicated_one() -> None:
    from k3num.engines import registry

    engine = registry.build("vllm", {"vllm": fetch.source_of("vllm@0.34.0", {}).root}, "auto")
    make = engine.extras["context_proj_tp"]
    assert make(1, 0, None, target_hidden=16, target_layers=2, hidden=32) is None
    assert make(3, 0, None, target_hidden=16, target_layers=2, hidden=32) is None  # 32 % 3: vLLM keeps it replicated
    layer = make(4, 2, None, target_hidden=16, target_layers=2, hidden=32)
    assert type(layer).__name__ == "GatheredColumnParallelLinear" and layer.prefix == "model.context_proj"
    assert tuple(layer.weight.shape) == (8, 32) and type(layer.weight).__name__ == "ModelWeightParameter"
    old = registry.build("vllm", {"vllm": fetch.source_of("vllm@0.33.0", {}).root}, "auto")  # the older release
    assert "context_proj_tp" not in old.extras and "0.34.0" in old.missing["context_proj_tp"]


def test_the_gemm_exactness_script_writes_one_row_per_tp_size_and_row_count(tmp_path) -> None:
    import subprocess
    import sys
    from pathlib import Path

    import pandas as pd

    out = tmp_path / "tp.csv"
    r = subprocess.run([sys.executable, "scripts/tp_gemm_exactness.py", "--device", "cpu", "--tokens", "1,3",
                        "--tp", "2,4", "--hidden", "64", "--taps", "2", "--csv", str(out)],
                       cwd=Path(__file__).resolve().parents[1], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    t = pd.read_csv(out)
    assert sorted(zip(t.tp, t.tokens)) == [(2, 1), (2, 3), (4, 1), (4, 3)] and (t.of == t.tokens * 64).all()
    assert (t.replicated_err_over_budget <= 1).all(), t.to_string()
    r = subprocess.run([sys.executable, "scripts/tp_gemm_exactness.py", "--tp", "two"],
                       cwd=Path(__file__).resolve().parents[1], capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "cannot run" in r.stderr
