#!/usr/bin/env bash
# One batched GPU session on a box without network (the team's `device` machine, or any CUDA host
# that has torch, triton, pytest, hypothesis and pandas but no engine wheels): the engines' kernel
# bandwidth table, then the property suite on the GPU against the real engines, all written to OUT.
#
# Before (on a machine with network), put the extracted engine sources inside the repo:
#     K3NUM_ENGINE_CACHE=$PWD/engine-cache k3num fetch
#   and carry engine-cache/vllm-0.33.0, engine-cache/sglang-0.5.23, engine-cache/tokenspeed-0.1.1
#   (about 0.5 MB; the wheels/ folder is not needed once extracted).
# Usage: scripts/device_session.sh OUT [PROFILE] [SUITE] [BENCH_REPS]
#   PROFILE  hypothesis profile of the property run (default nightly-1k)
#   SUITE    what pytest runs (default "properties": the small shapes on cuda + the K3-shape ones)
#   Engines: K3NUM_ENGINES (default vllm vllm-rocm sglang tokenspeed: the mirror ran in earlier nightlies);
#   K3NUM_ENGINE_TIMEOUT (seconds) interrupts an engine's run that would outlast the session's slot
set -uo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
out=${1:?usage: scripts/device_session.sh OUT [PROFILE] [SUITE] [BENCH_REPS]}
profile=${2:-nightly-1k}
suite=${3:-properties}
reps=${4:-20}
mkdir -p "$out"
cd "$root"
export K3NUM_ENGINE_CACHE=${K3NUM_ENGINE_CACHE:-$root/engine-cache} PYTHONUNBUFFERED=1
export K3NUM_ENGINES=${K3NUM_ENGINES:-vllm vllm-rocm sglang tokenspeed}
{
    date -u +"%F %T UTC"
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
    python -c "import torch, triton, hypothesis; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
'triton', triton.__version__, 'hypothesis', hypothesis.__version__)"
    git rev-parse HEAD 2>/dev/null || echo "(no git)"
} | tee "$out/env.txt"
for e in vllm-0.33.0 sglang-0.5.23 tokenspeed-0.1.1; do
    [ -f "$K3NUM_ENGINE_CACHE/$e/MANIFEST.json" ] || { echo "missing $K3NUM_ENGINE_CACHE/$e (carry it)"; exit 2; }
done
echo "== engine kernel bandwidth (reps $reps)"
python bench/engine_kernels.py --reps "$reps" --csv "$out/engine_kernels.csv" | tee "$out/engine_kernels.md"
bench=${PIPESTATUS[0]}
echo "== K3N-004/005 reproducer (attn_res write race)"
python scripts/repro_attn_res_write_race.py --calls 200 --csv "$out/attn_res_write_race.csv" | tee "$out/attn_res_write_race.md"
echo "== property suite: profile $profile, suite [$suite], engines [$K3NUM_ENGINES]"
K3NUM_PROFILE=$profile K3NUM_SUITE=$suite bash scripts/gpu_nightly.sh "$out/nightly"
props=$?
tar czf "$out/nightly.tgz" -C "$out" nightly
echo "device_session: bench exit $bench, properties exit $props"
[ "$bench" -eq 0 ] && [ "$props" -eq 0 ]
