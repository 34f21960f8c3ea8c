"""The cases file a two-process check hands from the head's process to the base's (harness/side_cases.py):
it round-trips the drawn cases and constructs nothing but this package's dataclasses and enums."""

from __future__ import annotations

import json
import pickle

import pytest
import torch

from k3num.fixtures.strategies import ProjectionCase
from k3num.harness import side_cases
from k3num.refmodel.geometry import RopeSpec

CASE = ProjectionCase(taps=2, tokens=1, hidden=16, hidden_out=16, stages=((0, 1),), order=(0,), seed=3, scale=0.01,
                      outliers=0.0)


def test_cases_round_trip_in_example_order(tmp_path):
    rope = RopeSpec(rotary_dim=64, theta=10000.0, style="neox")
    cases = [{"key": "t[{engine}]", "example": 2, "given": {"case": CASE, "rope": rope},
              "drawn": {"data": [1, (2, 3)]}},
             {"key": "t[{engine}]", "example": 1, "given": {"w": torch.arange(3.0)}, "drawn": {}}]
    path = side_cases.write(tmp_path / "cases.pt", cases)
    got = side_cases.read(path)
    assert [c["example"] for c in got["t[{engine}]"]] == [1, 2]
    assert got["t[{engine}]"][1]["given"]["rope"] == RopeSpec(rotary_dim=64, theta=10000.0, style="neox")
    assert got["t[{engine}]"][1]["given"]["case"] == CASE and got["t[{engine}]"][1]["drawn"] == {"data": [1, (2, 3)]}
    assert torch.equal(got["t[{engine}]"][0]["given"]["w"], torch.arange(3.0))


def test_a_class_outside_the_package_is_refused_on_writing(tmp_path):
    from dataclasses import make_dataclass
    from fractions import Fraction

    Outside = make_dataclass("Outside", ["x"])
    with pytest.raises(side_cases.CasesError, match="outside k3num"):
        side_cases.write(tmp_path / "c.pt", [{"key": "k", "example": 1, "given": {"o": Outside(Fraction(1))},
                                             "drawn": {}}])


@pytest.mark.parametrize("name", ["builtins:eval", "os:system", "k3num.harness.side_cases:read",
                                  "k3num.harness.side_cases:CasesError", "k3num.nope:X"])
def test_a_sidecar_naming_anything_but_a_package_dataclass_is_refused(tmp_path, name):
    path = side_cases.write(tmp_path / "c.pt", [{"key": "k", "example": 1, "given": {}, "drawn": {}}])
    (tmp_path / "c.pt.types.json").write_text(json.dumps([name]))
    with pytest.raises(side_cases.CasesError, match="class"):
        side_cases.read(path)


def test_a_file_that_would_run_code_is_refused(tmp_path):
    class Boom:
        def __reduce__(self):
            return (print, ("ran",))

    path = side_cases.write(tmp_path / "c.pt", [{"key": "k", "example": 1, "given": {}, "drawn": {}}])
    path.write_bytes(pickle.dumps([{"key": "k", "example": 1, "given": {"b": Boom()}, "drawn": {}}]))
    with pytest.raises(side_cases.CasesError, match="not a cases file"):
        side_cases.read(path)
    (tmp_path / "c.pt.types.json").unlink()
    with pytest.raises(side_cases.CasesError, match="no cases file"):
        side_cases.read(path)
