"""Where a training step's GPU time goes, by kernel, on the table's own path (no forced tiles):
torch.profiler over 10 forward+backward steps of each row, each kernel's mean time a step and its
share, bf16 unless --dtype says otherwise.  Tells which kernel a row's gap to a peer lives in
before one is tuned (e.g. the window 1023 row: dK/dV or dQ?).

    PYTHONPATH=. python benchmarks/profile/step_kernels.py "D128 S16384 causal window 1023" "D128 S16384 causal"
    ... step_kernels.py --impl fa4 "D128 S4096 causal"       # FA4's kernels (staged on PYTHONPATH)
    ncu -k regex:halfdq ... python step_kernels.py --plain 4 "D128 S4096 causal"  # steps for ncu to catch

Row names are ab_timing.py's labels.  --plain N runs N steps after the warm-up with no profiler
(an outside one, e.g. ncu, picks the launches; skip the warm-up's 3).
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ab_timing import FEATURE_ROWS, ROWS, label, row_tensors  # noqa: E402


def main() -> None:
    import torch
    import flashforge

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("rows", nargs="+")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--json", default=None)
    ap.add_argument("--impl", choices=("flashforge", "fa4"), default="flashforge")
    ap.add_argument("--plain", type=int, default=0, help="run this many steps unprofiled and stop")
    args = ap.parse_args()
    if args.impl == "fa4":
        from flash_attn.cute import flash_attn_func

        def attend(q, k, v, causal, window):  # FA4's causal window: (left, 0); returns (out, lse)
            return flash_attn_func(q, k, v, causal=causal, window_size=(window, 0) if window else (None, None))[0]
    else:
        def attend(q, k, v, causal, window):
            return flashforge.attention(q, k, v, causal=causal, window=window)
    dtype = getattr(torch, args.dtype)
    known = {label(*r): r for r in ROWS + FEATURE_ROWS}
    out = {}
    for name in args.rows:
        if name not in known:
            sys.exit(f"row {name!r}: not one of {sorted(known)}")
        D, S, causal, div, window = known[name]
        q, k, v, do = row_tensors(D, S, div, dtype)

        def step():
            o = attend(q, k, v, causal, window)
            torch.autograd.grad(o, (q, k, v), do)

        for _ in range(3):  # compile, plans
            step()
        torch.cuda.synchronize()
        if args.plain:
            for _ in range(args.plain):
                step()
            torch.cuda.synchronize()
            continue
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(args.steps):
                step()
            torch.cuda.synchronize()
        per = collections.defaultdict(float)
        for ev in prof.events():
            if ev.device_type == torch.autograd.DeviceType.CUDA:
                per[ev.name] += ev.device_time_total / args.steps  # (us a step)
        total = sum(per.values())
        out[name] = {"us_per_step": total, "kernels": dict(per)}
        print(f"\n{name}: {total:.0f} us a step of GPU time ({args.impl}, {args.dtype})")
        for kname, us in sorted(per.items(), key=lambda kv: -kv[1]):
            print(f"  {us:9.1f} us  {us / total:6.1%}  {kname[:110]}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
