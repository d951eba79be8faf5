"""A/B timing of two flashforge trees on one GPU, in one run: is a change slower?

    python benchmarks/profile/ab_timing.py --tree old=.ab/old --tree new=. [--rounds 2] [--json PATH]
    python benchmarks/profile/ab_timing.py --tree off=. --tree on=. --tree-env off:FLASHFORGE_L2_SECTION=0
    python benchmarks/profile/ab_timing.py --tree bf16=. --tree fp16=. --tree-dtype fp16=float16


Each tree is a directory holding a `flashforge` package (e.g. `git archive <commit> flashforge | tar -x
-C .ab/old`).  The two packages register the same custom ops, so they cannot share a process: each round
times every tree in a child process, in ABBA order so that drift of the machine (clocks, heat) falls
on both, and the median over rounds is kept.  Only the public `flashforge.attention` is used, so any
two versions compare.  Rows: PERF.md's standard grid (bf16, 16k tokens, H*D = 2048) and D = 256,
forward and forward+backward, TFLOP/s by PERF.md's convention (--features adds the compare's GQA 32/8
and causal window 1023 rows); ratio = last tree / first tree, and
"slower" / "faster" where every round of the last tree fell below / above every round of the first.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

# (D, S, causal, KV heads divisor, causal window)
ROWS = [(D, S, causal, 1, None) for D in (64, 128) for S in (1024, 4096, 16384) for causal in (False, True)]
ROWS += [(256, 4096, False, 1, None), (256, 16384, True, 1, None)]
FEATURE_ROWS = [(128, 4096, True, 4, None), (128, 16384, True, 1, 1023)]


def label(D, S, causal, div, window):
    return (f"D{D} S{S}{' causal' if causal else ''}" + (f" GQA {div}" if div > 1 else "")
            + (f" window {window}" if window is not None else ""))


def shape(D: int, S: int):
    """(B, H): the grid's 16k tokens and H*D = 2048; D = 256 rows: H = 8, PERF.md's head-dim cases."""
    if D == 256:
        return max(1, 16384 // S), 8
    return 16384 // S, 2048 // D


def row_tensors(D, S, div, dtype):
    """A row's q, k, v (leaves that want gradients) and dO, on the GPU from seed 0."""
    import torch
    B, H = shape(D, S)
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(B, S, H, D, device="cuda", dtype=dtype, generator=gen).requires_grad_()
    k, v = (torch.randn(B, S, H // div, D, device="cuda", dtype=dtype, generator=gen).requires_grad_()
            for _ in range(2))
    do = torch.randn(B, S, H, D, device="cuda", dtype=dtype, generator=gen)
    return q, k, v, do


def flops(D, S, causal, mode, window=None):
    from flashforge.benchmark.flops import visible_pairs
    B, H = shape(D, S)
    f = 4 * B * H * D * visible_pairs(S, S, causal, 0, window)
    return f * (3.5 if mode == "fwdbwd" else 1.0)


def child(dtype_name: str, grid_only: bool, only: list[str], features: bool) -> None:
    import torch
    import triton.testing
    import flashforge

    dtype = getattr(torch, dtype_name)
    out = {}
    for D, S, causal, div, window in ROWS + (FEATURE_ROWS if features else []):
        if grid_only and D == 256:
            continue
        name = label(D, S, causal, div, window)
        if only and name not in only:
            continue
        q, k, v, do = row_tensors(D, S, div, dtype)

        def fwd():
            with torch.no_grad():
                flashforge.attention(q, k, v, causal=causal, window=window)

        def fwdbwd():
            o = flashforge.attention(q, k, v, causal=causal, window=window)
            torch.autograd.grad(o, (q, k, v), do)

        for mode, fn in (("fwd", fwd), ("fwdbwd", fwdbwd)):
            ms = triton.testing.do_bench(fn, warmup=25, rep=150, return_mode="median")
            out[f"{name} {mode}"] = flops(D, S, causal, mode, window) / ms / 1e9
            print(f"{name} {mode} {out[f'{name} {mode}']:.1f}", file=sys.stderr, flush=True)  # progress
    print("AB_RESULT " + json.dumps(out), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tree", action="append", required=True, help="NAME=DIR (a dir holding flashforge/)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--json", default=None)
    ap.add_argument("--grid-only", action="store_true", help="leave out the D = 256 rows")
    # (2026-12-06, H100: when --warm ran every tree's child at once, the parent printed nothing within
    # 320 s, where one child alone took 38 s cold -- cause not found; now they run one after another,
    # each bounded by --child-timeout, and each child prints its rows to stderr as it goes)
    ap.add_argument("--warm", action="store_true", help="first run every tree once, untimed (compiles)")
    ap.add_argument("--child-timeout", type=float, default=300, help="seconds a child may run (default 300)")
    ap.add_argument("--only", action="append", default=[],
                    help='time only this row, e.g. "D128 S4096 causal" (repeatable)')
    ap.add_argument("--features", action="store_true", help="also the GQA 32/8 and window 1023 rows")
    ap.add_argument("--tree-env", action="append", default=[],
                    help="NAME:KEY=VALUE, an environment variable for tree NAME's children (repeatable)")
    ap.add_argument("--tree-dtype", action="append", default=[],
                    help="NAME=DTYPE, tree NAME's dtype in place of --dtype (one tree twice: float16 against "
                         "bfloat16 in ABBA order, so drift falls on both)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args.dtype, args.grid_only, args.only, args.features)
    trees = [t.split("=", 1) for t in args.tree]
    tree_env = {name: {} for name, _ in trees}
    for item in args.tree_env:
        name, kv = item.split(":", 1)
        key, value = kv.split("=", 1)
        tree_env[name][key] = value
    tree_dtype = dict(item.split("=", 1) for item in args.tree_dtype)
    results = {name: [] for name, _ in trees}

    def command(name, path):
        cmd = [sys.executable, os.path.abspath(__file__), "--child", "--tree", "x=x", "--dtype",
               tree_dtype.get(name, args.dtype)]
        cmd += [a for o in args.only for a in ("--only", o)]
        cmd += (["--grid-only"] if args.grid_only else []) + (["--features"] if args.features else [])
        return cmd, dict(os.environ, PYTHONPATH=os.path.abspath(path), **tree_env[name])

    if args.warm:  # compile every tree's kernels (Triton's cache keeps them); these timings are dropped
        for name, path in trees:
            cmd, env = command(name, path)
            try:
                rc = subprocess.run(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                    timeout=args.child_timeout).returncode
            except subprocess.TimeoutExpired:
                rc = "timed out"
            print(f"warm-up {name}: {rc}", flush=True)
    for r in range(args.rounds):
        order = trees if r % 2 == 0 else trees[::-1]
        for name, path in order:
            cmd, env = command(name, path)
            try:
                proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.child_timeout)
            except subprocess.TimeoutExpired as e:
                sys.exit(f"{name} (round {r}) ran past {args.child_timeout} s:\n{(e.stderr or b'')[-3000:]!r}")
            line = [ln for ln in proc.stdout.splitlines() if ln.startswith("AB_RESULT ")]
            if proc.returncode or not line:
                sys.exit(f"{name} (round {r}) failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
            results[name].append(json.loads(line[0][len("AB_RESULT "):]))
            # each child's rows as it ends, so a run cut by a time limit still leaves what it measured
            print(f"round {r}: {name} done " + json.dumps({k: round(v, 1) for k, v in results[name][-1].items()}),
                  flush=True)
    med = {name: {row: statistics.median(run[row] for run in runs) for row in runs[0]}
           for name, runs in results.items()}
    first, last = trees[0][0], trees[-1][0]
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"median": med, "runs": results}, f, indent=1)
    print(f"\n{'row':<40}" + "".join(f"{n:>9}" for n, _ in trees) + f"  {last}/{first}  rounds")
    ratios = {"fwd": [], "fwdbwd": []}
    for row in med[first]:
        ratio = med[last][row] / med[first][row]
        ratios[row.rsplit(" ", 1)[1]].append(ratio)
        # "slower"/"faster": every round of one tree beat every round of the other, so the gap is
        # not one round's noise; blank: the rounds overlap
        lo_f, hi_f = min(r[row] for r in results[first]), max(r[row] for r in results[first])
        lo_l, hi_l = min(r[row] for r in results[last]), max(r[row] for r in results[last])
        apart = "slower" if hi_l < lo_f else "faster" if lo_l > hi_f else ""
        print(f"{row:<40}" + "".join(f"{med[n][row]:9.1f}" for n, _ in trees) + f"  {ratio:6.3f}  {apart}")
    for mode, rs in ratios.items():
        print(f"geomean {mode}: {statistics.geometric_mean(rs):.3f}  (min {min(rs):.3f})")


if __name__ == "__main__":
    main()
