"""The Gluon backward with dQ inside the dK/dV kernel (TMA reduce-add) against the ordered pair of
kernels (dK/dV, then dQ), in one process (sm_90).

    PYTHONPATH=. python benchmarks/profile/fused_dq_gpu.py [--json PATH]

FF_FUSED_ROWS / FF_FUSED_VARIANTS (comma-separated labels) pick a subset for a short device call.

Each row runs a training step (forward + backward) and the backward alone, bf16, PERF.md's
shapes (16k tokens, H * D = 2048), twice with the same dK/dV tiles: deterministic=True (the
ordered kernels: 7 products per tile pair, dQ's scores recomputed) and deterministic=False
(fused: 5 products, dQ added in float32 by the copy engine's reduce).  It prints TFLOP/s (flash-attn's FLOP
count: `flashforge.benchmark.flops`), the ratio, and the largest difference between the two
runs' gradients relative to their largest entry.
"""
from __future__ import annotations

from flashforge.benchmark.flops import visible_pairs
from flashforge.ops.triton import configs
from _rows import finish, only, row_inputs, run_rows, tiles, training_rates, training_times

TC = configs.TileConfig
# (label, S, D, causal, window, Hkv divisor)
ROWS = [
    ("D64 S1k causal", 1024, 64, True, None, 1),
    ("D64 S4k", 4096, 64, False, None, 1),
    ("D64 S4k causal", 4096, 64, True, None, 1),
    ("D64 S16k causal", 16384, 64, True, None, 1),
    ("D64 S4k causal GQA 4", 4096, 64, True, None, 4),
    ("D128 S1k causal", 1024, 128, True, None, 1),
    ("D128 S4k causal", 4096, 128, True, None, 1),
    ("D128 S16k causal", 16384, 128, True, None, 1),
    ("D128 S16k", 16384, 128, False, None, 1),
    ("D64 S16k", 16384, 64, False, None, 1),
    ("D64 S8k causal", 8192, 64, True, None, 1),
    ("D128 S8k", 8192, 128, False, None, 1),
    ("D128 S4k causal GQA 4", 4096, 128, True, None, 4),
    ("D128 S16k causal GQA 4", 16384, 128, True, None, 4),
    ("D128 S16k causal window 1023", 16384, 128, True, 1023, 1),
    ("D64 S1k", 1024, 64, False, None, 1),
    ("D128 S1k", 1024, 128, False, None, 1),
    ("D64 S2k", 2048, 64, False, None, 1),
    ("D64 S2k causal", 2048, 64, True, None, 1),
    ("D128 S2k", 2048, 128, False, None, 1),
    ("D128 S2k causal", 2048, 128, True, None, 1),
    ("D256 S1k", 1024, 256, False, None, 1),
    ("D256 S2k", 2048, 256, False, None, 1),
    ("D256 S4k", 4096, 256, False, None, 1),
    ("D256 S4k causal", 4096, 256, True, None, 1),
    ("D256 S16k", 16384, 256, False, None, 1),
    ("D256 S16k causal", 16384, 256, True, None, 1),
]
# the fused dK/dV tiles tried per head dim (name -> config); "ordered" is the table's pair of
# kernels with deterministic=True
VARIANTS = {
    64: {"ws 2x64 keys s2": TC(64, 128, 4, 2, gluon=True, consumers=2, fused_dq=True),
         "ws 2x64 keys s3": TC(64, 128, 4, 3, gluon=True, consumers=2, fused_dq=True),
         "ws shared dq s2": TC(64, 128, 4, 2, gluon=True, consumers=2, fused_dq=True, shared_dq=True),
         "ws shared dq s3": TC(64, 128, 4, 3, gluon=True, consumers=2, fused_dq=True, shared_dq=True),
         "ws rs s2": TC(64, 128, 4, 2, gluon=True, consumers=2, fused_dq=True, rs=True),
         "ws shared rs s2": TC(64, 128, 4, 2, gluon=True, consumers=2, fused_dq=True, shared_dq=True, rs=True),
         "halfdq s2": TC(128, 128, 4, 2, gluon=True, consumers=2, fused_dq=True, half_dq=True),
         "halfdq s3": TC(128, 128, 4, 3, gluon=True, consumers=2, fused_dq=True, half_dq=True),
         "halfdq lockstep s2": TC(128, 128, 4, 2, gluon=True, consumers=2, fused_dq=True, half_dq=True, overlap=False),
         "64x64 4w overlap s3": TC(64, 64, 4, 3, gluon=True, fused_dq=True),
         "64x128 8w overlap s2": TC(64, 128, 8, 2, gluon=True, fused_dq=True),
         "64x64 4w one-at-a-time s3": TC(64, 64, 4, 3, gluon=True, overlap=False, fused_dq=True),
         "64x128 8w one-at-a-time s3": TC(64, 128, 8, 3, gluon=True, overlap=False, fused_dq=True)},
    128: {"ws 2x64 keys s2": TC(64, 128, 4, 2, gluon=True, consumers=2, fused_dq=True),
          "ws shared dq s2": TC(64, 128, 4, 2, gluon=True, consumers=2, fused_dq=True, shared_dq=True),
          "halfdq s2": TC(64, 128, 4, 2, gluon=True, consumers=2, fused_dq=True, half_dq=True),
          "halfdq s3": TC(64, 128, 4, 3, gluon=True, consumers=2, fused_dq=True, half_dq=True),
          "halfdq lockstep s2": TC(64, 128, 4, 2, gluon=True, consumers=2, fused_dq=True, half_dq=True, overlap=False),
          "64x64 4w one-at-a-time s2": TC(64, 64, 4, 2, gluon=True, overlap=False, fused_dq=True),
          "64x128 8w one-at-a-time s2": TC(64, 128, 8, 2, gluon=True, overlap=False, fused_dq=True)},
    # the wide kernel: two consumers share 64 keys, each half of the head dim (one Q / dO slot)
    256: {"wide": TC(64, 64, 4, 1, gluon=True, consumers=2, fused_dq=True, half_dq=True)},
}


def run_row(label, S, D, causal, window, gdiv):
    B, H, q, k, v, do = row_inputs(S, D, gdiv)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    fwd_flops = 4.0 * B * H * D * visible_pairs(S, S, causal, 0, window)
    out = {"row": label, "variants": {}}
    grads = {}
    chosen = {n: VARIANTS[D][n] for n in only("FF_FUSED_VARIANTS", VARIANTS[D])}
    for name, kv in [("ordered", None)] + list(chosen.items()):
        kw = dict(causal=causal, window=None if window is None else (window, -1), backend="triton",
                  deterministic=kv is None)
        with tiles("bwd_kv", D, kv):
            grads[name], ms_b, ms_fb = training_times(leaves, do, kw)
        out["variants"][name] = training_rates(fwd_flops, ms_b, ms_fb, grads[name], grads["ordered"])
    return out


def main():
    rows, args = run_rows([r for r in ROWS if r[0] in only("FF_FUSED_ROWS", [x[0] for x in ROWS])], run_row)
    print(f"{'row':18} {'variant':28} {'bwd':>5} {'ratio':>6} {'fwdbwd':>7} {'ratio':>6}  rel.diff")
    for r in rows:
        base = r["variants"]["ordered"]
        for name, v in r["variants"].items():
            print(f"{r['row']:18} {name:28} {v['bwd']:5.0f} {v['bwd'] / base['bwd']:6.2f} {v['fwdbwd']:7.0f} "
                  f"{v['fwdbwd'] / base['fwdbwd']:6.2f}  {v['rel_diff']:.1e}")
    finish(rows, args, "fused and ordered gradients")


if __name__ == "__main__":
    main()
