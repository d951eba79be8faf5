"""What the one-process GPU A/B scripts of this folder share (modifiers_gpu.py, fused_dq_gpu.py,
ws_fwd_gpu.py, ws_dq_gpu.py): their command line, the row loop, a row's inputs, forced tiles,
the training-step timings and rates, the agreement measure of two sets of outputs and the JSON / check at
the end."""
from __future__ import annotations

import argparse
import contextlib
import json
import os


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


def only(env: str, names):
    """The entries of `names` listed in $env (comma-separated), or all of them where it is unset:
    a subset of rows or variants for a short device call."""
    chosen = [n for n in os.environ.get(env, "").split(",") if n]
    return [n for n in names if not chosen or n in chosen]


def row_inputs(S: int, D: int, gdiv: int):
    """PERF.md's shapes (16k tokens, H * D = 2048), bf16, seeded: (B, H, q, k, v, do), k and v with
    H // gdiv heads."""
    import torch
    B, H = 16384 // S, 2048 // D
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, do = (torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(2))
    k, v = (torch.randn(B, S, H // gdiv, D, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(2))
    return B, H, q, k, v, do


@contextlib.contextmanager
def tiles(kind: str, D: int, cfg):
    """The table's entry (kind, D, 2 bytes) replaced by cfg inside the block (None: the table's own)."""
    from flashforge.ops.triton import configs
    if cfg is not None:
        configs.set_config(kind, D, 2, cfg)
    try:
        yield
    finally:
        configs.set_config(kind, D, 2, None)


def training_times(leaves, do, kw):
    """(gradients, backward ms, forward+backward ms) of flashforge.attention(*leaves, **kw) with
    output gradient do: triton.testing.do_bench medians."""
    import flashforge
    import torch
    import triton
    o = flashforge.attention(*leaves, **kw)
    grads = torch.autograd.grad(o, leaves, do, retain_graph=True)
    ms_b = triton.testing.do_bench(lambda: torch.autograd.grad(o, leaves, do, retain_graph=True),
                                   return_mode="median")

    def step():
        torch.autograd.grad(flashforge.attention(*leaves, **kw), leaves, do)

    return grads, ms_b, triton.testing.do_bench(step, return_mode="median")


def training_rates(fwd_flops: float, ms_b: float, ms_fb: float, grads, base) -> dict:
    """A variant's row entry: backward and forward+backward TFLOP/s (flash-attn's count: the
    backward 2.5 forwards) and its gradients' `rel_diff` to the base variant's."""
    return {"bwd": 2.5 * fwd_flops / ms_b / 1e9, "fwdbwd": 3.5 * fwd_flops / ms_fb / 1e9,
            "rel_diff": rel_diff(grads, base)}


def finish(rows, args, what: str, limit: float = 2e-2) -> None:
    """Write the rows to --json, then fail where a variant's rel_diff exceeds `limit` (or is NaN):
    `what` names the comparison in the message."""
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows}, f, indent=1)
    bad = [(r["row"], n) for r in rows for n, v in r["variants"].items() if not v["rel_diff"] <= limit]
    if bad:
        raise SystemExit(f"{what} disagree on: {bad}")
