#!/usr/bin/env bash
# The tests: bash scripts/test.sh [pytest args...]
# Installs what it needs on first use (see scripts/env.sh).  Without a CUDA GPU the Triton
# kernels run in the Triton interpreter (TRITON_INTERPRET=1), GPU-only tests skip, and the
# suite is spread over FF_TEST_WORKERS pytest-xdist workers (default: the cores, at most 4;
# 0 runs it in one process; so does passing -n N yourself, `-p no:xdist`, --collect-only or --pdb).
set -euo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/env.sh"
cd "$FF_ROOT"
ff_ensure pytest "pytest>=7" "hypothesis>=6"
ff_ensure hypothesis "hypothesis>=6"
# optional: tests/test_transformers.py skips (with the reason) where it cannot be installed;
# transformers does not depend on torch, so this never replaces the venv's torch
ff_ensure transformers "transformers>=4.53" || true
workers=()
if ff_has_cuda; then
    workers=()  # one process drives the GPU
else
    export TRITON_INTERPRET=1
    n="${FF_TEST_WORKERS:-$(nproc 2>/dev/null || echo 1)}"
    n=$((n > 4 ? 4 : n))
    for arg in "$@"; do  # the caller chose (-n, -p no:xdist) or only collects
        case "$arg" in -n*|--numprocesses*|no:xdist|--co|--collect-only|--pdb) n=0 ;; esac
    done
    if [ "$n" -gt 1 ] && ff_ensure xdist "pytest-xdist>=3"; then
        workers=(-n "$n")
    fi
fi
exec "$FF_PYTHON" -m pytest -q ${workers[@]+"${workers[@]}"} "$@"
