#!/usr/bin/env bash
# The test command: the harness's self-tests and the property suite under the
# `ci` hypothesis profile, on the CPU, spread over K3NUM_TEST_WORKERS pytest-xdist workers (2: a CI runner's
# cores; 0 runs one process), each test module on one worker (`--dist loadscope`: a module's costly fixtures,
# the mutant and plant runs, are built once). Extra arguments go to pytest.
set -euo pipefail
workers=${K3NUM_TEST_WORKERS:-2}
case $workers in ''|*[!0-9]*) echo "[tests] ERROR: K3NUM_TEST_WORKERS must be a number of workers (0: one process), got '$workers'" >&2; exit 2;; esac
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
source "$root/scripts/env.sh"
cd "$root"
# the pinned engine sources (idempotent); without them the real engines skip with a reason
k3num fetch || echo "[tests] WARNING: k3num fetch failed: the real engines (vllm, sglang, tokenspeed) will be skipped" >&2
if [ "$workers" -eq 0 ]; then
    exec python -m pytest --hypothesis-profile=ci "$@"
fi
exec python -m pytest --hypothesis-profile=ci -n "$workers" --dist loadscope "$@"
