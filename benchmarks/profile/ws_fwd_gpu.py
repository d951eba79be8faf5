"""The warp-specialized Gluon forward (ops/gluon/attention_fwd_ws_sm90.py: a loader warp, two
consumer warpgroups sharing each K/V tile) against the table's forward, in one process (sm_90).

    PYTHONPATH=. python benchmarks/profile/ws_fwd_gpu.py [--json PATH]

Each row runs the forward alone, bf16, PERF.md's shapes (16k tokens, H * D = 2048), once with the
table's tiles and once per variant below (forced with `configs.set_config`).  It prints TFLOP/s
(flash-attn's FLOP count), the ratio to the table's, and the largest difference between the two
outputs relative to their largest entry.
"""
from __future__ import annotations

from dataclasses import replace

import triton

import flashforge
from flashforge.benchmark.flops import visible_pairs
from flashforge.ops.triton import configs
from _rows import finish, only, rel_diff, row_inputs, run_rows, tiles

TC = configs.TileConfig
# (label, S, D, causal, window, Hkv divisor)
ROWS = [(f"D{D} S{S // 1024}k{' causal' if c else ''}", S, D, c, None, 1)
        for D in (64, 128) for S in (1024, 4096, 16384) for c in (False, True)] + [
    ("D128 S4k GQA 32/8 causal", 4096, 128, True, None, 4),
    ("D128 S16k causal window 1023", 16384, 128, True, 1023, 1),
] + [(f"D256 S{S // 1024}k{' causal' if c else ''}", S, 256, c, None, 1) for S in (4096, 16384) for c in (False, True)]
WS = dict(block_m=128, num_warps=4, gluon=True, consumers=2)
WS3 = dict(block_m=192, num_warps=4, gluon=True, consumers=3)
VARIANTS = {
    # poly1 / poly2: the table's one-warpgroup tiles with half / all of the interior tiles'
    # exponentials on the FMA pipes (`rounding.exp2_split`; the table's own tiles, causal or not)
    # ws3: three consumers, 192 rows a program (FA4's D = 64 tiles are 192 x 128)
    64: {"poly1": dict(poly_exp2=1), "poly2": dict(poly_exp2=2),
         "ws3 n64 s3": TC(block_n=64, num_stages=3, **WS3),
         "ws3 n64 s4": TC(block_n=64, num_stages=4, **WS3),
         "ws3 n128 s2": TC(block_n=128, num_stages=2, **WS3),
         "ws3 n64 s3 poly1": TC(block_n=64, num_stages=3, poly_exp2=1, **WS3),
         "ws n128 s2": TC(block_n=128, num_stages=2, **WS),
         "ws n128 s2 pp": TC(block_n=128, num_stages=2, pingpong=True, **WS),
         "ws n128 s4 pp": TC(block_n=128, num_stages=4, pingpong=True, **WS),
         "ws n64 s4 pp": TC(block_n=64, num_stages=4, pingpong=True, **WS)},
    128: {"1wg 64x128 v1": TC(64, 128, 4, 2, gluon=True, v_stages=1),  # the table's before v0.9.0
          "ws n128 s2": TC(block_n=128, num_stages=2, **WS),
          "ws n128 s2 pp": TC(block_n=128, num_stages=2, pingpong=True, **WS),
          "ws n128 s3v2 pp": TC(block_n=128, num_stages=3, v_stages=2, pingpong=True, **WS),
          "ws n64 s4 pp": TC(block_n=64, num_stages=4, pingpong=True, **WS)},
    256: {"ws n64 s2": TC(block_n=64, num_stages=2, **WS),
          "ws n64 s2 pp": TC(block_n=64, num_stages=2, pingpong=True, **WS),
          "ws n64 s2v1 pp": TC(block_n=64, num_stages=2, v_stages=1, pingpong=True, **WS),
          "ws n32 s3 pp": TC(block_n=32, num_stages=3, pingpong=True, **WS)},
}
# FF_WS_ROWS: a comma-separated subset of the labels (default all)
_LABELS = only("FF_WS_ROWS", [r[0] for r in ROWS])
ROWS = [r for r in ROWS if r[0] in _LABELS]
# FF_WS_VARIANTS: likewise a subset of the variants' names
_VARIANTS = set(only("FF_WS_VARIANTS", sorted({n for v in VARIANTS.values() for n in v})))


def run_row(label, S, D, causal, window, gdiv):
    B, H, q, k, v, _ = row_inputs(S, D, gdiv)
    flops = 4.0 * B * H * D * visible_pairs(S, S, causal, 0, window)
    kw = dict(causal=causal, window=None if window is None else (window, -1), backend="triton")
    out = {"row": label, "variants": {}}
    ref = None
    for name, cfg in [("table", None)] + [(n, c) for n, c in VARIANTS[D].items() if n in _VARIANTS]:
        if isinstance(cfg, dict):  # fields changed in the table's own Gluon tiles
            cfg = replace(configs.gluon_config(D, 2, causal, (9, 0)), **cfg)
        with tiles("fwd_causal" if causal else "fwd", D, cfg):
            o = flashforge.attention(q, k, v, **kw)
            ms = triton.testing.do_bench(lambda: flashforge.attention(q, k, v, **kw), return_mode="median")
        ref = o if ref is None else ref
        out["variants"][name] = {"fwd": flops / ms / 1e9, "rel_diff": rel_diff([o], [ref])}
    return out


def main():
    rows, args = run_rows(ROWS, run_row)
    print(f"\n{'row (fwd TFLOP/s, ratio to table)':30}")
    for r in rows:
        base = r["variants"]["table"]["fwd"]
        cells = [f"{n} {v['fwd']:.0f} ({v['fwd'] / base:4.2f})" for n, v in r["variants"].items()]
        print(f"{r['row']:30}" + " | ".join(cells))
    finish(rows, args, "outputs and the table's forward's")


if __name__ == "__main__":
    main()
