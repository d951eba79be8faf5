#!/usr/bin/env bash
# On the GPU machine (carry [".ab"] after prepare.sh): the patched tree's GPU tests of the fused
# backward, then ab_timing base / new (main + the pending patches) over the training rows and the
# window 1023 row, bf16, one process a tree, ROUNDS rounds.  Results under $OUT.  PARTS picks the
# parts (default all: ~3 min of tests at T_LIMIT 200, ~3 min of A/B at three rounds).
set -uo pipefail
export PYTHONUNBUFFERED=1
unset TRITON_INTERPRET
nvidia-smi --query-gpu=name --format=csv,noheader
PARTS=" ${PARTS:-tests ab window} "
T=()  # AB_TREES: the trees the A/B times (NAME for .ab/NAME, or NAME=DIR); AB_EXTRA: more ab_timing
for t in ${AB_TREES:-base new}; do [[ $t == *=* ]] && T+=(--tree "$t") || T+=(--tree "$t=.ab/$t"); done
T+=(${AB_EXTRA:-})  # arguments, e.g. --tree-env NAME:FLASHFORGE_TILE_CONFIGS=FILE
[[ $PARTS == *" tests "* ]] && { ( cd .ab/new_tree && FF_PARTS=tests FF_TEST_WORKERS=14 FF_TEST_LIMIT=${T_LIMIT:-200} FF_BUDGET=${T_LIMIT:-200} FF_RESERVE=0 \
  bash scripts/device.sh tests/test_bwd_stats.py tests/test_fused_bwd.py tests/test_extreme_logits.py tests/test_gluon_sm90.py \
    -k "${TESTS_K:-test_bwd_stats or test_fused_bwd or extreme or (test_backward_against_reference and (table or halfdq or kv-fused-overlap or kv-ws-fused-s2 or shared-rs)) or (d256_backward and (table or kv-wide)) or far_negative or varlen_wide_dkdv or varlen_warp_specialized_dq or training_steps or long_backward or long_window or delta_comes}" \
    > "$OUT/tests_stdout.txt" 2>&1 )
grep -E "passed|failed|error" "$OUT/pytest.log" | tail -2
grep -E "^FAILED|^ERROR" "$OUT/pytest.log" | head -20; }
O=()
for r in "D64 S1024" "D64 S4096" "D64 S4096 causal" "D64 S16384" "D64 S16384 causal" "D128 S1024" "D128 S4096" \
         "D128 S4096 causal" "D128 S16384" "D128 S16384 causal" "D128 S4096 causal GQA 4" "D256 S4096"; do
    O+=(--only "$r")
done
[[ $PARTS == *" ab "* ]] && { timeout -k 5 "${AB_LIMIT:-300}" python benchmarks/profile/ab_timing.py "${T[@]}" \
    --rounds "${ROUNDS:-3}" --features "${O[@]}" --child-timeout "${AB_CHILD:-100}" --json "$OUT/ab.json" > "$OUT/ab.txt" 2>&1
tail -30 "$OUT/ab.txt"; }
[[ $PARTS == *" window "* ]] && { timeout -k 5 "${AB2_LIMIT:-120}" python benchmarks/profile/ab_timing.py "${T[@]}" --rounds "${ROUNDS:-3}" --features --only "D128 S16384 causal window 1023" --child-timeout 60 \
    --json "$OUT/ab_window.json" > "$OUT/ab_window.txt" 2>&1
tail -6 "$OUT/ab_window.txt"; }
