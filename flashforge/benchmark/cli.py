"""GPU benchmark of flashforge against FA4 and the attention kernels PyTorch ships, on identical inputs.

    PYTHONPATH=. python benchmarks/attention_bench.py --suite SUITE --out DIR [options]

SUITE is one of fwd, fwdbwd, features, decode, varlen, memory, headdims, compare, all, or a comma-separated
list of them.  One process times flashforge and every peer available on the machine on the same
tensors, checks flashforge's output (and gradients) against a reference in the same run, prints a
table (last) and writes DIR/<suite>.json and DIR/<suite>.png for each suite, and the table as
DIR/<suite>.txt (for `all` or a list also DIR/all.json, .txt and .png, a chart of the ratios).  The
JSON is rewritten after every case, so a run cut short still leaves what it measured.

Peers: FA4 (the flash-attn-4 package, imported lazily: without it its column is "-" and the ratios are
to cuDNN alone, as the table says), SDPA with one backend forced (`sdpa_kernel`: cudnn =
CUDNN_ATTENTION, flash = FLASH_ATTENTION, efficient = EFFICIENT_ATTENTION), FlexAttention compiled
(`torch.compile(flex_attention)`, block masks from `create_block_mask`), and where a case calls for
them: PyTorch's `varlen_attn` (FA2 varlen), our own padded dense kernel (`ours_padded`) and our
default-mode kernel (`ours_default`, next to `deterministic=True`).  A peer that cannot run a case gets
null in the JSON and "-" in the table; why is in the row's `peer_errors`.

Suites (bf16 unless --dtype):
  fwd, fwdbwd  PERF.md's grid: 16k tokens (B = 16384 / S), H*D = 2048, D 64/128, S 1k/4k/16k, causal or not.
  features     D = 128, B = 4, S = 4k, H = 32: GQA 32/8 causal; additive bias [B,1,S,S]; bias + dropout
               0.1; bias with gradient; causal sliding window 1024 (and 16k, B = 1, H = 16, PERF's
               anchor) next to dense causal; prefill Sq = 1k against Sk = 16k keys (causal offset 15k);
               deterministic=True vs default.
  decode       Sq = 1, GQA 32/8, D = 128: B 1/4/32/128 x cache 4k/32k/128k (caches over 20 GB skipped);
               ours contiguous and paged (block 256) with automatic split-KV, in one row each.
  varlen       16 sequences of random lengths summing to 16k, H = 16, D = 128, causal or not.
  memory       peak memory of one forward+backward, B = 1, H = 16, S = 128k, D = 128, causal.
  headdims     D 32/96/256 (H = round(2048 / D)) and float32 at D 64/128, B = 4, S = 4k, non-causal.
  compare      against FA4 and cuDNN only: the grid forward and forward+backward, GQA 32/8 S = 4k causal,
               a causal window of 1023 at S = 16k, D = 256 (H = 8) at S = 4k and 16k, causal or not.
  all          all but compare, cheapest first.  Runs of several suites (all, or a list) stop starting cases
               after --max-seconds (default 510, to fit a 10-minute job) and run FlexAttention (seconds
               of compilation per new shape or mask) only where PERF.md has Flex anchors: not on the
               D = 64 grid nor head dims other than 256 (--full-flex: everywhere).  A single suite has
               no time limit and Flex everywhere.
Each table ends with the geometric means of the ratios over the standard grid's 12 rows per pass.

Units and FLOPs: PERF.md's convention (flashforge/benchmark/flops.py).  Decode is in GB/s (1e9) of K and
V read.  Memory rows are GiB (2**30): peak `torch.cuda.max_memory_allocated` during one forward+backward
minus what was allocated before it (inputs, do); the gradients count.  `ratio` = ours / max(FA4, cuDNN)
of those that ran ("ratio_to" names it; "ratio_fa4", "ratio_cudnn" keep both); where neither ran, ours /
the best peer that ran.  For GiB lower is better.

Correctness: see flashforge/benchmark/checks.py (||ours - ref|| / ||ref|| against a reference run in
the same process; bf16 2e-2, fp16 1e-2, fp32 1e-3).

Timing: triton.testing.do_bench(fn, warmup, rep, return_mode="median") after a warm-up call outside
the timed region (L2 flushed before every repetition by do_bench); random normal inputs.

Exit status: 0 all rows ok, 1 a check failed (everything is still printed and written), 2 no CUDA GPU
or bad arguments, 130 interrupted (Ctrl-C or SIGTERM: the rows measured so far are still printed and
written).  Nothing touches CUDA at import time.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from typing import Optional, Sequence

import torch

from .cases import DTYPES
from .environment import environment, fa4_error
from .plots import safe_plot
from .report import (fmt_value, format_geomeans, format_graph_table, format_table, grid_geomeans, skipped_row,
                     write_json)
from .runner import Runner
from .suites import ALL_ORDER, SUITES, build_cases, parse_suites, shrink, trim_flex
from .timing import Timing, count_timed, timing_plan


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="attention_bench.py", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="\n\n".join(__doc__.split("\n\n")[2:]))
    p.add_argument("--suite", required=True, help=f"{', '.join(SUITES)}, all, or a comma-separated list")
    p.add_argument("--out", default=os.environ.get("OUT") or "bench_results",
                   help="output directory (default: $OUT, else ./bench_results)")
    p.add_argument("--dtype", default="bf16", choices=sorted(DTYPES), help="input dtype (default bf16)")
    p.add_argument("--warmup", type=float, default=25.0, help="do_bench warm-up, ms (default 25)")
    p.add_argument("--rep", type=float, default=100.0, help="do_bench repetition time, ms (default 100)")
    p.add_argument("--timing-budget", type=float, default=None,
                   help="seconds of do_bench time to aim for; warm-up/rep shrink to fit (default: 200 for several suites)")
    p.add_argument("--max-seconds", type=float, default=None,
                   help="stop starting new cases after this many seconds (default: 510 for several suites, else none)")
    p.add_argument("--skip", default="", help="comma-separated peers not to run, e.g. flex,fa4")
    p.add_argument("--flex-static", action="store_true",
                   help="compile FlexAttention with dynamic=False (one compile per shape; default: torch's automatic dynamic)")
    p.add_argument("--full-flex", action="store_true",
                   help="several suites: FlexAttention on every case (default: only where PERF.md has Flex anchors)")
    p.add_argument("--cudagraph", action="store_true",
                   help="decode: also time ours and cuDNN inside a CUDA graph (timing.graph_ms), in 'extra'")
    p.add_argument("--filter", default="", help="only cases whose label contains this text")
    p.add_argument("--cpu-smoke", action="store_true",
                   help="testing aid: run every case shrunk, on the CPU, with wall-clock timing (numbers meaningless)")
    args = p.parse_args(argv)
    if hasattr(sys.stdout, "reconfigure"):
        sys.stdout.reconfigure(line_buffering=True)

    try:
        suites = parse_suites(args.suite)
    except ValueError as e:
        print(f"attention_bench: {e}", file=sys.stderr)
        return 2
    dtype = DTYPES[args.dtype]
    if args.cpu_smoke:
        device = torch.device("cpu")
    else:
        if not torch.cuda.is_available():
            print("attention_bench: no CUDA GPU here (torch.cuda.is_available() is False). This benchmark times GPU "
                  "kernels against FA4, cuDNN, FA2 and FlexAttention; on a CPU use `python -m flashforge.bench` or "
                  "benchmarks/cpu_vs_sdpa.py.", file=sys.stderr)
            return 2
        if os.environ.get("TRITON_INTERPRET") == "1":
            print("attention_bench: warning: TRITON_INTERPRET=1 is set; the Triton kernels run in the interpreter",
                  file=sys.stderr)
        device = torch.device("cuda", torch.cuda.current_device())

    multi = len(suites) > 1
    tag = "all" if suites == list(ALL_ORDER) else "+".join(suites)
    cases = [c for s in suites for c in build_cases(s, dtype)]
    if multi and not args.full_flex:
        cases = trim_flex(cases)
    if args.filter:
        cases = [c for c in cases if args.filter in c.label]
    if args.cpu_smoke:
        cases = [shrink(c) for c in cases]
    budget = args.timing_budget if args.timing_budget is not None else (200.0 if multi else None)
    warmup, rep = timing_plan(count_timed(cases), args.warmup, args.rep, budget)
    max_seconds = args.max_seconds if args.max_seconds is not None else (510.0 if multi else None)
    skip = [s.strip() for s in args.skip.split(",") if s.strip()]

    t_start = time.perf_counter()
    wants_fa4 = "fa4" not in skip and any("fa4" in c.peers for c in cases)
    env = environment(device, {**vars(args), "warmup_used": warmup, "rep_used": rep}, fa4=wants_fa4)
    no_fa4 = fa4_error(env)
    print("attention_bench " + " ".join(f"{k}={env[k]}" for k in
                                        ("torch", "triton", "gpu", "cudnn", "commit", "dirty") if k in env)
          + (f" fa4={env['fa4'].get('version') if not no_fa4 else 'missing'}" if wants_fa4 else ""))
    print(f"suites: {', '.join(suites)}; {len(cases)} cases, ~{count_timed(cases)} timed runs; do_bench warmup "
          f"{warmup:g} ms, rep {rep:g} ms" + (f"; stopping new cases after {max_seconds:g} s" if max_seconds else ""))
    runner = Runner(device, Timing(warmup, rep), flex_compiled=not args.cpu_smoke,
                    flex_dynamic=False if args.flex_static else None, skip=skip, cudagraph=args.cudagraph)
    os.makedirs(args.out, exist_ok=True)
    rows: list = []
    report = {"environment": env, "rows": rows}
    combined = os.path.join(args.out, f"{tag}.json")
    interrupted = ""

    def on_term(signum, frame):  # `timeout` sends SIGTERM: still print and write what was measured
        raise KeyboardInterrupt("SIGTERM")
    old_term = signal.signal(signal.SIGTERM, on_term) if hasattr(signal, "SIGTERM") else None
    try:
        for i, case in enumerate(cases):
            elapsed = time.perf_counter() - t_start
            if interrupted or (max_seconds and elapsed > max_seconds):
                why = interrupted or f"--max-seconds {max_seconds:g} reached"
                rows.append(skipped_row(case, f"skipped: {why}", runner.unit(case)))
                continue
            t0 = time.perf_counter()
            try:
                new = runner.run_or_report(case)
            except KeyboardInterrupt as e:
                interrupted = f"interrupted ({e or 'Ctrl-C'})"
                rows.append(skipped_row(case, f"skipped: {interrupted}", runner.unit(case)))
                continue
            rows.extend(new)
            status = " ".join(f"{r['name']}: ours {fmt_value(r['ours'], r['unit'])} {r['unit']}"
                              f"{'' if r['ok'] else ' FAIL'}" for r in new)
            print(f"[{i + 1}/{len(cases)} {time.perf_counter() - t_start:5.0f}s] {case.suite} {case.pass_label}: "
                  f"{status} ({time.perf_counter() - t0:.1f} s)", file=sys.stderr, flush=True)
            write_json(combined, report)
    finally:
        if old_term is not None:
            signal.signal(signal.SIGTERM, old_term)

    written = [combined]
    for s in suites:
        sub = [r for r in rows if r["suite"] == s]
        if not sub:
            continue
        if multi:
            write_json(os.path.join(args.out, f"{s}.json"), {"environment": env, "rows": sub})
            written.append(os.path.join(args.out, f"{s}.json"))
        png = os.path.join(args.out, f"{s}.png")
        why = safe_plot(sub, png, f"{s} ({dtype}, {env.get('gpu', device)})")
        written.append(png if why is None else f"{png} not written: {why}")
    if multi:
        png = os.path.join(args.out, f"{tag}.png")
        why = safe_plot(rows, png, f"{tag}: ours / max(FA4, cuDNN) ({dtype}, {env.get('gpu', device)})")
        written.append(png if why is None else f"{png} not written: {why}")

    failed = [r for r in rows if not r["ok"]]
    skipped = [r for r in rows if r["extra"].get("skipped")]
    report["ok"] = not failed
    report["seconds"] = round(time.perf_counter() - t_start, 1)
    means = {s: grid_geomeans([r for r in rows if r["suite"] == s]) for s in suites}
    report["grid_geomeans"] = {s: m for s, m in means.items() if m}
    tables = []
    for s in suites:
        sub = [r for r in rows if r["suite"] == s]
        tables.append("\n".join(t for t in (format_table(sub, f"{s} {dtype}", no_fa4), format_geomeans(sub)) if t))
    tables.append(format_graph_table(rows))
    text = "\n\n".join(t for t in tables if t)
    write_json(combined, report)
    txt = os.path.join(args.out, f"{tag}.txt")
    with open(txt, "w") as f:
        f.write(text + "\n")
    written.append(txt)
    print()
    print(text + "\n")
    print("wrote: " + "; ".join(written))
    print(f"RESULT: {'ok' if not failed else 'FAILED'}: {len(rows)} rows, {len(failed)} failed"
          + (f", {len(skipped)} skipped ({interrupted or 'time'})" if skipped else "") + f", {report['seconds']:.0f} s")
    return 1 if failed else (130 if interrupted else 0)
