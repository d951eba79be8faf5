#!/usr/bin/env bash
# On the GPU machine (one device call, carry [".ab"] after prepare.sh): the patched tree's GPU
# tests of the half-dQ kernel, then the A/B main / 0001+0002 / 0001+0002 with D = 128 staggered
# (.ab/d128ov.json) over the D = 64 and D = 128 training rows and window 1023 (bf16, one process a tree, ROUNDS rounds). Results under $OUT.
set -uo pipefail
export PYTHONUNBUFFERED=1
unset TRITON_INTERPRET
nvidia-smi --query-gpu=name,clocks.sm --format=csv,noheader
( cd .ab/pend_tree && FF_PARTS=tests FF_TEST_WORKERS=14 FF_TEST_LIMIT=${T_LIMIT:-200} FF_BUDGET=${T_LIMIT:-200} FF_RESERVE=0 \
  bash scripts/device.sh tests/test_gluon_sm90.py::test_backward_against_reference \
    tests/test_gluon_sm90.py::test_training_steps_from_launch_plans_match_the_launchers \
    tests/test_gluon_sm90.py::test_table_long_backward_takes_the_ws_kernel tests/test_extreme_logits.py \
    -k "(test_backward_against_reference and (table or halfdq)) or extreme or training_steps or long_backward" \
    > "$OUT/tests_stdout.txt" 2>&1 )
grep -E "passed|failed|error" "$OUT/pytest.log" | tail -3
grep -E "^FAILED|^ERROR" "$OUT/pytest.log" | head -20
O=()
for r in "D64 S1024" "D64 S4096" "D64 S4096 causal" "D64 S16384" "D64 S16384 causal" "D128 S1024" "D128 S4096" \
         "D128 S4096 causal" "D128 S16384" "D128 S16384 causal" "D128 S4096 causal GQA 4" "D128 S16384 causal window 1023"; do O+=(--only "$r"); done
timeout -k 5 "${AB_LIMIT:-330}" python benchmarks/profile/ab_timing.py --tree main=.ab/pend_main --tree p12=.ab/pend_12 \
    --tree p12ov=.ab/pend_12 --tree-env p12ov:FLASHFORGE_TILE_CONFIGS=$PWD/.ab/d128ov.json --rounds "${ROUNDS:-4}" --grid-only --features "${O[@]}" --child-timeout 100 \
    --json "$OUT/ab_pending.json" > "$OUT/ab_pending.txt" 2>&1
tail -30 "$OUT/ab_pending.txt"
