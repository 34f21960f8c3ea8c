#!/usr/bin/env bash
# The test command: the harness's self-tests and the property suite under the
# `ci` hypothesis profile, on the CPU. Extra arguments go to pytest.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
source "$root/scripts/env.sh"
cd "$root"
exec python -m pytest --hypothesis-profile=ci "$@"
