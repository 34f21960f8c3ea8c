#!/usr/bin/env bash
# The nightly GPU job: the whole property suite on the GPU (small shapes with --device cuda,
# and the gpu-marked properties at full K3 shapes) under a hypothesis profile, spread by
# pytest-xdist over the visible GPUs (one worker per GPU, times K3NUM_WORKERS_PER_GPU; the
# worker-to-GPU mapping is in harness/plugin.py and harness/scaleout.py), then one drift CSV (the
# controller merges the workers' records) and a summary table.
#
# Usage: scripts/gpu_nightly.sh [OUT_DIR] [extra pytest args]
# Environment:
#   K3NUM_PROFILE  hypothesis profile (default nightly; gpu-smoke, nightly-1k, ... see harness/plugin.py)
#   K3NUM_ENGINES  space- or comma-separated engines (default: every default engine)
#   K3NUM_RELEASES all (default): after the default releases, the suite once more per other pinned release of
#                  a pin the engines read (vLLM 0.34.0: OUT_DIR/drift-vllm-0.34.0.csv); default: those alone
#   K3NUM_WORKERS  pytest-xdist's -n (default auto: one worker per visible GPU x K3NUM_WORKERS_PER_GPU)
#   K3NUM_WORKERS_PER_GPU  workers sharing one GPU under -n auto (default 4: the K3-shape properties are
#                  bound by the host, so one worker leaves the GPU idle; 4 and 8 took the same time on
#                  one H200, docs/gpu-run.md run 26)
#   K3NUM_SHARDS   split each `shardable` property's example budget (the repeat-call hunts) into N tests
#                  that the workers run side by side (the plugin's --shards; random profiles only)
#   K3NUM_DIST     xdist's --dist (default worksteal: idle workers take queued tests from busy ones)
#   K3NUM_MAX_WORKER_RESTART  workers xdist may replace (default 100): a worker whose CUDA context is lost
#                  exits and is replaced; past the limit xdist runs nothing more (the plugin names what never ran)
#   K3NUM_TIMEOUT  seconds after which the run is interrupted (SIGINT: pytest stops, the controller
#                  merges what the workers wrote, and the job exits non-zero); default none
#                  (K3NUM_ENGINE_TIMEOUT, its earlier name, is still read)
#   K3NUM_SUITE    what to run: "properties" (default), or a path/-m expression passed to pytest,
#                  e.g. "properties -m gpu" for the K3-shape properties alone
#   K3NUM_SANITIZE the sanitizer mode after the properties: comma-separated compute-sanitizer tools
#                  (memcheck,racecheck,initcheck,synccheck), each run over every kernel subject once
#                  at small shapes (scripts/gpu_sanitize.py: OUT_DIR/sanitize/sanitizer.csv and .md,
#                  appended to summary.md); an unknown tool fails before anything runs; without
#                  compute-sanitizer on PATH the mode is skipped and says so (it does not pass)
#   K3NUM_HISTORY  a history directory: checked writable before the run (refused otherwise), then the run is
#                  appended to it and OUT_DIR/report/ written (`k3num report`: report.md, report.html, plots)
#   K3NUM_GATE     with K3NUM_HISTORY, 1 makes the regression gate decide too (`k3num report --gate`): the
#                  job fails on a ratio drift beyond the history's noise, and on an empty history
#   K3NUM_IMPACT_CASES  with K3NUM_HISTORY: seeded blocks per ledger entry and drafter for `k3num impact --ledger`,
#                  run before the report so that its ledger table gives each entry's token severity
#                  (OUT_DIR/impact-ledger.csv); default 10 on cuda, 0 (not run: the report says "not measured")
#                  on cpu, where Triton's interpreter makes it about 6 s a block
#   K3NUM_IMPACT_K3_CASES  cases per engine and drafter of `k3num impact --geometry k3` (the draft step at the
#                  presets' K3 geometry, OUT_DIR/impact-k3.csv; a decided token flipped outside the ledger fails the
#                  job); default 3 on cuda, 0 (not run) on cpu
#   K3NUM_REPRO_ALL  1: --repro-dir OUT_DIR/repro --repro-all (the report's worst cases then replay from
#                  their bundles; each subject call's inputs are cloned for it)
#   K3NUM_NIGHTLY_DEVICE  cuda (default) or cpu: the same loop on a machine without a GPU (the
#                  gpu-marked properties then skip; tests/test_nightly_loop.py runs it so in CI)
# CUDA_VISIBLE_DEVICES, when set, lists the GPUs to use. Runs with the python on PATH (a GPU box has
# torch with CUDA; no venv is created). Exits non-zero when the run failed; the log stays in OUT_DIR.
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
from k3num.oracles import sanitizer
try:
    sanitizer.check_tools(sys.argv[1])
except ValueError as e:
    sys.exit(f"gpu_nightly: K3NUM_SANITIZE: {e}")
PY
fi
device=${K3NUM_NIGHTLY_DEVICE:-cuda}
case $device in
    cuda) python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'no CUDA device: the nightly GPU job needs one (K3NUM_NIGHTLY_DEVICE=cpu runs the same loop on the CPU)')" ;;
    cpu) ;;
    *) echo "gpu_nightly: K3NUM_NIGHTLY_DEVICE=$device: cuda or cpu"; exit 2 ;;
esac
history=${K3NUM_HISTORY:-}
if [ -n "$history" ]; then  # a history that cannot be written is refused before hours of properties
    python -m k3num.harness.cli report --history "$history" --check || exit 2
fi
repro=() gate=()
[ "${K3NUM_REPRO_ALL:-0}" = 1 ] && repro=(--repro-dir "$out/repro" --repro-all)
[ "${K3NUM_GATE:-0}" = 1 ] && gate=(--gate)
profile=${K3NUM_PROFILE:-nightly}
engines=${K3NUM_ENGINES:-$(python -c "from k3num.engines import registry; print(' '.join(registry.defaults()))")}
engines=${engines//,/ }
read -r -a suite <<< "${K3NUM_SUITE:-properties}"
limit=${K3NUM_TIMEOUT:-${K3NUM_ENGINE_TIMEOUT:-}}
workers=${K3NUM_WORKERS:-auto}
export K3NUM_WORKERS_PER_GPU=${K3NUM_WORKERS_PER_GPU:-4}
python -c "import xdist" 2>/dev/null || { echo "gpu_nightly: pytest-xdist is not installed (pip install pytest-xdist)"; exit 2; }
echo "gpu_nightly: profile=$profile engines=[$engines] suite=[${suite[*]}] workers=$workers" \
     "(per GPU under auto: $K3NUM_WORKERS_PER_GPU) sanitize=[${sanitize:-off}] -> $out"
start=$SECONDS
# the workers share the host's cores: each gets its share of torch's CPU threads, not all of them
n=$workers
[ "$n" = auto ] && n=$(python -c "import os, torch
from k3num.harness import scaleout
g = scaleout.visible_gpus(os.environ.get('CUDA_VISIBLE_DEVICES'), torch.cuda.device_count()) \
    if torch.cuda.is_available() else []
print(scaleout.auto_workers(len(g), os.environ['K3NUM_WORKERS_PER_GPU']) or os.cpu_count())")
threads=$(( $(nproc) / n )); [ "$threads" -ge 1 ] || threads=1
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$threads}
status=0
${limit:+timeout -s INT -k 60 "$limit"} python -m pytest "${suite[@]}" --engine "${engines// /,}" \
    -n "$workers" --dist "${K3NUM_DIST:-worksteal}" --max-worker-restart "${K3NUM_MAX_WORKER_RESTART:-100}" \
    --device "$device" --hypothesis-profile="$profile" \
    -p no:cacheprovider -o junit_suite_name=k3num --durations=15 --drift-csv "$out/drift.csv" ${limit:+--run-limit "$limit"} \
    --junitxml "$out/junit.xml" "${repro[@]}" "$@" > "$out/pytest.log" 2>&1 || status=$?
[ "$status" -eq 124 ] && echo "gpu_nightly: interrupted at the ${limit} s limit (the CSV holds the tests that finished)"
# pytest exit 5 (nothing collected) is a failure here too: a nightly that ran nothing must not pass
# pytest's own tally ("N passed, M skipped in T s"); the k3-numerics block follows it in the log
tally=$(grep -E '(passed|failed|errors?|skipped|no tests ran).* in [0-9.]+s' "$out/pytest.log" | tail -n 1 | tr -d '=')
echo "gpu_nightly: pytest finished with exit $status after $((SECONDS - start)) s:${tally:- (no tally: see $out/pytest.log)}"
[ "$status" -eq 0 ] || status=1
# every other pinned release of a pin the engines read (vLLM 0.34.0 beside the default 0.33.0), each a run of
# its own (harness/main_job.py): OUT_DIR/drift-<engine>-<version>.csv and pytest-<engine>-<version>.log;
# K3NUM_RELEASES=default runs the default releases alone
csvs=("$out/drift.csv")
if [ "${K3NUM_RELEASES:-all}" != default ]; then
    while IFS=$'\t' read -r label release_engines; do
        [ -n "$label" ] || continue
        echo "gpu_nightly: the other pinned release $label: --engine $release_engines"
        rstatus=0
        ${limit:+timeout -s INT -k 60 "$limit"} python -m pytest "${suite[@]}" --engine "$release_engines" \
            -n "$workers" --dist "${K3NUM_DIST:-worksteal}" --max-worker-restart "${K3NUM_MAX_WORKER_RESTART:-100}" \
            --device "$device" --hypothesis-profile="$profile" -p no:cacheprovider -o junit_suite_name=k3num \
            --drift-csv "$out/drift-$label.csv" ${limit:+--run-limit "$limit"} --junitxml "$out/junit-$label.xml" \
            "$@" > "$out/pytest-$label.log" 2>&1 || rstatus=$?
        tally=$(grep -E '(passed|failed|errors?|skipped|no tests ran).* in [0-9.]+s' "$out/pytest-$label.log" \
                | tail -n 1 | tr -d '=')
        echo "gpu_nightly: $label finished with exit $rstatus:${tally:- (no tally: see $out/pytest-$label.log)}"
        [ "$rstatus" -eq 0 ] || status=1
        [ -f "$out/drift-$label.csv" ] && csvs+=("$out/drift-$label.csv")
    done < <(python -c "import sys
from k3num.harness import main_job
for label, engines in main_job.other_releases(sys.argv[1].split()):
    print(f'{label}\t{engines}')" "$engines")
fi
python - "${csvs[@]}" > "$out/summary.md" <<'PY'
import sys
from pathlib import Path

import pandas as pd

from k3num.oracles.drift import SM100_NOTE, covers_vllm_attn_res, summarize

for i, path in enumerate(Path(p) for p in sys.argv[1:]):
    if not path.exists():
        sys.exit(f"gpu_nightly: the run wrote no drift CSV ({path})")
    df = pd.read_csv(path)
    if df.empty:
        sys.exit(f"gpu_nightly: the drift CSV holds no record ({path})")
    if i:
        print(f"\n{path.name}:")
    t = summarize(df, ["engine", "engine_version", "mode", "device", "subject", "property"])
    print(t.to_string(index=False, float_format=lambda v: f"{v:.3g}"))
    if covers_vllm_attn_res(t):
        print(SM100_NOTE)
PY
# the draft step at K3 geometry (hidden 7168, the real blocks, vocabulary 163840): exit 1 when a decided token
# flipped outside the ledger; by default on cuda only (each case draws GBs of weights)
k3_cases=${K3NUM_IMPACT_K3_CASES:-$([ "$device" = cuda ] && echo 3 || echo 0)}
if [ "$k3_cases" -gt 0 ]; then
    set +e
    python -m k3num.harness.cli impact --geometry k3 --format csv --device "$device" --cases "$k3_cases" \
        --engine "${engines// /,}" > "$out/impact-k3.csv" 2> "$out/impact-k3.log"
    krc=$?
    set -e
    case $krc in
        0) echo "gpu_nightly: the draft step at K3 geometry ($k3_cases cases per engine and drafter): no decided token flipped outside the ledger ($out/impact-k3.csv)" ;;
        1) echo "gpu_nightly: the draft step at K3 geometry: a decided token flipped outside the ledger ($out/impact-k3.csv)"; status=1 ;;
        *) echo "gpu_nightly: k3num impact --geometry k3 could not run (exit $krc, see $out/impact-k3.log)"; status=1 ;;
    esac
fi
if [ -n "$history" ]; then
    set +e
    impact=()
    impact_cases=${K3NUM_IMPACT_CASES:-$([ "$device" = cuda ] && echo 10 || echo 0)}
    if [ "$impact_cases" -gt 0 ]; then
        if python -m k3num.harness.cli impact --ledger --format csv --device "$device" --cases "$impact_cases" \
                > "$out/impact-ledger.csv" 2> "$out/impact.log"; then
            impact=(--impact "$out/impact-ledger.csv")
        else
            echo "gpu_nightly: k3num impact --ledger failed (see $out/impact.log): the report's severities say not measured"
            status=1
        fi
    fi
    python -m k3num.harness.cli report --history "$history" --out "$out/report" "${gate[@]}" "${impact[@]}" "$out/drift.csv" \
        2>&1 | tee "$out/report.log"
    rrc=${PIPESTATUS[0]}
    set -e
    # 1: the gate's alarm; 2: no history to gate against, or a run the report could not read
    [ "$rrc" -eq 0 ] || { echo "gpu_nightly: k3num report exited $rrc (see $out/report.log)"; status=1; }
fi
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
