"""Where a backward's time goes: the CUDA kernels of 20 backward calls (torch.profiler), and the
GPU time per call (CUDA events) beside the host's, for the table's ordered backward and the
warp-specialized dK/dV kernel with dQ fused, on one of PERF.md's rows (sm_90, bf16).

    PYTHONPATH=. python benchmarks/profile/bwd_kernel_times.py S D causal
"""
from __future__ import annotations

import sys
import time

import torch

from flashforge.ops import launch
from flashforge.ops.triton import configs
from _rows import row_inputs, tiles

import flashforge


def main():
    S, D, causal = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "causal"
    B, H, q, k, v, do = row_inputs(S, D, 1)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    ws = configs.TileConfig(64, 128, 4, 2, gluon=True, consumers=2, fused_dq=True)
    for name, kv, det in (("ordered", None, True), ("ws fused", ws, False)):
        with tiles("bwd_kv", D, kv):
            o = flashforge.attention(*leaves, causal=causal, backend="triton", deterministic=det)
            for _ in range(3):
                torch.autograd.grad(o, leaves, do, retain_graph=True)
            torch.cuda.synchronize()
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            hits, entries = launch.hits, len(launch._compiled)
            t0 = time.perf_counter()
            e0.record()
            for _ in range(20):
                torch.autograd.grad(o, leaves, do, retain_graph=True)
            e1.record()
            host = (time.perf_counter() - t0) / 20 * 1e3
            torch.cuda.synchronize()
            print(f"== {name}: {e0.elapsed_time(e1) / 20:.3f} ms a call on the GPU, host {host:.3f} ms to issue; "
                  f"launch cache: {(launch.hits - hits) / 20:.1f} hits a call, {len(launch._compiled) - entries} new entries")
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                for _ in range(20):
                    torch.autograd.grad(o, leaves, do, retain_graph=True)
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12, max_name_column_width=60))
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                for _ in range(20):
                    torch.autograd.grad(o, leaves, do, retain_graph=True)
                torch.cuda.synchronize()
            print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=8, max_name_column_width=60))


if __name__ == "__main__":
    main()
