"""Decoding tiles and split counts, timed in CUDA graphs (GPU): the sweep behind the table's
"fwd_decode" entry and `auto_splits` (benchmarks/RESULTS.md v0.7.2).  A diagnostic, not a benchmark.

    PYTHONPATH=. python benchmarks/tune/decode_sweep.py [--max-seconds 380] [--out DIR]

For each KV-cache shape (bf16, GQA 32/8, D = 128, one query) it times cuDNN, the table's own
choice, a kernel that only reads the same K and V bytes (the floor: flashforge/benchmark/
read_floor.py), and each candidate TileConfig x split count, set through
`set_config("fwd_causal", 128, 2, ...)` (an override beats the "fwd_decode" entry).  Every
candidate's output is compared with the table's (relative error < 2e-2, else "wrong").  Each
time is the median of replays of 20 calls captured in a graph, each after a 256 MB L2 flush,
less the flushes' own graph.  Prints the best few per shape; writes DIR/decode_sweep.json.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

SHAPES = ((1, 4096), (1, 32768), (4, 4096), (1, 131072), (4, 32768), (32, 4096))
HQ, HKV, D = 32, 8, 128
# (block_m, block_n, num_warps, num_stages), each with and without TMA
CANDIDATES = ((64, 64, 4, 3), (16, 64, 4, 3), (16, 64, 4, 4), (16, 128, 4, 2), (16, 128, 4, 3), (64, 64, 4, 4),
              (64, 128, 4, 2), (64, 128, 8, 2), (16, 64, 2, 3), (16, 64, 4, 5), (64, 64, 4, 2), (16, 32, 4, 4))
SPLITS = (None, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128)


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--max-seconds", type=float, default=380.0)
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("decode_sweep: needs a CUDA GPU")
        return 2
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import flashforge
    from flashforge.ops import replay
    from flashforge.ops.triton.configs import TileConfig, set_config
    from flashforge.benchmark.read_floor import readers
    from flashforge.benchmark.timing import graph_ms

    t0, dev = time.time(), torch.device("cuda")

    def graph_us(fn):
        return graph_ms(fn, dev) * 1e3
    rows, data = [], {}

    def gbps(B, L, us):
        return 2 * B * L * HKV * D * 2 / us / 1e3

    for B, L in SHAPES:
        q = torch.randn(B, 1, HQ, D, device=dev, dtype=torch.bfloat16)
        k = torch.randn(B, L, HKV, D, device=dev, dtype=torch.bfloat16)
        v = torch.randn_like(k)
        lens = torch.full((B,), L, dtype=torch.int32, device=dev)
        us = min(graph_us(fn) for fn in readers(k, v))
        rows.append(dict(kind="read", B=B, L=L, us=us, gbps=gbps(B, L, us)))
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            us = graph_us(lambda: F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                                                 v.transpose(1, 2), enable_gqa=True))
        rows.append(dict(kind="cudnn", B=B, L=L, us=us, gbps=gbps(B, L, us)))
        ref = flashforge.attention_with_kvcache(q, k, v, cache_seqlens=lens).float()
        us = graph_us(lambda: flashforge.attention_with_kvcache(q, k, v, cache_seqlens=lens))
        rows.append(dict(kind="table", B=B, L=L, us=us, gbps=gbps(B, L, us)))
        data[(B, L)] = (q, k, v, lens, ref)
        read, cudnn, table = (r["gbps"] for r in rows[-3:])
        print(f"B={B} L={L}: read {read:.0f} cuDNN {cudnn:.0f} table {table:.0f} GB/s", flush=True)
    try:
        for cand in CANDIDATES:
            for tma in (True, False):
                if time.time() - t0 > args.max_seconds:
                    break
                cfg = (*cand, tma)
                set_config("fwd_causal", 128, 2, TileConfig(*cand, tma=tma))
                replay.clear()
                for (B, L), (q, k, v, lens, ref) in data.items():
                    for s in SPLITS:
                        if s is not None and (s * cand[1] > L or (B >= 32 and s > 4)):
                            continue
                        try:
                            o = flashforge.attention_with_kvcache(q, k, v, cache_seqlens=lens, num_splits=s)
                            err = ((o.float() - ref).norm() / ref.norm()).item()
                            us = graph_us(lambda: flashforge.attention_with_kvcache(q, k, v, cache_seqlens=lens,
                                                                                    num_splits=s))
                            rows.append(dict(kind="candidate", cfg=cfg, B=B, L=L, splits=s, us=us,
                                             gbps=gbps(B, L, us), err=err))
                        except Exception as e:  # noqa: BLE001 -- out of resources: skipped with its error
                            rows.append(dict(kind="failed", cfg=cfg, B=B, L=L, splits=s, error=str(e)[:200]))
                            break
                print(f"{cfg} done at {time.time() - t0:.0f} s", flush=True)
    finally:
        set_config("fwd_causal", 128, 2, None)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "decode_sweep.json"), "w") as f:
        json.dump(rows, f)
    print("\nbest per shape (GB/s; cfg = block_m, block_n, warps, stages, tma; splits None = auto)")
    for B, L in SHAPES:
        ref = {r["kind"]: r["gbps"] for r in rows
               if r["B"] == B and r["L"] == L and r["kind"] in ("read", "cudnn", "table")}
        good = sorted((r for r in rows if r["kind"] == "candidate" and r["B"] == B and r["L"] == L and r["err"] < 2e-2),
                      key=lambda r: -r["gbps"])[:3]
        print(f"B={B} L={L}: read {ref['read']:.0f} cuDNN {ref['cudnn']:.0f} table {ref['table']:.0f} | "
              + "; ".join(f"{r['cfg']} x{r['splits']} {r['gbps']:.0f}" for r in good))
    wrong = [r for r in rows if r["kind"] == "candidate" and r["err"] >= 2e-2]
    print(f"wrong: {len(wrong)}; failed: {sum(r['kind'] == 'failed' for r in rows)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
