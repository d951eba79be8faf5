"""The warp-specialized dQ kernel (ops/gluon/attention_bwd_dq_ws_sm90.py: a loader warp, two
64-row consumers sharing each K/V tile) against the table's dQ kernel, in one process (sm_90).

    PYTHONPATH=. python benchmarks/profile/ws_dq_gpu.py [--json PATH]

Each row runs the backward alone and a training step (forward + backward), bf16, PERF.md's shapes
(16k tokens, H * D = 2048), with the table's dQ tiles and with each variant below (forced with
`configs.set_config("bwd_q", ...)`; the dK/dV kernel keeps the table's).  It prints TFLOP/s
(flash-attn's FLOP count), the ratio to the table's, and the largest difference between the two
runs' gradients relative to their largest entry.
"""
from __future__ import annotations

import json
import os

import torch
import triton

import flashforge
from flashforge.benchmark.flops import visible_pairs
from flashforge.ops.triton import configs
from _rows import rel_diff, run_rows

TC = configs.TileConfig
# (label, S, D, causal, window, Hkv divisor)
ROWS = [(f"D{D} S{S // 1024}k{' causal' if c else ''}", S, D, c, None, 1)
        for D in (64, 128) for S in (1024, 4096, 16384) for c in (False, True)] + [
    ("D128 S4k GQA 32/8 causal", 4096, 128, True, None, 4),
]
WS = dict(block_m=128, block_n=64, num_warps=4, gluon=True, consumers=2)
VARIANTS = {"ws s2": TC(num_stages=2, **WS), "ws s2 pp": TC(num_stages=2, pingpong=True, **WS),
            "ws s3 pp": TC(num_stages=3, pingpong=True, **WS)}
# FF_WS_ROWS / FF_WS_VARIANTS: comma-separated subsets of the labels / variant names (default all)
_ROWS = [r for r in os.environ.get("FF_WS_ROWS", "").split(",") if r]
_VARIANTS = [v for v in os.environ.get("FF_WS_VARIANTS", "").split(",") if v]
ROWS = [r for r in ROWS if not _ROWS or r[0] in _ROWS]
VARIANTS = {n: c for n, c in VARIANTS.items() if not _VARIANTS or n in _VARIANTS}


def run_row(label, S, D, causal, window, gdiv):
    B, H = 16384 // S, 2048 // D
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, do = (torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(2))
    k, v = (torch.randn(B, S, H // gdiv, D, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(2))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    fwd_flops = 4.0 * B * H * D * visible_pairs(S, S, causal, 0, window)
    kw = dict(causal=causal, window=None if window is None else (window, -1), backend="triton")
    out = {"row": label, "variants": {}}
    grads = {}
    for name, cfg in [("table", None)] + list(VARIANTS.items()):
        if cfg is not None:
            configs.set_config("bwd_q", D, 2, cfg)
        try:
            o = flashforge.attention(*leaves, **kw)
            grads[name] = torch.autograd.grad(o, leaves, do, retain_graph=True)
            ms_b = triton.testing.do_bench(lambda: torch.autograd.grad(o, leaves, do, retain_graph=True),
                                           return_mode="median")

            def step():
                torch.autograd.grad(flashforge.attention(*leaves, **kw), leaves, do)

            ms_fb = triton.testing.do_bench(step, return_mode="median")
        finally:
            configs.set_config("bwd_q", D, 2, None)
        out["variants"][name] = {"bwd": 2.5 * fwd_flops / ms_b / 1e9, "fwdbwd": 3.5 * fwd_flops / ms_fb / 1e9,
                                 "rel_diff": rel_diff(grads[name], grads["table"])}
    return out


def main():
    rows, args = run_rows(ROWS, run_row)
    print(f"\n{'row (TFLOP/s bwd / fwd+bwd, ratio to table)':30}")
    for r in rows:
        base = r["variants"]["table"]
        cells = [f"{n} {v['bwd']:.0f} ({v['bwd'] / base['bwd']:4.2f}) / {v['fwdbwd']:.0f} "
                 f"({v['fwdbwd'] / base['fwdbwd']:4.2f})" for n, v in r["variants"].items()]
        print(f"{r['row']:26}" + " | ".join(cells))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows}, f, indent=1)
    bad = [(r["row"], n) for r in rows for n, v in r["variants"].items() if not v["rel_diff"] <= 2e-2]
    if bad:
        raise SystemExit(f"gradients disagree with the table's backward on: {bad}")


if __name__ == "__main__":
    main()
