"""CPU timing: flashforge's PyTorch path against torch's scaled_dot_product_attention, on shapes of your
choice (the main job, `python -m flashforge.bench`, runs a fixed set of them).

Forward and forward+backward over a grid of shapes, through the benchmark library (flashforge/benchmark/:
the same cases, FLOP counts, checks and table as every other benchmark).  The table gives GFLOP/s and
ours / SDPA (above 1: flashforge is faster) from the best of N runs, the least disturbed by other load.

Usage: ``PYTHONPATH=. python benchmarks/cpu_vs_sdpa.py [--batch 1 2] [--seqlens 512 1024] [--threads 4]
[--dtype bf16] [--reps 5]``.
"""
from __future__ import annotations

import argparse
import sys

import torch

from flashforge.benchmark.cases import DTYPES, Case, fmt_len
from flashforge.benchmark.report import format_table
from flashforge.benchmark.runner import Runner
from flashforge.benchmark.timing import Timing


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--seqlens", type=int, nargs="+", default=[512, 1024, 2048])
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--dtype", default="fp32", choices=sorted(DTYPES))
    ap.add_argument("--reps", type=int, default=5, help="timed runs of each (after one warm-up that checks it)")
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    args = ap.parse_args(argv)
    dtype = DTYPES[args.dtype]
    cases = [Case("cpu", mode, B, S, S, args.heads, args.heads, args.head_dim, dtype, causal=causal, peers=("sdpa",),
                  threads=args.threads, name=f"B={B} S={fmt_len(S)}" + (" causal" if causal else ""))
             for B in args.batch for S in args.seqlens for causal in (False, True) for mode in ("fwd", "fwdbwd")]
    timing = Timing(cpu_budget_s=0.0, cpu_min_runs=args.reps, cpu_cap_s=float("inf"), cpu_stat="min")
    runner = Runner(torch.device("cpu"), timing)
    rows = [r for c in cases for r in runner.run_or_report(c)]
    threads = args.threads or torch.get_num_threads()
    print(format_table(rows, f"torch {torch.__version__}, {threads} threads, {dtype}, H={args.heads}, "
                             f"D={args.head_dim}, best of {args.reps}"))
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
