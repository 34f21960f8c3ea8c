#!/usr/bin/env bash
# The main job: the property suite against the default engines, writing the drift
# CSV of this run to out/runs/drift-<UTC time>.csv with out/drift.csv linking to it
# (--drift-dir out; a run never overwrites another's). Extra arguments go to pytest, e.g.
#   --engine mirror --hypothesis-profile nightly --drift-csv /tmp/d.csv
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
source "$root/scripts/env.sh"
cd "$root"
k3num fetch || echo "[properties] WARNING: k3num fetch failed: the real engines will be skipped" >&2
args=("$@")
case " ${args[*]-} " in *" --drift-csv"*|*" --drift-dir"*) ;; *) args+=(--drift-dir out) ;; esac
case " ${args[*]-} " in *" --hypothesis-profile"*) ;; *) args+=(--hypothesis-profile=ci) ;; esac
exec python -m pytest properties "${args[@]}"
