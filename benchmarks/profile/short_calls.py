"""Where the time of a short call goes: the benchmark's timing (do_bench, eager), the same
call inside a CUDA graph (no host work), and the host's own time per call (measured while
the GPU is held busy, so launches only queue), ours without training launch plans and with them
("ours-p", ops/replay.py).  A diagnostic for the S = 1k grid rows,
whose kernels run for 50-400 us: when the host needs longer than the GPU, eager timing
measures the host.

    PYTHONPATH=. python benchmarks/profile/short_calls.py [--seqlen 1024] [--dtype bf16]
"""
import argparse
import time

import torch
import triton.testing

import flashforge
from flashforge.ops import launch, replay


def host_us(fn, n=20):
    """Host time per call: the GPU sleeps first, so every launch only queues."""
    fn()
    torch.cuda.synchronize()
    torch.cuda._sleep(int(2e8))  # ~0.1 s of GPU time: longer than n calls' host work
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) / n * 1e6


def graph_ms(fn):
    try:
        return triton.testing.do_bench_cudagraph(fn, rep=50)
    except Exception as e:  # noqa: BLE001 -- report, keep going
        print(f"  (CUDA graph failed: {type(e).__name__}: {str(e)[:120]})")
        return float("nan")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seqlen", type=int, default=1024)
    ap.add_argument("--dtype", default="bf16", choices=("bf16", "fp16"))
    ap.add_argument("--head-dim", type=int, action="append", default=[], help="these only (default 64 and 128)")
    args = ap.parse_args()
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float16
    S = args.seqlen
    sdpa = torch.nn.functional.scaled_dot_product_attention
    from torch.nn.attention import SDPBackend, sdpa_kernel
    print(f"{'case':26s} {'impl':6s} {'eager ms':>9s} {'graph ms':>9s} {'host us':>8s} {'TF/s eager':>10s} "
          f"{'TF/s graph':>10s}")
    for D in args.head_dim or (64, 128):
        B, H = 16384 // S, 2048 // D
        for causal in (False, True):
            g = torch.Generator(device="cuda").manual_seed(0)
            q, k, v, do = (torch.randn(B, S, H, D, device="cuda", dtype=dtype, generator=g) for _ in range(4))
            leaves = [t.clone().requires_grad_() for t in (q, k, v)]
            tl = [t.transpose(1, 2).detach().clone().requires_grad_() for t in (q, k, v)]
            dot = do.transpose(1, 2).contiguous()
            flops = 4 * B * H * S * S * D / (2 if causal else 1)

            def ours_fwd():
                with torch.no_grad():
                    flashforge.attention(q, k, v, causal=causal)

            def ours_fb():
                torch.autograd.grad(flashforge.attention(*leaves, causal=causal), leaves, do)

            def cudnn_fwd():
                with torch.no_grad(), sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                    sdpa(*tl, is_causal=causal)

            def cudnn_fb():
                with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                    torch.autograd.grad(sdpa(*tl, is_causal=causal), tl, dot)

            def plans(fn, on):  # training launch plans on or off for this call (ops/replay.py)
                def run():
                    saved, replay.TRAINING = replay.TRAINING, on
                    try:
                        fn()
                    finally:
                        replay.TRAINING = saved
                return run

            runs = [("ours", plans(ours_fwd, False), flops), ("ours-p", plans(ours_fwd, True), flops),
                    ("cudnn", cudnn_fwd, flops),
                    ("ours", plans(ours_fb, False), 3.5 * flops), ("ours-p", plans(ours_fb, True), 3.5 * flops),
                    ("cudnn", cudnn_fb, 3.5 * flops)]
            for i, (name, fn, f) in enumerate(runs):
                pas = "fwd" if i < 3 else "fwd+bwd"
                eager = triton.testing.do_bench(fn, warmup=10, rep=50)
                graph = graph_ms(fn)
                h = host_us(fn)
                print(f"D={D} S={S}{' causal' if causal else '':7s} {pas:7s} {name:6s} {eager:9.3f} {graph:9.3f} "
                      f"{h:8.1f} {f / eager * 1e-9:10.0f} {f / graph * 1e-9:10.0f}", flush=True)
    print(f"launch cache: enabled={launch.ENABLED}, launches served from it: {launch.hits}; "
          f"calls served by launch plans: {replay.served}")


if __name__ == "__main__":
    main()
