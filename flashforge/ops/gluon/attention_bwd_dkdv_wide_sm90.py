"""Hopper (sm_90) dK/dV kernel in Gluon for D = 256, warp-specialized, dQ fused: the consumers
split the head dim (issue 18).

Why: at D = 256 the other kernels cannot hold a 64-key block's dK and dV ([64, 256] float32 each,
256 registers a thread together) in one warpgroup, so the ordered pair runs dV and dK in two
launches and dQ in a third kernel: 8 products a tile pair where 5 suffice
(`attention_bwd_sm90`'s split_kv, RESULTS.md v0.8.6).  Here a program owns 64 keys and two
consumer warpgroups share them, FA3's layout for its widest head dim:

- scores are formed queries by keys, S = Q K^T and dP = dO V^T over 64-query tiles, each
  consumer the 32 keys [32 c, 32 c + 32) of the block (64 x 32 products over D = 256);
- each stores its P and dS columns into one [64 queries, 64 keys] tile each, shared;
- once both halves are stored, each consumer computes the head-dim columns [128 c, 128 c + 128)
  of dV += P^T dO, dK += dS^T Q over all 64 keys (the shared tiles, transposed, as A operands) and
  of the tile's dQ_t = dS K, which a writer warp hands to the copy engine's reduce-add into the
  zeroed float32 accumulator (as the half-dQ kernel's: `attention_bwd_dkdv_halfdq_sm90`);
- a loader warp brings K and V once, then each query tile's Q, dO (one slot each: two would not
  fit beside the dQ staging) and its lse and delta (asynchronous copies onto the same barrier).

Registers a consumer: dK and dV halves (64 + 64), dQ_t's half (64), S and dP (16 + 16).
Scope: D = 256 (Dv = D), not deterministic (the reduce-adds come in varying order), lse_lo's two
launches (LO_PASS, the other dK/dV kernels' scheme), causal, windows, softcap, ALiBi, GQA,
packed batches.
"""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)

from .attention_bwd_dkdv_halfdq_sm90 import _tile_lse
from .attention_bwd_dkdv_ws_sm90 import _lo_launch, _tile_masked, _tile_rows
from .pipeline import copy_out, copy_pair, key_block, query_window, reduce_out, wait
from .rounding import exponent, fused_score
from .scores import modified_score

ROWS = gl.constexpr(64)  # keys a program, queries a tile
KH = gl.constexpr(32)  # keys a consumer's scores cover


@gluon.jit
def _probs_qk(s, rows, cols, m, nc, lse2, lo, Sk, offset, span, qk_scale, scale, softcap, slope, alibi_off,
              MASKED: gl.constexpr, CAUSAL: gl.constexpr, HAS_WL: gl.constexpr, HAS_SOFTCAP: gl.constexpr,
              HAS_ALIBI: gl.constexpr, USE_LO: gl.constexpr, FUSE: gl.constexpr):
    """(P, the softcap's tanh) of S [queries m + rows, keys nc + cols], the forward's score
    exactly (`attention_bwd_sm90._dst_tile`'s rules, queries by keys); a masked tile also masks
    keys from Sk on (zero-filled: their P, exp2(-lse), could overflow where lse is far below 0,
    and inf * 0 in dS K would put NaN into dQ)."""
    if HAS_SOFTCAP or HAS_ALIBI:
        s2, tc = modified_score(s, rows[:, None], cols[None, :], qk_scale, scale, softcap, slope,
                                alibi_off + (m - nc), HAS_SOFTCAP, HAS_ALIBI)
        x = s2 - lse2[:, None]
    else:
        x = exponent(s, qk_scale, lse2[:, None], FUSE)
        tc = x
    if MASKED:  # key n visible from query i iff n <= i + offset (CAUSAL) and n >= i + offset - span (HAS_WL)
        d = cols[None, :] - rows[:, None]
        if CAUSAL:
            x = gl.where(d <= m + offset - nc, x, float("-inf"))
        if HAS_WL:
            x = gl.where(d >= m + (offset - span) - nc, x, float("-inf"))
        x = gl.where(cols[None, :] < Sk - nc, x, float("-inf"))
    if USE_LO:
        x = x - lo[:, None]
    return gl.exp2(x), tc


@gluon.jit
def _stage_dq(dq, dq_smem, first: gl.constexpr, ROWS: gl.constexpr, DQ_N: gl.constexpr):
    # a [64, 2 DQ_N] part of dQ_t into buffers first, first + 1 of the writer's boxes (halves of
    # the register tile: each thread's own registers, no data moves)
    lo, hi = dq.reshape([ROWS, 2, DQ_N]).permute(0, 2, 1).split()
    dq_smem.index(first).reshape([ROWS, DQ_N]).store(lo)
    dq_smem.index(first + 1).reshape([ROWS, DQ_N]).store(hi)


@gluon.jit
def _wide_consumer(dk_desc, dv_desc, lse_ring, LSE_LO, delta_ring, k_smem, v_smem, kv_bar, q_ring, do_ring, ready, empty,
                   p_smem, ds_smem, p_ready, ds_ready, pds_free, dq_smem, dq_full, dq_empty, b, hk, group, n0, k_start, Sk, Sq,
                   offset, span, T, n_mt, mt_lo, n_masked, n_lfull, row_b, stride_lh, qk_scale, scale, softcap, SL,
                   stride_sh, alibi_off, ME: gl.constexpr, CAUSAL: gl.constexpr, HAS_WL: gl.constexpr,
                   HAS_SOFTCAP: gl.constexpr, HAS_ALIBI: gl.constexpr, D: gl.constexpr, VARLEN: gl.constexpr,
                   USE_LO: gl.constexpr, DQ_N: gl.constexpr):
    """Scores of keys n0 + 32 ME + [0, 32); dK, dV and every tile's dQ_t in head-dim columns
    [DH ME, DH ME + DH) (module docstring)."""
    dtype: gl.constexpr = k_smem.dtype
    DH: gl.constexpr = D // 2
    FUSE: gl.constexpr = fused_score(dtype, HAS_SOFTCAP=HAS_SOFTCAP, HAS_ALIBI=HAS_ALIBI)
    # S / dP: [queries, 32 keys]; dK / dV / dQ_t: [64, DH]
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, KH, 16])
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, DH, 16])
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    col_s: gl.constexpr = gl.SliceLayout(0, s_layout)
    nc = n0 + ME * KH
    tail = n0 + ROWS > Sk
    n_mt_div = gl.maximum(n_mt, 1)
    rows = gl.arange(0, ROWS, layout=row_s)  # (tile-relative query and key indices)
    cols = gl.arange(0, KH, layout=col_s)
    s_zero = gl.zeros([ROWS, KH], gl.float32, layout=s_layout)
    dq_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, DH // 2, 16])
    dq_zero = gl.zeros([ROWS, DH // 2], gl.float32, layout=dq_layout)
    dk = gl.zeros([ROWS, DH], gl.float32, layout=acc_layout)
    dv = gl.zeros([ROWS, DH], gl.float32, layout=acc_layout)
    mbarrier.wait(kv_bar, 0)
    k_all = k_smem.reshape([ROWS, D])
    k_mine = k_all.slice(ME * KH, KH, dim=0)  # this consumer's keys, for S
    v_mine = v_smem.reshape([ROWS, D]).slice(ME * KH, KH, dim=0)
    k_lo = k_all.slice(ME * DH, DH // 2, dim=1)  # every key, this consumer's columns, for dQ_t
    k_hi = k_all.slice(ME * DH + DH // 2, DH // 2, dim=1)
    p_mine = p_smem.slice(ME * KH, KH, dim=1)
    ds_mine = ds_smem.slice(ME * KH, KH, dim=1)
    for t in range(T):
        wait(ready, t, 1)
        # slot 0, by an index the compiler cannot fold (t < 2**30): with a constant one, every
        # product's shared-memory descriptors are loop-invariant, get hoisted out of the loop and
        # spilled (ptxas: ~40 64-bit values, reloaded every tile)
        z = t >> 30
        q_s = q_ring.index(z).reshape([ROWS, D])
        do_s = do_ring.index(z).reshape([ROWS, D])
        s = warpgroup_mma(q_s, k_mine.permute((1, 0)), s_zero, use_acc=False, is_async=True)
        dp = warpgroup_mma(do_s, v_mine.permute((1, 0)), s_zero, use_acc=False, is_async=True)
        m, h = _tile_rows(t, n_mt_div, mt_lo, hk, group, ROWS)
        lse2, lo = _tile_lse(lse_ring, LSE_LO + row_b + h.to(gl.int64) * stride_lh + m, 0, rows, Sq - m, row_s,
                             USE_LO, True)
        if HAS_ALIBI:
            slope = gl.load(SL + h * stride_sh)
        else:
            slope = 0.0
        sv = warpgroup_mma_wait(1, deps=(s, ))  # (S retired; dP may still run)
        if _tile_masked(t, n_mt_div, n_masked, n_lfull, tail, HAS_WL):
            p, tc = _probs_qk(sv, rows, cols, m, nc, lse2, lo, Sk, offset, span, qk_scale, scale, softcap, slope,
                              alibi_off, True, CAUSAL, HAS_WL, HAS_SOFTCAP, HAS_ALIBI, USE_LO, FUSE)
        else:
            p, tc = _probs_qk(sv, rows, cols, m, nc, lse2, lo, Sk, offset, span, qk_scale, scale, softcap, slope,
                              alibi_off, False, CAUSAL, HAS_WL, HAS_SOFTCAP, HAS_ALIBI, USE_LO, FUSE)
        # this consumer's columns of the shared P tile, once both consumers' products of tile
        # t - 1 have read it; then dV's product runs while dS is formed
        if t > 0:
            mbarrier.wait(pds_free, (t - 1) & 1)
        p_mine.store(p.to(dtype))
        fence_async_shared()
        mbarrier.arrive(p_ready, count=1)
        delta = delta_ring.index(0).load(row_s)
        dpv = warpgroup_mma_wait(0, deps=(dp, ))
        ds = p * (dpv - delta[:, None])
        if HAS_SOFTCAP:  # with respect to the raw product
            ds = ds * (1.0 - tc * tc)
        mbarrier.wait(p_ready, t & 1)  # the other's columns stored too
        dv = warpgroup_mma(p_smem.permute((1, 0)), do_s.slice(ME * DH, DH, dim=1), dv, is_async=True)
        ds_mine.store(ds.to(dtype))
        fence_async_shared()
        mbarrier.arrive(ds_ready, count=1)
        mbarrier.wait(ds_ready, t & 1)
        dk = warpgroup_mma(ds_smem.permute((1, 0)), q_s.slice(ME * DH, DH, dim=1), dk, is_async=True)
        # dQ_t's columns in two [64, DH / 2] parts, one after the other (a whole [64, DH] part
        # beside dK and dV spilled: 368 B of stack a thread)
        dq = warpgroup_mma(ds_smem, k_lo, dq_zero, use_acc=False, is_async=True)
        # Q and dO are read by all of this consumer's products once dV's and dK's retire: the
        # slot goes back to the loader while dQ_t's products still run (its load, which one slot
        # leaves exposed, starts a product earlier)
        dv, dk = warpgroup_mma_wait(1, deps=(dv, dk))
        mbarrier.arrive(empty.index(0), count=1)
        dq = warpgroup_mma_wait(0, deps=(dq, ))
        mbarrier.wait(dq_empty, (t & 1) ^ 1)  # the writer has handed the previous tile's parts on
        _stage_dq(dq, dq_smem, 0, ROWS, DQ_N)
        dq = warpgroup_mma(ds_smem, k_hi, dq_zero, use_acc=False, is_async=True)
        dq = warpgroup_mma_wait(0, deps=(dq, ))
        mbarrier.arrive(pds_free, count=1)
        _stage_dq(dq, dq_smem, 2, ROWS, DQ_N)
        fence_async_shared()
        mbarrier.arrive(dq_full, count=1)
    # dK, dV columns through the Q and dO slot (reinterpreted as two [64, DH] boxes each) once
    # both consumers' last products have read it; the copy engine clips rows past Sk
    if T > 0:
        mbarrier.wait(pds_free, (T - 1) & 1)
    box_layout: gl.constexpr = dk_desc.layout
    dk_out = q_ring._reinterpret(dtype, [2] + dk_desc.block_type.shape, box_layout).index(ME)
    dv_out = do_ring._reinterpret(dtype, [2] + dv_desc.block_type.shape, box_layout).index(ME)
    dk_out.reshape([ROWS, DH]).store((dk * scale).to(dtype))
    dv_out.reshape([ROWS, DH]).store(dv.to(dtype))
    fence_async_shared()
    copy_out(dk_desc, b, n0, hk, k_start, Sk, dk_out, VARLEN, ME * DH)
    copy_out(dv_desc, b, n0, hk, k_start, Sk, dv_out, VARLEN, ME * DH)
    tma.store_wait(0)


@gluon.jit
def _wide_consumer1(dk_desc, dv_desc, lse_ring, LSE_LO, delta_ring, k_smem, v_smem, kv_bar, q_ring, do_ring, ready,
                    empty, p_smem, ds_smem, p_ready, ds_ready, pds_free, dq_smem, dq_full, dq_empty, b, hk, group, n0, k_start,
                    Sk, Sq, offset, span, T, n_mt, mt_lo, n_masked, n_lfull, row_b, stride_lh, qk_scale, scale,
                    softcap, SL, stride_sh, alibi_off, CAUSAL: gl.constexpr, HAS_WL: gl.constexpr,
                    HAS_SOFTCAP: gl.constexpr, HAS_ALIBI: gl.constexpr, D: gl.constexpr, VARLEN: gl.constexpr,
                    USE_LO: gl.constexpr, DQ_N: gl.constexpr):
    # the second half's keys and columns, in a worker partition
    _wide_consumer(dk_desc, dv_desc, lse_ring, LSE_LO, delta_ring, k_smem, v_smem, kv_bar, q_ring, do_ring, ready, empty,
                   p_smem, ds_smem, p_ready, ds_ready, pds_free, dq_smem, dq_full, dq_empty, b, hk, group, n0, k_start, Sk, Sq,
                   offset, span, T, n_mt, mt_lo, n_masked, n_lfull, row_b, stride_lh, qk_scale, scale, softcap, SL,
                   stride_sh, alibi_off, 1, CAUSAL, HAS_WL, HAS_SOFTCAP, HAS_ALIBI, D, VARLEN, USE_LO, DQ_N)


@gluon.jit
def _wide_loader(q_desc, k_desc, v_desc, do_desc, k_smem, v_smem, kv_bar, q_ring, do_ring, ready, empty, lse_ring,
                 delta_ring, LSE2, DELTA, row_b, stride_lh, b, hk, group, n0, k_start, Sk, q_start, Sq, T, n_mt, mt_lo,
                 VARLEN: gl.constexpr):
    """K and V once; then each query tile's Q and dO into the one slot once both consumers are
    done with the previous tile, its lse and delta with them (`_stats_loader`'s scheme:
    asynchronous copies that complete on the tile's ready barrier; zeros past the sequence's end)."""
    copy_pair(k_desc, v_desc, b, n0, hk, k_start, Sk, kv_bar, k_smem, v_smem, VARLEN)
    stat_layout: gl.constexpr = gl.BlockedLayout([ROWS // 32], [32], [1], [0])
    idx = gl.arange(0, ROWS, layout=stat_layout)
    n_mt_div = gl.maximum(n_mt, 1)
    for t in range(T):
        mbarrier.wait(empty.index(0), (t & 1) ^ 1)
        m, h = _tile_rows(t, n_mt_div, mt_lo, hk, group, ROWS)
        row0 = row_b + h.to(gl.int64) * stride_lh + m
        ok = idx < Sq - m
        async_copy.async_copy_global_to_shared(lse_ring.index(0), LSE2 + row0 + idx, mask=ok)
        async_copy.async_copy_global_to_shared(delta_ring.index(0), DELTA + row0 + idx, mask=ok)
        # (before the copy engine's expect-arrive: each thread's pending copies hold the phase open)
        async_copy.mbarrier_arrive(ready.index(0))
        copy_pair(q_desc, do_desc, b, m, h, q_start, Sq, ready.index(0), q_ring.index(0), do_ring.index(0), VARLEN)


@gluon.jit
def _reduce_cols(dq_desc, buf, full, empty, t, b, m, h, col, q_start, Sq, NP: gl.constexpr, DQ_N: gl.constexpr,
                 VARLEN: gl.constexpr):
    # one consumer's columns [col, col + NP * DQ_N) of tile t's dQ_t, once written; rows past the
    # sequence's end are clipped by the copy engine
    mbarrier.wait(full, t & 1)
    for p in gl.static_range(NP):
        reduce_out(dq_desc, b, m, h, col + p * DQ_N, q_start, Sq, buf.index(p), VARLEN)
    tma.store_wait(0)
    mbarrier.arrive(empty, count=1)


@gluon.jit
def _wide_writer(dq_desc, dq_smem0, dq_smem1, dq_full, dq_empty, b, hk, group, q_start, Sq, T, n_mt, mt_lo,
                 D: gl.constexpr, DQ_N: gl.constexpr, VARLEN: gl.constexpr):
    """Each tile's two dQ_t column halves into the float32 accumulator by the copy engine's
    reduce-add; a half's buffer goes back to its consumer once the reduces have read it."""
    DH: gl.constexpr = D // 2
    n_mt_div = gl.maximum(n_mt, 1)
    for t in range(T):
        m, h = _tile_rows(t, n_mt_div, mt_lo, hk, group, ROWS)
        _reduce_cols(dq_desc, dq_smem0, dq_full.index(0), dq_empty.index(0), t, b, m, h, 0, q_start, Sq, DH // DQ_N,
                     DQ_N, VARLEN)
        _reduce_cols(dq_desc, dq_smem1, dq_full.index(1), dq_empty.index(1), t, b, m, h, DH, q_start, Sq, DH // DQ_N,
                     DQ_N, VARLEN)


@gluon.jit
def attn_bwd_dkdv_wide_sm90_kernel(q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, LSE2, LSE_LO, DELTA, FAR,
                                   stride_lb, stride_lh, CU_Q, CU_K, ORDER, Hq, Sq, Sk, total_q, total_k, group,
                                   offset, bottom_right, span, qk_scale, scale, softcap, SLOPES, stride_sb,
                                   stride_sh, right, dq_desc, CAUSAL: gl.constexpr, HAS_WL: gl.constexpr,
                                   HAS_SOFTCAP: gl.constexpr, HAS_ALIBI: gl.constexpr, D: gl.constexpr,
                                   VARLEN: gl.constexpr, HAS_LO: gl.constexpr, LO_PASS: gl.constexpr,
                                   FAR_READY: gl.constexpr, CONSUMER_REGS: gl.constexpr, LOADER_REGS: gl.constexpr,
                                   num_warps: gl.constexpr):
    """dK, dV of one 64-key block and its adds to dQ (unscaled); the arguments mean
    `attn_bwd_dkdv_ws_sm90_kernel`'s (q, k, v, dO boxes: 64 rows, D wide; dK, dV boxes: 64 rows,
    D / 2 wide, one consumer's columns), but LSE2 and FAR as the half-dQ kernel's."""
    gl.static_assert(D == 256, "the wide kernel serves D = 256")
    gl.static_assert(FAR_READY or not HAS_LO, "with lse_lo, FAR comes filled (LSE2 is not lse: no scan)")
    dtype: gl.constexpr = q_desc.dtype
    DQ_N: gl.constexpr = dq_desc.block_type.shape[len(dq_desc.block_type.shape) - 1]
    bh, b, hk, n0, q_start, Sq, k_start, Sk, offset, row_b = key_block(CU_Q, CU_K, ORDER, Hq, group, Sq, Sk, total_q,
                                                                       total_k, offset, bottom_right, stride_lb,
                                                                       ROWS, VARLEN, CAUSAL, D)
    SL = SLOPES + b * stride_sb
    alibi_off = offset - right
    mt_lo, n_mt, n_masked, n_lfull = query_window(n0, Sq, Sk, offset, span, ROWS, ROWS, CAUSAL, HAS_WL)
    T = n_mt * group
    # lse_lo's two launches, as the other dK/dV kernels'
    USE_LO: gl.constexpr = LO_PASS
    T, active = _lo_launch(FAR, LSE2, bh, row_b, stride_lh, hk, group, Sq, n0, T, HAS_LO, LO_PASS, FAR_READY, num_warps)

    k_smem = gl.allocate_shared_memory(dtype, k_desc.block_type.shape, k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, v_desc.block_type.shape, v_desc.layout)
    q_ring = gl.allocate_shared_memory(dtype, [1] + q_desc.block_type.shape, q_desc.layout)
    do_ring = gl.allocate_shared_memory(dtype, [1] + do_desc.block_type.shape, do_desc.layout)
    # P and dS, [64 queries, 64 keys]: each consumer stores 32 columns, i.e. one 64-byte swizzle
    # atom (a 128-byte swizzle would put both consumers' columns in every atom)
    pds_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=64, element_bitwidth=16, rank=2)
    p_smem = gl.allocate_shared_memory(dtype, [ROWS, ROWS], pds_layout)
    ds_smem = gl.allocate_shared_memory(dtype, [ROWS, ROWS], pds_layout)
    dq_smem0 = gl.allocate_shared_memory(gl.float32, [D // 2 // DQ_N] + dq_desc.block_type.shape, dq_desc.layout)
    dq_smem1 = gl.allocate_shared_memory(gl.float32, [D // 2 // DQ_N] + dq_desc.block_type.shape, dq_desc.layout)
    stat_smem: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0])
    lse_ring = gl.allocate_shared_memory(gl.float32, [1, ROWS], stat_smem)
    delta_ring = gl.allocate_shared_memory(gl.float32, [1, ROWS], stat_smem)
    kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    ready = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    dq_full = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    dq_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    # the shared P and dS tiles: each stored by both consumers (ready), both read by both's products (free)
    p_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    ds_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    pds_free = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_bar, count=1)
    mbarrier.init(ready.index(0), count=1)
    mbarrier.init(empty.index(0), count=2)
    for i in gl.static_range(2):
        mbarrier.init(dq_full.index(i), count=1)
        mbarrier.init(dq_empty.index(i), count=1)
    mbarrier.init(p_ready, count=2)
    mbarrier.init(ds_ready, count=2)
    mbarrier.init(pds_free, count=2)
    fence_async_shared()

    if active:
        gl.warp_specialize([
            (_wide_consumer, (dk_desc, dv_desc, lse_ring, LSE_LO, delta_ring, k_smem, v_smem, kv_bar, q_ring, do_ring,
                              ready, empty, p_smem, ds_smem, p_ready, ds_ready, pds_free, dq_smem0, dq_full.index(0),
                              dq_empty.index(0), b, hk, group, n0, k_start, Sk, Sq, offset, span, T, n_mt, mt_lo,
                              n_masked, n_lfull, row_b, stride_lh, qk_scale, scale, softcap, SL, stride_sh, alibi_off,
                              0, CAUSAL, HAS_WL, HAS_SOFTCAP, HAS_ALIBI, D, VARLEN, USE_LO, DQ_N)),
            (_wide_consumer1, (dk_desc, dv_desc, lse_ring, LSE_LO, delta_ring, k_smem, v_smem, kv_bar, q_ring, do_ring,
                               ready, empty, p_smem, ds_smem, p_ready, ds_ready, pds_free, dq_smem1, dq_full.index(1),
                               dq_empty.index(1), b, hk, group, n0, k_start, Sk, Sq, offset, span, T, n_mt, mt_lo,
                               n_masked, n_lfull, row_b, stride_lh, qk_scale, scale, softcap, SL, stride_sh,
                               alibi_off, CAUSAL, HAS_WL, HAS_SOFTCAP, HAS_ALIBI, D, VARLEN, USE_LO, DQ_N)),
            (_wide_loader, (q_desc, k_desc, v_desc, do_desc, k_smem, v_smem, kv_bar, q_ring, do_ring, ready, empty,
                            lse_ring, delta_ring, LSE2, DELTA, row_b, stride_lh, b, hk, group, n0, k_start, Sk,
                            q_start, Sq, T, n_mt, mt_lo, VARLEN)),
            (_wide_writer, (dq_desc, dq_smem0, dq_smem1, dq_full, dq_empty, b, hk, group, q_start, Sq, T, n_mt, mt_lo,
                            D, DQ_N, VARLEN)),
        ], [4, 1, 1], [CONSUMER_REGS, LOADER_REGS, LOADER_REGS])
