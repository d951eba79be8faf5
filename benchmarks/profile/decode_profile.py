"""Where a decoding step's time goes (GPU): host time per call, do_bench time, and the
kernels' own time from the profiler, for contiguous and paged caches and several
split-KV factors.  A diagnostic for benchmarks/RESULTS.md, not a benchmark.

    PYTHONPATH=. python benchmarks/profile/decode_profile.py [--shapes 1:4096,1:32768,...] [--splits auto,1,8,32]
"""
from __future__ import annotations

import argparse
import sys
import time

import torch


def kernel_us(fn, reps: int = 20) -> dict:
    """Mean CUDA time per call of each kernel name (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    out = {}
    for e in prof.key_averages():
        if e.device_type.name == "CUDA" and e.count:
            t = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0.0)
            out[e.key[:40]] = t / reps
    return out


def host_us(fn, reps: int = 200) -> float:
    fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    host = (time.perf_counter() - t) / reps * 1e6
    torch.cuda.synchronize()
    return host


def host_profile() -> int:
    """cProfile of the Python side: a decoding step, and a 1k forward and backward."""
    import cProfile
    import pstats
    import flashforge
    dev = torch.device("cuda")
    q = torch.randn(1, 1, 32, 128, device=dev, dtype=torch.bfloat16)
    k = torch.randn(1, 4096, 8, 128, device=dev, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    seqlens = torch.full((1,), 4096, dtype=torch.int32, device=dev)
    qq, kk, vv = (torch.randn(16, 1024, 16, 128, device=dev, dtype=torch.bfloat16, requires_grad=True)
                  for _ in range(3))
    do = torch.randn_like(qq)
    cases = {
        "decode": lambda: flashforge.attention_with_kvcache(q, k, v, cache_seqlens=seqlens),
        "fwd 1k": lambda: flashforge.attention(qq.detach(), kk.detach(), vv.detach()),
        "fwd+bwd 1k": lambda: torch.autograd.grad(flashforge.attention(qq, kk, vv), (qq, kk, vv), do),
    }
    for name, fn in cases.items():
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        print(f"== {name}: host {host_us(fn, 50):.1f} us per call")
        pr = cProfile.Profile()
        pr.enable()
        for _ in range(50):
            fn()
        pr.disable()
        torch.cuda.synchronize()
        pstats.Stats(pr).sort_stats("tottime").print_stats(18)
    return 0


def main(argv=None) -> int:
    import triton
    import flashforge
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", default="1:4096,1:32768,1:131072,4:4096,4:32768,4:131072,32:4096,32:32768")
    p.add_argument("--splits", default="auto,1,4,16,32,64")
    p.add_argument("--page", type=int, default=256)
    p.add_argument("--cprofile", action="store_true", help="only profile the host side of a few calls")
    args = p.parse_args(argv)
    if args.cprofile:
        return host_profile()
    Hq, Hkv, D = 32, 8, 128
    dev = torch.device("cuda")
    print(f"{'B':>4} {'L':>7} {'layout':>6} {'splits':>6} {'host us':>8} {'bench us':>9} {'kernels us':>10}  GB/s  kernels")
    for item in args.shapes.split(","):
        B, L = map(int, item.split(":"))
        q = torch.randn(B, 1, Hq, D, device=dev, dtype=torch.bfloat16)
        k = torch.randn(B, L, Hkv, D, device=dev, dtype=torch.bfloat16)
        v = torch.randn_like(k)
        nb = B * L // args.page
        perm = torch.randperm(nb, device=dev)
        kp = torch.empty(nb, args.page, Hkv, D, device=dev, dtype=k.dtype)
        vp = torch.empty_like(kp)
        kp[perm] = k.reshape(nb, args.page, Hkv, D)
        vp[perm] = v.reshape(nb, args.page, Hkv, D)
        table = perm.view(B, L // args.page).to(torch.int32)
        seqlens = torch.full((B,), L, dtype=torch.int32, device=dev)
        gbytes = 2 * B * L * Hkv * D * 2 / 1e9
        ref = flashforge.attention_with_kvcache(q, k, v, cache_seqlens=seqlens, num_splits=1).float()
        for layout in ("contig", "paged"):
            for s in args.splits.split(","):
                ns = None if s == "auto" else int(s)
                if layout == "contig":
                    def fn():
                        return flashforge.attention_with_kvcache(q, k, v, cache_seqlens=seqlens, num_splits=ns)
                else:
                    def fn():
                        return flashforge.attention_with_kvcache(q, kp, vp, cache_seqlens=seqlens, block_table=table,
                                                                 num_splits=ns)
                err = (fn().float() - ref).abs().max().item()
                h = host_us(fn)
                b = triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median") * 1e3
                ks = kernel_us(fn)
                kt = sum(ks.values())
                names = " ".join(f"{n.split('(')[0][:22]}={t:.1f}" for n, t in ks.items())
                print(f"{B:>4} {L:>7} {layout:>6} {s:>6} {h:8.1f} {b:9.1f} {kt:10.1f} {gbytes / (kt * 1e-6):6.0f}  "
                      f"{names}{'  ERR %.3g' % err if err > 2e-2 else ''}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
