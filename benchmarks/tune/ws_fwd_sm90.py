"""Experiment (issue 18): a warp-specialized sm_90 attention forward in Gluon, beside ours.

Not wired into flashforge's dispatch.  It compiles offline (``--compile``, no GPU needed: Triton's
bundled ptxas, registers and stack printed); on an H100/H200 the default run checks it against
float32 attention on odd sizes with a NaN-poisoned output, then times it against flashforge's
sm_90 forward (`ops/gluon/attention_fwd_sm90.py`) on the standard grid rows:

    python benchmarks/tune/ws_fwd_sm90.py --compile        # any machine
    PYTHONPATH=. python benchmarks/tune/ws_fwd_sm90.py     # the GPU: check, then time

Design (FA3's, written for Gluon 3.6's `gl.warp_specialize`):

- a loader partition, one warp and 24-40 registers, that only issues TMA copies: Q once, then K_j
  and V_j into rings of STAGES slots.  Each slot has a "ready" barrier (the copy engine completes
  it) and an "empty" barrier (the compute partition arrives once the products that read the slot
  are done), so the loader runs ahead by STAGES tiles without any copy in the compute warps'
  instruction stream;
- the compute (default) partition, two warpgroups over a 128-row query block (``num_warps=8``):
  the intra-warpgroup pipeline of our current kernel (S_j issued, then O += P_{j-1} V_{j-1}, the
  softmax of S_j while that product runs), with the copies replaced by barrier waits;
- registers: ``maxnreg`` sets the budget the partitions share; the compiler moves registers from
  the loader warpgroup to the compute warpgroups (setmaxnreg).

Left for later (each a step to measure on its own): ping-pong between the two warpgroups (named
barriers so one's softmax runs under the other's products), persistent programs with a tile
scheduler, varlen, and the backward.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from triton.experimental import gluon  # noqa: E402
from triton.experimental.gluon import language as gl  # noqa: E402
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma,  # noqa: E402
                                                              warpgroup_mma, warpgroup_mma_wait)

from flashforge.ops.gluon.attention import _descriptor, _qk_scale  # noqa: E402
from flashforge.ops.gluon.attention_fwd_sm90 import _softmax_step  # noqa: E402
from flashforge.ops.gluon.pipeline import copy_in, copy_out, key_tiles, query_block, slot  # noqa: E402
from flashforge.ops.gluon.rounding import LN2, fused_score  # noqa: E402
from flashforge.ops.launch import cdiv  # noqa: E402


@gluon.jit
def _loader(q_desc, k_desc, v_desc, q_smem, k_ring, v_ring, q_bar, k_ready, k_empty, v_ready, v_empty, b, h, hk,
            m0, n_tiles, BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    """The loader partition: Q, then every key tile's K and V, each into its ring's next slot once
    the compute partition has released it (empty barriers start complete: phase 1 passes)."""
    mbarrier.expect(q_bar, q_desc.block_type.nbytes)
    copy_in(q_desc, b, m0, h, 0, 0, q_bar, q_smem, True, False)
    for j in range(n_tiles):
        s = j % STAGES
        phase = (j // STAGES) & 1
        mbarrier.wait(k_empty.index(s), phase ^ 1)
        mbarrier.expect(k_ready.index(s), k_desc.block_type.nbytes)
        copy_in(k_desc, b, j * BLOCK_N, hk, 0, 0, k_ready.index(s), k_ring.index(s), True, False)
        mbarrier.wait(v_empty.index(s), phase ^ 1)
        mbarrier.expect(v_ready.index(s), v_desc.block_type.nbytes)
        copy_in(v_desc, b, j * BLOCK_N, hk, 0, 0, v_ready.index(s), v_ring.index(s), True, False)


@gluon.jit
def _compute(q_desc, o_desc, LSE, q_smem, k_ring, v_ring, q_bar, k_ready, k_empty, v_ready, v_empty, b, h, m0,
             n_tiles, n_full, Sq, Sk, offset, qk_scale, stride_lb, stride_lh, CAUSAL: gl.constexpr,
             BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, D: gl.constexpr, STAGES: gl.constexpr,
             num_warps: gl.constexpr):
    """The compute partition: the online softmax over the key tiles, then o and lse."""
    dtype: gl.constexpr = q_desc.dtype
    FUSE: gl.constexpr = fused_score(dtype)
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                       instr_shape=[16, D, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)

    o_m = m0 + gl.arange(0, BLOCK_M, layout=row_s)
    m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, layout=row_s)
    l_i = gl.zeros([BLOCK_M], gl.float32, layout=row_s)
    acc = gl.zeros([BLOCK_M, D], gl.float32, layout=o_layout)
    s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=s_layout)
    mbarrier.wait(q_bar, 0)
    q = q_smem.reshape([BLOCK_M, D])

    if n_tiles > 0:
        mbarrier.wait(k_ready.index(0), 0)
        s = warpgroup_mma(q, slot(k_ring, 0, BLOCK_N, D, STAGES).permute((1, 0)), s_zero, use_acc=False,
                          is_async=True)
        s = warpgroup_mma_wait(0, deps=(s, ))
        mbarrier.arrive(k_empty.index(0), count=1)
        if n_full > 0:
            p, alpha, m_i, l_i = _softmax_step(s, m_i, l_i, 0, o_m, Sk, offset, qk_scale, s_layout, False, CAUSAL,
                                               BLOCK_N, FUSE=FUSE)
        else:
            p, alpha, m_i, l_i = _softmax_step(s, m_i, l_i, 0, o_m, Sk, offset, qk_scale, s_layout, True, CAUSAL,
                                               BLOCK_N, FUSE=FUSE)
        p = gl.convert_layout(p.to(dtype), p_layout)
        for j in range(1, n_tiles):
            sj = j % STAGES
            sp = (j - 1) % STAGES
            mbarrier.wait(k_ready.index(sj), (j // STAGES) & 1)
            s = warpgroup_mma(q, slot(k_ring, j, BLOCK_N, D, STAGES).permute((1, 0)), s_zero, use_acc=False,
                              is_async=True)
            mbarrier.wait(v_ready.index(sp), ((j - 1) // STAGES) & 1)
            acc = warpgroup_mma(p, slot(v_ring, j - 1, BLOCK_N, D, STAGES), acc, is_async=True)
            s = warpgroup_mma_wait(1, deps=(s, ))  # S_j done; P_{j-1} V_{j-1} may still run
            mbarrier.arrive(k_empty.index(sj), count=1)
            if j < n_full:
                p_new, alpha, m_i, l_i = _softmax_step(s, m_i, l_i, j * BLOCK_N, o_m, Sk, offset, qk_scale,
                                                       s_layout, False, CAUSAL, BLOCK_N, FUSE=FUSE)
            else:
                p_new, alpha, m_i, l_i = _softmax_step(s, m_i, l_i, j * BLOCK_N, o_m, Sk, offset, qk_scale,
                                                       s_layout, True, CAUSAL, BLOCK_N, FUSE=FUSE)
            acc, p = warpgroup_mma_wait(0, deps=(acc, p))
            mbarrier.arrive(v_empty.index(sp), count=1)
            acc = acc * gl.convert_layout(alpha, row_o)[:, None]
            p = gl.convert_layout(p_new.to(dtype), p_layout)
        last = n_tiles - 1
        mbarrier.wait(v_ready.index(last % STAGES), (last // STAGES) & 1)
        acc = warpgroup_mma(p, slot(v_ring, last, BLOCK_N, D, STAGES), acc, is_async=True)
        acc = warpgroup_mma_wait(0, deps=(acc, ))
        mbarrier.arrive(v_empty.index(last % STAGES), count=1)

    empty = l_i == 0.0
    l_safe = gl.where(empty, 1.0, l_i)
    lse = gl.where(empty, float("-inf"), (m_i + gl.log2(l_safe)) * LN2)
    row = b.to(gl.int64) * stride_lb + h.to(gl.int64) * stride_lh
    gl.store(LSE + row + o_m, lse, mask=o_m < Sq)
    acc = acc / gl.convert_layout(l_safe, row_o)[:, None]
    q_smem.reshape([BLOCK_M, D]).store(acc.to(dtype))  # Q is no longer read: every S is done
    fence_async_shared()
    copy_out(o_desc, b, m0, h, 0, 0, q_smem, False)
    tma.store_wait(0)


@gluon.jit
def ws_fwd_sm90_kernel(q_desc, k_desc, v_desc, o_desc, LSE, stride_lb, stride_lh, Hq, Sq, Sk, group, offset,
                       qk_scale, CAUSAL: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                       D: gl.constexpr, STAGES: gl.constexpr, LOADER_REGS: gl.constexpr, num_warps: gl.constexpr):
    dtype: gl.constexpr = q_desc.dtype
    b, h, hk, m0 = query_block(Sq, Hq, group, BLOCK_M, CAUSAL)
    n_tiles, n_full = key_tiles(m0, Sq, Sk, offset, BLOCK_M, BLOCK_N, CAUSAL)

    q_smem = gl.allocate_shared_memory(dtype, q_desc.block_type.shape, q_desc.layout)
    k_ring = gl.allocate_shared_memory(dtype, [STAGES] + k_desc.block_type.shape, k_desc.layout)
    v_ring = gl.allocate_shared_memory(dtype, [STAGES] + v_desc.block_type.shape, v_desc.layout)
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(k_empty.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(v_empty.index(i), count=1)
    fence_async_shared()

    gl.warp_specialize([
        (_compute, (q_desc, o_desc, LSE, q_smem, k_ring, v_ring, q_bar, k_ready, k_empty, v_ready, v_empty, b, h, m0,
                    n_tiles, n_full, Sq, Sk, offset, qk_scale, stride_lb, stride_lh, CAUSAL, BLOCK_M, BLOCK_N, D,
                    STAGES, num_warps)),
        (_loader, (q_desc, k_desc, v_desc, q_smem, k_ring, v_ring, q_bar, k_ready, k_empty, v_ready, v_empty, b, h,
                   hk, m0, n_tiles, BLOCK_N, STAGES)),
    ], [1], [LOADER_REGS])


def ws_forward(q, k, v, causal=False, block_m=128, block_n=128, stages=2, num_warps=8, loader_regs=24,
               poison=False, kernel=ws_fwd_sm90_kernel):
    """(o, lse) of dense bf16/fp16 [B, S, H, D] inputs, D in {64, 128}; causal top-left aligned;
    ``poison``: o and lse start as NaN, so an element the kernel does not write fails a check."""
    B, Sq, Hq, D = q.shape
    Sk, Hkv = k.shape[1], k.shape[2]
    o = torch.full_like(q, float("nan")) if poison else torch.empty_like(q)
    lse = torch.full((B, Hq, Sq), float("nan"), dtype=torch.float32, device=q.device) if poison else \
        torch.empty(B, Hq, Sq, dtype=torch.float32, device=q.device)
    grid = (cdiv(Sq, block_m), B * Hq)
    kw = dict(CAUSAL=causal, BLOCK_M=block_m, BLOCK_N=block_n, D=D, STAGES=stages, LOADER_REGS=loader_regs,
              num_warps=num_warps)
    kernel[grid](_descriptor(q, block_m), _descriptor(k, block_n), _descriptor(v, block_n), _descriptor(o, block_m),
                 lse, lse.stride(0), lse.stride(1), Hq, Sq, Sk, Hq // Hkv, 0, _qk_scale(D ** -0.5), **kw)
    return o, lse


# name: ws_forward keyword arguments.  The registers: with the loader's warpgroup at 24, the
# compiler raises the compute warpgroups to 240 (`setmaxnreg` in the PTX; the kernel's .maxnreg is
# 65536 / 384 threads = 168).  Shared memory at D = 128: 164 KB (n128, 2 stages), 131 KB (n64, 3).
VARIANTS = {
    "m128n128s2": dict(block_m=128, block_n=128, stages=2),
    "m128n64s3": dict(block_m=128, block_n=64, stages=3),
}


def compile_offline():
    """Compile each variant for sm_90 with Triton's ptxas (no GPU): registers and stack per variant."""
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tools"))
    import sm90_compile_check as cc
    fails = 0
    for D in (64, 128):
        for causal in (False, True):
            for name, kw in VARIANTS.items():
                log = []
                q = torch.randn(2, 300, 4, D, dtype=torch.bfloat16)
                k = torch.randn(2, 300, 2, D, dtype=torch.bfloat16)
                ws_forward(q, k, k, causal, kernel=cc.Recorder(ws_fwd_sm90_kernel, log), **kw)
                print(f"== D{D} causal={causal} {name}", flush=True)
                fails += len(cc.compile_all(log))
    print(f"{fails} failed")
    return 1 if fails else 0


def check_and_time():
    import triton.testing
    import flashforge
    import torch.nn.functional as F
    torch.manual_seed(0)
    bad = 0
    for (B, S, Hq, Hkv, D, causal) in ((2, 333, 4, 2, 64, False), (1, 777, 4, 4, 128, True), (2, 1000, 8, 2, 128,
                                                                                              False)):
        q, k, v = (torch.randn(B, S, h, D, device="cuda", dtype=torch.bfloat16) for h in (Hq, Hkv, Hkv))
        ref = F.scaled_dot_product_attention(*(t.float().transpose(1, 2) for t in (q, k, v)), is_causal=causal,
                                             enable_gqa=True).transpose(1, 2)
        kr = k.float().repeat_interleave(Hq // Hkv, dim=2)
        scores = torch.einsum("bqhd,bkhd->bhqk", q.float(), kr) * D ** -0.5
        if causal:
            scores = scores.masked_fill(torch.ones(S, S, dtype=torch.bool, device="cuda").triu(1), float("-inf"))
        ref_lse = scores.logsumexp(-1)
        for name, kw in VARIANTS.items():
            o, lse = ws_forward(q, k, v, causal, poison=True, **kw)
            err = (o.float() - ref).abs().max().item()  # NaN (an unwritten element) fails below
            lse_err = (lse - ref_lse).abs().max().item()
            ok = err < 2e-2 and lse_err < 1e-3
            bad += not ok
            print(f"check B{B} S{S} {Hq}/{Hkv} D{D} causal={causal} {name}: max err {err:.2e}, lse {lse_err:.2e} "
                  f"{'ok' if ok else 'FAIL'}")
    print(f"\n{'row':<22}{'ours':>8}" + "".join(f"{n:>16}" for n in VARIANTS) + "  (TFLOP/s, fwd)")
    for D in (64, 128):
        for S in (1024, 4096, 16384):
            for causal in (False, True):
                B, H = 16384 // S, 2048 // D
                q, k, v = (torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
                fl = 4 * B * H * S * S * D / (2 if causal else 1)
                ours = triton.testing.do_bench(lambda: flashforge.attention(q, k, v, causal=causal), warmup=25,
                                               rep=100, return_mode="median")
                row = f"D{D} S{S}{' causal' if causal else ''}"
                cols = []
                for name, kw in VARIANTS.items():
                    ms = triton.testing.do_bench(lambda: ws_forward(q, k, v, causal, **kw), warmup=25, rep=100,
                                                 return_mode="median")
                    cols.append(fl / ms / 1e9)
                print(f"{row:<22}{fl / ours / 1e9:8.1f}" + "".join(f"{c:16.1f}" for c in cols), flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--compile", action="store_true", help="compile for sm_90 offline, print registers/stack")
    args = ap.parse_args()
    sys.exit(compile_offline() if args.compile else check_and_time())
