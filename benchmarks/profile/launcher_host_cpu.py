"""The launchers' own host time, on a machine without a GPU: a training step's forward and backward
launch code for sm_90 (tile table, Gluon scope checks, descriptors, argument packing), with every
kernel replaced by a recorder (as tools/sm90_compile_check.py does) and the tensors on the meta
device (no allocation cost).  Run it in two trees to see what a change adds to a step's host time
(the grid's S = 1k rows on the H200 are bound by it).

    python benchmarks/profile/launcher_host_cpu.py [--D 128] [--S 1024] [--dtype bf16]
"""
from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.pop("TRITON_INTERPRET", None)
ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
sys.path[:0] = [ROOT, os.path.join(ROOT, "tools")]

import torch  # noqa: E402

import sm90_compile_check as cc  # noqa: E402
from flashforge.ops.params import AttnParams  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--D", type=int, default=128)
    ap.add_argument("--S", type=int, default=1024)
    ap.add_argument("--dtype", default="bf16", choices=("bf16", "fp16"))
    ap.add_argument("--steps", type=int, default=300)
    args = ap.parse_args()
    L, log = cc.launchers, []
    cc.record_launches(log)
    L._interpreting = lambda q: False
    torch.cuda.get_device_capability = lambda device=None: (9, 0)
    L._arch = lambda q: (9, 0)
    real = cc.configs.get_config
    L.get_config = lambda kind, d, e, interpret, **kw: real(kind, d, e, False, **kw)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float16
    B, H = max(1, 16384 // args.S), max(1, 2048 // args.D)
    for causal in (False, True):
        q = torch.empty(B, args.S, H, args.D, dtype=dtype, device="meta")
        lse_lo = torch.empty(B, H, args.S, device="meta")
        p = AttnParams(scale=args.D ** -0.5, window_right=0 if causal else -1)

        def step():
            o, lse = L.attention_forward(q, q, q, None, p, lse_lo=lse_lo)
            L.attention_backward(o, None, q, q, q, None, o, lse, p, False, lse_lo=lse_lo)

        for _ in range(min(50, args.steps)):
            step()
        times = []
        for _ in range(7):
            log.clear()
            t0 = time.perf_counter()
            for _ in range(args.steps):
                step()
            times.append((time.perf_counter() - t0) / args.steps * 1e6)
        print(f"D={args.D} S={args.S} {args.dtype} causal={causal}: {sorted(times)[3]:.1f} us a step "
              f"(median of 7; {len(log) // args.steps} launches: "
              f"{', '.join(sorted({fn.__name__ for fn, _, _ in log}))})")


if __name__ == "__main__":
    main()
