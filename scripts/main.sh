#!/usr/bin/env bash
# The main job: a self-check of flashforge against its float64 reference, then a small
# benchmark against PyTorch SDPA, on this machine's GPU if it has one, else on the CPU.
#   bash scripts/main.sh [--json PATH] [--check-only] [--device cpu|cuda]
# Installs what it needs on first use (see scripts/env.sh); exits non-zero if a check fails.
set -euo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/env.sh"
cd "$FF_ROOT"
exec "$FF_PYTHON" -m flashforge.bench "$@"
