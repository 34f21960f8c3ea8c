#!/usr/bin/env bash
# The nightly GPU job: the `gpu`-marked properties (full K3 shapes) under a hypothesis
# profile (default nightly), writing the drift CSV and a summary table.
# Usage: scripts/gpu_nightly.sh [OUT_DIR] [extra pytest args]
# Runs with the python on PATH (a GPU box has torch with CUDA; no venv is created).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
out=${1:-$root/out/nightly}
shift || true
mkdir -p "$out"
cd "$root"
python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'no CUDA device: the nightly GPU job needs one')"
profile=${K3NUM_PROFILE:-nightly}
set +e
python -m pytest properties -m gpu --hypothesis-profile="$profile" -p no:cacheprovider \
    --drift-csv "$out/drift.csv" --junitxml "$out/junit.xml" "$@" 2>&1 | tee "$out/pytest.log"
status=${PIPESTATUS[0]}
set -e
python - "$out/drift.csv" > "$out/summary.md" <<'PY'
import sys
import pandas as pd
df = pd.read_csv(sys.argv[1])
judged = df[df.verdict != "info"]
g = judged.groupby(["engine", "mode", "subject", "property"])
t = g.agg(records=("ratio", "size"), worst_ratio=("ratio", "max"), median_rel_fro=("rel_fro", "median"),
          failures=("verdict", lambda v: int((v == "fail").sum()))).reset_index()
print(t.to_string(index=False, float_format=lambda v: f"{v:.3g}"))
PY
cat "$out/summary.md"
exit "$status"
