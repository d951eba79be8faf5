#!/usr/bin/env bash
# The one command for the GPU machine (torch and triton already there, nothing installed):
#   bash scripts/device.sh [pytest args...]
# FF_PARTS picks the parts, which run in this order (default "tests bench"):
#   tests    the GPU test files (pytest args replace the default list below)   -> junit-gpu.xml, pytest.log
#   bench    python -m flashforge.bench: self-check, then the grid against FA4 and cuDNN  -> bench.json, bench.log
#   compare  benchmarks/attention_bench.py --suite compare: ours / max(FA4, cuDNN) on the grid and the
#            issue-18 feature rows, with the grid's geometric means (FF_COMPARE_DTYPE: bf16, or fp16)
#            -> compare.log, compare/compare.{json,txt,png}
# All three leave 8 files under $OUT, as many as the device tool returns.
# FA4: where its staged packages are ($FF_FA4_SITE, default $HOME/.cache/fa4/site; two device calls
# stage them, ../shared/tools/fa4/README.md), bench and compare get them on PYTHONPATH (the tests never
# use FA4); without them FA4's column is "-" and the ratios are to cuDNN alone, as the tables say.
# (This tree is ~9 MiB: with .fa4a's 58 MiB it exceeds a call's 64 MiB.  scripts/fa4_stage_prepare.sh
# runs the shared prepare.sh and swaps the two libraries between the folders: 23 MiB, then 48 MiB a call.)
# Time: the parts share FF_BUDGET seconds (default 500: a 9-minute call with time to stage FA4 and to
# print); each gets what is left less FF_RESERVE seconds (default 150) for every part after it, at most
# its cap: FF_TEST_LIMIT (default 300), FF_BENCH_LIMIT (330), FF_COMPARE_LIMIT (360).  FF_TEST_WORKERS=N
# spreads the tests over N pytest-xdist processes (default: one); FF_PYTEST_ARGS are added to pytest's
# arguments (e.g. a --deselect), with the default file list or without.  FF_TEST_SHARD=1, 2, 3 or 4 runs one
# part of the default file list (four calls for the whole suite; 4 is test_gluon_sm90.py's backward; on 14 workers
# the second took 293 s and the third's files 86 s at v0.9.3; the first and third together 407 s at v0.9.4).
# FF_TEST_HANG_S (default 240): a test running longer ends its process (tests/conftest.py), since a
# deadlocked kernel cannot be interrupted (2026-12-07: one hung the rest of a call).
# Prints the pytest summary, the benchmark tables and one status line per part last; exits non-zero if
# a part fails or runs out of time.
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
PARTS="${FF_PARTS:-tests bench}"
T_END=$((SECONDS + ${FF_BUDGET:-500}))
RESERVE="${FF_RESERVE:-150}"
FA4_SITE="${FF_FA4_SITE:-$HOME/.cache/fa4/site}"
FA4_PATH=""
[ -d "$FA4_SITE" ] && FA4_PATH="$FA4_SITE:$FA4_SITE/nvidia_cutlass_dsl/dsl_packages:"

# limit PART CAP: the seconds PART may run, printed; 0 when too little is left to be worth starting
limit() {
    local later=0 seen=0 p
    for p in tests bench compare; do
        [[ " $PARTS " == *" $p "* ]] || continue
        [ "$seen" = 1 ] && later=$((later + 1))
        [ "$p" = "$1" ] && seen=1
    done
    local lim=$((T_END - SECONDS - RESERVE * later))
    [ "$lim" -gt "$2" ] && lim="$2"
    [ "$lim" -lt 60 ] && lim=0
    echo "$lim"
}
declare -A RC=()

"$PY" -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name() if torch.cuda.is_available() else 'NO GPU')"
nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total,clocks.sm --format=csv,noheader 2>/dev/null || true
echo "FA4: ${FA4_PATH:+staged at $FA4_SITE}${FA4_PATH:-not staged ($FA4_SITE missing): its columns will be '-'}"

# every file with tests that run on CUDA, in three parts that each fit one call on 14 workers
# (v0.9.3, plans on, cold compile cache: test_gluon_sm90 with test_launch / test_configs ran past
# 370 s with the other files of the old first half; those others took 86 s, the second part 293 s)
# test_gluon_sm90.py's forward tests (shard 1) and backward tests (shard 4), by function: the whole
# file (1184 tests with the persistent forward's) ran past a call's limit on 14 workers (RESULTS.md
# v0.9.11: 861 reported in 336 s).  tests/test_device_script.py checks that each function is in one.
GLUON_FWD=(test_against_reference test_window_against_reference test_modifiers_against_reference
    test_d256_against_reference test_three_consumers_against_reference test_table_long_d64_forward_takes_three_consumers
    test_three_consumers_refused_past_d64_take_the_portable_kernel test_out_of_scope_takes_portable_kernel
    test_matches_portable_kernel test_varlen_warp_specialized_forward test_varlen_three_consumers
    test_causal_sections_with_a_partial_last_one)
GLUON_BWD=(test_d256_backward_against_reference test_backward_against_reference
    test_backward_far_negative_scores_with_keys_past_the_tile test_wide_backward_far_negative_scores_with_keys_past_the_tile
    test_deterministic_backward_is_bitwise_and_unfused test_table_long_backward_takes_the_ws_kernel
    test_long_window_backward_takes_the_ws_kernel test_training_steps_from_launch_plans_match_the_launchers test_backward_out_of_scope_takes_portable_kernels
    test_backward_matches_portable_kernels test_delta_comes_from_the_dq_kernel test_varlen_against_each_sequence_alone
    test_varlen_wide_dkdv test_wide_deterministic_takes_the_ordered_kernels test_varlen_warp_specialized_dq)
SHARD1=("${GLUON_FWD[@]/#/tests/test_gluon_sm90.py::}" tests/test_configs.py tests/test_launch.py)
SHARD4=("${GLUON_BWD[@]/#/tests/test_gluon_sm90.py::}")
SHARD2=(tests/test_extreme_logits.py tests/test_safety.py tests/test_transformers.py tests/test_fused_bwd.py
    tests/test_compile.py tests/test_tma.py tests/test_kvcache.py tests/test_dropout.py tests/test_rope.py
    tests/test_interfaces.py tests/test_distributed.py tests/test_poly_exp2.py tests/test_properties.py
    tests/test_flash_attn_dropin.py tests/test_attention_torch.py::test_runs_on_cuda_tensors)
SHARD3=(tests/test_attention.py tests/test_gpu.py tests/test_varlen.py tests/test_dispatch.py tests/test_replay.py)
if [ "$#" -eq 0 ]; then
    case "${FF_TEST_SHARD:-}" in
        1) set -- "${SHARD1[@]}" ;;
        2) set -- "${SHARD2[@]}" ;;
        3) set -- "${SHARD3[@]}" ;;
        4) set -- "${SHARD4[@]}" ;;
        "") set -- "${SHARD1[@]}" "${SHARD2[@]}" "${SHARD3[@]}" "${SHARD4[@]}" ;;
        *) echo "FF_TEST_SHARD=${FF_TEST_SHARD}: 1, 2, 3 or 4 (or unset: all four)" >&2; exit 2 ;;
    esac
fi
# shellcheck disable=SC2206  # word-split on purpose: several arguments in one variable
[ -n "${FF_PYTEST_ARGS:-}" ] && set -- "$@" ${FF_PYTEST_ARGS}
if [[ " $PARTS " == *" tests "* ]]; then
    lim=$(limit tests "${FF_TEST_LIMIT:-300}")
    workers=()
    [ -n "${FF_TEST_WORKERS:-}" ] && workers=(-n "$FF_TEST_WORKERS")
    echo "== pytest ${workers[*]:+${workers[*]} }$* (limit ${lim}s)"
    t0=$SECONDS
    if [ "$lim" -gt 0 ]; then
        # SIGINT: pytest stops where it is and still prints its summary and writes the junit file.
        # One inductor compile thread: with a pool, a worker's exit can wait up to 300 s for it
        # (RESULTS v0.8.8: every test had reported when the limit cut such a wait, summary unprinted)
        FF_TEST_HANG_S="${FF_TEST_HANG_S:-240}" TORCHINDUCTOR_COMPILE_THREADS=1 timeout -s INT -k 30 "$lim" "$PY" -m pytest -q -p no:cacheprovider ${workers[@]+"${workers[@]}"} \
            --junitxml="$OUT_DIR/junit-gpu.xml" "$@" > "$OUT_DIR/pytest.log" 2>&1
        RC[tests]=$?
    else
        RC[tests]=skipped
    fi
    echo "pytest exit ${RC[tests]} after $((SECONDS - t0)) s (log: $OUT_DIR/pytest.log)"
fi

if [[ " $PARTS " == *" bench "* ]]; then
    lim=$(limit bench "${FF_BENCH_LIMIT:-330}")
    echo "== python -m flashforge.bench (limit ${lim}s)"
    t0=$SECONDS
    if [ "$lim" -gt 0 ]; then
        PYTHONPATH="$FA4_PATH$PYTHONPATH" timeout -k 10 "$lim" "$PY" -m flashforge.bench --json "$OUT_DIR/bench.json" \
            > "$OUT_DIR/bench.log" 2>&1
        RC[bench]=$?
    else
        RC[bench]=skipped
    fi
    echo "bench exit ${RC[bench]} after $((SECONDS - t0)) s (log: $OUT_DIR/bench.log)"
fi

if [[ " $PARTS " == *" compare "* ]]; then
    lim=$(limit compare "${FF_COMPARE_LIMIT:-360}")
    echo "== attention_bench --suite compare (limit ${lim}s)"
    t0=$SECONDS
    if [ "$lim" -gt 0 ]; then
        # stop starting rows 75 s before the limit: one row (FA4's and our compiles, three timings)
        # takes up to about a minute, and the table is printed after the last
        stop=$((lim - 75)); [ "$stop" -lt 30 ] && stop=30
        PYTHONPATH="$FA4_PATH$PYTHONPATH" timeout -k 10 "$lim" "$PY" benchmarks/attention_bench.py --suite compare \
            --dtype "${FF_COMPARE_DTYPE:-bf16}" --max-seconds "$stop" --out "$OUT_DIR/compare" \
            > "$OUT_DIR/compare.log" 2>&1
        RC[compare]=$?
    else
        RC[compare]=skipped
    fi
    echo "compare exit ${RC[compare]} after $((SECONDS - t0)) s (log: $OUT_DIR/compare.log)"
fi

if [ -n "${RC[tests]:-}" ]; then
    echo
    echo "================ pytest: failures and summary"
    # the short test summary (-ra, from pyproject.toml) down to the closing line, at most 30 lines
    if grep -q "short test summary info" "$OUT_DIR/pytest.log" 2>/dev/null; then
        sed -n '/short test summary info/,$p' "$OUT_DIR/pytest.log" | tail -n 30 | cut -c1-240
    else
        tail -n 1 "$OUT_DIR/pytest.log" 2>/dev/null
    fi
fi
if [ -n "${RC[bench]:-}" ]; then
    echo
    echo "================ benchmark (python -m flashforge.bench)"
    if [ -n "${RC[compare]:-}" ]; then  # the compare table below has these rows too: its means only
        grep -E '^FAIL|FAIL$|^geomean|^RESULT' "$OUT_DIR/bench.log" 2>/dev/null | cut -c1-240
    else
        grep -v ': done (' "$OUT_DIR/bench.log" 2>/dev/null | tail -n 80
    fi
fi
if [ -n "${RC[compare]:-}" ]; then
    echo
    echo "================ compare: ours / max(FA4, cuDNN)"
    if [ -f "$OUT_DIR/compare/compare.txt" ]; then
        cat "$OUT_DIR/compare/compare.txt"
    else
        tail -n 40 "$OUT_DIR/compare.log"
    fi
fi
echo
# the lines that matter, last, so that a cut output still shows them
status=0
for p in tests bench compare; do
    rc="${RC[$p]:-}"
    [ -z "$rc" ] && continue
    case "$p" in
        tests) what="$(tail -n 1 "$OUT_DIR/pytest.log" 2>/dev/null | tr -d '=' | sed 's/^ *//')";;
        bench) what="$(grep '^RESULT' "$OUT_DIR/bench.log" 2>/dev/null || echo 'no RESULT line')";;
        compare) what="$(grep '^RESULT' "$OUT_DIR/compare.log" 2>/dev/null || echo 'no RESULT line')";;
    esac
    case "$rc" in
        124|137) what="$what; TIMED OUT";;
        skipped) what="not run: too little of FF_BUDGET left";;
    esac
    printf '%-8s %s (exit %s)\n' "$p:" "$what" "$rc"
    [ "$rc" = 0 ] || status=1
done
exit "$status"
