#!/usr/bin/env bash
# Create (or refresh) the project's virtual environment in .venv and activate it.
# Sourced by the run scripts; safe to run again: it reinstalls only when
# pyproject.toml changed. torch is installed first as the CPU build so that no
# CUDA build is pulled on a CPU-only machine.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv="${K3NUM_VENV:-$root/.venv}"
stamp="$venv/.k3num-installed"
want=$(sha256sum "$root/pyproject.toml" | cut -d' ' -f1)
if [ ! -x "$venv/bin/python" ]; then
    echo "[env] creating $venv" >&2
    python3 -m venv "$venv"
fi
if [ "$(cat "$stamp" 2>/dev/null || true)" != "$want" ]; then
    echo "[env] installing torch==2.13.0 (CPU) and k3-numerics[test] into $venv" >&2
    "$venv/bin/python" -m pip install -q --upgrade pip
    if ! "$venv/bin/python" -c "import torch" 2>/dev/null; then
        "$venv/bin/python" -m pip install -q "torch==2.13.0" \
            || "$venv/bin/python" -m pip install -q "torch==2.13.0" --index-url https://download.pytorch.org/whl/cpu
    fi
    "$venv/bin/python" -m pip install -q -e "$root[test]"
    echo "$want" > "$stamp"
fi
# shellcheck disable=SC1091
source "$venv/bin/activate"
