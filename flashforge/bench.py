"""Self-check and small benchmark of flashforge on whatever device this machine has.

    python -m flashforge.bench [--json PATH] [--device cpu|cuda] [--check-only]

1. Self-check: a few small cases (forward and backward; causal with an offset, GQA, bias with gradient,
   bool mask with fully masked rows, dropout, window + softcap + lse) against
   `flashforge.reference.attention` in float64 (flashforge/benchmark/selfcheck.py).
2. Benchmark: `flashforge.attention` against its peers on the same inputs, forward and forward+backward,
   run by the benchmark library (flashforge/benchmark/) that benchmarks/attention_bench.py also uses.
   CUDA: bf16 on PERF.md's standard grid (16k tokens, H*D = 2048, D 64/128, S 1k/4k/16k, causal or
   not) against FA4 (where the flash-attn-4 package imports) and SDPA's cuDNN backend, timed by
   `triton.testing.do_bench` (median), with the geometric means over the grid.  CPU: B=1, H=8, D=64,
   S 512/1024/2048 causal or not, and one decoding step (1 query, 16k keys), against SDPA, in float32
   and bfloat16, on torch's default threads and on one; median wall-clock of a few runs.  Every row
   also checks our output (and gradients) against a reference computed in the same run (the first SDPA
   backend that ran, else SDPA's math backend in float32), so a fast wrong kernel cannot report a number.

FLOPs follow PERF.md (flash-attn's convention): forward 4*B*H*Sq*Sk*D, halved when causal;
forward+backward 3.5x that.  ours/best = ours / max(FA4, cuDNN) on a GPU, ours / SDPA on the CPU:
above 1, flashforge is faster.  Exits with status 1 if any check or benchmark comparison fails.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Optional

import torch

from flashforge.benchmark.environment import environment, fa4_error
from flashforge.benchmark.report import format_geomeans, format_table, grid_geomeans, write_json
from flashforge.benchmark.runner import Runner
from flashforge.benchmark.selfcheck import self_check
from flashforge.benchmark.suites import main_cases

# what the first line shows of the environment (the JSON has all of it)
_SHOWN = ("flashforge", "torch", "triton", "python", "device", "gpu", "cuda", "cpu", "cpus", "threads", "commit")


def _save(json_path: Optional[str], report: dict) -> None:
    if json_path:
        write_json(json_path, report)


def _tables(rows: list, device: torch.device, no_fa4: Optional[str]) -> str:
    """One table per dtype and thread count (the CPU has four), then the grid's geometric means."""
    groups: dict = {}
    for r in rows:
        groups.setdefault((r["case"]["dtype"], r["case"]["threads"]), []).append(r)
    out = []
    for (dtype, threads), sub in groups.items():
        title = f"benchmark, {device.type} {dtype}"
        if device.type != "cuda":
            n = threads or torch.get_num_threads()
            title += f", {n} thread" + ("s" if n > 1 else "")
        out.append(format_table(sub, title, no_fa4))
    means = format_geomeans(rows)
    return "\n\n".join(out + ([means] if means else []))


def benchmark(device: torch.device, report: dict, json_path: Optional[str]) -> bool:
    rows: list = []
    t0 = time.perf_counter()
    runner = Runner(device)
    for case in main_cases(device.type, torch.get_num_threads()):
        new = runner.run_or_report(case)
        rows += new
        report["bench"] = rows
        _save(json_path, report)  # a run cut short still leaves what it measured
        print(f"  {new[0]['name']} {case.pass_label}: done ({time.perf_counter() - t0:.0f} s)", file=sys.stderr,
              flush=True)
    report["grid_geomeans"] = grid_geomeans(rows)
    print("\n" + _tables(rows, device, fa4_error(report["environment"])))
    return all(r["ok"] for r in rows)


def main(argv: Optional[list] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m flashforge.bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", metavar="PATH", help="also write the results here as JSON")
    parser.add_argument("--device", choices=("cpu", "cuda"), help="default: cuda if available, else cpu")
    parser.add_argument("--check-only", action="store_true", help="run the self-check, skip the benchmark")
    args = parser.parse_args(argv)
    sys.stdout.reconfigure(line_buffering=True)  # keep stdout in step with stderr's progress lines

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and os.environ.get("TRITON_INTERPRET") == "1":
        print("warning: TRITON_INTERPRET=1 is set, so the Triton kernels run in the interpreter", file=sys.stderr)
    env = environment(device, vars(args), fa4=device.type == "cuda" and not args.check_only)
    print("flashforge " + " ".join(f"{k}={env[k]}" for k in _SHOWN if k in env)
          + (f" fa4={env['fa4'].get('version') or 'missing'}" if "fa4" in env else ""))
    report: dict = {"environment": env, "check": [], "bench": []}

    check_ok = self_check(device, report, args.json)
    bench_ok = True if args.check_only else benchmark(device, report, args.json)
    report["ok"] = check_ok and bench_ok
    _save(args.json, report)
    if args.json:
        print(f"\nwrote {args.json}")
    print("\nRESULT: " + ("ok" if report["ok"] else "FAILED") +
          ("" if check_ok else " (self-check)") + ("" if bench_ok else " (benchmark)"))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
