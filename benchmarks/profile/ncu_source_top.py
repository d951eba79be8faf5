"""Summarize ncu's per-instruction (SASS) counters of one kernel launch: the instructions that
collect the most stall samples and the most excess shared-memory wavefronts (bank conflicts),
so a kernel's hot spots can be read without carrying the whole report back.

    ncu --section SourceCounters --section WarpStateStats -k regex:halfdq --launch-skip 4 \
        --launch-count 1 -o rep python benchmarks/profile/step_kernels.py --plain 2 "D128 S4096 causal"
    ncu --import rep.ncu-rep --page source --csv --print-source sass > sass.csv
    python benchmarks/profile/ncu_source_top.py sass.csv [--top 25]
    python benchmarks/profile/ncu_source_top.py sass.csv --listing 300   # in address order: every
        instruction with >= 300 stall samples, its offset and its two main stall reasons

Column names differ between ncu versions, so they are matched by substring.
"""
from __future__ import annotations

import argparse
import csv
import sys


def _num(x: str) -> float:
    try:
        return float(x.replace(",", ""))
    except ValueError:
        return 0.0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("csv")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--listing", type=float, default=None, metavar="MIN_SAMPLES",
                    help="instead: the kernel in address order, instructions with at least this many samples")
    args = ap.parse_args()
    with open(args.csv, newline="") as f:
        lines = [ln for ln in f if ln.count(",") > 3]  # ncu prints a banner before the table
    rows = list(csv.reader(lines))
    if not rows:
        sys.exit(f"{args.csv}: no table")
    head, body = rows[0], rows[1:]
    print("columns:", " | ".join(head))

    def col(*keys):
        for i, h in enumerate(head):
            if all(k.lower() in h.lower() for k in keys):
                return i
        return None

    def exact(name):
        return next((i for i, h in enumerate(head) if h.strip().lower() == name), None)

    src = col("source")
    addr = col("address")
    want = {
        "stall(all)": col("warp stall sampling", "all"),
        "stall(not issued)": col("warp stall sampling", "not"),
        "smem excess": col("wavefronts shared excessive"),
        "smem wavefronts": exact("l1 wavefronts shared"),  # (by substring it would be the excess column)
        "smem ideal": col("wavefronts shared ideal"),
        "executed": exact("instructions executed"),
    }
    want = {k: v for k, v in want.items() if v is not None}
    print("using:", {k: head[v] for k, v in want.items()})
    if args.listing is not None and addr is not None and "stall(all)" in want:
        _listing(head, body, addr, src, want["stall(all)"], want.get("executed"), args.listing)
        return
    total = {k: sum(_num(r[v]) for r in body if len(r) > v) for k, v in want.items()}
    print("totals:", {k: f"{v:.4g}" for k, v in total.items()})
    for key in ("stall(all)", "smem excess"):
        if key not in want:
            continue
        i = want[key]
        ranked = sorted((r for r in body if len(r) > i), key=lambda r: -_num(r[i]))[: args.top]
        print(f"\n== top {args.top} by {key} ==")
        for r in ranked:
            vals = " ".join(f"{k}={_num(r[v]):.4g}" for k, v in want.items())
            print(f"{r[addr] if addr is not None else '':>8} {vals}  {r[src][:90] if src is not None else ''}")


def _listing(head, body, addr, src, stall, executed, least):
    """Offsets from the kernel's first instruction, so a loop's stalls read in program order."""
    reasons = [i for i, h in enumerate(head) if h.startswith("stall_") and "Not Issued" not in h]
    base = int(body[0][addr], 16)
    total = sum(_num(r[stall]) for r in body) or 1.0
    for r in body:
        n = _num(r[stall])
        if n < least:
            continue
        top = sorted(((_num(r[i]), head[i][len("stall_"):]) for i in reasons), reverse=True)[:2]
        ex = f"ex={_num(r[executed]):9.0f} " if executed is not None else ""
        why = " ".join(f"{name}:{v:.0f}" for v, name in top)
        print(f"{int(r[addr], 16) - base:6x} {ex}samples={n:7.0f} {100 * n / total:5.1f}%  {why:<34} "
              f"{r[src].strip()[:80] if src is not None else ''}")


if __name__ == "__main__":
    main()
