"""The Triton kernels compile for sm_90 (H100/H200) on any machine.

The interpreter runs the kernels as numpy code and accepts some programs that
the GPU compiler rejects; tools/sm90_compile_check.py compiles every kernel
variant the launchers produce with Triton's own compiler and ptxas, no GPU
needed.  It runs in a subprocess: kernels decorated under TRITON_INTERPRET=1
(as in this test session) cannot be compiled."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")
ROOT = Path(__file__).resolve().parents[1]


def test_every_kernel_variant_compiles_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    # (cold, with an empty Triton cache as on a fresh CI machine, it took 12 min alone on 2 cores
    # (2026-12-06, 386 variants); beside the other tests' worker it takes longer)
    run = subprocess.run([sys.executable, str(ROOT / "tools" / "sm90_compile_check.py"), "--wgmma"], env=env,
                         capture_output=True, text=True, timeout=2400)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    assert run.stdout.rstrip().endswith("0 failed"), run.stdout[-2000:]
    assert "wgmma" in run.stdout, "bf16 kernels should use Hopper's warpgroup MMA"
    # no Gluon kernel has ptxas run its warpgroup MMAs one at a time (a kernel that did would run
    # at a fraction of its tiles' speed, with nothing else to show for it)
    assert "wgmma=ok" in run.stdout
    serialized = [line for line in run.stdout.splitlines() if "wgmma=SERIALIZED" in line]
    assert not serialized, "\n".join(serialized[:10])


def test_table_for_other_gpus_fits_their_shared_memory():
    """sm_80 (A100, 163 KB per block) and sm_89 (L4 / RTX 40, 99 KB) take the generic
    tile table; the sm_90 table's wide tiles would not launch there."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    run = subprocess.run([sys.executable, str(ROOT / "tools" / "sm90_compile_check.py"), "--quick",
                          "--arch", "80,89"], env=env, capture_output=True, text=True, timeout=1200)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    assert run.stdout.rstrip().endswith("0 failed"), run.stdout[-2000:]
    assert "== sm_89" in run.stdout and "mma" in run.stdout
