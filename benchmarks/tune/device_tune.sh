#!/usr/bin/env bash
# One device call that tunes the tile table for the GPU it runs on:
#   1. tile sweeps (benchmarks/tune/sweep.py --quick) at D = 128 and 64, forward and backward,
#      merging each kind's winner into $OUT/tiles.json,
#   2. the GPU tests (pytest-xdist when present: compiling dominates a cold run),
#   3. the fwd / fwd+bwd grid against cuDNN with those tiles (FLASHFORGE_TILE_CONFIGS).
# Every step has a time limit so that the whole call stays under ~9.5 minutes and the
# summary prints.  FF_TUNE_BUDGET (seconds, default 560) sets the total; FF_SWEEPS ("128:fwd 64:bwd"
# ...), FF_BENCH_SUITES (default fwd,fwdbwd) and FF_BENCH_SKIP (default fa4,flex,flash,efficient:
# cuDNN only, the fastest to run; set it empty for every peer) pick the work.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
export PYTHONUNBUFFERED=1
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}"
unset TRITON_INTERPRET
OUT_DIR="${OUT:-$(mktemp -d)}"
mkdir -p "$OUT_DIR"
BUDGET="${FF_TUNE_BUDGET:-560}"
T_END=$((SECONDS + BUDGET))
left() { echo $((T_END - SECONDS)); }
PY=python3

nvidia-smi --query-gpu=name,driver_version,clocks.sm --format=csv,noheader 2>/dev/null || true
XDIST=""
"$PY" -c "import xdist" 2>/dev/null && XDIST="-n 12"

TILES="$OUT_DIR/tiles.json"
# a sweep spec is D:PASS[:SEQLEN[:CONFIGS[:causal]]]; PASS is fwd, bwd or a kind (bwd_kv ...);
# CONFIGS is sweep.py's --configs list (empty: the --quick grid)
n=0
for spec in ${FF_SWEEPS-"128:fwd" "128:bwd" "64:fwd" "64:bwd"}; do
    IFS=: read -r d pass sl cfgs causal <<< "$spec"
    n=$((n + 1))
    lim=$(( $(left) - ${FF_SWEEP_RESERVE:-360} ))
    [ "$lim" -gt "${FF_SWEEP_LIMIT:-110}" ] && lim="${FF_SWEEP_LIMIT:-110}"
    if [ "$lim" -lt 30 ]; then echo "skip sweep $spec (time)"; continue; fi
    args=(--head-dim "$d" --seqlen "${sl:-4096}")
    case "$pass" in fwd|bwd|all) args+=(--pass "$pass");; *) args+=(--kinds "$pass");; esac
    if [ -n "$cfgs" ]; then args+=(--configs "$cfgs"); else args+=(--quick); fi
    [ "$causal" = causal ] && args+=(--causal)
    log="$OUT_DIR/sweep_${n}_D${d}_${pass}_${sl:-4096}${causal:+_causal}.log"
    echo "== sweep $n: ${args[*]} (limit ${lim}s)"
    # only the 4k sweeps (the grid's middle, where the table is tuned) write the tile file
    # (FF_NO_TILES=1: none does, and the benchmark runs the committed table)
    [ "${sl:-4096}" = 4096 ] && [ -z "${FF_NO_TILES:-}" ] && args+=(--write-configs "$TILES")
    timeout -k 5 "$lim" "$PY" benchmarks/tune/sweep.py "${args[@]}" --out "$OUT_DIR" \
        --max-seconds $((lim - 45)) --warmup 10 --rep 40 \
        > "$log" 2>&1
    echo "sweep exit $? ($(grep -c 'TFLOP/s' "$log") timed)"
done
echo "== tiles"; cat "$TILES" 2>/dev/null

if [ -n "${FF_SKIP_TESTS:-}" ]; then echo "== pytest skipped (FF_SKIP_TESTS)"; test_rc=skipped; else
echo "== pytest ($XDIST)"
t0=$SECONDS
lim=$(( $(left) - 60 )); [ "$lim" -gt "${FF_TEST_LIMIT:-280}" ] && lim="${FF_TEST_LIMIT:-280}"
# FF_TESTS: the test files to run (default: every file with GPU tests)
timeout -k 5 "$lim" "$PY" -m pytest -q -p no:cacheprovider $XDIST --junitxml="$OUT_DIR/junit-gpu.xml" \
    ${FF_TESTS:-tests/test_gpu.py tests/test_gluon_sm90.py tests/test_rope.py tests/test_varlen.py \
    tests/test_kvcache.py tests/test_tma.py tests/test_compile.py tests/test_transformers.py \
    tests/test_dispatch.py tests/test_attention_torch.py::test_runs_on_cuda_tensors} \
    > "$OUT_DIR/pytest.log" 2>&1
test_rc=$?
echo "pytest exit $test_rc after $((SECONDS - t0)) s"
fi

lim=$(( $(left) - 5 ))
echo "== bench ${FF_BENCH_SUITES:-fwd,fwdbwd} with the tuned tiles (limit ${lim}s)"
[ -f "$TILES" ] && export FLASHFORGE_TILE_CONFIGS="$TILES"
timeout -k 5 "$lim" "$PY" benchmarks/attention_bench.py --suite "${FF_BENCH_SUITES:-fwd,fwdbwd}" --skip "${FF_BENCH_SKIP-fa4,flex,flash,efficient}" \
    --out "$OUT_DIR/bench" --max-seconds $((lim - 30)) > "$OUT_DIR/bench.log" 2>&1
echo "bench exit $?"

echo
for f in "$OUT_DIR"/sweep_*.log; do
    echo "---- $(basename "$f")"; sed -n '/ configs ran correctly/,$p' "$f" | grep -v '^wrote' | head -24
done
echo "---- pytest"
[ -f "$OUT_DIR/pytest.log" ] && sed -n '/short test summary info/,$p' "$OUT_DIR/pytest.log" | tail -n 25 | cut -c1-220
echo "---- bench"
tail -n 45 "$OUT_DIR/bench.log"
[ -f "$OUT_DIR/pytest.log" ] && echo "pytest: $(tail -n 1 "$OUT_DIR/pytest.log") (exit $test_rc)"
# the device tool returns only a few files: everything in one archive
(cd "$OUT_DIR" && tar czf /tmp/ff_results.tgz --exclude=results.tgz . && rm -rf ./* && mv /tmp/ff_results.tgz results.tgz)
