"""`k3num check`: a change judged against its baseline on the same cases (the pre-merge check).

    k3num check --engine NAME --head PATH [--base pinned|PATH] [--hypothesis-profile P] [-k EXPR]
                [--device DEV] [--out DIR]

The property suite runs once, in source mode, with every example paired: the head (PATH read as
`--engine-src`) and the base (the pinned release, or another tree) on the same drawn case
(harness/pairing_run.py). oracles/pairing.py then judges each property test: new, fixed, known, the
head's lost subjects ("contract changed: ..."), and the paired drift. Written to DIR (default
out/check): check.md (for a pull-request comment: new first, then what the head cannot run, drift,
fixed and known), check.csv (one row per property test and subject), examples.csv and records.csv
(the raw pairs), drift.csv (the usual records of both sides) and repro/ (a bundle for every failing
head comparison). Exit 0: nothing new, no drift beyond noise; 1: something new, a lost subject, or
drift; 2: could not run (a bad --head, --base or --engine, a failed run, nothing ran).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import pandas as pd

from k3num.engines import registry
from k3num.harness import impact, profiles
from k3num.oracles import ledger, pairing
from k3num.supply import env, fetch


class CheckError(ValueError):
    """Bad input: the run cannot start (exit 2)."""


def _tree(flag: str, path: str, pin: str) -> Path:
    """The tree `path` names: a directory laid out like the installed package, or a pinned release's version
    (`--head 0.34.0`: that release's verified cache, for the release-to-release report). A directory is
    judged as the release its version file names (`fetch.judged_as`) and must hold that release's bound
    files; a version between pins is judged as the newest pin below it, said on stderr."""
    if path in fetch.releases(pin) and not Path(path).exists():
        return _release_tree(flag, f"{pin}@{path}")
    root = Path(path).expanduser()
    if not root.is_dir():
        raise CheckError(f"{flag} {path}: not a directory")
    try:  # the version the check's tables name is the tree's own, and it names the files the tree must hold
        note = fetch.check_tree(pin, root.resolve())
    except ValueError as e:
        raise CheckError(f"{flag} {path}: {e}") from None
    if note:
        print(f"[check] {flag} {path}: {note}", file=sys.stderr)
    return root.resolve()


def _release_tree(flag: str, spec: str) -> Path:
    """A pinned release's verified cache tree (CheckError when it is not fetched)."""
    root = fetch.release_root(spec)
    try:
        fetched = fetch.verified_manifest(fetch.Source(spec.partition("@")[0], root))
    except fetch.FetchError as e:
        raise CheckError(f"{flag} {spec}: {e}") from None
    if not fetched:
        raise CheckError(f"{flag}: {spec} is not fetched (run `k3num fetch {spec}`)")
    return root


def base_release(pin: str, head: Path) -> fetch.Pin:
    """The pinned release `--base pinned` means for `head`: the one the head is judged as."""
    return fetch.Source(pin, head).pin


def validate(args: argparse.Namespace) -> tuple[str, Path, str]:
    """(pin, head tree, base for --check-base: "pinned" for the default release, else a tree's path);
    CheckError says what is wrong. `--base pinned` (the default) is the pinned release the head is judged
    as: a 0.33.0 tree is checked against 0.33.0, not against the engine's newest release."""
    if args.engine not in registry.pinned():
        raise CheckError(f"--engine {args.engine}: not an engine with a pinned source; valid: "
                         f"{', '.join(registry.pinned())}")
    pin = args.engine.split("-")[0]
    head = _tree("--head", args.head, pin)
    if args.base == "pinned":
        release = base_release(pin, head)
        spec = fetch.spec_of(release)
        root = _release_tree("--base pinned", spec)
        return pin, head, "pinned" if release is fetch.PINS[pin] else str(root)
    return pin, head, str(_tree("--base", args.base, pin))


def _plugin_args() -> list[str]:
    """`-p k3num.harness.plugin` where no install registered the plugin (a checkout used in place, as on a
    GPU box without network); an installed one (entry point `k3num`) is loaded by pytest itself."""
    from importlib.metadata import entry_points

    return [] if any(ep.name == "k3num" for ep in entry_points(group="pytest11")) else ["-p", "k3num.harness.plugin"]


def pytest_command(args: argparse.Namespace, pin: str, head: Path, base: str, out: Path) -> list[str]:
    cmd = [sys.executable, "-m", "pytest", *_plugin_args(), "--pyargs", "k3num.properties", "--engine", args.engine,
           "--engine-src", f"{pin}={head}", "--engine-mode", "source", "--check-base", base,
           "--check-out", str(out), "--repro-dir", str(out / "repro"), "--drift-csv", str(out / "drift.csv"),
           f"--hypothesis-profile={args.hypothesis_profile}", "-p", "no:cacheprovider", "-rN",
           "--check-moves-to", f"{out}={Path(args.out).expanduser().resolve()}"]
    if args.k:
        cmd += ["-k", args.k]
    if args.device:
        cmd += ["--device", args.device]
    return cmd


def side_command(args: argparse.Namespace, pin: str, tree: Path | None, side: str, out: Path) -> list[str]:
    """One side of a two-process check: `tree` read as --engine-src (None: the pinned cache), in source mode
    (taking the built ops where they load), its examples and records in `out`. The head draws (and writes
    its bundles and out/cases.pt); the base replays the head's cases (out/../side-head/cases.pt)."""
    cmd = [sys.executable, "-m", "pytest", *_plugin_args(), "--pyargs", "k3num.properties", "--engine", args.engine,
           "--engine-mode", "source", "--check-side", side, "--check-out", str(out),
           "--drift-csv", str(out / "drift.csv"), f"--hypothesis-profile={args.hypothesis_profile}",
           "-p", "no:cacheprovider", "-rN",
           "--check-moves-to", f"{out.parent}={Path(args.out).expanduser().resolve()}"]
    if tree is not None:
        cmd += ["--engine-src", f"{pin}={tree}"]
    if side == "head":
        cmd += ["--repro-dir", str(out.parent / "repro")]
    else:
        cmd += ["--check-replay", str(out.parent / "side-head" / "cases.pt")]
    if args.k:
        cmd += ["-k", args.k]
    if args.device:
        cmd += ["--device", args.device]
    return cmd


def two_processes(args: argparse.Namespace, head: Path, base: str) -> str:
    """Why the sides run in two processes ("" for one): asked for (--processes 2), or a side runs vLLM's
    compiled ops (one process cannot register two libraries under the same op names)."""
    if args.processes == "2":
        return "--processes 2"
    if args.processes == "1" or args.engine != "vllm" or not (args.device or "").startswith("cuda"):
        return ""
    from k3num.supply import cuda_ops

    built = []
    for name, tree in (("head", head), ("base", None if base == "pinned" else Path(base))):
        try:
            src = cuda_ops.sources_of(fetch.Source("vllm", tree))
            if cuda_ops.library_path(cuda_ops.arch(), src).is_file():
                built.append(f"the {name}'s ({src.label})")
        except cuda_ops.BuildError:
            continue
    return f"{' and '.join(built)} compiled ops are built: two libraries of the same op names" if built else ""


def _rows(found: pd.DataFrame, drift: pd.DataFrame, engine: str) -> pd.DataFrame:
    """check.csv: one row per property test (node) and subject, the outcome counts on the node's rows."""
    merged = found.merge(drift, on="node", how="outer")
    merged["engine"] = engine
    for c in ("examples", "new", "fixed", "known", "flaky", "head_skipped", "pairs", "worse", "better", "tied"):
        merged[c] = merged[c].fillna(0).astype(int)
    merged["drift"] = merged["drift"].fillna("")
    merged["status"] = merged["status"].fillna("same")
    return merged.fillna("")


def _entry(entry_id: str) -> str:
    """An entry as check.md names it: its id and its upstream report, or that none is filed yet."""
    d = ledger.by_id(entry_id)
    if d is None:
        return entry_id
    up = d.upstream
    if up.startswith("none found (not reported yet)"):
        up = "not reported upstream yet" + up[len("none found (not reported yet)"):]
    return f"{entry_id} ({up})"


def _flaky_note(entry_id: str) -> str:
    """What a flaky failure in a test is: a known race only where the test's entry is a race."""
    d = ledger.by_id(entry_id) if entry_id else None
    if d is None:
        return "; no ledger entry: a new race? (fails the check)"
    if not d.race:
        return f"; ledger {_entry(entry_id)} is not a race: a flaky failure there is new (fails the check)"
    return f"; a known race: ledger {_entry(entry_id)}"


def _cell(text: str) -> str:
    """A failure message whole in one Markdown table cell: its " / "-joined lines on lines of their own."""
    return str(text).replace("|", "/").replace(" / ", "<br>")


def changed_files(pin: str, head: Path, base: Path) -> list[str]:
    """The bound files of the head's release whose bytes differ from the base tree's (or that the base lacks),
    in the pin's order: what the head changes, as the check reads it."""
    files = fetch.Source(pin, head).pin.files
    return [f for f in files if not (base / f).is_file() or fetch.sha256_of(head / f) != fetch.sha256_of(base / f)]


def sides_line(args: argparse.Namespace, pin: str, head: Path, base: str) -> str:
    """Which releases the two sides are: the head's own version, and the base (by default the pinned release
    the head is judged as)."""
    h, b = fetch.Source(pin, head), fetch.Source(pin, None if base == "pinned" else Path(base))
    said = " (the pinned release the head is judged as: `--base pinned`)" if args.base == "pinned" else ""
    return f"head {pin} {h.version}, base {pin} {b.version}{said}"


def oracle_line(examples: pd.DataFrame) -> str:
    """How often the float64 oracle ran (harness/oracle_memo.py's counts in examples.csv)."""
    cols = ("oracle_computed", "oracle_reused", "oracle_missed")
    if not set(cols) <= set(examples.columns):
        return ""
    c, r, m = (int(pd.to_numeric(examples[k], errors="coerce").fillna(0).sum()) for k in cols)
    return (f"The float64 oracle: {c} calls computed on the head's passes, {r} answered from them on the base's "
            f"(the same input bits), {m} computed again (inputs that differed).")


def unexplained_unpaired(unpaired: pd.DataFrame, examples: pd.DataFrame) -> pd.DataFrame:
    """The unpaired examples a skip does not explain. A side that skips an example skips its whole test
    (hypothesis stops there), so the other side's later examples of that test are one-sided; any other
    unpaired example (different drawn cases, a side that stopped) means the check could not pair it."""
    if unpaired.empty:
        return unpaired
    skipped = {("head only", n) for n in examples.loc[examples["base"] == pairing.SKIP, "node"]}
    skipped |= {("base only", n) for n in examples.loc[examples["head"] == pairing.SKIP, "node"]}
    keep = [not (w.startswith("ran on the ") and (w[len("ran on the "):], n) in skipped)
            for w, n in zip(unpaired["why"], unpaired["node"])]
    return unpaired[keep]


TOKEN_TESTS = ("test_a_decided_token_never_flips", "test_a_block_without_a_near_tie_is_accepted_whole")


def new_failure_severity(node: str, args: argparse.Namespace) -> str:
    """A new failure of a token property flips a decided token on the head (a block without a near-tie not
    accepted whole has a decided position that differs); any other new failure is a tensor's, whose token
    effect `k3num impact` on the head measures."""
    name = node.split("::", 1)[-1].split("[", 1)[0]
    if name in TOKEN_TESTS:
        return impact.CHANGES
    return f"a tensor's: `k3num impact --engine {args.engine} --engine-src {args.engine}={args.head}`"


def markdown(found: pd.DataFrame, drift: pd.DataFrame, args: argparse.Namespace, replay: list[str],
             oracle: str = "", split: str = "", unpaired: pd.DataFrame | None = None, sides: str = "",
             changed: list[str] | None = None) -> str:
    """check.md: which releases, what the head changes, then new first, what the head cannot run, drift,
    fixed and known."""
    short = lambda node: node.split("::", 1)[-1]  # noqa: E731
    new = found[found["new"] > 0]
    lost = found[found["status"] == "head cannot run"]
    worse = drift[drift["drift"] == "worse"]
    fixed = found[(found["fixed"] > 0) & (found["new"] == 0)]
    known = found[found["known"] > 0]
    verdict = "FAIL" if pairing.exit_code(found, drift) else "PASS"
    lines = [f"# k3num check: {verdict}", "",
             f"`{args.engine}`: head `{args.head}` against base `{args.base}`, profile `{args.hypothesis_profile}`"
             + (f", `-k {args.k}`" if args.k else "") + f"; {int(found['examples'].sum())} paired examples in "
             f"{len(found)} property tests." + (f" {oracle}" if oracle else "")
             + (f" One process per side ({split}), joined by test, example and drawn case." if split else ""), ""]
    if sides:
        lines += [f"Releases: {sides}.", ""]
    if changed is not None:
        lines += ["## The head's changes (bound files whose bytes differ from the base's)", ""]
        lines += [f"- `{f}`" for f in changed] or ["None: the head's bound files are the base's bytes."]
        lines.append("")
    if unpaired is not None and len(unpaired):
        lines += ["## Not paired (could not be judged)", "", "| property test | examples | why |",
                  "| --- | --- | --- |"]
        for (node, why), g in unpaired.groupby(["node", "why"], sort=True):
            lines.append(f"| `{short(node)}` | {len(g)} | {why} |")
        lines.append("")
    lines += ["## New failures (fail on the head, pass on the base)", ""]
    if len(new):
        sev = new["node"].map(lambda n: new_failure_severity(n, args))
        new = new.assign(severity=sev, _first=sev != impact.CHANGES).sort_values("_first", kind="stable")
        lines += ["A failure that flips decided tokens is listed first; the others' token effect is `k3num impact` "
                  "on the head (the command in the row).", "",
                  "| property test | new | of | severity | first failure |", "| --- | --- | --- | --- | --- |"]
        lines += [f"| `{short(r.node)}` | {r.new} | {r.examples} | {r.severity} | {_cell(r.first_new)} |"
                  for r in new.itertuples()]
        if replay:
            lines += ["", "Repro bundles, each replayed on the head by:", ""] + [f"    {c}" for c in replay]
    else:
        lines += ["None."]
    lines += ["", "## What the head cannot run (the base can)", ""]
    lines += [f"- `{short(r.node)}`: {r.head_skip_why}" for r in lost.itertuples()] or ["None."]
    flaky = found[found["flaky"] > 0]
    if len(flaky):
        lines += ["", "## Flaky on the head (its failure did not repeat on the same case, or the test has a known "
                      "race)", ""]
        lines += [f"- `{short(r.node)}`: {r.flaky} of {r.examples} examples" + _flaky_note(r.ledger)
                  for r in flaky.itertuples()]
    lines += ["", f"## Paired drift (sign test, one-sided, alpha {pairing.ALPHA:g}; oracles/pairing.py)", ""]
    if len(worse):
        lines += ["| property test | property | subject | worse | better | tied | median head/base | p |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- |"]
        lines += [f"| `{short(r.node)}` | {r.property} | {r.subject} | {r.worse} | {r.better} | {r.tied} | "
                  f"{r.median_ratio:.3g} | {r.p_worse:.2g} |" for r in worse.itertuples()]
    else:
        lines += [f"None beyond noise ({int(drift['pairs'].sum())} paired comparisons, "
                  f"{int((drift['drift'] == 'better').sum())} groups better)."]
    lines += ["", "## Fixed (fail on the base, pass on the head)", ""]
    lines += [f"- `{short(r.node)}`: {r.fixed} of {r.examples} examples"
              + (f"; fixes ledger entry {_entry(r.ledger)}: remove it" if r.ledger else "")
              for r in fixed.itertuples()] or ["None."]
    lines += ["", "## Known (fail on both)", ""]
    lines += [f"- `{short(r.node)}`: {r.known} of {r.examples} examples"
              + (f"; ledger {_entry(r.ledger)}" if r.ledger else "; no ledger entry")
              for r in known.itertuples()] or ["None."]
    return "\n".join(lines) + "\n"


def _run(cmd: list[str], env: dict, out: Path, k: str | None) -> int:
    """Run one pytest process of the check: 0, or 2 with the reason printed."""
    run = subprocess.run(cmd, env=env)
    if run.returncode == 5:
        print(f"[check] ERROR: no property test selected{f' by -k {k}' if k else ''}: nothing was checked",
              file=sys.stderr)
        return 2
    if run.returncode != 0 or not (out / "examples.csv").is_file():
        print(f"[check] ERROR: the paired run failed (pytest exit {run.returncode}); its log is above",
              file=sys.stderr)
        return 2
    return 0


# what a check writes into --out: a run that produced a result replaces exactly these; nothing else there is touched
OWNED = ("check.md", "check.csv", "examples.csv", "records.csv", "unpaired.csv", "drift.csv", "drift.meta.json",
         "repro", "side-head", "side-base", "mutate")


def cmd_check(args: argparse.Namespace) -> int:
    """Exit 0 nothing new, 1 new or drifting, 2 could not run. The run writes into a fresh folder inside --out
    and, once it has a result, replaces the previous run's files there (OWNED) with its own: a run that
    could not start or could not judge leaves the previous results as they were, and no file of an
    earlier run survives beside a new one (bundles included)."""
    import shutil
    import tempfile

    try:
        pin, head, base = validate(args)
    except CheckError as e:
        print(f"[check] ERROR: {e}", file=sys.stderr)
        return 2
    out = Path(args.out).expanduser().resolve()
    out.mkdir(parents=True, exist_ok=True)
    stage = Path(tempfile.mkdtemp(prefix=".check-run-", dir=out))
    try:
        rc = _check(args, pin, head, base, stage, out)
        if rc is None:
            return 2
        if getattr(args, "mutate", False):  # the head's changed lines, mutated: what no property judges
            rc = max(rc, _mutate_changed(args, head, stage))
        for name in OWNED:
            old = out / name
            if old.is_dir() and not old.is_symlink():
                shutil.rmtree(old)
            elif old.exists() or old.is_symlink():
                old.unlink()
        for item in stage.iterdir():
            item.rename(out / item.name)
        return rc
    finally:
        shutil.rmtree(stage, ignore_errors=True)


def _mutate_changed(args: argparse.Namespace, head: Path, stage: Path) -> int:
    """`--mutate`: k3num mutate on the lines the head changed (harness/mutate.py), into OUT/mutate; 0 nothing
    survived (or nothing to mutate), 1 a survivor (listed), 2 it could not run."""
    from k3num.harness import mutate

    print("[check] --mutate: the mutants of the lines the head changed", file=sys.stderr)
    ns = argparse.Namespace(engine=args.engine, head=str(head), release=None, file=None, function=None,
                            operators=None, sample=None, seed=0, workers=args.mutate_workers, profile="ci",
                            out=str(stage / "mutate"), fresh=True)
    return mutate.main(ns)


def _check(args: argparse.Namespace, pin: str, head: Path, base: str, stage: Path, out: Path) -> int | None:
    """The check run into `stage`; its exit code, or None when it could not run (the reason printed)."""
    child_env = env.child({"K3NUM_ENGINE_MODE": "source"})
    split = two_processes(args, head, base)
    unpaired = pd.DataFrame(columns=["node", "example", "why"])
    if split:
        print(f"[check] {args.engine}: head {head} against base {base}, one process each ({split})", file=sys.stderr)
        sides = {}
        for side, tree in (("head", head), ("base", None if base == "pinned" else Path(base))):
            d = stage / f"side-{side}"
            print(f"[check] the {side}'s run", file=sys.stderr)
            if _run(side_command(args, pin, tree, side, d), child_env, d, args.k):
                return None
            sides[side] = (pd.read_csv(d / "examples.csv", keep_default_na=False),
                           pd.read_csv(d / "records.csv", keep_default_na=False))
        examples, records, unpaired = pairing.join_sides(sides["head"][0], sides["base"][0], sides["head"][1],
                                                         sides["base"][1])
        examples.to_csv(stage / "examples.csv", index=False)
        records.to_csv(stage / "records.csv", index=False)
        unpaired.to_csv(stage / "unpaired.csv", index=False)
    else:
        print(f"[check] {args.engine}: {sides_line(args, pin, head, base)}; head {head}; running the paired "
              "properties", file=sys.stderr)
        if _run(pytest_command(args, pin, head, base, stage), child_env, stage, args.k):
            return None
        examples = pd.read_csv(stage / "examples.csv", keep_default_na=False)
        records = pd.read_csv(stage / "records.csv", keep_default_na=False)
    if examples.empty:
        print("[check] ERROR: no example ran on both sides (every selected test skipped?): nothing was checked",
              file=sys.stderr)
        return None
    for c in ("max_abs", "budget", "ratio"):
        records[c] = pd.to_numeric(records[c], errors="coerce")
    found, drift = pairing.outcomes(examples), pairing.paired_drift(records)
    bundles = sorted(p.name for p in (stage / "repro").glob("*.safetensors")) if (stage / "repro").is_dir() else []
    _rows(found, drift, args.engine).to_csv(stage / "check.csv", index=False)
    bad_pairs = unexplained_unpaired(unpaired, examples)
    replay = replay_commands(bundles, out / "repro", pin, head, args.device)
    base_root = fetch.release_root(pin) if base == "pinned" else Path(base)
    (stage / "check.md").write_text(markdown(found, drift, args, replay, oracle_line(examples), split, bad_pairs,
                                             sides_line(args, pin, head, base), changed_files(pin, head, base_root)))
    rc = pairing.exit_code(found, drift)
    if len(bad_pairs):
        print(f"[check] ERROR: {len(bad_pairs)} example(s) could not be paired between the two processes "
              f"({out / 'unpaired.csv'}; check.md lists them)", file=sys.stderr)
        rc = rc or 2
    print("[check] (pytest's counts above are the paired run's: each side's failures are collected there for "
          "pairing, not raised; the verdict is the next line)", file=sys.stderr)
    print(f"[check] {'FAIL' if rc else 'PASS'}: {int(found['new'].gt(0).sum())} test(s) with new failures, "
          f"{int((found['status'] == 'head cannot run').sum())} the head cannot run, "
          f"{int(found['flaky'].gt(0).sum())} flaky, {int((drift['drift'] == 'worse').sum())} drifting, "
          f"{int(found['fixed'].gt(0).sum())} fixed, "
          f"{int(found['known'].gt(0).sum())} known; {out / 'check.md'}", file=sys.stderr)
    return rc


def replay_commands(bundles: list[str], repro: Path, pin: str, head: Path, device: str | None) -> list[str]:
    """The command that replays each bundle on the head, as it runs when pasted (paths as they will be)."""
    import shlex

    dev = f" --device {shlex.quote(device)}" if device else ""
    return [f"k3num replay {shlex.quote(str(repro / name))} --engine-src {shlex.quote(f'{pin}={head}')}{dev}"
            for name in bundles]


def add_parser(sub) -> None:
    c = sub.add_parser("check", help="the pre-merge check: a head tree against the pinned release (or a base tree) "
                                     "on the same drawn cases: new / fixed / known failures and paired drift; exit 0 "
                                     "nothing new, 1 new or drift, 2 could not run",
                       description="The pre-merge check: every drawn example of the selected properties runs through "
                                   "the head tree and the base on the same case; check.md says what is new, fixed, "
                                   "known and drifting. A tree to edit: `k3num tree ENGINE DIR`.",
                       epilog="exit codes: 0 nothing new, nothing lost, no drift beyond noise; 1 a new failure, a "
                              "subject the head cannot run, a flaky failure outside the ledger, or paired drift; 2 "
                              "could not run (bad --head/--base/--engine, a failed run, nothing selected)")
    c.add_argument("--engine", required=True, help=f"one of {', '.join(registry.pinned())}")
    c.add_argument("--head", required=True, metavar="PATH|VERSION",
                   help="the change: a tree laid out like the installed package (a checkout's root), or a pinned "
                        "release's version (--head 0.34.0: the release-to-release report)")
    c.add_argument("--base", default="pinned", metavar="pinned|PATH|VERSION",
                   help="the baseline: pinned (default) is the pinned release the head is judged as (its version "
                        "file's, or the newest pin below it: a 0.33.0 tree against 0.33.0), or another tree, or a "
                        "pinned release's version")
    profiles.add_option(c, "ci", "hypothesis profile (default ci)")
    c.add_argument("-k", default=None, help="a pytest -k expression selecting properties")
    c.add_argument("--mutate", action="store_true",
                   help="then mutate the lines the head changed (k3num mutate --head) and list the survivors: the "
                        "new code no property judges (OUT/mutate/report.md); a survivor makes the exit 1")
    c.add_argument("--mutate-workers", type=int, default=1, metavar="N", help="--mutate's workers (default 1)")
    c.add_argument("--device", default=None,
                   help="device of the small-shape properties: cpu or cuda[:N] (default: cuda where CUDA is, else cpu)")
    c.add_argument("--out", default="out/check", help="output directory (default out/check)")
    c.add_argument("--processes", choices=("auto", "1", "2"), default="auto",
                   help="1: both sides in one process, every example head then base (the oracle once per case); 2: "
                        "one process per side, joined by (test, example, drawn case); auto (default): 2 where a "
                        "side runs vLLM's compiled ops on cuda (`k3num build-ops`), else 1")
    c.set_defaults(func=cmd_check)
