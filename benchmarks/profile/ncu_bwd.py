"""One row's backward with one dK/dV tile variant, a few times over, for a profiler to catch (sm_90).

    ncu --clock-control none -k regex:attn_bwd_dkdv --launch-skip 2 --launch-count 1 --set full \
        -o OUT/name python benchmarks/profile/ncu_bwd.py "D64 S4k" "ws shared dq s2"

Rows and variants are `fused_dq_gpu.py`'s (its ROWS and VARIANTS); "ordered" is the table's
deterministic pair.  The first call compiles; the profiler should skip it (--launch-skip).
Nothing is timed here: ncu's own replay measures the kernel it catches.
"""
from __future__ import annotations

import sys

import torch

import flashforge
from _rows import row_inputs, tiles
from fused_dq_gpu import ROWS, VARIANTS


def main(label: str, variant: str, calls: int = 4) -> None:
    (_, S, D, causal, window, gdiv), = [r for r in ROWS if r[0] == label]
    _, _, q, k, v, do = row_inputs(S, D, gdiv)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    cfg = None if variant == "ordered" else VARIANTS[D][variant]
    kw = dict(causal=causal, window=None if window is None else (window, -1), backend="triton",
              deterministic=cfg is None)
    with tiles("bwd_kv", D, cfg):
        o = flashforge.attention(*leaves, **kw)
        for _ in range(calls):
            torch.autograd.grad(o, leaves, do, retain_graph=True)
    torch.cuda.synchronize()
    print(f"{label} / {variant}: {calls} backward calls")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
