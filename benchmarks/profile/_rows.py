"""What the one-process GPU A/B scripts of this folder share (modifiers_gpu.py, fused_dq_gpu.py):
their command line, the row loop and the agreement measure of two sets of outputs."""
from __future__ import annotations

import argparse
import json


def rel_diff(ours, theirs) -> float:
    """Largest |a - b| / max |b| over pairs of tensors (outputs, gradients): how far two kernels'
    results are apart, relative to each tensor's largest entry."""
    return max(((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-6)).item()
               for a, b in zip(ours, theirs))


def run_rows(rows, run_row) -> tuple[list, argparse.Namespace]:
    """Parse --json, run `run_row(*row)` for each row and print each result as a JSON line as it
    lands (a device call may end before the table is printed); returns (results, args)."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args()
    out = []
    for r in rows:
        out.append(run_row(*r))
        print(json.dumps(out[-1]), flush=True)
    return out, args
