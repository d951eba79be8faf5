"""Softcap and ALiBi rows, the Gluon kernels against the portable ones, in one process (sm_90).

    python benchmarks/profile/modifiers_gpu.py [--json PATH]

Why a script of its own: cuDNN takes neither modifier, and FA4 (softcap only) needs two device
calls to stage, so the compare suite has no such rows.  Each row runs twice: with the tile table
as it is (the Gluon kernels serve the call) and with the same tiles set as overrides without
gluon=True (the portable kernels).  It prints TFLOP/s (PERF.md's convention, flash-attn's FLOP
count; `flashforge.benchmark.flops`), the ratio, and the largest difference between the two
outputs and gradients (both must agree to bf16 rounding).
"""
from __future__ import annotations

import json
import math

import torch
import triton

import flashforge
from flashforge.benchmark.flops import visible_pairs
from flashforge.ops.triton import configs
from _rows import rel_diff, run_rows

ROWS = [  # (label, S, D, causal, window, softcap, alibi): 16k tokens, H * D = 2048
    ("D128 S4k causal softcap 30", 4096, 128, True, None, 30.0, False),
    ("D128 S4k causal ALiBi", 4096, 128, True, None, 0.0, True),
    ("D64 S4k softcap 50", 4096, 64, False, None, 50.0, False),
    ("D128 S16k causal window 1023 softcap 30", 16384, 128, True, 1023, 30.0, False),
    ("D256 S4k causal softcap 30", 4096, 256, True, None, 30.0, False),
]
KINDS = ("fwd", "fwd_causal", "bwd_kv", "bwd_q")


def portable(D: int, on: bool) -> None:
    """Override the table's entries of head dim D with its own portable tiles (on), or clear them."""
    for kind in KINDS:
        if on:
            cfg = configs.get_config("fwd" if kind.startswith("fwd") else kind, D, 2, False,
                                     causal=kind == "fwd_causal", arch=(9, 0))
            configs.set_config(kind, D, 2, cfg)
        else:
            configs.set_config(kind, D, 2, None)


def run_row(label, S, D, causal, window, softcap, alibi):
    B, H = 16384 // S, 2048 // D
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, do = (torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(4))
    slopes = torch.exp2(-8.0 * torch.arange(1, H + 1, device="cuda") / H) if alibi else None
    kw = dict(causal=causal, softcap=softcap, alibi_slopes=slopes, backend="triton",
              window=None if window is None else (window, -1))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    fwd_flops = 4.0 * B * H * D * visible_pairs(S, S, causal, 0, window)
    out = {"row": label}
    results = {}
    for name, on in (("gluon", False), ("portable", True)):
        portable(D, on)
        try:
            o = flashforge.attention(*leaves, **kw)
            grads = torch.autograd.grad(o, leaves, do)
            results[name] = (o.detach(), *grads)
            ms_f = triton.testing.do_bench(lambda: flashforge.attention(*leaves, **kw), return_mode="median")

            def step():
                torch.autograd.grad(flashforge.attention(*leaves, **kw), leaves, do)

            ms_fb = triton.testing.do_bench(step, return_mode="median")
        finally:
            portable(D, False)
        out[name] = {"fwd": fwd_flops / ms_f / 1e9, "fwdbwd": 3.5 * fwd_flops / ms_fb / 1e9}
    out["rel_diff"] = rel_diff(results["gluon"], results["portable"])
    return out


def main():
    rows, args = run_rows(ROWS, run_row)
    print(f"{'row':42} {'pass':8} {'gluon':>7} {'portable':>9} {'ratio':>6}  rel.diff")
    for r in rows:
        for p in ("fwd", "fwdbwd"):
            g, pt = r["gluon"][p], r["portable"][p]
            print(f"{r['row']:42} {p:8} {g:7.0f} {pt:9.0f} {g / pt:6.2f}  {r['rel_diff']:.1e}")
    geo = {p: math.exp(sum(math.log(r["gluon"][p] / r["portable"][p]) for r in rows) / len(rows))
           for p in ("fwd", "fwdbwd")}
    print(f"geomean gluon / portable: fwd {geo['fwd']:.2f}, fwd+bwd {geo['fwdbwd']:.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "geomean": geo}, f, indent=1)
    bad = [r["row"] for r in rows if r["rel_diff"] > 2e-2]
    if bad:
        raise SystemExit(f"Gluon and portable disagree on: {bad}")


if __name__ == "__main__":
    main()
