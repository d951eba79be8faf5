"""The benchmark's command line: argument parsing and main (its --help text is the package doc)."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from typing import Optional, Sequence

import torch

from . import __doc__ as PACKAGE_DOC
from .cases import ALL_ORDER, DTYPES, SUITES, build_cases, parse_suites, shrink, trim_flex
from .plots import _safe_plot
from .report import (_fmt_value, _short_error, environment, format_graph_table, format_table, make_row, skipped_row,
                     write_json)
from .runner import Runner, count_timed, timing_plan


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="attention_bench.py", description=PACKAGE_DOC.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="\n\n".join(PACKAGE_DOC.split("\n\n")[2:]))
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
    p.add_argument("--skip", default="", help="comma-separated peers not to run, e.g. flex")
    p.add_argument("--flex-static", action="store_true",
                   help="compile FlexAttention with dynamic=False (one compile per shape; default: torch's automatic dynamic)")
    p.add_argument("--full-flex", action="store_true",
                   help="several suites: FlexAttention on every case (default: only where PERF.md has Flex anchors)")
    p.add_argument("--cudagraph", action="store_true",
                   help="decode: also time ours and cuDNN inside a CUDA graph (do_bench_cudagraph), in 'extra'")
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
                  "kernels against cuDNN, FA2 and FlexAttention; on a CPU use `python -m flashforge.bench` or "
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
    env = environment(device, {**vars(args), "warmup_used": warmup, "rep_used": rep})
    print("attention_bench " + " ".join(f"{k}={env[k]}" for k in
                                        ("torch", "triton", "gpu", "cudnn", "commit", "dirty") if k in env))
    print(f"suites: {', '.join(suites)}; {len(cases)} cases, ~{count_timed(cases)} timed runs; do_bench warmup "
          f"{warmup:g} ms, rep {rep:g} ms" + (f"; stopping new cases after {max_seconds:g} s" if max_seconds else ""))
    runner = Runner(device, warmup, rep, flex_compiled=not args.cpu_smoke,
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
                rows.append(skipped_row(case, f"skipped: {why}"))
                continue
            t0 = time.perf_counter()
            try:
                new = runner.run_case(case)
            except KeyboardInterrupt as e:
                interrupted = f"interrupted ({e or 'Ctrl-C'})"
                rows.append(skipped_row(case, f"skipped: {interrupted}"))
                continue
            except Exception as e:  # a harness bug or a dead CUDA context: report the case, go on
                new = [make_row(case, None, {n: None for n in case.peers}, ok=False,
                                error="harness: " + _short_error(e))]
                runner._cleanup()
            rows.extend(new)
            status = " ".join(f"{r['name']}: ours {_fmt_value(r['ours'], r['unit'])} {r['unit']}"
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
        why = _safe_plot(sub, png, f"{s} ({dtype}, {env.get('gpu', device)})")
        written.append(png if why is None else f"{png} not written: {why}")
    if multi:
        png = os.path.join(args.out, f"{tag}.png")
        why = _safe_plot(rows, png, f"{tag}: ours / cuDNN ({dtype}, {env.get('gpu', device)})")
        written.append(png if why is None else f"{png} not written: {why}")

    failed = [r for r in rows if not r["ok"]]
    skipped = [r for r in rows if r["extra"].get("skipped")]
    report["ok"] = not failed
    report["seconds"] = round(time.perf_counter() - t_start, 1)
    write_json(combined, report)
    tables = [format_table([r for r in rows if r["suite"] == s], f"{s} {dtype}") for s in suites]
    tables.append(format_graph_table(rows))
    text = "\n\n".join(t for t in tables if t)
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
