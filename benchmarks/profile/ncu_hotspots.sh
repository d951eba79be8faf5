#!/usr/bin/env bash
# On the GPU machine: ncu of our backward's dK/dV kernel (one launch a row) with per-instruction
# counters, summarized by ncu_source_top.py (top stall and bank-conflict instructions) -- small
# enough to come back whole.  Results under $OUT.
#
#     bash benchmarks/profile/ncu_hotspots.sh "D128 S4096 causal" "D64 S4096"
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"
export PYTHONPATH="../..${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
unset TRITON_INTERPRET
OUT="${OUT:-/tmp/ncu_hotspots}"; mkdir -p "$OUT"
which ncu > /dev/null || { echo "no ncu"; exit 1; }
for row in "$@"; do
    tag=$(echo "$row" | tr ' ' '_')
    timeout "${P_LIMIT:-150}" ncu --clock-control none -k "${KERNEL:-regex:attn_bwd_dkdv}" --launch-skip 4 --launch-count 1 \
        --section SourceCounters --section WarpStateStats --section SpeedOfLight --section MemoryWorkloadAnalysis_Tables \
        -o "$OUT/rep_$tag" python step_kernels.py --plain 2 "$row" > "$OUT/ncu_$tag.log" 2>&1
    ncu --import "$OUT/rep_$tag.ncu-rep" --page details > "$OUT/details_$tag.txt" 2>&1
    ncu --import "$OUT/rep_$tag.ncu-rep" --page source --csv --print-source sass > "/tmp/sass_$tag.csv" 2>&1
    python ncu_source_top.py "/tmp/sass_$tag.csv" > "$OUT/top_$tag.txt" 2>&1
    gzip -c "/tmp/sass_$tag.csv" > "$OUT/sass_$tag.csv.gz"
    rm -f "$OUT/rep_$tag.ncu-rep"
    echo "== $row: $(grep -m1 -oE 'attn_bwd_dkdv[A-Za-z0-9_]*' "$OUT/details_$tag.txt")"
    grep -E "Duration|Stall|bank|wavefronts" "$OUT/details_$tag.txt" | sed 's/  */ /g' | head -12 | cut -c1-200
    head -3 "$OUT/top_$tag.txt" | cut -c1-400
done
