"""`k3num`: the harness's command line, one function per subcommand.

    k3num fetch [TARGET...]   the pinned engine wheels (and vLLM's csrc subset: target vllm-csrc),
                              hash-checked, with only the needed files extracted
    k3num build-ops           vLLM's CUDA ops for the fused context-KV path, built from the pinned
                              sdist's csrc against the local torch (a CUDA machine with nvcc)
    k3num golden write        a golden set: inputs and float64 oracle outputs (safetensors) and a
                              hash-checked manifest, for `pytest --golden DIR`
"""

from __future__ import annotations

import argparse
import sys

from engines import fetch


def cmd_fetch(args: argparse.Namespace) -> int:
    status = 0
    for name in args.targets or fetch_targets():
        try:
            if name.endswith("-csrc"):
                fetch.fetch_csrc(name.removesuffix("-csrc"))
            else:
                fetch.fetch(name)
        except fetch.FetchError as e:
            print(f"[fetch] ERROR: {e}", file=sys.stderr)
            status = 1
    return status


def fetch_targets() -> list[str]:
    return sorted(fetch.PINS) + [f"{name}-csrc" for name in sorted(fetch.SDISTS)]


def cmd_build_ops(args: argparse.Namespace) -> int:
    from engines import cuda_ops

    try:
        so = cuda_ops.build(verbose=args.verbose, jobs=args.jobs)
    except cuda_ops.BuildError as e:
        print(f"[build-ops] ERROR: {e}", file=sys.stderr)
        return 1
    print(f"[build-ops] {cuda_ops.describe(so)}")
    return 0


def cmd_golden_write(args: argparse.Namespace) -> int:
    from pathlib import Path

    from fixtures import golden

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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="k3num", description="k3-numerics: the K3 numerics harness's tools")
    sub = ap.add_subparsers(dest="cmd", required=True, metavar="COMMAND")
    f = sub.add_parser("fetch", help="download the pinned engine wheels (and vLLM's csrc subset) and extract "
                                     "the files the adapters need, hash-checked")
    f.add_argument("targets", nargs="*", help=f"default: all ({', '.join(fetch_targets())})")
    f.set_defaults(func=cmd_fetch)
    b = sub.add_parser("build-ops", help="build vLLM's rms_norm, rotary_embedding and concat_and_cache_mla_grouped "
                                         "CUDA ops from the pinned sdist (CUDA machine; cached)")
    b.add_argument("--jobs", type=int, default=None, help="parallel compile jobs (MAX_JOBS; default: all cores)")
    b.add_argument("-v", "--verbose", action="store_true", help="show the compiler's commands")
    b.set_defaults(func=cmd_build_ops)
    g = sub.add_parser("golden", help="golden sets: inputs and float64 oracle outputs stored as safetensors")
    gsub = g.add_subparsers(dest="golden_cmd", required=True, metavar="ACTION")
    gw = gsub.add_parser("write", help="write a golden set (then judge with `pytest --golden DIR`)")
    gw.add_argument("--preset", required=True, help="k3-attnres, k3-dspark, tiny-attnres or tiny-dspark")
    gw.add_argument("--cases", type=int, required=True, help="number of cases")
    gw.add_argument("--out", required=True, help="an empty or new directory")
    gw.add_argument("--seed", type=int, default=0, help="seed of the case draws (default 0)")
    gw.set_defaults(func=cmd_golden_write)
    args = ap.parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    raise SystemExit(main())
