"""The decode benchmark's floor: a kernel that only streams the K and V bytes a decoding step
reads (summing them, so the loads are kept), timed like the attention kernels.  At small
batches no attention kernel can beat it: what it cannot reach (launch latency, the ramp of a
few microseconds of work, the L2 flush's dirty lines written back) bounds every kernel."""
from __future__ import annotations

from typing import Callable

import torch
import triton
import triton.language as tl


@triton.jit
def _stream_read(A, B, OUT, n_a, n_b, programs_a, BLOCK: tl.constexpr, ITERS: tl.constexpr):
    # programs [0, programs_a) read A, the rest B: one launch for both tensors, as attention's
    pid = tl.program_id(0)
    in_a = pid < programs_a
    X = tl.where(in_a, A, B)
    n = tl.where(in_a, n_a, n_b)
    start = tl.where(in_a, pid, pid - programs_a).to(tl.int64) * (BLOCK * ITERS)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for i in range(ITERS):
        o = start + i * BLOCK + tl.arange(0, BLOCK)
        acc += tl.load(X + o, mask=o < n, other=0.0).to(tl.float32)
    tl.store(OUT + pid, tl.sum(acc, axis=0))


# (elements per load, loads per program): H200 sweep in CUDA graphs, 17-537 MB of K and V --
# long programs win on big reads, short ones (more programs in flight) on 67 MB
SHAPES = ((8192, 2), (2048, 8))


def readers(k: torch.Tensor, v: torch.Tensor) -> list[Callable[[], None]]:
    """One callable per SHAPES entry, each reading all of k and v once (contiguous tensors
    of one dtype) and returning its per-program sums; the caller times each and keeps the fastest."""
    if not (k.is_contiguous() and v.is_contiguous() and k.dtype == v.dtype):
        raise ValueError("read floor: k and v must be contiguous and of one dtype")
    out = []
    for block, iters in SHAPES:
        pa, pb = triton.cdiv(k.numel(), block * iters), triton.cdiv(v.numel(), block * iters)
        sink = torch.empty(pa + pb, dtype=torch.float32, device=k.device)

        def fn(pa=pa, pb=pb, sink=sink, block=block, iters=iters):
            _stream_read[(pa + pb,)](k, v, sink, k.numel(), v.numel(), pa, BLOCK=block, ITERS=iters, num_warps=8)
            return sink
        out.append(fn)
    return out
