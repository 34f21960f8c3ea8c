#!/usr/bin/env bash
# Create (or refresh) the project's virtual environment in .venv and activate it.
# Sourced by the run scripts and by users (`source scripts/env.sh`); safe to run again: it reinstalls
# only when pyproject.toml changed. torch is installed first as the CPU build so that no CUDA build is
# pulled on a CPU-only machine. It leaves the caller's shell options as they were (no `set -e` is left
# behind in an interactive shell: tests/test_env_script.py) and returns non-zero when a step fails.
_k3num_env() {
    local root venv stamp want
    root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd) || return 1
    venv="${K3NUM_VENV:-$root/.venv}"
    stamp="$venv/.k3num-installed"
    want=$(sha256sum "$root/pyproject.toml" | cut -d' ' -f1) || return 1
    if [ ! -x "$venv/bin/python" ]; then
        echo "[env] creating $venv" >&2
        python3 -m venv "$venv" || return 1
    fi
    if [ "$(cat "$stamp" 2>/dev/null || true)" != "$want" ]; then
        echo "[env] installing torch==2.13.0 (CPU) and k3-numerics[test] into $venv" >&2
        "$venv/bin/python" -m pip install -q --upgrade pip || return 1
        if ! "$venv/bin/python" -c "import torch" 2>/dev/null; then
            "$venv/bin/python" -m pip install -q "torch==2.13.0" \
                || "$venv/bin/python" -m pip install -q "torch==2.13.0" --index-url https://download.pytorch.org/whl/cpu \
                || return 1
        fi
        # setuptools' "Editable installation" banner is not ours to print: pip's own -q keeps the rest quiet
        "$venv/bin/python" -m pip install -q -e "$root[test]" 2>&1 | { grep -v -i "editable install" >&2 || true; }
        [ "${PIPESTATUS[0]}" -eq 0 ] || return 1
        echo "$want" > "$stamp"
    fi
    # shellcheck disable=SC1091
    source "$venv/bin/activate"
}
_k3num_env
_k3num_rc=$?
unset -f _k3num_env
if [ "$_k3num_rc" -ne 0 ]; then
    echo "[env] ERROR: setting up the virtual environment failed (exit $_k3num_rc)" >&2
fi
# sourced: hand the status back without closing the caller's shell; run as a script: exit with it
if (return 0 2>/dev/null); then eval "unset _k3num_rc; return $_k3num_rc"; fi
exit "$_k3num_rc"
