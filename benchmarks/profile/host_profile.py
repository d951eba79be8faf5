"""Python profile (cProfile) of the host side of eager calls: forward and forward+backward at
the grid's S = 1k shapes, with the GPU held busy so only the host's work is measured.

    PYTHONPATH=. python benchmarks/profile/host_profile.py [--calls 50] [--top 30]
"""
import argparse
import cProfile
import pstats

import torch

import flashforge


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=50)
    ap.add_argument("--top", type=int, default=30)
    args = ap.parse_args()
    S, D = 1024, 128
    B, H = 16384 // S, 2048 // D
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, do = (torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(4))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    cases = {
        "fwd (Gluon)": lambda: flashforge.attention(q, k, v),
        "fwd causal (portable, TMA)": lambda: flashforge.attention(q, k, v, causal=True),
        "fwd+bwd": lambda: torch.autograd.grad(flashforge.attention(*leaves), leaves, do),
        "fwd+bwd causal": lambda: torch.autograd.grad(flashforge.attention(*leaves, causal=True), leaves, do),
    }
    for name, fn in cases.items():
        with torch.no_grad() if "bwd" not in name else torch.enable_grad():
            fn()
            torch.cuda.synchronize()
            torch.cuda._sleep(int(5e8))  # the GPU stays busy: launches only queue
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(args.calls):
                fn()
            prof.disable()
            torch.cuda.synchronize()
        st = pstats.Stats(prof)
        print(f"\n===== {name}: {st.total_tt / args.calls * 1e6:.0f} us per call (profiled)")
        st.sort_stats("tottime").print_stats(args.top)


if __name__ == "__main__":
    main()
