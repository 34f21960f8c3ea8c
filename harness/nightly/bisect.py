"""`k3num bisect`: the first engine commit where a replay (or a set of properties) turns bad.

Each revision is checked out with `git worktree add --detach` into a temporary folder and judged there
with `--engine-src NAME=<worktree>`:
- `--bundle FILE`: `k3num replay FILE` (exit 0 good, 1 bad, 2 not replayable: skipped);
- `-k EXPR`: the properties matching EXPR under the `ci` profile (exit 0 with at least one test run:
  good; 1: bad; every test skipped, e.g. the adapter could not bind that tree: skipped).
A revision where the engine's pinned files are missing is skipped without being run, as
`git bisect skip` would. The search is git bisect's: the commits on the ancestry path good..bad, a
binary search that steps around skipped revisions; when only skipped commits separate the last good
from the first bad one, all the candidates are named.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

GOOD, BAD, SKIP = "good", "bad", "skip"


class BisectError(RuntimeError):
    """A bisection that cannot run (with git's message where git refused)."""


def git(repo: Path, *args: str) -> str:
    r = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True)
    if r.returncode != 0:
        raise BisectError(f"git {' '.join(args)}: {r.stderr.strip() or r.stdout.strip()}")
    return r.stdout.strip()


def resolve(repo: Path, rev: str) -> str:
    """The commit a revision names; an unknown revision fails with git's own message."""
    return git(repo, "rev-parse", "--verify", "--end-of-options", f"{rev}^{{commit}}")


def candidates(repo: Path, good: str, bad: str) -> list[str]:
    """The commits after `good` up to and including `bad`, oldest first (the ancestry path)."""
    r = subprocess.run(["git", "-C", str(repo), "merge-base", "--is-ancestor", good, bad], capture_output=True,
                       text=True)
    if r.returncode != 0:
        raise BisectError(f"--good {good[:12]} is not an ancestor of --bad {bad[:12]}")
    out = git(repo, "rev-list", "--reverse", "--ancestry-path", f"{good}..{bad}")
    return out.split() if out else []


@dataclass
class Outcome:
    first_bad: list[str]  # one commit, or the candidates when skipped commits hide which
    verdicts: dict[str, str] = field(default_factory=dict)  # commit -> good/bad/skip, in test order
    # commits judged with the bundle's own budget (its rule is not recomputed by this harness)
    not_recomputed: list[str] = field(default_factory=list)


def search(commits: list[str], judge: Callable[[str], str], log: Callable[[str], None] = print) -> Outcome:
    """git bisect over `commits` (oldest first; the last is bad), `judge(commit)` -> good/bad/skip."""
    verdicts: dict[str, str] = {}

    def run(c: str) -> str:
        v = judge(c)
        verdicts[c] = v
        log(f"[bisect] {c[:12]}: {v}")
        return v

    lo, hi = -1, len(commits) - 1  # commits[lo] good (-1: the --good revision), commits[hi] bad
    while hi - lo > 1:
        inside = [i for i in range(lo + 1, hi) if verdicts.get(commits[i]) != SKIP]
        if not inside:
            break
        mid = (lo + hi) // 2
        order = sorted(inside, key=lambda i: (abs(i - mid), i))  # the middle first, then its neighbours
        i = order[0]
        v = run(commits[i])
        if v == GOOD:
            lo = i
        elif v == BAD:
            hi = i
    first = [commits[i] for i in range(lo + 1, hi + 1)]
    return Outcome(first_bad=first, verdicts=verdicts)


def engine_files_present(tree: Path, engine: str) -> list[str]:
    """Why a revision's tree cannot be judged (empty when it can): it is judged as the release its version file
    names (`fetch.check_tree`: the newest pin below a version no pin knows) and must hold that release's bound
    files; a revision older than every pin, or one lacking files, is skipped with the reason."""
    from k3num.supply import fetch

    try:
        fetch.check_tree(engine, tree.resolve())
    except ValueError as e:
        return [str(e)]
    return []


# what `k3num replay` says when it judged with the bundle's own reference and budget
NOT_RECOMPUTED = "budget not recomputed"


class _ReplayJudge:
    """`k3num replay BUNDLE --engine-src ENGINE=TREE` per tree; `notes` keeps, per tree, the verdict
    lines that were judged with the bundle's own budget (an older rule this harness cannot recompute)."""

    def __init__(self, engine: str, bundle: Path, device: str) -> None:
        self.engine, self.bundle, self.device = engine, bundle, device
        self.notes: dict[Path, str] = {}

    def __call__(self, tree: Path) -> str:
        r = subprocess.run([sys.executable, "-m", "k3num.harness.cli", "replay", str(self.bundle), "--engine-src",
                            f"{self.engine}={tree}", "--device", self.device], capture_output=True, text=True)
        if NOT_RECOMPUTED in r.stdout:
            self.notes[tree] = r.stdout.strip().splitlines()[-1]
        return GOOD if r.returncode == 0 else BAD if r.returncode == 1 else SKIP


def replay_judge(engine: str, bundle: Path, device: str = "cpu") -> Callable[[Path], str]:
    return _ReplayJudge(engine, bundle, device)


def pytest_judge(engine: str, kexpr: str, profile: str = "ci") -> Callable[[Path], str]:
    def judge(tree: Path) -> str:
        with tempfile.TemporaryDirectory(prefix="k3num-bisect-junit-") as d:
            junit = Path(d) / "junit.xml"
            # --pyargs: the installed (or linked) property package, from a checkout or an install alike
            r = subprocess.run([sys.executable, "-m", "pytest", "--pyargs", "k3num.properties", "-k", kexpr,
                                "--engine", engine, "--engine-src", f"{engine}={tree}", "-p", "no:cacheprovider",
                                "-q", "-x", f"--hypothesis-profile={profile}", "--junitxml", str(junit)],
                               capture_output=True, text=True)
            ran = 0
            if junit.exists():
                for case in ET.parse(junit).iter("testcase"):
                    if case.find("skipped") is None:
                        ran += 1
        if r.returncode == 5:
            raise BisectError(f"-k {kexpr!r}: no test matches")
        if r.returncode == 0:
            return GOOD if ran else SKIP
        return BAD if r.returncode == 1 else SKIP
    return judge


def bisect(repo: Path, engine: str, good: str, bad: str, judge_tree: Callable[[Path], str],
           log: Callable[[str], None] = print) -> Outcome:
    """Resolve the revisions, check the ends (good must judge good, bad bad), then search."""
    repo = Path(repo).resolve()
    g, b = resolve(repo, good), resolve(repo, bad)
    commits = candidates(repo, g, b)
    if not commits:
        raise BisectError(f"no commit between --good {good} and --bad {bad}")
    not_recomputed: list[str] = []
    with tempfile.TemporaryDirectory(prefix="k3num-bisect-") as tmp:
        def judge(commit: str) -> str:
            wt = Path(tmp) / commit[:12]
            git(repo, "worktree", "add", "--detach", "--force", str(wt), commit)
            try:
                missing = engine_files_present(wt, engine)
                if missing:
                    log(f"[bisect] {commit[:12]}: not judged ({missing[0]}): skipped")
                    return SKIP
                verdict = judge_tree(wt)
                if wt in getattr(judge_tree, "notes", {}):
                    not_recomputed.append(commit)
                return verdict
            finally:
                git(repo, "worktree", "remove", "--force", str(wt))

        for rev, want in ((g, GOOD), (b, BAD)):
            v = judge(rev)
            log(f"[bisect] {rev[:12]} (--{want}): {v}")
            if v != want:
                raise BisectError(f"--{want} {rev[:12]} judges {v}, not {want}: nothing to bisect")
        out = search(commits, judge, log=log)
        out.verdicts = {g: GOOD, b: BAD, **out.verdicts}
        out.not_recomputed = not_recomputed
    git(repo, "worktree", "prune")
    return out


def describe(repo: Path, commit: str) -> str:
    """`<sha> <subject line>` of a commit."""
    return git(Path(repo), "log", "-1", "--format=%H %s", commit)
