#!/usr/bin/env bash
# On the GPU machine: ncu of our backward's dK/dV kernel (one launch a row) with per-instruction
# counters, summarized by ncu_source_top.py (each kernel's stall listing in address order, then its
# top stall and bank-conflict instructions) into summary.txt; the rest as raw.tar.gz under $OUT.
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
    ncu --import "$OUT/rep_$tag.ncu-rep" --page source --csv --print-source sass > "$OUT/sass_$tag.csv" 2>&1
    rm -f "$OUT/rep_$tag.ncu-rep"
    { echo "== $row: $(grep -m1 -oE 'attn_bwd_dkdv[A-Za-z0-9_]*' "$OUT/details_$tag.txt")"
      grep -E "Duration|Stall|bank|wavefronts" "$OUT/details_$tag.txt" | sed 's/  */ /g' | head -12 | cut -c1-200
      python ncu_source_top.py "$OUT/sass_$tag.csv" --listing "${LISTING_MIN:-300}" | tail -n +3
      python ncu_source_top.py "$OUT/sass_$tag.csv" | tail -n +3; } >> "$OUT/summary.txt" 2>&1
done
grep -A12 "^== " "$OUT/summary.txt" | cut -c1-200
# the device returns at most 8 files: everything but the summary goes back as one archive
( cd "$OUT" && tar -czf raw.tar.gz --remove-files $(ls | grep -vE '^(summary.txt|raw.tar.gz)$') )
