"""The suite's hypothesis profiles, registered once on import: one list that the plugin, the commands'
`--hypothesis-profile` options and their usage errors all read (`NAMES`, `describe`, `check`).

Every profile is built on hypothesis's own "default" profile, not on `settings.default`: where the CI
environment variable is set (GitHub Actions, GitLab, most nightly runners) hypothesis makes its CI profile
the default, derandomized, and a profile registered without a parent would inherit that, so the nightly
would draw the same 10,000 examples every night and --shards would be refused. All have deadline=None:
oracle and kernel timings vary too much for deadlines.
"""

from __future__ import annotations

import argparse

from hypothesis import HealthCheck, Phase, settings
from hypothesis.errors import InvalidArgument

_COMMON = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
_BASE = settings.get_profile("default")

# name -> what it is for (the order of every help text and usage error)
NAMES: dict[str, str] = {
    "dev": "quick local runs, 50 examples per property (the default without --hypothesis-profile)",
    "ci": "derandomized, no example database, print_blob, 40 examples: CI's and the check's",
    "nightly": ">= 10,000 examples per property, for the scheduled GPU job",
    "nightly-1k": "nightly with 1,000 examples per property",
    "gpu-smoke": "5 derandomized examples: does everything run on this GPU box at all",
    "ci-mutants": "ci without the shrink phase, for the mutant self-test",
    "gate-proof": "300 random examples, no database: the regression gate's proof",
}
DEFAULT = "dev"

settings.register_profile("dev", parent=_BASE, max_examples=50, **_COMMON)
settings.register_profile("ci", parent=_BASE, max_examples=40, derandomize=True, database=None, print_blob=True,
                          **_COMMON)
settings.register_profile("nightly", parent=_BASE, max_examples=10_000, print_blob=True, **_COMMON)
settings.register_profile("nightly-1k", parent=settings.get_profile("nightly"), max_examples=1_000)
settings.register_profile("gpu-smoke", parent=_BASE, max_examples=5, derandomize=True, database=None,
                          print_blob=True, **_COMMON)
# the ci example budget without the shrink phase: the mutant self-test only needs to know that a
# mutant fails, not its minimal counterexample
settings.register_profile("ci-mutants", parent=settings.get_profile("ci"),
                          phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.target])
# the regression gate's proof (tests/test_history_gate.py): fresh random draws every run, so two runs
# of one source differ by real sampling noise, and enough examples for a within-budget drift to show
settings.register_profile("gate-proof", parent=_BASE, max_examples=300, database=None, **_COMMON)


def names_line() -> str:
    """The profiles, comma-separated, for a help text or an error."""
    return ", ".join(NAMES)


def check(name: str) -> str:
    """`name` when it is a registered profile (ours, or one of hypothesis's own such as "default"), else
    ValueError listing ours: a command refuses a bad profile before it starts pytest."""
    try:
        settings.get_profile(name)
    except InvalidArgument:
        raise ValueError(f"--hypothesis-profile {name}: not a registered profile; the suite's: {names_line()} "
                         "(hypothesis's own, such as default, are accepted too)") from None
    return name


def option_type(name: str) -> str:
    """argparse's `type=` for a profile option: a bad name is a usage error (exit 2) before anything runs."""
    try:
        return check(name)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e).removeprefix(f"--hypothesis-profile {name}: ")) from None


def add_option(parser, default: str | None, what: str) -> None:
    """The one profile option of every command: `--hypothesis-profile` (`--profile` is its older spelling)."""
    parser.add_argument("--hypothesis-profile", "--profile", dest="hypothesis_profile", default=default,
                        type=option_type, metavar="PROFILE", help=f"{what}: one of {names_line()}")
