#!/usr/bin/env bash
# Time a few forward tile configs on every row of PERF.md's grid (S 1k/4k/16k, causal or not)
# at D = 128 and 64, and a few backward ones on two D = 128 rows: a config that wins at
# S = 4k (the sweep's shape) can lose at 1k or when causal.  Candidates: $FF_FWD128,
# $FF_FWD64, $FF_BWD128 (sweep.py --configs syntax).  Leaves sweep_*.json and logs in one
# archive under $OUT.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
export PYTHONUNBUFFERED=1 PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}"
unset TRITON_INTERPRET
OUT_DIR="${OUT:-$(mktemp -d)}"; mkdir -p "$OUT_DIR/grid"
FWD128="${FF_FWD128:-128x128w8s3,64x64w4s3tma,128x128w8s3tma,128x64w8s3tma}"
FWD64="${FF_FWD64:-128x64w8s3,64x128w4s2tma,64x64w4s2tma,128x64w8s3tma}"
BWD128="${FF_BWD128:-32x128w8s3,64x64w4s2,128x32w8s3}"
if [ -n "${FF_PRE_TESTS:-}" ]; then
    echo "== pytest $FF_PRE_TESTS"
    timeout 150 python3 -m pytest -q -p no:cacheprovider -x $FF_PRE_TESTS 2>&1 | tail -n 5
fi
run() {  # D S causal pass configs
    local c=""; [ "$3" = yes ] && c="--causal"
    local jobs=1; [ "$2" = 1024 ] && jobs=6
    timeout 100 python3 benchmarks/tune/sweep.py --head-dim "$1" --seqlen "$2" $c --pass "$4" --configs "$5" \
        --jobs $jobs --warmup 10 --rep 40 --out "$OUT_DIR/grid" > "$OUT_DIR/grid/D$1_S$2_$3_$4.log" 2>&1
    echo "D=$1 S=$2 causal=$3 $4: exit $?"
    grep -E '^ +(fwd|bwd_kv|bwd_q) .*TFLOP/s' "$OUT_DIR/grid/D$1_S$2_$3_$4.log" | sed 's/^ */    /'
}
for causal in no yes; do for S in 1024 4096 16384; do run 128 $S $causal fwd "$FWD128"; done; done
for causal in no yes; do for S in 1024 4096 16384; do run 64 $S $causal fwd "$FWD64"; done; done
run 128 1024 yes bwd "$BWD128"
run 128 16384 no bwd "$BWD128"
(cd "$OUT_DIR" && tar czf /tmp/ff_grid.tgz grid && rm -rf grid && mv /tmp/ff_grid.tgz grid.tgz)
