#!/usr/bin/env bash
# On the CPU machine, in the checkout: build the trees the device call (device_ab.sh) compares,
# under .ab/ (gitignored; carry it): main's package (base), main + every pending patch in order
# (new; and p1, p2, ...: main + the first k patches), and the fully patched tree for its GPU
# tests (new_tree).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
rm -rf .ab && mkdir -p .ab/base .ab/new .ab/new_tree
work=$(mktemp -d)
git worktree add -q --detach "$work" HEAD
trap 'git worktree remove --force "$work"' EXIT
git -C "$work" archive HEAD flashforge | tar -x -C .ab/base
# each patch's cumulative tree too (.ab/p1 = main + the first, .ab/p2 = + the second, ...), so
# one call can time them apart: AB_TREES="base p1 p2"
i=0
for patch in "$PWD"/benchmarks/pending/0*.patch; do
    i=$((i + 1))
    git -C "$work" am -q "$patch"
    mkdir -p ".ab/p$i" && git -C "$work" archive HEAD flashforge | tar -x -C ".ab/p$i"
done
git -C "$work" archive HEAD flashforge | tar -x -C .ab/new
git -C "$work" archive HEAD | tar -x -C .ab/new_tree
rm -rf .ab/new_tree/benchmarks/results
# D = 128's half-dQ entries in the DEFER form, for a third tree (newov = new under this file through
# FLASHFORGE_TILE_CONFIGS; the table's entries otherwise, ops/triton/configs.py)
cfg='"block_m": 64, "block_n": 128, "num_warps": 4, "num_stages": 2, "gluon": true, "consumers": 2, "fused_dq": true, "half_dq": true, "overlap": true'
printf '{"bwd_kv_ws_gluon/128/2": {%s, "min_keys": 1024},\n "bwd_kv_ws_gluon_causal/128/2": {%s, "min_keys": 2048}}\n' \
    "$cfg" "$cfg" > .ab/d128ov.json
du -sh .ab
