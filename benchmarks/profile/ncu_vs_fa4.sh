#!/usr/bin/env bash
# On the GPU machine, FA4 staged (../shared/tools/fa4/): where our training step's backward loses to
# FA4's on the same rows.  For each row: each library's kernels a step (step_kernels.py, torch.profiler),
# then ncu (--set full) of one launch of each backward's main kernel -- ours the half-dQ dK/dV kernel,
# FA4's FlashAttentionBackwardSm90 -- and the headline metrics side by side, and each kernel's
# per-instruction stall listing (listing.txt).  Results under $OUT (listing.txt, raw.tar.gz).
#
#     NCU_N=2 bash benchmarks/profile/ncu_vs_fa4.sh "D128 S4096 causal" "D64 S4096" "D64 S1024"
# (every row's kernels a step; ncu on the first NCU_N rows, default all)
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"
FA4_SITE="${FF_FA4_SITE:-$HOME/.cache/fa4/site}"
export PYTHONPATH="$FA4_SITE:$FA4_SITE/nvidia_cutlass_dsl/dsl_packages:../..${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
unset TRITON_INTERPRET
OUT="${OUT:-/tmp/ncu_vs_fa4}"; mkdir -p "$OUT"
LIM="${P_LIMIT:-90}"
for impl in flashforge fa4; do
    timeout "$LIM" python step_kernels.py --impl "$impl" --steps 5 --json "$OUT/steps_$impl.json" "$@" \
        > "$OUT/steps_$impl.txt" 2>&1
    grep -A6 "a step of GPU time" "$OUT/steps_$impl.txt" | cut -c1-120
done
which ncu > /dev/null || { echo "no ncu"; exit 0; }
METRICS="Duration|Compute \(SM\) Throughput|Issue Slots Busy|Executed Ipc Active|Registers Per|Achieved Occupancy|Shared Memory Configuration Size|Dynamic Shared Memory Per Block|Block Size|Grid Size|Warp Cycles Per Issued"
for row in "${@:1:${NCU_N:-$#}}"; do
    tag=$(echo "$row" | tr ' ' '_')
    for impl in flashforge fa4; do
        if [ "$impl" = fa4 ]; then k="regex:BackwardSm90"; else k="regex:attn_bwd_dkdv"; fi
        # the warm-up's 3 steps launch the kernel 3 times (our causal rows: lse_lo may add a launch; the
        # first of a step is the one caught either way)
        timeout "$LIM" ncu --clock-control none -k "$k" --launch-skip 4 --launch-count 1 --set full \
            -o "$OUT/${impl}_$tag" python step_kernels.py --impl "$impl" --plain 2 "$row" > "$OUT/ncu_${impl}_$tag.log" 2>&1
        ncu --import "$OUT/${impl}_$tag.ncu-rep" --page details > "$OUT/details_${impl}_$tag.txt" 2>&1
        ncu --import "$OUT/${impl}_$tag.ncu-rep" --page raw --csv > "$OUT/raw_${impl}_$tag.csv" 2>&1
        # per-instruction counters (stalls, bank conflicts, local traffic) of the SASS, for the lines that cost
        ncu --import "$OUT/${impl}_$tag.ncu-rep" --page source --csv --print-source sass > "$OUT/sass_${impl}_$tag.csv" 2>&1
        # the loop in address order, where each kernel's warps wait (ncu_source_top.py --listing)
        { echo "== $row $impl"; python ncu_source_top.py "$OUT/sass_${impl}_$tag.csv" --listing "${LISTING_MIN:-300}" | tail -n +3
          python ncu_source_top.py "$OUT/sass_${impl}_$tag.csv" --top 15 | tail -n +3; } >> "$OUT/listing.txt" 2>&1
        rm -f "$OUT/${impl}_$tag.ncu-rep"
        echo "== $row $impl: $(grep -m1 -oE '(attn_bwd_dkdv[A-Za-z0-9_]*|[A-Za-z0-9_]*BackwardSm90[A-Za-z0-9_]{0,20})' "$OUT/details_${impl}_$tag.txt")"
        grep -E "$METRICS" "$OUT/details_${impl}_$tag.txt" | sed 's/  */ /g' | head -14
        grep -E "Stall|stall" "$OUT/details_${impl}_$tag.txt" | head -4 | cut -c1-200
    done
done
# the device returns at most 8 files: everything but the summaries goes back as one archive
( cd "$OUT" && tar -czf raw.tar.gz --remove-files $(ls | grep -vE '^(listing.txt|raw.tar.gz)$') )
