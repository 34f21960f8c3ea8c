#!/usr/bin/env bash
# The main job: the property suite against the default engines, writing the drift
# CSV of this run to out/runs/drift-<UTC time>.csv with out/drift.csv linking to it
# (--drift-dir out; a run never overwrites another's), then once more per other pinned
# release (each engine's default is its newest pin; vLLM's older one writes
# out/runs/drift-<UTC time>-vllm-<version>.csv). Extra arguments go
# to pytest; --engine or --engine-src make it one run, as asked, e.g.
#   --engine mirror --hypothesis-profile nightly --drift-csv /tmp/d.csv
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
source "$root/scripts/env.sh"
cd "$root"
k3num fetch || echo "[properties] WARNING: k3num fetch failed: the real engines will be skipped" >&2
args=("$@")
case " ${args[*]-} " in *" --drift-csv"*|*" --drift-dir"*) ;; *) args+=(--drift-dir out) ;; esac
case " ${args[*]-} " in *" --hypothesis-profile"*) ;; *) args+=(--hypothesis-profile=ci) ;; esac
# once on the default engines, then once per other pinned release (vllm@0.33.0): harness/main_job.py
exec python -m k3num.harness.main_job "${args[@]}"
