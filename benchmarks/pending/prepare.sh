#!/usr/bin/env bash
# On the CPU machine, in the checkout: build the trees the device call (device_ab.sh) compares,
# under .ab/ (gitignored; carry it): main's package (base), main + 0001 (new), main + 0001 + 0002 +
# 0003 (new3) and the fully patched tree for its GPU tests (new_tree).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
rm -rf .ab && mkdir -p .ab/base .ab/new .ab/new3 .ab/new_tree
work=$(mktemp -d)
git worktree add -q --detach "$work" HEAD
trap 'git worktree remove --force "$work"' EXIT
git -C "$work" archive HEAD flashforge | tar -x -C .ab/base
git -C "$work" am -q "$PWD"/benchmarks/pending/0001-*.patch
git -C "$work" archive HEAD flashforge | tar -x -C .ab/new
git -C "$work" am -q "$PWD"/benchmarks/pending/0002-*.patch "$PWD"/benchmarks/pending/0003-*.patch
git -C "$work" archive HEAD flashforge | tar -x -C .ab/new3
git -C "$work" archive HEAD | tar -x -C .ab/new_tree
rm -rf .ab/new_tree/benchmarks/results
du -sh .ab
