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

from flashforge.benchmark.flops import visible_pairs
from flashforge.ops.triton import configs
from _rows import finish, only, row_inputs, run_rows, tiles, training_rates, training_times

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
_LABELS = only("FF_WS_ROWS", [r[0] for r in ROWS])
ROWS = [r for r in ROWS if r[0] in _LABELS]
VARIANTS = {n: VARIANTS[n] for n in only("FF_WS_VARIANTS", VARIANTS)}


def run_row(label, S, D, causal, window, gdiv):
    B, H, q, k, v, do = row_inputs(S, D, gdiv)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    fwd_flops = 4.0 * B * H * D * visible_pairs(S, S, causal, 0, window)
    kw = dict(causal=causal, window=None if window is None else (window, -1), backend="triton")
    out = {"row": label, "variants": {}}
    grads = {}
    for name, cfg in [("table", None)] + list(VARIANTS.items()):
        with tiles("bwd_q", D, cfg):
            grads[name], ms_b, ms_fb = training_times(leaves, do, kw)
        out["variants"][name] = training_rates(fwd_flops, ms_b, ms_fb, grads[name], grads["table"])
    return out


def main():
    rows, args = run_rows(ROWS, run_row)
    print(f"\n{'row (TFLOP/s bwd / fwd+bwd, ratio to table)':30}")
    for r in rows:
        base = r["variants"]["table"]
        cells = [f"{n} {v['bwd']:.0f} ({v['bwd'] / base['bwd']:4.2f}) / {v['fwdbwd']:.0f} "
                 f"({v['fwdbwd'] / base['fwdbwd']:4.2f})" for n, v in r["variants"].items()]
        print(f"{r['row']:26}" + " | ".join(cells))
    finish(rows, args, "gradients and the table's backward's")


if __name__ == "__main__":
    main()
