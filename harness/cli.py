"""`k3num`: the harness's command line, one function per subcommand.

    k3num fetch [TARGET...]   the pinned engine wheels (and vLLM's csrc subset: target vllm-csrc),
                              hash-checked, with only the needed files extracted
    k3num build-ops           vLLM's CUDA ops for the fused context-KV path and the MLA epilogue, built from the pinned
                              sdist's csrc against the local torch (a CUDA machine with nvcc)
    k3num replay BUNDLE       rerun a repro bundle (--repro-dir) and judge it: exit 0 pass, 1 fail
    k3num repro K3N-00X       write the repro bundle of a ledger entry's reproducer
    k3num golden write        a golden set: inputs and float64 oracle outputs (safetensors) and a
                              hash-checked manifest, for `pytest --golden DIR`
    k3num report              append a run's drift CSV(s) to the history, write report.md/.html with
                              plots, and (--gate) fail on a ratio drift beyond the history's noise
    k3num check               the pre-merge check: a head tree against the pinned release on the same
                              drawn cases (new / fixed / known failures, paired drift; harness/check.py)
    k3num bisect              the first bad engine commit, by `k3num replay` or selected properties on
                              git worktrees
    k3num impact              what each engine's K3 paths do to the draft's proposed tokens (harness/impact.py)
    k3num coverage            every K3 kernel and code path on the three paths: bound or not, the property
                              tests that judge it, why not (harness/coverage.py; --format csv)
    k3num mutate              the suite's mutation score on an engine's bound K3 functions (cosmic-ray;
                              harness/mutate.py)
    k3num tree ENGINE DIR     a pinned release's bound files, copied from the hash-checked cache into DIR laid
                              out like the installed package: a tree to edit for `k3num check --head DIR`
"""

from __future__ import annotations

import argparse
import hashlib
import sys
from pathlib import Path

from k3num.harness import profiles
from k3num.supply import env, fetch


def cmd_fetch(args: argparse.Namespace) -> int:
    valid = fetch_targets()
    unknown = [n for n in args.targets if n not in valid]
    if unknown:  # before anything is downloaded: every valid name, the csrc targets included
        print(f"[fetch] ERROR: unknown target(s) {', '.join(unknown)}; valid: {', '.join(valid)}", file=sys.stderr)
        return 2
    status = 0
    targets = args.targets or valid
    for name in targets:
        try:
            if name.endswith("-csrc"):
                fetch.fetch_csrc(name.removesuffix("-csrc"))
            elif name.endswith("-bin"):
                engine = name.removesuffix("-bin")
                if engine not in targets:  # the wheels the libraries come from, checked (once: not if fetched above)
                    fetch.fetch(engine)
                for key in (k for k, b in fetch.BINARIES.items() if b.engine == engine):
                    said: list[str] = []  # one line per library: the extraction's, or that it was there
                    path = fetch.binary(key, log=lambda m: (said.append(m), print(m)))
                    if not said:
                        print(f"[fetch] {key}: up to date: {path}")
            else:
                fetch.fetch(name)
        except fetch.FetchError as e:
            print(f"[fetch] ERROR: {e}", file=sys.stderr)
            status = 1
    return status


def cmd_tree(args: argparse.Namespace) -> int:
    """Exit 0 written, 2 bad input (an engine or release not pinned, an engine not fetched, a non-empty DIR
    without --force)."""
    from k3num.harness import fixes

    try:
        pin = fetch.release_pin(args.engine)
    except ValueError as e:
        print(f"[tree] ERROR: {e}; valid: {', '.join(sorted(fetch.all_release_specs()))}", file=sys.stderr)
        return 2
    dest = Path(args.dir).expanduser()
    if dest.exists() and (not dest.is_dir() or any(dest.iterdir())) and not args.force:
        print(f"[tree] ERROR: {dest}: exists and is not an empty folder (--force replaces it)", file=sys.stderr)
        return 2
    try:
        fixes.pinned_tree(args.engine, dest)
    except fixes.FixError as e:
        print(f"[tree] ERROR: {e}", file=sys.stderr)
        return 2
    print(f"[tree] {pin.engine} {pin.version}: {len(pin.files)} files into {dest.resolve()}; edit them, then "
          f"`k3num check --engine {pin.engine} --head {dest}`", file=sys.stderr)
    for rel in pin.files:
        print(rel)
    return 0


def fetch_targets() -> list[str]:
    # every pinned release: the default's bare name, the others as ENGINE@VERSION (supply/fetch.py RELEASES)
    return (sorted(fetch.all_release_specs()) + [f"{spec}-csrc" for spec in fetch.csrc_specs()]
            + sorted({f"{b.engine}-bin" for b in fetch.BINARIES.values()}))


def _sources(items: list[str], *, whole_trees: bool = True) -> dict[str, Path]:
    """--engine-src NAME=PATH items over the trees this process was started with (K3NUM_ENGINE_SRC, read at
    the boundary: harness/run.py); ValueError naming the bad item. With `whole_trees` each given tree is judged as
    the release it says and must hold that release's bound files (`fetch.check_tree`), before anything runs;
    build-ops reads only a checkout's csrc/ and passes False."""
    from k3num.harness import run

    try:
        given = fetch.parse_sources(items)
        for pin, tree in given.items() if whole_trees else ():
            note = fetch.check_tree(pin, tree)
            if note:
                print(f"[k3num] --engine-src {pin}={tree}: {note}", file=sys.stderr)
        return {**run.RunContext.from_env().sources, **given}
    except ValueError as e:
        raise ValueError(f"--engine-src: {e}") from None


def cmd_build_ops(args: argparse.Namespace) -> int:
    """Exit 0 built (or cached), 2 when it cannot build here (no CUDA, a checkout missing files or with a
    changed schema, a compile error), each with its reason."""
    from k3num.supply import cuda_ops

    try:
        local = _sources(args.engine_src, whole_trees=False)
        unknown = sorted(set(local) - {"vllm"})
        if unknown:
            raise ValueError(f"--engine-src {unknown[0]}: build-ops builds vLLM's ops only (--engine-src vllm=PATH)")
        cuda_ops.arch()  # no CUDA: said before the checkout is read, nothing made in the cache
        # a checkout's csrc, or the pinned sdist of the release named (`--engine-src vllm=<a release's cache tree>`,
        # as `--engine vllm@0.33.0` sets it; default: the newest)
        vllm = fetch.Source("vllm", local.get("vllm"))
        src = cuda_ops.checkout_sources(vllm.local, vllm.pin.version) if vllm.local else cuda_ops.sources_of(vllm)
        so = cuda_ops.build(verbose=args.verbose, jobs=args.jobs, src=src)
    except (cuda_ops.BuildError, ValueError) as e:
        print(f"[build-ops] ERROR: {e}", file=sys.stderr)
        return 2
    print(f"[build-ops] {cuda_ops.describe(so, src)}")
    return 0


def cmd_golden_write(args: argparse.Namespace) -> int:

    from k3num.fixtures import golden

    try:
        out = golden.write(args.preset, args.cases, Path(args.out), seed=args.seed)
    except golden.GoldenError as e:
        print(f"[golden] ERROR: {e}", file=sys.stderr)
        return 2
    manifest = golden.load_manifest(out)
    size = sum((out / name).stat().st_size for name in manifest["files"])
    print(f"[golden] {manifest['cases']} {manifest['kind']} cases of {manifest['preset']} in {out} "
          f"({size / 2**20:.1f} MiB), refmodel {manifest['refmodel_version'][:12]}...")
    return 0


def cmd_replay(args: argparse.Namespace) -> int:
    from k3num.harness import repro

    if args.device == "cpu":
        env.put_default("TRITON_INTERPRET", "1")  # before triton's first import, as the plugin does
    try:
        sources = _sources(args.engine_src)
        passed, line = repro.replay(Path(args.bundle), device=args.device, sources=sources)
    except (repro.NotReplayable, ValueError, OSError) as e:
        print(f"[replay] ERROR: {e}", file=sys.stderr)
        return 2
    print(line)
    return 0 if passed else 1


def cmd_repro(args: argparse.Namespace) -> int:
    import subprocess

    from k3num.oracles import ledger

    entry = next((d for d in ledger.LEDGER if d.id == args.entry), None)
    if entry is None:
        print(f"[repro] ERROR: no ledger entry {args.entry!r}; known: {[d.id for d in ledger.LEDGER]}", file=sys.stderr)
        return 2
    root = Path(__file__).resolve().parents[1]
    files = [p for p in sorted((root / "properties").glob("test_*.py")) if f"def {entry.test}(" in p.read_text()]
    if not files:
        print(f"[repro] ERROR: {entry.id}: its test {entry.test} is in no property file", file=sys.stderr)
        return 2
    out = Path(args.out)
    before = set(out.glob("*.safetensors")) if out.is_dir() else set()
    cmd = [sys.executable, "-m", "pytest", f"{files[0].relative_to(root)}::{entry.test}", "--engine", entry.engine,
           "--repro-dir", str(out), "-p", "no:cacheprovider", "-q", f"--hypothesis-profile={args.hypothesis_profile}"]
    print(f"[repro] {entry.id}: {' '.join(cmd[2:])}")
    subprocess.run(cmd, cwd=root, capture_output=True, text=True)
    written = sorted(set(out.glob("*.safetensors")) - before) if out.is_dir() else []
    if not written:
        where = f" (it shows in modes {', '.join(entry.modes)})" if entry.modes else ""
        print(f"[repro] {entry.id}: no failing comparison was reproduced here{where}; an exact-contract failure "
              "writes no bundle", file=sys.stderr)
        return 1
    for p in written:
        print(f"[repro] {p}  (replay: k3num replay {p})")
    return 0


def cmd_report(args: argparse.Namespace) -> int:

    import pandas as pd

    from k3num.harness.nightly import report
    from k3num.oracles import history as hist

    try:  # a history that cannot be made or written is refused before anything is read (nothing is made yet)
        hist.could_write(args.history)
    except hist.HistoryError as e:
        print(f"[report] ERROR: {e}", file=sys.stderr)
        return 2
    if not args.check:  # then the run's CSVs: a bad one is refused before the history folder is made
        if not args.csv:
            print("[report] ERROR: no drift CSV given (k3num report --history DIR CSV...)", file=sys.stderr)
            return 2
        try:
            frames = [hist.read_run_csv(c) for c in args.csv]
            metas = [hist.read_meta(c) for c in args.csv]
        except hist.SchemaError as e:
            print(f"[report] ERROR: {e}", file=sys.stderr)
            return 2
    try:  # a history that cannot be written is refused before the report is computed
        hdir = hist.check_writable(args.history)
    except hist.HistoryError as e:
        print(f"[report] ERROR: {e}", file=sys.stderr)
        return 2
    if args.check:
        print(f"[report] history directory {hdir} is writable")
        return 0
    meta = _report_meta(args, metas)
    if args.impact:
        from k3num.harness import impact

        try:
            meta["impact"] = impact.read_severities(args.impact)
        except ValueError as e:
            print(f"[report] ERROR: --impact: {e}", file=sys.stderr)
            return 2
    # what identifies the run: its CSVs and their sidecars (the sidecar holds the run's start time, so two
    # derandomized runs with the same records are two runs, and one run reported twice is one)
    meta["csv_sha256"] = hashlib.sha256(b"".join(
        p.read_bytes() for c in args.csv for p in (Path(c), hist.meta_path(c)) if p.exists())).hexdigest()
    df = pd.concat(frames, ignore_index=True)
    past = hist.load_history(hdir)
    for f, why in past.bad:
        print(f"[report] WARNING: history file {f} skipped: {why}", file=sys.stderr)
    run = hist.summarize_run(df, meta)
    # the same CSV bytes reported again: the run is in the history already, once
    again = next((r for r in past.runs if r["meta"].get("csv_sha256") == meta["csv_sha256"]), None)
    earlier = [r for r in past.runs if r is not again]
    verdicts, refused = None, None
    if args.gate:
        try:
            verdicts = hist.gate(earlier, run, allow_missing=args.allow_missing)
        except hist.HistoryError as e:
            refused = e
    if again is None:
        written = hist.write_run(hdir, run)
        run["file"] = written.name
        where = f"appended as {written}; {len(past.runs) + 1} runs in the history"
        runs = [*past.runs, run]
    else:
        where = f"already in the history as {again['file']} (the same CSV bytes): not appended again"
        runs = past.runs
    out = Path(args.out) if args.out else hdir / "report"
    md, html_path = report.render(runs, out, gate=verdicts, skipped=past.bad)
    print(f"[report] run of {len(df)} records ({meta.get('profile', '?')}, {meta.get('device_name', '?')}) {where}")
    print(f"[report] {md} and {html_path}")
    if refused is not None:  # the run seeds the history and the report is written; the gate does not pass
        print(f"[report] ERROR: {refused}", file=sys.stderr)
        return 2
    if verdicts is None:
        return 0
    shown = verdicts[verdicts["verdict"].isin(["alarm", "ok"])]
    print(shown.to_string(index=False, float_format=lambda v: f"{v:.3g}") if not shown.empty else
          "[report] gate: no group has history to compare with")
    missing = verdicts[verdicts["verdict"] == "missing"]
    for _, g in missing.iterrows():
        print(f"[report] GATE: missing from this run: {hist.group_label(g)}", file=sys.stderr)
    alarms = verdicts[verdicts["verdict"] == "alarm"]
    if not alarms.empty or not missing.empty:
        print(f"[report] GATE: {len(alarms)} group(s) drifted beyond the history's noise, {len(missing)} group(s) "
              "of the history missing from this run", file=sys.stderr)
        return 1
    print(f"[report] gate passed: {len(shown)} group(s) within the history's noise")
    return 0


def cmd_bisect(args: argparse.Namespace) -> int:

    from k3num.harness.nightly import bisect

    if args.engine not in fetch.PINS:
        print(f"[bisect] ERROR: --engine {args.engine!r}: bisect needs an engine with pinned files "
              f"({', '.join(sorted(fetch.PINS))})", file=sys.stderr)
        return 2
    if args.bundle:
        judge = bisect.replay_judge(args.engine, Path(args.bundle).resolve(), device=args.device)
        how = f"k3num replay {args.bundle}"
    else:
        judge = bisect.pytest_judge(args.engine, args.k, profile=args.hypothesis_profile)
        how = f"the properties matching -k {args.k!r} ({args.hypothesis_profile})"
    print(f"[bisect] {args.engine} in {args.repo}, {args.good}..{args.bad}, judged by {how}")
    try:
        out = bisect.bisect(Path(args.repo), args.engine, args.good, args.bad, judge)
    except bisect.BisectError as e:
        print(f"[bisect] ERROR: {e}", file=sys.stderr)
        return 2
    tested = sum(1 for v in out.verdicts.values() if v != bisect.SKIP)
    skipped = sum(1 for v in out.verdicts.values() if v == bisect.SKIP)
    if len(out.first_bad) == 1:
        print(f"[bisect] first bad commit: {bisect.describe(Path(args.repo), out.first_bad[0])}")
    else:
        print("[bisect] only skipped commits are left to test; the first bad commit is one of:")
        for c in out.first_bad:
            print(f"[bisect]   {bisect.describe(Path(args.repo), c)}")
    print(f"[bisect] {tested} revisions judged, {skipped} skipped")
    if out.not_recomputed:
        print(f"[bisect] judged with the bundle's own reference and budget ({bisect.NOT_RECOMPUTED}: an older rule "
              f"this harness cannot recompute): {', '.join(c[:12] for c in out.not_recomputed)}")
    return 0


def _report_meta(args: argparse.Namespace, metas: list[dict]) -> dict:
    """The run's metadata: the CSVs' sidecars (the first, with every sidecar's examples), then the flags."""
    import datetime

    meta: dict = dict(next((m for m in metas if m), {}))
    examples: dict = {}
    for m in metas:
        examples.update(m.get("examples", {}))
    meta["examples"] = examples
    for flag, key in (("date", "date"), ("hypothesis_profile", "profile"), ("device_name", "device_name"),
                      ("harness_commit", "harness_commit")):
        v = getattr(args, flag)
        if v:
            meta[key] = v
    meta.setdefault("date", datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"))
    for k in ("profile", "device_name", "harness_commit", "command", "torch", "repro_dir"):
        meta.setdefault(k, "")
    meta["csv"] = [str(c) for c in args.csv]
    return meta


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="k3num", description="k3-numerics: the K3 numerics harness's tools")
    sub = ap.add_subparsers(dest="cmd", required=True, metavar="COMMAND")
    f = sub.add_parser("fetch", help="download the pinned engine wheels (and vLLM's csrc subset) and extract "
                                     "the files the adapters need, hash-checked",
                       description="Download the pinned engine wheels (and vLLM's source distribution for its csrc "
                                   "subset, and the one compiled library a GPU run loads), check each against its "
                                   "sha256 pin (supply/fetch.py), and extract the files the adapters need into the "
                                   "engine cache (~/.cache/k3-numerics/engines, K3NUM_ENGINE_CACHE). Idempotent: a "
                                   "fetched target is checked, not downloaded again. Exit 0 all fetched, 1 a target "
                                   "failed, 2 an unknown target.")
    f.add_argument("targets", nargs="*", help=f"default: all ({', '.join(fetch_targets())})")
    f.set_defaults(func=cmd_fetch)
    b = sub.add_parser("build-ops", help="build vLLM's rms_norm, rotary_embedding, concat_and_cache_mla_grouped, "
                                         "concat_and_cache_mla and the fused MLA epilogue's prefill and decode "
                                         "inserts from the pinned sdist (CUDA machine; cached)",
                       epilog="exit codes: 0 built (or cached); 2 cannot build here (no CUDA, a checkout missing "
                              "files or with a changed schema, a compile error), with the reason")
    b.add_argument("--jobs", type=int, default=None, help="parallel compile jobs (MAX_JOBS; default: all cores)")
    b.add_argument("-v", "--verbose", action="store_true", help="show the compiler's commands")
    b.add_argument("--engine-src", action="append", default=[], metavar="vllm=PATH",
                   help="build the ops from a vLLM checkout's csrc/ instead of the pinned sdist's (version "
                        "<pin>+local, cached by the hash of its files); the properties, check and replay with the "
                        "same --engine-src then run on them")
    b.set_defaults(func=cmd_build_ops)
    g = sub.add_parser("golden", help="golden sets: inputs and float64 oracle outputs stored as safetensors")
    gsub = g.add_subparsers(dest="golden_cmd", required=True, metavar="ACTION")
    gw = gsub.add_parser("write", epilog="exit codes: 0 written; 2 bad input (a preset, a folder), with the reason",
                         help="write a golden set (then judge with `bash scripts/run_properties.sh --golden "
                                       "DIR`)", description="Write a golden set: inputs and float64 oracle outputs "
                                       "with a hash-checked manifest. Judge an engine against it with `bash "
                                       "scripts/run_properties.sh --golden DIR --engine NAME`.")
    gw.add_argument("--preset", required=True, help="k3-attnres, k3-dspark, tiny-attnres or tiny-dspark")
    gw.add_argument("--cases", type=int, required=True, help="number of cases")
    gw.add_argument("--out", required=True, help="an empty or new directory")
    gw.add_argument("--seed", type=int, default=0, help="seed of the case draws (default 0)")
    gw.set_defaults(func=cmd_golden_write)
    r = sub.add_parser("replay", epilog="exit codes: 0 the subject passes on the bundle's inputs; 1 it fails; 2 not "
                                        "replayable (a bad bundle or --engine-src), with the reason",
                       help="rerun a repro bundle's subject on its stored inputs and judge it with the same "
                                      "budget: exit 0 pass, 1 fail (a bisection predicate), 2 not replayable")
    r.add_argument("bundle", help="a .safetensors file written by --repro-dir")
    r.add_argument("--engine-src", action="append", default=[], metavar="NAME=PATH",
                   help="read engine NAME from PATH (a checkout or a patch) instead of the pinned release")
    r.add_argument("--device", default="cpu", help="device of the stored inputs (default cpu)")
    r.set_defaults(func=cmd_replay)
    rp = sub.add_parser("repro", help="write the repro bundle(s) of a ledger entry's reproducer",
                        epilog="exit codes: 0 bundles written; 1 the reproducer did not fail here (no bundle); 2 an "
                               "unknown entry")
    rp.add_argument("entry", help="a ledger entry id (oracles/ledger.py)")
    rp.add_argument("--out", required=True, help="directory for the bundles")
    profiles.add_option(rp, "ci", "hypothesis profile of the run (default ci)")
    rp.set_defaults(func=cmd_repro)
    rep = sub.add_parser("report", epilog="exit codes: 0 written (with --gate: no alarm); 1 --gate: an alarm; 2 bad "
                                          "input (a CSV, the history folder), or --gate with no history",
                         help="append a run (drift CSVs) to a history directory and write report.md, "
                                         "report.html and PNG plots; --gate exits 1 on a drift beyond the history's "
                                         "noise")
    rep.add_argument("csv", nargs="*", help="the run's drift CSV(s) (their .meta.json sidecars are read too)")
    rep.add_argument("--history", required=True, metavar="DIR", help="the history directory (one JSON file per run)")
    rep.add_argument("--out", default=None, metavar="DIR", help="where the report goes (default DIR/report)")
    rep.add_argument("--gate", action="store_true", help="compare the run with the history first: exit 1 on an alarm, "
                     "2 when there is no history (the run is still appended)")
    rep.add_argument("--check", action="store_true", help="only check that the history directory is writable")
    rep.add_argument("--allow-missing", nargs="+", default=[], metavar="GROUP",
                     help="with --gate: groups of the history this run may lack (engine[/subject[/property[/mode"
                          "[/device]]]]); any other missing group fails the gate")
    rep.add_argument("--impact", default=None, metavar="CSV",
                     help="`k3num impact --ledger --format csv`'s output: each ledger entry's token severity in the "
                          "report's ledger table (kept in the history with the run)")
    rep.add_argument("--date", default=None, help="override the run's date (ISO 8601, UTC)")
    profiles.add_option(rep, None, "override the run's hypothesis profile")
    rep.add_argument("--device-name", default=None, help="override the run's device name")
    rep.add_argument("--harness-commit", default=None, help="override the run's harness commit")
    rep.set_defaults(func=cmd_report)
    t = sub.add_parser("tree", help="copy a pinned release's bound files into DIR, laid out like the installed "
                                    "package: a tree to edit and judge with `k3num check --head DIR`",
                       description="Copy the pinned release's bound files (the ones the adapters read, from the "
                                   "hash-checked cache) into DIR laid out like the installed package. Edit them, "
                                   "then `k3num check --engine ENGINE --head DIR`. Exit 0 written, 2 bad input.")
    t.add_argument("engine", metavar="ENGINE[@VERSION]",
                   help=f"a pinned release: one of {', '.join(sorted(fetch.all_release_specs()))} (ENGINE alone: its "
                   "newest)")
    t.add_argument("dir", metavar="DIR", help="a new or empty folder")
    t.add_argument("--force", action="store_true", help="replace DIR if it exists")
    t.set_defaults(func=cmd_tree)
    from k3num.harness import check, coverage, impact, mutate

    check.add_parser(sub)
    coverage.add_parser(sub)
    impact.add_parser(sub)
    mutate.add_parser(sub)
    bi = sub.add_parser("bisect", epilog="exit codes: 0 the first bad commit found (or the candidates left); 2 it "
                                         "could not bisect (an engine without pins, a revision that does not judge "
                                         "as its end says), with the reason",
                        help="the first bad engine commit between --good and --bad: each revision checked "
                                       "out with git worktree and judged by k3num replay or selected properties")
    bi.add_argument("--engine", required=True, help="the engine the repository holds (vllm, sglang, tokenspeed)")
    bi.add_argument("--repo", required=True, help="a git repository laid out like the installed package")
    bi.add_argument("--good", required=True, help="a revision that passes")
    bi.add_argument("--bad", required=True, help="a later revision that fails")
    how = bi.add_mutually_exclusive_group(required=True)
    how.add_argument("--bundle", help="judge each revision by `k3num replay BUNDLE`")
    how.add_argument("-k", help="judge each revision by the properties matching this pytest -k expression")
    profiles.add_option(bi, "ci", "hypothesis profile of -k runs (default ci)")
    bi.add_argument("--device", default="cpu", help="device of --bundle replays (default cpu)")
    bi.set_defaults(func=cmd_bisect)
    args = ap.parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    raise SystemExit(main())
