"""CPU timing: flashforge's PyTorch path against torch's scaled_dot_product_attention.

Both run float32 on the CPU, forward and forward+backward, over a grid of
shapes; the table gives the best-of-N milliseconds (the least disturbed by
other load on the machine) and ours / SDPA (below 1 is faster).

Usage: ``python benchmarks/cpu_vs_sdpa.py [--batch 1 2] [--seqlens 512 1024] [--threads 4]``.
"""
from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

import flashforge


def _best_ms(ours, sdpa, reps: int) -> tuple[float, float]:
    """Best-of-``reps`` milliseconds of each; the two alternate, so that load from elsewhere on the
    machine falls on both alike."""
    ours(), sdpa()  # warm-up: allocator, thread pool, first-call dispatch
    best = [float("inf"), float("inf")]
    for _ in range(reps):
        for i, fn in enumerate((ours, sdpa)):
            t0 = time.perf_counter()
            fn()
            best[i] = min(best[i], time.perf_counter() - t0)
    return 1e3 * best[0], 1e3 * best[1]


def _cases(B: int, H: int, S: int, D: int, causal: bool):
    """Forward and forward+backward closures for both implementations on the same inputs."""
    q, k, v = (torch.randn(B, S, H, D, requires_grad=True) for _ in range(3))
    do = torch.randn(B, S, H, D)

    def ours():
        return flashforge.attention(q, k, v, causal=causal, backend="torch")

    def sdpa():
        # SDPA wants [B, H, S, D]; transposes are views, as a BSHD model would pass them.
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                           is_causal=causal)
        return o.transpose(1, 2)

    def fwd(f):
        def run():
            with torch.no_grad():
                f()
        return run

    def fwd_bwd(f):
        def run():
            q.grad = k.grad = v.grad = None
            f().backward(do)
        return run

    return {"fwd": (fwd(ours), fwd(sdpa)), "fwd+bwd": (fwd_bwd(ours), fwd_bwd(sdpa))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--seqlens", type=int, nargs="+", default=[512, 1024, 2048])
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)

    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, float32, H={args.heads}, "
          f"D={args.head_dim}, best of {args.reps}")
    header = f"{'B':>2} {'S':>5} {'causal':>6} {'pass':>8} {'ours ms':>9} {'sdpa ms':>9} {'ratio':>6}"
    print(header)
    print("-" * len(header))
    for B in args.batch:
        for S in args.seqlens:
            for causal in (False, True):
                for name, (ours, sdpa) in _cases(B, args.heads, S, args.head_dim, causal).items():
                    t_ours, t_sdpa = _best_ms(ours, sdpa, args.reps)
                    print(f"{B:>2} {S:>5} {str(causal):>6} {name:>8} {t_ours:9.2f} {t_sdpa:9.2f} "
                          f"{t_ours / t_sdpa:6.2f}")


if __name__ == "__main__":
    main()
