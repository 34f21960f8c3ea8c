"""`k3num bisect` on a git repository built from the fetched pinned vLLM files, with a commit that
introduces a known kernel mutant (harness.fixes' unmasked load), one that removes the engine's files
(skipped), and unrelated ones."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from k3num.harness import cli, fixes
from k3num.harness.nightly import bisect
from k3num.supply import fetch

ROOT = Path(__file__).resolve().parents[1]
KEXPR = "test_attn_res_off_path_shapes_within_budget_or_refused"


def _git(repo: Path, *args: str) -> str:
    env = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t",
           "PATH": "/usr/bin:/bin"}
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, text=True,
                          env=env).stdout.strip()


@pytest.fixture(scope="module")
def engine_repo(tmp_path_factory) -> tuple[Path, dict[str, str]]:
    """c0 pinned files; c1 unrelated; c2 the engine files removed; c3 restored; c4 the mutant; c5 unrelated."""
    if not fetch.verified_manifest("vllm"):
        pytest.skip("vllm is not fetched (k3num fetch vllm)")
    repo = tmp_path_factory.mktemp("vllm-repo")
    fixes.patched_tree(fixes.Fix("none", "vllm", (), ("vllm",), ()), repo / "tree")
    for p in (repo / "tree").iterdir():
        shutil.move(str(p), repo / p.name)
    (repo / "tree").rmdir()
    _git(repo, "init", "-q", "-b", "main")
    shas = {}

    def commit(name: str, msg: str) -> None:
        _git(repo, "add", "-A")
        _git(repo, "commit", "-q", "--allow-empty", "-m", msg)
        shas[name] = _git(repo, "rev-parse", "HEAD")

    commit("c0", "the pinned release")
    (repo / "NOTES.md").write_text("unrelated\n")
    commit("c1", "docs: an unrelated note")
    attn = repo / fixes.VLLM_ATTN_RES
    kept = attn.read_text()
    attn.unlink()
    commit("c2", "refactor: move the kernel away (the engine files are missing here)")
    attn.write_text(kept)
    commit("c3", "refactor: move the kernel back")
    mutant = next(f for f in fixes.TREE_MUTANTS if f.id == "unmasked-load")
    for rel, edit in mutant.edits:
        (repo / rel).write_text(edit((repo / rel).read_text(), rel))
    commit("c4", "perf: drop the column mask of the source loads")
    (repo / "NOTES.md").write_text("unrelated, again\n")
    commit("c5", "docs: another note")
    return repo, shas


def test_search_steps_around_a_skipped_revision_like_git_bisect():
    commits = ["c1", "c2", "c3", "c4", "c5"]
    truth = {"c1": "good", "c2": "skip", "c3": "good", "c4": "bad", "c5": "bad"}
    out = bisect.search(commits, truth.__getitem__, log=lambda s: None)
    assert out.first_bad == ["c4"]
    assert out.verdicts["c2"] == "skip"


def test_search_names_every_candidate_when_skips_hide_the_first_bad_commit():
    truth = {"c1": "good", "c2": "skip", "c3": "bad"}
    out = bisect.search(["c1", "c2", "c3"], truth.__getitem__, log=lambda s: None)
    assert out.first_bad == ["c2", "c3"]


def test_bisect_finds_the_commit_that_introduced_the_mutant(engine_repo, capsys):
    repo, shas = engine_repo
    rc = cli.main(["bisect", "--engine", "vllm", "--repo", str(repo), "--good", shas["c0"], "--bad", shas["c5"],
                   "-k", KEXPR])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert f"first bad commit: {shas['c4']} perf: drop the column mask of the source loads" in out
    # skipped, as git bisect skip, naming the file the revision's release lacks
    assert f"{shas['c2'][:12]}: not judged (" in out and f"lacks 1 of {fetch.PINS['vllm'].version}'s" in out, out
    assert _git(repo, "worktree", "list").count("\n") == 0  # every worktree removed


def test_bisect_with_an_unknown_revision_fails_with_gits_message(engine_repo, capsys):
    repo, shas = engine_repo
    rc = cli.main(["bisect", "--engine", "vllm", "--repo", str(repo), "--good", "no-such-rev", "--bad", shas["c5"],
                   "-k", KEXPR])
    err = capsys.readouterr().err
    assert rc == 2
    assert "git rev-parse" in err and "fatal: Needed a single revision" in err


def test_bisect_refuses_ends_that_do_not_judge_as_named(engine_repo, capsys):
    repo, shas = engine_repo
    rc = cli.main(["bisect", "--engine", "vllm", "--repo", str(repo), "--good", shas["c4"], "--bad", shas["c5"],
                   "-k", KEXPR])
    assert rc == 2
    assert "judges bad, not good" in capsys.readouterr().err


K3N_008 = "properties/test_off_path_shapes.py::test_model_aggregation_off_grid_hidden_within_budget_or_refused"


def test_bisect_by_a_repro_bundle_finds_the_commit_that_reverted_a_fix(tmp_path, capsys):
    """SGLang: c0 carries the K3N-008 fix (harness.fixes), c1 is unrelated, c2 reverts the fix (the pinned
    release's file), c3 is unrelated; the K3N-008 bundle replays PASS on c0 and FAIL from c2 on."""
    if fetch.missing_files("sglang"):
        pytest.skip("sglang 0.5.23 is not fetched here: run `k3num fetch sglang`")
    out = tmp_path / "repro"
    subprocess.run([sys.executable, "-m", "pytest", K3N_008, "--engine", "sglang", "--repro-dir", str(out), "-q",
                    "-p", "no:cacheprovider", "--hypothesis-profile=ci"], cwd=ROOT, capture_output=True)
    bundle = sorted(out.glob("off_path_shape_within_budget-sglang-*.safetensors"))[0]
    repo = tmp_path / "sglang-repo"
    fixes.patched_tree(fixes.by_id("K3N-008"), repo)
    pinned = fixes.patched_tree(fixes.Fix("none", "sglang", (), ("sglang",), ()), tmp_path / "pinned")
    _git(repo, "init", "-q", "-b", "main")
    shas = {}
    for name, msg, change in (
        ("c0", "attn_residual: route the model's aggregation through the dispatcher", None),
        ("c1", "docs: a note", lambda: (repo / "NOTES.md").write_text("a note\n")),
        ("c2", "attn_residual: call the fused kernel directly again",
         lambda: shutil.copyfile(pinned / fixes.SGLANG_ATTN, repo / fixes.SGLANG_ATTN)),
        ("c3", "docs: another note", lambda: (repo / "NOTES.md").write_text("another note\n")),
    ):
        if change is not None:
            change()
        _git(repo, "add", "-A")
        _git(repo, "commit", "-q", "-m", msg)
        shas[name] = _git(repo, "rev-parse", "HEAD")
    rc = cli.main(["bisect", "--engine", "sglang", "--repo", str(repo), "--good", shas["c0"], "--bad", shas["c3"],
                   "--bundle", str(bundle)])
    text = capsys.readouterr().out
    assert rc == 0, text
    assert f"first bad commit: {shas['c2']} attn_residual: call the fused kernel directly again" in text
