#!/usr/bin/env bash
# On the CPU machine, in the checkout: build the trees the device call (device_ab.sh) compares,
# under .ab/ (gitignored; carry it): main, main + 0001, main + 0001 + 0002 (packages only), and
# the full patched tree for its GPU tests.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
rm -rf .ab/pend_main .ab/pend_1 .ab/pend_12 .ab/pend_tree && mkdir -p .ab/pend_main .ab/pend_1 .ab/pend_12 .ab/pend_tree
work=$(mktemp -d)
git worktree add -q --detach "$work" HEAD
trap 'git worktree remove --force "$work"' EXIT
git -C "$work" archive HEAD flashforge | tar -x -C .ab/pend_main
git -C "$work" am -q "$PWD"/benchmarks/pending/0001-*.patch
git -C "$work" archive HEAD flashforge | tar -x -C .ab/pend_1
git -C "$work" am -q "$PWD"/benchmarks/pending/0002-*.patch
git -C "$work" archive HEAD flashforge | tar -x -C .ab/pend_12
git -C "$work" archive HEAD | tar -x -C .ab/pend_tree
rm -rf .ab/pend_tree/benchmarks/results
du -sh .ab
