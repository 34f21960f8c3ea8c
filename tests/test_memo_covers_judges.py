"""Every float64 oracle function the judges call is one the oracle memo wraps (harness/oracle_memo.py): a
judge calling an entry point the memo does not know computes the oracle on both sides of a `k3num check`."""

from __future__ import annotations

import ast
import inspect

from k3num.harness import judges, oracle_memo


def test_every_oracle_call_of_the_judges_goes_through_a_memoized_entry_point() -> None:
    modules = {alias: mod.__name__ for alias, mod in vars(judges).items()
               if inspect.ismodule(mod) and mod.__name__.startswith("k3num.refmodel.")}
    memoized = set(oracle_memo.ORACLES)
    helpers = {"normalize", "inv_freq", "cos_sin", "attention_scaling"}  # pieces, not oracle entry points
    called = set()
    for node in ast.walk(ast.parse(inspect.getsource(judges))):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and isinstance(node.func.value, ast.Name) and node.func.value.id in modules):
            called.add((modules[node.func.value.id], node.func.attr))
    oracle_calls = {c for c in called if c[1] not in helpers and callable(getattr(
        __import__(c[0], fromlist=[c[1]]), c[1], None)) and not c[1][0].isupper()}
    assert oracle_calls, "the judges call no oracle: the scan is broken"
    assert oracle_calls <= memoized, f"not memoized: {sorted(oracle_calls - memoized)}"
