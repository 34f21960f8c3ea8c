#!/usr/bin/env bash
# The nightly GPU job: the whole property suite on the GPU (small shapes with --device cuda,
# and the gpu-marked properties at full K3 shapes) under a hypothesis profile, one pytest
# process per engine running side by side, then one drift CSV and a summary table.
#
# Usage: scripts/gpu_nightly.sh [OUT_DIR] [extra pytest args]
# Environment:
#   K3NUM_PROFILE  hypothesis profile (default nightly; gpu-smoke, nightly-1k, ... see conftest.py)
#   K3NUM_ENGINES  space-separated jobs, one process each (default: every default engine). A job is
#                  an engine name, or ENGINE@KEXPR to run only the tests matching pytest's -k KEXPR
#                  (split a slow engine across processes: "sglang@mix_triton sglang@draft"; write a
#                  space in KEXPR as +: "sglang@mix+and+not+eager")
#   K3NUM_ENGINE_TIMEOUT  seconds after which an engine's run is interrupted (SIGINT: pytest stops,
#                  writes its CSV and junit, and exits non-zero); default none
#   K3NUM_SUITE    what to run: "properties" (default), or a path/-m expression passed to pytest,
#                  e.g. "properties -m gpu" for the K3-shape properties alone
#   K3NUM_SANITIZE the sanitizer mode after the properties: comma-separated compute-sanitizer tools
#                  (memcheck,racecheck,initcheck,synccheck), each run over every kernel subject once
#                  at small shapes (scripts/gpu_sanitize.py: OUT_DIR/sanitize/sanitizer.csv and .md,
#                  appended to summary.md); an unknown tool fails before anything runs; without
#                  compute-sanitizer on PATH the mode is skipped and says so (it does not pass)
# The jobs are spread over the visible GPUs round robin (CUDA_VISIBLE_DEVICES, when set, lists
# them); each job sees one GPU, as cuda:0. Runs with the python on PATH (a GPU box has torch with
# CUDA; no venv is created). Exits non-zero when any engine's run failed; every engine's log stays
# in OUT_DIR.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
out=${1:-$root/out/nightly}
shift || true
mkdir -p "$out"
cd "$root"
sanitize=${K3NUM_SANITIZE:-}
if [ -n "$sanitize" ]; then  # refuse a bad tool name before hours of properties
    python - "$sanitize" <<'PY' || exit 2
import sys
from oracles import sanitizer
try:
    sanitizer.check_tools(sys.argv[1])
except ValueError as e:
    sys.exit(f"gpu_nightly: K3NUM_SANITIZE: {e}")
PY
fi
python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'no CUDA device: the nightly GPU job needs one')"
profile=${K3NUM_PROFILE:-nightly}
engines=${K3NUM_ENGINES:-$(python -c "from engines import registry; print(' '.join(registry.defaults()))")}
read -r -a suite <<< "${K3NUM_SUITE:-properties}"
limit=${K3NUM_ENGINE_TIMEOUT:-}
echo "gpu_nightly: profile=$profile jobs=[$engines] suite=[${suite[*]}] sanitize=[${sanitize:-off}] -> $out"
start=$SECONDS
declare -A pids
# the jobs share the host's cores: each gets its share of torch's CPU threads, not all of them
read -r -a joblist <<< "$engines"
threads=$(( $(nproc) / ${#joblist[@]} )); [ "$threads" -ge 1 ] || threads=1
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$threads}
# the jobs are spread over the visible GPUs round robin; each sees its GPU as cuda:0
read -r -a gpus <<< "$(python -c "import os, torch
v = os.environ.get('CUDA_VISIBLE_DEVICES', '').strip()
ids = [x.strip() for x in v.split(',') if x.strip()] if v else [str(i) for i in range(torch.cuda.device_count())]
print(' '.join(ids))")"
[ ${#gpus[@]} -ge 1 ] || { echo "gpu_nightly: no GPU is visible"; exit 2; }
job=0
for e in $engines; do
    gpu=${gpus[$((job % ${#gpus[@]}))]}
    job=$((job + 1))
    echo "gpu_nightly: job $e on GPU $gpu"
    engine=${e%%@*}
    select=()
    kexpr=${e#*@}
    [ "$engine" != "$e" ] && select=(-k "${kexpr//+/ }")
    CUDA_VISIBLE_DEVICES=$gpu ${limit:+timeout -s INT -k 30 "$limit"} python -m pytest "${suite[@]}" "${select[@]}" --engine "$engine" \
        --device cuda --hypothesis-profile="$profile" -p no:cacheprovider -o junit_suite_name="k3num-$e" \
        --durations=15 --drift-csv "$out/drift-$e.csv" --junitxml "$out/junit-$e.xml" "$@" \
        > "$out/pytest-$e.log" 2>&1 &
    pids[$e]=$!
done
status=0
for e in $engines; do
    if wait "${pids[$e]}"; then rc=0; else rc=$?; fi
    [ "$rc" -eq 124 ] && echo "gpu_nightly: engine $e was interrupted at its ${limit} s limit (its CSV holds the tests it finished)"
    echo "gpu_nightly: engine $e finished with exit $rc after $((SECONDS - start)) s: $(tail -n 1 "$out/pytest-$e.log")"
    # pytest exit 5 (nothing collected) is a failure here too: a nightly that ran nothing must not pass
    [ "$rc" -eq 0 ] || status=1
done
python - "$out" $engines > "$out/summary.md" <<'PY'
import sys
from pathlib import Path

import pandas as pd

from oracles.drift import SM100_NOTE, covers_vllm_attn_res, summarize

out, engines = Path(sys.argv[1]), sys.argv[2:]
frames = [pd.read_csv(out / f"drift-{e}.csv") for e in engines if (out / f"drift-{e}.csv").exists()]
if not frames:
    sys.exit("gpu_nightly: no engine wrote a drift CSV")
df = pd.concat(frames, ignore_index=True)
df.to_csv(out / "drift.csv", index=False)
t = summarize(df, ["engine", "mode", "device", "subject", "property"])
print(t.to_string(index=False, float_format=lambda v: f"{v:.3g}"))
if covers_vllm_attn_res(t):
    print(SM100_NOTE)
PY
if [ -n "$sanitize" ]; then
    set +e
    python scripts/gpu_sanitize.py --sanitize "$sanitize" --out "$out/sanitize"
    src=$?
    set -e
    { echo; cat "$out/sanitize/sanitizer.md"; } >> "$out/summary.md"
    # 3: skipped (no compute-sanitizer): reported in the summary, not a failure of the properties
    [ "$src" -eq 0 ] || [ "$src" -eq 3 ] || status=1
fi
cat "$out/summary.md"
echo "gpu_nightly: done in $((SECONDS - start)) s, exit $status"
exit "$status"
