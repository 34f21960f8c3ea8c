#!/usr/bin/env bash
# The test command: the harness's self-tests and the property suite under the
# `ci` hypothesis profile, on the CPU. Extra arguments go to pytest.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
source "$root/scripts/env.sh"
cd "$root"
# the pinned engine sources (idempotent); without them the real engines skip with a reason
k3num fetch || echo "[tests] WARNING: k3num fetch failed: the real engines (vllm, sglang, tokenspeed) will be skipped" >&2
exec python -m pytest --hypothesis-profile=ci "$@"
