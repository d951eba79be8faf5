"""CPU diagnostic: torch's flash-attention backward on bfloat16 inputs, run natively against the
upcast to float32 that `flashforge.ops.attention_cpu_aten` does, for speed and for error against
the float64 gradients.

The question it answers: is the upcast still worth its cost?  The main job's bfloat16 fwd+bwd rows
trail SDPA, which runs this kernel natively in bfloat16; the upcast buys accuracy.  Error is
max |grad - grad64| / max |grad64| per tensor (dq, dk, dv); time is the median of 5 calls.  A third
error column is what the GPU kernels would give ("gpu"): the same products with their rounding
points (P and dS rounded to bfloat16 before the products that take them, float32 accumulation,
one rounding of each gradient), emulated in PyTorch, dense: one meaning for both devices asks the
CPU path to be no less accurate than that.

    python benchmarks/profile/cpu_bf16_backward.py [--threads 1 2] [--seqlens 512 1024 2048]
"""
from __future__ import annotations

import argparse
import time

import torch

_FWD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
_BWD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default


def _median_ms(fn, n: int = 5) -> float:
    fn()
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return sorted(times)[n // 2] * 1e3


def _reference(q, k, v, do, causal):
    qd, kd, vd = (x.double().requires_grad_() for x in (q, k, v))
    s = qd @ kd.transpose(-1, -2) / q.shape[-1] ** 0.5
    if causal:
        S = q.shape[2]
        s = s.masked_fill(torch.ones(S, S, dtype=torch.bool).triu(1), float("-inf"))
    return torch.autograd.grad(s.softmax(-1) @ vd, (qd, kd, vd), do.double())


def _gpu_rounding(q, k, v, do, causal):
    """dq, dk, dv as the sm_90 / portable Triton kernels round them (module docstring): float32
    scores and softmax, P (forward's P V and the backward's P^T dO) and dS in bfloat16 operands."""
    S, scale = q.shape[2], q.shape[-1] ** -0.5
    qf, kf, vf, dof = (x.float() for x in (q, k, v, do))
    s = qf @ kf.transpose(-1, -2) * scale
    if causal:
        s = s.masked_fill(torch.ones(S, S, dtype=torch.bool).triu(1), float("-inf"))
    p = (s - s.logsumexp(-1, keepdim=True)).exp()
    pb = p.bfloat16().float()
    o = (pb @ vf).bfloat16()
    delta = (o.float() * dof).sum(-1, keepdim=True)
    ds = (p * (dof @ vf.transpose(-1, -2) - delta)).bfloat16().float()
    return (ds @ kf * scale).bfloat16(), (ds.transpose(-1, -2) @ qf * scale).bfloat16(), \
        (pb.transpose(-1, -2) @ dof).bfloat16()


def _errors(grads, ref):
    return [(g.double() - r).abs().max().item() / r.abs().max().item() for g, r in zip(grads, ref)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--seqlens", type=int, nargs="+", default=[512, 1024, 2048, 4096])
    ap.add_argument("--heads", type=int, default=8)
    args = ap.parse_args()
    print(f"{'threads':>7} {'S':>5} {'causal':>6} {'native ms':>9} {'upcast ms':>9} {'upcast/native':>13}  "
          f"error native (dq dk dv)      error upcast (dq dk dv)      error gpu (dq dk dv)")
    for threads in args.threads:
        torch.set_num_threads(threads)
        for S in args.seqlens:
            for causal in (False, True):
                g = torch.Generator().manual_seed(S)
                q, k, v, do = (torch.randn(1, args.heads, S, 64, generator=g).bfloat16() for _ in range(4))
                o, lse = _FWD(q.float(), k.float(), v.float(), 0.0, causal)
                o16 = o.bfloat16()

                def native():
                    return _BWD(do, q, k, v, o16, lse, 0.0, causal)

                def upcast():
                    grads = _BWD(do.float(), q.float(), k.float(), v.float(), o16.float(), lse, 0.0, causal)
                    return [x.bfloat16() for x in grads]

                ref = _reference(q, k, v, do, causal)
                t_n, t_u = _median_ms(native), _median_ms(upcast)
                e_n, e_u = _errors(native(), ref), _errors(upcast(), ref)
                e_g = _errors(_gpu_rounding(q, k, v, do, causal), ref)
                print(f"{threads:7d} {S:5d} {str(causal):>6} {t_n:9.1f} {t_u:9.1f} {t_u / t_n:13.2f}  "
                      + "      ".join(" ".join(f"{e:.1e}" for e in es) for es in (e_n, e_u, e_g)), flush=True)


if __name__ == "__main__":
    main()
