"""The read-only pre-norm AttnRes mixture (SGLang's aggregate_stream family) against the oracle."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from k3num.fixtures.strategies import seeds
from k3num.properties.checks.attn_res_mix import SUBJECTS, check_read_only_mixture
from k3num.properties.support import DEVICE


@pytest.mark.parametrize("hidden", [64, 1024])
@pytest.mark.parametrize("name", SUBJECTS)
@given(tokens=st.integers(1, 4), nvb=st.integers(0, 8), seed=seeds)
def test_read_only_mixture_within_rounding_budget_of_oracle(engine, name: str, hidden: int, tokens: int, nvb: int,
                                                            seed: int) -> None:
    check_read_only_mixture(engine, name, tokens, hidden, nvb, seed, DEVICE)


