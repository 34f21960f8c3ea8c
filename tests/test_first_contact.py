"""A newcomer's first commands are green on correct code: the README's pytest lines, run exactly as written
(no profile flag), pass on the pinned engines; and a tree of every pinned release is judged as that release
through every entry point (pytest's --engine-src, the main job, `k3num check --head`, `k3num impact`)."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from k3num.harness import fixes
from k3num.supply import fetch

ROOT = Path(__file__).resolve().parents[1]
FAST = "within_rounding"  # one property of the AttnRes file: seconds per engine under the interpreter


def readme_pytest_lines() -> list[str]:
    """Every `pytest ...` line of the README's bash blocks, comments dropped."""
    text = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```bash\n(.*?)```", text, re.S)
    return [ln.split("  #")[0].strip() for b in blocks for ln in b.splitlines() if ln.strip().startswith("pytest ")]


def _need(spec: str) -> None:
    if not fetch.verified_manifest(spec):
        pytest.skip(f"{spec} is not fetched (k3num fetch {spec})")


def _run(argv: list[str], cwd: Path, timeout: int = 900) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", *argv], cwd=cwd, capture_output=True, text=True, timeout=timeout)


def test_the_readme_holds_its_pytest_lines_and_none_names_a_profile() -> None:
    lines = readme_pytest_lines()
    assert len(lines) >= 3, lines
    assert not [ln for ln in lines if "hypothesis-profile" in ln], lines


@pytest.mark.parametrize("line", readme_pytest_lines())
def test_each_readme_pytest_line_passes_without_a_profile_flag(line: str, tmp_path: Path) -> None:
    for spec in ("vllm", "sglang", "tokenspeed"):
        _need(spec)
    argv = shlex.split(line)
    cwd = ROOT
    if "--pyargs" in argv:  # written for an engine's checkout root: a tree laid out like one
        cwd = fixes.pinned_tree("vllm", tmp_path / "vllm-checkout")
    r = _run(["pytest", *argv[1:], "-p", "no:cacheprovider"], cwd)
    tally = next((ln for ln in reversed(r.stdout.splitlines()) if re.search(r"\d+ (passed|failed)", ln)), "")
    assert r.returncode == 0 and "passed" in tally and "failed" not in tally and "error" not in tally, (
        f"{line}: exit {r.returncode}\n{r.stdout[-4000:]}\n{r.stderr[-2000:]}")
    assert "DeadlineExceeded" not in r.stdout


RELEASES = ["vllm@" + v for v in fetch.releases("vllm")]


@pytest.fixture(params=RELEASES)
def release_tree(request, tmp_path: Path) -> tuple[str, Path]:
    """(version, a tree of that pinned release laid out like the installed package, one comment added)."""
    _need(request.param)
    tree = fixes.pinned_tree(request.param, tmp_path / "tree")
    with open(tree / fixes.VLLM_ATTN_RES, "a") as fh:
        fh.write("# a comment-only edit\n")
    return request.param.partition("@")[2], tree


def _versions(csv: Path) -> set[str]:
    df = pd.read_csv(csv, keep_default_na=False)
    return set(df.loc[df["engine"] == "vllm", "engine_version"])


def test_a_release_tree_runs_through_engine_src_as_its_own_release(release_tree, tmp_path: Path) -> None:
    version, tree = release_tree
    csv = tmp_path / "d.csv"
    r = _run(["pytest", "properties/test_attn_res.py", "-k", FAST, "--engine", "vllm", "--engine-src",
              f"vllm={tree}", "--drift-csv", str(csv), "-p", "no:cacheprovider", "-q"], ROOT)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    assert _versions(csv) == {f"{version}+local"}


def test_a_release_tree_runs_through_the_main_job_as_one_run(release_tree, tmp_path: Path) -> None:
    version, tree = release_tree
    csv = tmp_path / "d.csv"
    r = _run(["k3num.harness.main_job", "--engine-src", f"vllm={tree}", "-k", f"test_attn_res and {FAST}",
              "--engine", "vllm", "--drift-csv", str(csv), "-p", "no:cacheprovider", "-q"], ROOT)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    assert "run 1 of" not in r.stdout  # --engine-src makes it one run
    assert _versions(csv) == {f"{version}+local"}


def test_check_bases_a_comment_only_head_on_its_own_release_and_passes(release_tree, tmp_path: Path) -> None:
    version, tree = release_tree
    out = tmp_path / "check"
    r = _run(["k3num.harness.cli", "check", "--engine", "vllm", "--head", str(tree), "-k", FAST, "--out", str(out)],
             ROOT)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    md = (out / "check.md").read_text()
    assert f"head vllm {version}+local, base vllm {version} (the pinned release the head is judged as" in md, md
    assert f"- `{fixes.VLLM_ATTN_RES}`" in md  # the head's changed file is named
    assert r.stderr.rstrip().splitlines()[-1].startswith("[check] PASS"), r.stderr[-2000:]


def test_impact_judges_a_release_tree(release_tree) -> None:
    version, tree = release_tree
    r = _run(["k3num.harness.cli", "impact", "--engine", "vllm-rocm", "--engine-src", f"vllm={tree}", "--cases",
              "1", "--format", "csv"], ROOT)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    assert "positions" in r.stdout.splitlines()[0]


def _with_version(tree: Path, version: str) -> Path:
    vf = tree / fetch.VERSION_FILES["vllm"]
    vf.write_text(re.sub(r"__version__ = version = '[^']+'|__version__ = '[^']+'", f"__version__ = '{version}'",
                         vf.read_text()))
    return tree


def test_a_version_between_pins_is_judged_as_the_newest_pin_below_it_and_says_so(tmp_path: Path) -> None:
    old = fetch.releases("vllm")[0]
    _need(f"vllm@{old}")
    tree = _with_version(fixes.pinned_tree(f"vllm@{old}", tmp_path / "t"), old + ".post1")
    r = _run(["pytest", "properties/test_attn_res.py", "-k", FAST, "--engine", "vllm", "--engine-src",
              f"vllm={tree}", "-p", "no:cacheprovider", "-q"], ROOT)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    assert f"vllm {old}.post1 is not a pinned release: judged as {old}, the newest pin below it" in r.stderr


def test_a_tree_older_than_every_pin_is_refused_before_the_run(tmp_path: Path) -> None:
    old = fetch.releases("vllm")[0]
    _need(f"vllm@{old}")
    tree = _with_version(fixes.pinned_tree(f"vllm@{old}", tmp_path / "t"), "0.1.0")
    r = _run(["pytest", "properties/test_attn_res.py", "-k", FAST, "--engine", "vllm", "--engine-src",
              f"vllm={tree}", "-p", "no:cacheprovider", "-q"], ROOT)
    assert r.returncode == 4 and "no pinned release at or below it" in r.stderr, r.stdout[-3000:] + r.stderr[-3000:]


def test_judged_as_picks_the_exact_pin_else_the_newest_below_else_refuses() -> None:
    pins = fetch.releases("vllm")
    assert fetch.judged_as("vllm", pins[0]) == (fetch.release_pin(f"vllm@{pins[0]}"), "")
    assert fetch.judged_as("vllm", pins[-1] + "+local")[0].version == pins[-1]
    newer = fetch.judged_as("vllm", "99.0.0.dev3+gabc")
    assert newer[0].version == pins[-1] and "judged as" in newer[1]
    with pytest.raises(fetch.TreeVersionError, match="older than every pin"):
        fetch.judged_as("vllm", "0.0.1")
