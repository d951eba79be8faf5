"""Hopper (sm_90) dQ kernel in Gluon, warp-specialized: the forward's structure
(`attention_fwd_ws_sm90`) for `attention_bwd_sm90.attn_bwd_dq_sm90_kernel`.

A program owns 128 query rows: two consumer warpgroups (partitions, `gl.warp_specialize`) of
64 rows each share every K and V tile, which one loader warp copies into rings with "ready" and
"empty" barriers (both consumers release a slot).  Each consumer runs the dQ kernel's loop on
its rows (S_j and dP_j issued with dQ += dS_{j-1} K_{j-1}; dS_j formed while that product
runs): V_j's slot is released once dP_j is done, K_j's once dQ's product of tile j is.  The
loader copies the union of the halves' key tiles; a consumer releases the tiles its rows do
not see without computing them.  PINGPONG: the consumers take turns issuing their products.

Everything else is the dQ kernel's: delta here (DELTA_HERE) or read, lse's low part (HAS_LO)
and the far flags for the dK/dV kernel (FAR_OUT), softcap, ALiBi, windows, packed batches.
"""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)

from .attention_bwd_sm90 import _lse2, delta_rows, ds_tile_at, lo_rows
from .pipeline import copy_out, copy_pair, slot, wait
from .rounding import fused_score
from .ws_pipeline import (HALF, consumer_tiles, fill, release_tiles, turn_pass, turn_wait, ws_program,
                          ws_rings)


@gluon.jit
def _dq_tiles_ws(q_t, do_t, k_ring, v_ring, k_ready, k_empty, v_ready, v_empty, turn, dq, s_zero, first, n_lo, n_tiles,
                 n_lfull, n_full, n_other, Sk, o_m, lse2, lo, delta, offset, span, qk_scale, scale, softcap, slope,
                 alibi_off, s_layout: gl.constexpr, op_layout: gl.constexpr, dtype: gl.constexpr,
                 BLOCK_N: gl.constexpr, D: gl.constexpr, STAGES: gl.constexpr, V_STAGES: gl.constexpr,
                 CAUSAL: gl.constexpr, HAS_WL: gl.constexpr, HAS_LO: gl.constexpr, FUSE: gl.constexpr,
                 HAS_SOFTCAP: gl.constexpr, HAS_ALIBI: gl.constexpr, ME: gl.constexpr, PINGPONG: gl.constexpr):
    """`attention_bwd_sm90._dq_tiles` over ring indices first + [0, n_tiles), copies replaced by
    the rings' barriers."""
    wait(k_ready, first, STAGES)
    wait(v_ready, first, V_STAGES)
    turn_wait(turn, 0, n_other, ME, PINGPONG)
    s = warpgroup_mma(q_t, slot(k_ring, first, BLOCK_N, D, STAGES).permute((1, 0)), s_zero, use_acc=False,
                      is_async=True)
    dp = warpgroup_mma(do_t, slot(v_ring, first, BLOCK_N, D, V_STAGES).permute((1, 0)), s_zero, use_acc=False,
                       is_async=True)
    turn_pass(turn, ME, PINGPONG)
    s, dp = warpgroup_mma_wait(0, deps=(s, dp))
    mbarrier.arrive(v_empty.index(first % V_STAGES), count=1)
    ds = ds_tile_at(s, dp, 0, n_lo, n_lfull, n_full, o_m, lse2, lo, delta, Sk, offset, span, qk_scale, scale, softcap,
                    slope, alibi_off, s_layout, CAUSAL, HAS_WL, BLOCK_N, HAS_LO, FUSE, HAS_SOFTCAP, HAS_ALIBI)
    ds = gl.convert_layout(ds.to(dtype), op_layout)
    for j in range(1, n_tiles):
        r = first + j
        wait(k_ready, r, STAGES)
        wait(v_ready, r, V_STAGES)
        turn_wait(turn, j, n_other, ME, PINGPONG)
        s = warpgroup_mma(q_t, slot(k_ring, r, BLOCK_N, D, STAGES).permute((1, 0)), s_zero, use_acc=False,
                          is_async=True)
        dp = warpgroup_mma(do_t, slot(v_ring, r, BLOCK_N, D, V_STAGES).permute((1, 0)), s_zero, use_acc=False,
                           is_async=True)
        dq = warpgroup_mma(ds, slot(k_ring, r - 1, BLOCK_N, D, STAGES), dq, is_async=True)
        turn_pass(turn, ME, PINGPONG)
        # S_j, dP_j are done; dQ's product of tile j - 1 may still run.  V_j's slot is free.
        s, dp = warpgroup_mma_wait(1, deps=(s, dp))
        mbarrier.arrive(v_empty.index(r % V_STAGES), count=1)
        ds_new = ds_tile_at(s, dp, j, n_lo, n_lfull, n_full, o_m, lse2, lo, delta, Sk, offset, span, qk_scale, scale,
                            softcap, slope, alibi_off, s_layout, CAUSAL, HAS_WL, BLOCK_N, HAS_LO, FUSE, HAS_SOFTCAP,
                            HAS_ALIBI)
        dq, ds = warpgroup_mma_wait(0, deps=(dq, ds))
        mbarrier.arrive(k_empty.index((r - 1) % STAGES), count=1)
        ds = gl.convert_layout(ds_new.to(dtype), op_layout)
    last = first + n_tiles - 1
    turn_wait(turn, n_tiles, n_other, ME, PINGPONG)
    dq = warpgroup_mma(ds, slot(k_ring, last, BLOCK_N, D, STAGES), dq, is_async=True)
    turn_pass(turn, ME, PINGPONG)
    dq = warpgroup_mma_wait(0, deps=(dq, ))
    mbarrier.arrive(k_empty.index(last % STAGES), count=1)
    return dq


@gluon.jit
def _dq_consumer(dq_desc, LSE, LSE_LO, DELTA, far_at, O, DLSE, stride_ob, stride_os, stride_oh, q_smem, do_smem,
                 k_ring, v_ring, q_bar, k_ready, k_empty, v_ready, v_empty, turn, b, h, m0, q_start, Sq, Sk, offset,
                 span, u_lo, u_tiles, row, qk_scale, scale, softcap, slope, alibi_off, ME: gl.constexpr,
                 CAUSAL: gl.constexpr, HAS_WL: gl.constexpr, HAS_SOFTCAP: gl.constexpr, HAS_ALIBI: gl.constexpr,
                 BLOCK_N: gl.constexpr, D: gl.constexpr, STAGES: gl.constexpr, V_STAGES: gl.constexpr,
                 VARLEN: gl.constexpr, DELTA_HERE: gl.constexpr, HAS_DLSE: gl.constexpr, HAS_LO: gl.constexpr,
                 FAR_OUT: gl.constexpr, PINGPONG: gl.constexpr):
    """dQ of query rows m0 + ME * 64 + [0, 64) (and their delta, DELTA_HERE)."""
    dtype: gl.constexpr = dq_desc.dtype
    FUSE: gl.constexpr = fused_score(dtype, HAS_SOFTCAP=HAS_SOFTCAP, HAS_ALIBI=HAS_ALIBI)
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, D, 16])
    op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)

    mc, n_lo, n_tiles, n_lfull, n_full, first, n_other, _ = consumer_tiles(m0, Sq, Sk, offset, span, u_lo, u_tiles, ME,
                                                                           BLOCK_N, CAUSAL, HAS_WL, PINGPONG)
    release_tiles(k_ready, k_empty, v_ready, v_empty, 0, first, STAGES, V_STAGES)

    o_m = mc + gl.arange(0, HALF, layout=row_s)
    lse2, lo = _lse2(LSE, LSE_LO, row, o_m, Sq, HAS_LO)
    dq = gl.zeros([HALF, D], gl.float32, layout=acc_layout)
    s_zero = gl.zeros([HALF, BLOCK_N], gl.float32, layout=s_layout)
    mbarrier.wait(q_bar, 0)
    q_t = q_smem.reshape([HALF, D])
    do_t = do_smem.reshape([HALF, D])
    if DELTA_HERE:
        delta = delta_rows(O, DLSE, DELTA, do_t, b, h, q_start, mc, Sq, row, stride_ob, stride_os, stride_oh, row_s,
                           HAS_DLSE, HALF, D, 4)
    else:
        delta = gl.load(DELTA + row + o_m, mask=o_m < Sq, other=0.0)

    if n_tiles > 0:
        if lo_rows(lse2, o_m, Sq, far_at, HAS_LO, FAR_OUT):
            dq = _dq_tiles_ws(q_t, do_t, k_ring, v_ring, k_ready, k_empty, v_ready, v_empty, turn, dq, s_zero, first,
                              n_lo, n_tiles, n_lfull, n_full, n_other, Sk, o_m, lse2, lo, delta, offset, span,
                              qk_scale, scale, softcap, slope, alibi_off, s_layout, op_layout, dtype, BLOCK_N, D,
                              STAGES, V_STAGES, CAUSAL, HAS_WL, True, FUSE, HAS_SOFTCAP, HAS_ALIBI, ME, PINGPONG)
        else:
            dq = _dq_tiles_ws(q_t, do_t, k_ring, v_ring, k_ready, k_empty, v_ready, v_empty, turn, dq, s_zero, first,
                              n_lo, n_tiles, n_lfull, n_full, n_other, Sk, o_m, lse2, lo, delta, offset, span,
                              qk_scale, scale, softcap, slope, alibi_off, s_layout, op_layout, dtype, BLOCK_N, D,
                              STAGES, V_STAGES, CAUSAL, HAS_WL, False, FUSE, HAS_SOFTCAP, HAS_ALIBI, ME, PINGPONG)

    q_smem.reshape([HALF, D]).store((dq * scale).to(dtype))  # this half's Q is read no more
    fence_async_shared()
    copy_out(dq_desc, b, mc, h, q_start, Sq, q_smem, VARLEN)
    release_tiles(k_ready, k_empty, v_ready, v_empty, first + n_tiles, u_tiles, STAGES, V_STAGES)
    tma.store_wait(0)


@gluon.jit
def _dq_consumer1(dq_desc, LSE, LSE_LO, DELTA, far_at, O, DLSE, stride_ob, stride_os, stride_oh, q_smem, do_smem,
                  k_ring, v_ring, q_bar, k_ready, k_empty, v_ready, v_empty, turn, b, h, m0, q_start, Sq, Sk, offset,
                  span, u_lo, u_tiles, row, qk_scale, scale, softcap, slope, alibi_off, CAUSAL: gl.constexpr,
                  HAS_WL: gl.constexpr, HAS_SOFTCAP: gl.constexpr, HAS_ALIBI: gl.constexpr, BLOCK_N: gl.constexpr,
                  D: gl.constexpr, STAGES: gl.constexpr, V_STAGES: gl.constexpr, VARLEN: gl.constexpr,
                  DELTA_HERE: gl.constexpr, HAS_DLSE: gl.constexpr, HAS_LO: gl.constexpr, FAR_OUT: gl.constexpr,
                  PINGPONG: gl.constexpr):
    # the second half's rows, in a worker partition
    _dq_consumer(dq_desc, LSE, LSE_LO, DELTA, far_at, O, DLSE, stride_ob, stride_os, stride_oh, q_smem, do_smem,
                 k_ring, v_ring, q_bar, k_ready, k_empty, v_ready, v_empty, turn, b, h, m0, q_start, Sq, Sk, offset,
                 span, u_lo, u_tiles, row, qk_scale, scale, softcap, slope, alibi_off, 1, CAUSAL, HAS_WL, HAS_SOFTCAP,
                 HAS_ALIBI, BLOCK_N, D, STAGES, V_STAGES, VARLEN, DELTA_HERE, HAS_DLSE, HAS_LO, FAR_OUT, PINGPONG)


@gluon.jit
def _dq_loader(q_desc, k_desc, v_desc, do_desc, q_smem0, q_smem1, do_smem0, do_smem1, k_ring, v_ring, q_bars, k_ready,
               k_empty, v_ready, v_empty, b, h, hk, m0, q_start, Sq, k_start, Sk, u_lo, u_tiles,
               BLOCK_N: gl.constexpr, STAGES: gl.constexpr, V_STAGES: gl.constexpr, VARLEN: gl.constexpr):
    """Both halves' Q and dO, then the union's key tiles, K_r then V_r (both read at tile r)."""
    copy_pair(q_desc, do_desc, b, m0, h, q_start, Sq, q_bars.index(0), q_smem0, do_smem0, VARLEN)
    copy_pair(q_desc, do_desc, b, m0 + HALF, h, q_start, Sq, q_bars.index(1), q_smem1, do_smem1, VARLEN)
    for r in range(0, u_tiles):
        fill(k_desc, k_ring, k_ready, k_empty, r, (u_lo + r) * BLOCK_N, b, hk, k_start, Sk, STAGES, VARLEN)
        fill(v_desc, v_ring, v_ready, v_empty, r, (u_lo + r) * BLOCK_N, b, hk, k_start, Sk, V_STAGES, VARLEN)


@gluon.jit
def attn_bwd_dq_ws_sm90_kernel(q_desc, k_desc, v_desc, do_desc, dq_desc, LSE, LSE_LO, DELTA, FAR, stride_lb,
                               stride_lh, CU_Q, CU_K, ORDER, Hq, Sq, Sk, total_q, total_k, group, offset, bottom_right,
                               span, qk_scale, scale, O, DLSE, stride_ob, stride_os, stride_oh, softcap, SLOPES,
                               stride_sb, stride_sh, right, CAUSAL: gl.constexpr, HAS_WL: gl.constexpr,
                               HAS_SOFTCAP: gl.constexpr, HAS_ALIBI: gl.constexpr, BLOCK_N: gl.constexpr,
                               D: gl.constexpr, STAGES: gl.constexpr, V_STAGES: gl.constexpr, VARLEN: gl.constexpr,
                               DELTA_HERE: gl.constexpr, HAS_DLSE: gl.constexpr, HAS_LO: gl.constexpr,
                               FAR_OUT: gl.constexpr, PINGPONG: gl.constexpr, CONSUMER_REGS: gl.constexpr,
                               LOADER_REGS: gl.constexpr, num_warps: gl.constexpr):
    # the arguments mean attn_bwd_dq_sm90_kernel's; a program owns 2 * 64 query rows (num_warps = 4:
    # the default partition is the first consumer); q, dO and dQ boxes are 64 rows
    dtype: gl.constexpr = q_desc.dtype
    kv_row, b, h, hk, m0, q_start, Sq, k_start, Sk, offset, alibi_off, slope, u_lo, u_tiles, row = ws_program(
        Sq, Hq, group, CU_Q, CU_K, ORDER, Sk, total_q, total_k, offset, bottom_right, span, right, SLOPES, stride_sb,
        stride_sh, stride_lb, stride_lh, BLOCK_N, CAUSAL, HAS_WL, HAS_ALIBI, VARLEN, D)
    far_at = FAR + kv_row  # the dK/dV kernel's grid row (`key_program`)

    q_smem0 = gl.allocate_shared_memory(dtype, q_desc.block_type.shape, q_desc.layout)
    q_smem1 = gl.allocate_shared_memory(dtype, q_desc.block_type.shape, q_desc.layout)
    do_smem0 = gl.allocate_shared_memory(dtype, do_desc.block_type.shape, do_desc.layout)
    do_smem1 = gl.allocate_shared_memory(dtype, do_desc.block_type.shape, do_desc.layout)
    k_ring, v_ring, q_bars, turn, k_ready, k_empty, v_ready, v_empty = ws_rings(k_desc, v_desc, STAGES, V_STAGES,
                                                                                PINGPONG)

    gl.warp_specialize([
        (_dq_consumer, (dq_desc, LSE, LSE_LO, DELTA, far_at, O, DLSE, stride_ob, stride_os, stride_oh, q_smem0,
                        do_smem0, k_ring, v_ring, q_bars.index(0), k_ready, k_empty, v_ready, v_empty, turn, b, h, m0,
                        q_start, Sq, Sk, offset, span, u_lo, u_tiles, row, qk_scale, scale, softcap, slope, alibi_off,
                        0, CAUSAL, HAS_WL, HAS_SOFTCAP, HAS_ALIBI, BLOCK_N, D, STAGES, V_STAGES, VARLEN, DELTA_HERE,
                        HAS_DLSE, HAS_LO, FAR_OUT, PINGPONG)),
        (_dq_consumer1, (dq_desc, LSE, LSE_LO, DELTA, far_at, O, DLSE, stride_ob, stride_os, stride_oh, q_smem1,
                         do_smem1, k_ring, v_ring, q_bars.index(1), k_ready, k_empty, v_ready, v_empty, turn, b, h, m0,
                         q_start, Sq, Sk, offset, span, u_lo, u_tiles, row, qk_scale, scale, softcap, slope,
                         alibi_off, CAUSAL, HAS_WL, HAS_SOFTCAP, HAS_ALIBI, BLOCK_N, D, STAGES, V_STAGES, VARLEN,
                         DELTA_HERE, HAS_DLSE, HAS_LO, FAR_OUT, PINGPONG)),
        (_dq_loader, (q_desc, k_desc, v_desc, do_desc, q_smem0, q_smem1, do_smem0, do_smem1, k_ring, v_ring, q_bars,
                      k_ready, k_empty, v_ready, v_empty, b, h, hk, m0, q_start, Sq, k_start, Sk, u_lo, u_tiles,
                      BLOCK_N, STAGES, V_STAGES, VARLEN)),
    ], [4, 1], [CONSUMER_REGS, LOADER_REGS])
