#!/usr/bin/env bash
# On the CPU machine, in the checkout: pack FA4 for the two staging calls (../shared/tools/fa4/) so
# that each call, with this tree (~9 MiB), stays under the device tool's 64 MiB.  The shared
# prepare.sh puts the compiler library (~50 MB packed) into .fa4a beside ~10 MB of wheels: with the
# tree, that call would carry ~67 MiB.  Here the two libraries swap folders (.fa4a: the wheels and
# the runtime library, ~23 MiB; .fa4b: the compiler library, ~48 MiB) and the stage scripts are
# rewritten to match.  Then: call 1 `bash .fa4a/stage1.sh ...` with carry [".fa4a"], call 2 at once
# after (same warm machine) `bash .fa4b/stage2.sh && FF_PARTS=compare bash scripts/device.sh` with
# carry [".fa4b"].
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash ../shared/tools/fa4/prepare.sh
mv .fa4a/ir.so.xz .fa4a/ir.path .fa4b/
mv .fa4b/rt.so.xz .fa4b/rt.path .fa4a/
sed -i 's/ir\.path/rt.path/; s/ir\.so\.xz/rt.so.xz/' .fa4a/stage1.sh
sed -i 's|^so=\(.*\)$|so=\1; mkdir -p "$(dirname "$so")"|' .fa4a/stage1.sh
sed -i 's/rt\.path/ir.path/; s/rt\.so\.xz/ir.so.xz/; s/^rt=/ir=/; s/"\$rt"/"$ir"/' .fa4b/stage2.sh
sed -i 's|^ir=\(.*\)$|ir=\1; mkdir -p "$(dirname "$ir")"|' .fa4b/stage2.sh
grep -q 'rt.so.xz' .fa4a/stage1.sh && grep -q 'ir.so.xz' .fa4b/stage2.sh || {
    echo "fa4_stage_prepare.sh: the shared stage scripts changed; check .fa4a/stage1.sh, .fa4b/stage2.sh" >&2; exit 1; }
du -sh .fa4a .fa4b
