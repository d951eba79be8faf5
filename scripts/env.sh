# Sourced by scripts/main.sh and scripts/test.sh: find or make a Python that has torch and
# triton, make this source tree importable, and export FF_PYTHON and FF_ROOT.
#
#   - $FF_PYTHON, when set, is used as it is: nothing is installed into it.
#   - Else, if the repository has no .venv/ and `python3` already has torch and triton (a GPU
#     machine with its own stack), that is used as it is.
#   - Otherwise .venv/ in the repository is created if missing and gets the tested CPU stack
#     (FF_VENV_REQS: torch==2.13.0, triton==3.6.0, numpy<2.4) plus this package in editable
#     mode.  Each step runs only when its check fails (the requirements are stamped into
#     .venv/.flashforge-reqs, so changing them here updates old venvs), so a second run
#     installs nothing and costs well under a second.
#
# `ff_ensure MODULE PIP_SPEC...` adds an extra tool (pytest, ...) the same way: only when the
# module is missing, and only into our own .venv, never into a Python we were given.

FF_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# numpy<2.4: Triton 3.6's interpreter (TRITON_INTERPRET=1) fails on numpy >= 2.4 (int() of
# 1-element arrays in range(lo, hi) loops).
FF_VENV_REQS=("${FF_TORCH_SPEC:-torch==2.13.0}" "${FF_TRITON_SPEC:-triton==3.6.0}" "numpy<2.4")
FF_OWN_VENV=0

_ff_log() { echo "[flashforge env] $*" >&2; }

_ff_pip() {
    "$FF_PYTHON" -m pip install --disable-pip-version-check --progress-bar off "$@"
}

# _ff_has MODULE...: true when every module can be found (found, not imported: importing
# torch costs seconds).  -I keeps PYTHONPATH and the current directory out of the search.
_ff_has() {
    "$FF_PYTHON" -I -c "import importlib.util, sys
sys.exit(not all(importlib.util.find_spec(m) for m in sys.argv[1:]))" "$@" >/dev/null 2>&1
}

if [ -z "${FF_PYTHON:-}" ]; then
    FF_PYTHON=python3
    if [ -x "$FF_ROOT/.venv/bin/python" ] || ! _ff_has torch triton; then
        FF_OWN_VENV=1
    fi
fi
if [ "$FF_OWN_VENV" = 1 ]; then
    if [ ! -x "$FF_ROOT/.venv/bin/python" ]; then
        _ff_log "creating $FF_ROOT/.venv"
        "$FF_PYTHON" -m venv "$FF_ROOT/.venv"
    fi
    FF_PYTHON="$FF_ROOT/.venv/bin/python"
    stamp="$FF_ROOT/.venv/.flashforge-reqs"
    if ! _ff_has torch triton || [ "$(cat "$stamp" 2>/dev/null)" != "${FF_VENV_REQS[*]}" ]; then
        # On this project's machines `torch==2.13.0` resolves to the local CPU wheel
        # (2.13.0+cpu); elsewhere pip may pick a CUDA build: see README "Install".
        _ff_log "installing ${FF_VENV_REQS[*]} into .venv"
        _ff_pip "${FF_VENV_REQS[@]}"
        "$FF_PYTHON" -c "import torch; print('[flashforge env] torch', torch.__version__, 'cuda', torch.version.cuda)" >&2
        echo "${FF_VENV_REQS[*]}" > "$stamp"
    fi
    if ! FF_ROOT="$FF_ROOT" "$FF_PYTHON" -I -c "import importlib.util, os, sys
spec = importlib.util.find_spec('flashforge')
sys.exit(not (spec and spec.origin.startswith(os.environ['FF_ROOT'] + os.sep)))" >/dev/null 2>&1; then
        _ff_log "installing flashforge (editable, --no-deps) into .venv"
        _ff_pip --no-deps -e "$FF_ROOT" >/dev/null
    fi
fi

# Both ways, the tree being run wins over any installed copy.
export PYTHONPATH="$FF_ROOT${PYTHONPATH:+:$PYTHONPATH}"
export FF_PYTHON FF_ROOT FF_OWN_VENV

# ff_ensure MODULE PIP_SPEC...: make MODULE importable, installing PIP_SPEC into .venv if needed.
ff_ensure() {
    local module="$1"; shift
    if _ff_has "$module"; then
        return 0
    fi
    if [ "$FF_OWN_VENV" != 1 ]; then
        _ff_log "$FF_PYTHON has no $module; install $* there (nothing is installed into a Python we were given)"
        return 1
    fi
    _ff_log "installing $* into .venv"
    _ff_pip "$@"
}

# ff_has_cuda: true when torch sees a CUDA device.
ff_has_cuda() {
    "$FF_PYTHON" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" >/dev/null 2>&1
}
