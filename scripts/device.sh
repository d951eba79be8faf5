#!/usr/bin/env bash
# The one command for the GPU machine (torch and triton already there, nothing installed):
#   bash scripts/device.sh [pytest args...]
#   (default: test_gpu.py, and the files whose Triton / cuda cases run on CUDA there: rope, varlen,
#   kvcache, compile, transformers)
# FF_PARTS="tests bench" (default) picks the parts: one call of the device tool is limited to
# 10 minutes, so the first run of a new tree (cold kernel compiles) is best split into
# FF_PARTS=tests and FF_PARTS=bench.
# Runs the GPU tests, then `python -m flashforge.bench`; with $OUT set, leaves there
# junit-gpu.xml, pytest.log, bench.json and bench.log.  Prints the pytest summary and the
# benchmark's table last.  Exits non-zero if either fails.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export PYTHONUNBUFFERED=1
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}"
unset TRITON_INTERPRET  # the real kernels, not the interpreter
PY="${FF_PYTHON:-}"
if [ -z "$PY" ]; then
    for PY in python3 python; do
        "$PY" -c "import torch, triton" >/dev/null 2>&1 && break
    done
fi
OUT_DIR="${OUT:-$(mktemp -d)}"
mkdir -p "$OUT_DIR"
# time limits keep the whole run within ~8 minutes, so the summary below always prints
TEST_LIMIT="${FF_TEST_LIMIT:-240}"
BENCH_LIMIT="${FF_BENCH_LIMIT:-330}"
PARTS="${FF_PARTS:-tests bench}"
test_rc=0
bench_rc=0
: > "$OUT_DIR/pytest.log"
: > "$OUT_DIR/bench.log"
if [ "$PARTS" = tests ]; then TEST_LIMIT="${FF_TEST_LIMIT:-560}"; fi
if [ "$PARTS" = bench ]; then BENCH_LIMIT="${FF_BENCH_LIMIT:-560}"; fi

"$PY" -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name() if torch.cuda.is_available() else 'NO GPU')"
nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total,clocks.sm --format=csv,noheader 2>/dev/null || true

if [ "$#" -eq 0 ]; then
    set -- tests/test_gpu.py tests/test_rope.py tests/test_varlen.py tests/test_kvcache.py tests/test_tma.py tests/test_compile.py \
        tests/test_transformers.py tests/test_attention_torch.py::test_runs_on_cuda_tensors
fi
if [[ " $PARTS " == *" tests "* ]]; then
    echo "== pytest $* (limit ${TEST_LIMIT}s)"
    t0=$SECONDS
    timeout -k 10 "$TEST_LIMIT" "$PY" -m pytest -q -p no:cacheprovider --junitxml="$OUT_DIR/junit-gpu.xml" "$@" \
        > "$OUT_DIR/pytest.log" 2>&1
    test_rc=$?
    echo "pytest exit $test_rc after $((SECONDS - t0)) s (log: $OUT_DIR/pytest.log)"
fi

if [[ " $PARTS " == *" bench "* ]]; then
    echo "== python -m flashforge.bench (limit ${BENCH_LIMIT}s)"
    t0=$SECONDS
    timeout -k 10 "$BENCH_LIMIT" "$PY" -m flashforge.bench --json "$OUT_DIR/bench.json" > "$OUT_DIR/bench.log" 2>&1
    bench_rc=$?
    echo "bench exit $bench_rc after $((SECONDS - t0)) s (log: $OUT_DIR/bench.log)"
fi

echo
echo "================ pytest: failures and summary"
# the short test summary (-ra, from pyproject.toml) down to the closing line, at most 30 lines
if grep -q "short test summary info" "$OUT_DIR/pytest.log"; then
    sed -n '/short test summary info/,$p' "$OUT_DIR/pytest.log" | tail -n 30 | cut -c1-240
else
    tail -n 1 "$OUT_DIR/pytest.log"
fi
[ "$test_rc" = 124 ] && echo "pytest TIMED OUT after ${TEST_LIMIT}s"
echo
echo "================ benchmark"
grep -v ': done (' "$OUT_DIR/bench.log" | tail -n 80
[ "$bench_rc" = 124 ] && echo "benchmark TIMED OUT after ${BENCH_LIMIT}s (bench.json holds the rows done)"
echo
# the two lines that matter, last, so that a cut output still shows them
echo "pytest: $(tail -n 1 "$OUT_DIR/pytest.log" | tr -d '=' | sed 's/^ *//') (exit $test_rc)"
echo "bench:  $(grep '^RESULT' "$OUT_DIR/bench.log" || echo 'no RESULT line') (exit $bench_rc)"
[ "$test_rc" = 0 ] && [ "$bench_rc" = 0 ]
