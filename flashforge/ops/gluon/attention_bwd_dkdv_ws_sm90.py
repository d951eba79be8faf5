"""Hopper (sm_90) dK/dV kernel in Gluon, warp-specialized, with dQ fused: a program owns 128 keys.

Why (issue 18): the ordered pair of backward kernels runs 7 products a (query tile, key tile)
pair, the dQ kernel recomputing S and dP; FA3 runs 5 by adding dQ_t = dS K into a float32
accumulator.  `attention_bwd_sm90`'s FUSED_DQ does that in one warpgroup, but with the reduce
waits in its instruction stream and 245-255 registers (D = 128 spills); it measured level with the
pair (RESULTS.md v0.8.9).  Here:

- two consumer warpgroups (partitions) of 64 keys each share every Q and dO tile, which a loader
  warp copies into a ring (ready / empty barriers; both consumers release a slot), so each SM
  copies each query tile once for 128 keys;
- each consumer computes, per query tile, S = Q K_c^T and dP = dO V_c^T (queries by keys, so
  lse and delta cost two registers a thread, not sixteen), then P and dS into shared memory,
  dV += P^T dO, dK += dS^T Q, and dQ_t = dS K_c, one product D wide stored as 32-column float32
  boxes into its dQ buffer (SHARED_DQ: consumer t % 2 computes tile t's over both halves' keys,
  `_kv_consumer`);
- a writer warp hands each consumer's buffer to the copy engine's reduce-add (into the zeroed
  float32 accumulator) and waits for it to be read, so no consumer waits on a reduce.

Both consumers walk the union of their query tiles (a 128-key block's range); a tile one
consumer's keys do not see is masked whole there (P = dS = 0).  lse's low part: the two-launch
scheme of `attn_bwd_dkdv_sm90_kernel` (LO_PASS).  Scope: D <= 128, 64-row query tiles, not
deterministic (the adds come in varying order), no split of dK and dV.

Where it stands (H200, bf16, RESULTS.md v0.9.1, v0.9.2): with SHARED_DQ the table's
backward for calls with >= 8192 keys and no narrower window, not deterministic (the "bwd_kv_ws"
entries, `triton/attention._long_bwd_kv`): 1.05-1.13x the ordered pair's backward at S = 8k and 16k
(D = 64 S16k causal 386 against 341 TFLOP/s, D = 128 S16k 498 against 452), level at 4k, 0.82-0.89x
at 1k, 0.85x with a causal 1023 window.  Without SHARED_DQ (each consumer its own dQ over its 64
keys, opt-in) 1.00-1.08x at S >= 4k.  Ablations put the rest in shared-memory traffic: without the
dQ product it ran 1.2-1.3x, without the reduce-adds 1.03-1.19x.
"""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_init, warpgroup_mma_wait)

from .attention_bwd_sm90 import _dst_tile, _lo_needed, _row_stats, p_and_ds
from .ws_pipeline import HALF
from .pipeline import copy_out, copy_pair, key_block, query_window, reduce_out, slot, wait
from .rounding import fused_score


@gluon.jit
def _lo_launch(FAR, LSE, bh, row_b, stride_lh, hk, group, Sq, n0, T, HAS_LO: gl.constexpr, LO_PASS: gl.constexpr,
               FAR_READY: gl.constexpr, num_warps: gl.constexpr):
    """(T, active) of a warp-specialized dK/dV program in lse_lo's two launches: the second
    (LO_PASS) runs only the blocks of the GQA groups FAR marks (the others are not active: they
    leave the first launch's dK, dV as they are); the first, with lse_lo (HAS_LO), leaves those
    blocks to it (their T = 0: dK, dV written as zeros, then redone) and marks FAR itself unless
    the dQ kernel did (FAR_READY)."""
    if LO_PASS:
        active = gl.load(FAR + bh) != 0
    else:
        active = True
        if HAS_LO:
            if FAR_READY:
                far = gl.load(FAR + bh) != 0
            else:
                far = _lo_needed(LSE, row_b, stride_lh, hk, group, Sq, num_warps)
                if n0 == 0:  # (the first key block)
                    gl.store(FAR + bh, far.to(gl.int32))
            if far:
                T = 0
    if not active:
        T = 0
    return T, active


@gluon.jit
def _tile_rows(t, n_mt, mt_lo, hk, group, BLOCK_M: gl.constexpr):
    # (first query row, head) of flattened tile t: (head of the group, query tile)
    g = t // n_mt
    return (mt_lo + t - g * n_mt) * BLOCK_M, hk * group + g


@gluon.jit
def _kv_consumer(dk_desc, dv_desc, LSE, LSE_LO, DELTA, k_smem, v_smem, kv_bar, q_ring, do_ring, ready, empty, ds_smem,
                 dq_smem, dq_full, dq_empty, b, hk, group, n0, k_start, Sk, q_start, Sq, offset, span, T, n_mt, mt_lo,
                 n_masked, n_lfull, row_b, stride_lh, qk_scale, scale, softcap, SL, stride_sh, alibi_off,
                 ME: gl.constexpr, CAUSAL: gl.constexpr, HAS_WL: gl.constexpr, HAS_SOFTCAP: gl.constexpr,
                 HAS_ALIBI: gl.constexpr, BLOCK_M: gl.constexpr, D: gl.constexpr, STAGES: gl.constexpr,
                 VARLEN: gl.constexpr, USE_LO: gl.constexpr, DQ_N: gl.constexpr, p_smem, k_other, kv_bar_other,
                 ds_other, ds_ready, ds_free, ds_free_other, SHARED_DQ: gl.constexpr):
    """dK, dV of keys n0 + ME * 64 + [0, 64), and their share of every tile's dQ.

    The scores are formed queries by keys (S = Q K^T, as the dQ kernel does), so lse, its low part
    and delta are row vectors of two registers a thread (keys by queries, each was sixteen);
    P and dS go through shared memory, where their transposes are the A operands of
    dV += P^T dO and dK += dS^T Q, and dS itself that of dQ_t = dS K.

    SHARED_DQ: tile t's dQ_t is one product over all 128 keys, by consumer t % 2, from both
    consumers' dS (`ds_ready`: both written) and K; it frees the other's dS (`ds_free_other`), which
    that consumer waits for before writing its next one.  One float32 buffer and one set of
    reduce-adds a tile instead of two: the buffer's store and the copy engine's read are half the
    shared-memory traffic they were (RESULTS.md v0.9.1: the kernel is bound by that traffic)."""
    dtype: gl.constexpr = k_smem.dtype
    FUSE: gl.constexpr = fused_score(dtype, HAS_SOFTCAP=HAS_SOFTCAP, HAS_ALIBI=HAS_ALIBI)
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, HALF, 16])
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, D, 16])
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    NP: gl.constexpr = D // DQ_N
    gl.static_assert((NP == 2) or (NP == 4), "D = 64 or 128: two or four float32 boxes of dQ")

    nc, n_masked_c, n_lfull_c, tail = _half_masks(n0, n_masked, n_lfull, Sk, offset, span, n_mt, mt_lo, ME, CAUSAL,
                                                  HAS_WL, BLOCK_M)
    n_mt_div = gl.maximum(n_mt, 1)
    s_zero = gl.zeros([BLOCK_M, HALF], gl.float32, layout=s_layout)
    dq_zero = gl.zeros([BLOCK_M, D], gl.float32, layout=acc_layout)
    # (as in-flight accumulators: each tile's dK and dV products retire at the next tile's wait)
    dk = warpgroup_mma_init(gl.zeros([HALF, D], gl.float32, layout=acc_layout))
    dv = warpgroup_mma_init(gl.zeros([HALF, D], gl.float32, layout=acc_layout))
    k_t, v_t, k_o = _resident_kv(k_smem, v_smem, kv_bar, k_other, kv_bar_other, D, SHARED_DQ)
    for t in range(T):
        wait(ready, t, STAGES)
        q_s = slot(q_ring, t, BLOCK_M, D, STAGES)
        do_s = slot(do_ring, t, BLOCK_M, D, STAGES)
        s = warpgroup_mma(q_s, k_t.permute((1, 0)), s_zero, use_acc=False, is_async=True)
        dp = warpgroup_mma(do_s, v_t.permute((1, 0)), s_zero, use_acc=False, is_async=True)
        m, h = _tile_rows(t, n_mt_div, mt_lo, hk, group, BLOCK_M)
        o_m = m + gl.arange(0, BLOCK_M, layout=row_s)
        lse2, lo, delta = _row_stats(LSE, LSE_LO, DELTA, row_b + h.to(gl.int64) * stride_lh, o_m, Sq, USE_LO)
        if HAS_ALIBI:
            slope = gl.load(SL + h * stride_sh)
        else:
            slope = 0.0
        # (retires the previous tile's dV and dK as well, so its Q and dO slot goes back)
        s, dp, dv, dk = warpgroup_mma_wait(0, deps=(s, dp, dv, dk))
        if t > 0:
            mbarrier.arrive(empty.index((t - 1) % STAGES), count=1)
        if _tile_masked(t, n_mt_div, n_masked_c, n_lfull_c, tail, HAS_WL):
            p, ds = p_and_ds(s, dp, nc, o_m, lse2, lo, delta, Sk, offset, span, qk_scale, scale, softcap, slope,
                             alibi_off, s_layout, True, CAUSAL, HAS_WL, HALF, USE_LO, FUSE, HAS_SOFTCAP, HAS_ALIBI)
        else:
            p, ds = p_and_ds(s, dp, nc, o_m, lse2, lo, delta, Sk, offset, span, qk_scale, scale, softcap, slope,
                             alibi_off, s_layout, False, CAUSAL, HAS_WL, HALF, USE_LO, FUSE, HAS_SOFTCAP, HAS_ALIBI)
        if SHARED_DQ:
            p_smem.store(p.to(dtype))
            _ds_wait_free(ds_free, t, ME, SHARED_DQ)
            ds_smem.store(ds.to(dtype))
            fence_async_shared()
            mbarrier.arrive(ds_ready, count=1)
            # (both branches yield dV and dK in flight, as the loop carries them)
            dv = warpgroup_mma_init(dv)
            dk = warpgroup_mma_init(dk)
            if t % 2 == ME:
                mbarrier.wait(ds_ready, t & 1)
                dq = warpgroup_mma(ds_smem, k_t, dq_zero, use_acc=False, is_async=True)
                dq = warpgroup_mma(ds_other, k_o, dq, is_async=True)
                dv = warpgroup_mma(p_smem.permute((1, 0)), do_s, dv, is_async=True)
                dk = warpgroup_mma(ds_smem.permute((1, 0)), q_s, dk, is_async=True)
                dq = warpgroup_mma_wait(2, deps=(dq, ))
                mbarrier.arrive(ds_free_other, count=1)
                _store_dq(dq, dq_smem, dq_full, dq_empty, t // 2, BLOCK_M, D, DQ_N)
            else:
                dv = warpgroup_mma(p_smem.permute((1, 0)), do_s, dv, is_async=True)
                dk = warpgroup_mma(ds_smem.permute((1, 0)), q_s, dk, is_async=True)
        else:
            p_smem.store(p.to(dtype))
            ds_smem.store(ds.to(dtype))
            fence_async_shared()
            # dQ_t = dS K over these 64 keys, one product D wide (narrower ones would each read dS
            # again), issued before dV and dK, so it retires first and is stored while those run
            dq = warpgroup_mma(ds_smem, k_t, dq_zero, use_acc=False, is_async=True)
            dv = warpgroup_mma(p_smem.permute((1, 0)), do_s, dv, is_async=True)
            dk = warpgroup_mma(ds_smem.permute((1, 0)), q_s, dk, is_async=True)
            dq = warpgroup_mma_wait(2, deps=(dq, ))
            _store_dq(dq, dq_smem, dq_full, dq_empty, t, BLOCK_M, D, DQ_N)
    dv, dk = warpgroup_mma_wait(0, deps=(dv, dk))
    _dkdv_out(dk, dv, dk_desc, dv_desc, k_smem, v_smem, empty, ds_free, b, nc, hk, k_start, Sk, T, scale, ME, D,
              STAGES, VARLEN, SHARED_DQ, True)


@gluon.jit
def _rs_consumer(dk_desc, dv_desc, LSE, LSE_LO, DELTA, k_smem, v_smem, kv_bar, q_ring, do_ring, ready, empty, ds_smem,
                 dq_smem, dq_full, dq_empty, b, hk, group, n0, k_start, Sk, q_start, Sq, offset, span, T, n_mt, mt_lo,
                 n_masked, n_lfull, row_b, stride_lh, qk_scale, scale, softcap, SL, stride_sh, alibi_off,
                 ME: gl.constexpr, CAUSAL: gl.constexpr, HAS_WL: gl.constexpr, HAS_SOFTCAP: gl.constexpr,
                 HAS_ALIBI: gl.constexpr, BLOCK_M: gl.constexpr, D: gl.constexpr, STAGES: gl.constexpr,
                 VARLEN: gl.constexpr, USE_LO: gl.constexpr, DQ_N: gl.constexpr, k_other, kv_bar_other,
                 ds_other, ds_ready, ds_free, ds_free_other, SHARED_DQ: gl.constexpr):
    """`_kv_consumer`'s work with the scores formed keys by queries (S^T = K Q^T, as the
    one-warpgroup dK/dV kernel forms them): P^T and dS^T stay in registers as the A operands of
    dV += P^T dO and dK += dS^T Q (FA3's register-operand products), and only dS^T goes through
    shared memory, for dQ_t = dS K (its transpose, read as the A operand).  A consumer's shared-memory
    traffic a tile drops by P's store and two A-operand reads (~24 of ~120 KB at D = 64); lse, its
    low part and delta cost sixteen registers a thread each.  D = 64 only: at D = 128 the two
    [64, 128] float32 accumulators and the register operands leave ptxas no room, and it
    serializes the products (tools/sm90_compile_check.py --wgmma).  The register operands of a
    tile's dV and dK products are carried to the next tile's wait and named in it, so that ptxas
    sees them live until those products retire (without that it serialized every variant)."""
    dtype: gl.constexpr = k_smem.dtype
    FUSE: gl.constexpr = fused_score(dtype, HAS_SOFTCAP=HAS_SOFTCAP, HAS_ALIBI=HAS_ALIBI)
    gl.static_assert(D == 64, "the register-operand consumer is for D = 64")
    # S^T / dP^T: [keys, queries]; dK / dV: [keys, D]; dQ_t: [queries, D]
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_M, 16])
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, D, 16])
    op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    col_s: gl.constexpr = gl.SliceLayout(0, s_layout)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    nc, n_masked_c, n_lfull_c, tail = _half_masks(n0, n_masked, n_lfull, Sk, offset, span, n_mt, mt_lo, ME, CAUSAL,
                                                  HAS_WL, BLOCK_M)
    n_mt_div = gl.maximum(n_mt, 1)
    o_n = nc + gl.arange(0, HALF, layout=row_s)
    s_zero = gl.zeros([HALF, BLOCK_M], gl.float32, layout=s_layout)
    dq_zero = gl.zeros([BLOCK_M, D], gl.float32, layout=acc_layout)
    dk = gl.zeros([HALF, D], gl.float32, layout=acc_layout)
    dv = gl.zeros([HALF, D], gl.float32, layout=acc_layout)
    k_t, v_t, k_o = _resident_kv(k_smem, v_smem, kv_bar, k_other, kv_bar_other, D, SHARED_DQ)
    for t in range(T):
        wait(ready, t, STAGES)
        q_s = slot(q_ring, t, BLOCK_M, D, STAGES)
        do_s = slot(do_ring, t, BLOCK_M, D, STAGES)
        st = warpgroup_mma(k_t, q_s.permute((1, 0)), s_zero, use_acc=False, is_async=True)
        dpt = warpgroup_mma(v_t, do_s.permute((1, 0)), s_zero, use_acc=False, is_async=True)
        st, dpt = warpgroup_mma_wait(0, deps=(st, dpt))
        if _tile_masked(t, n_mt_div, n_masked_c, n_lfull_c, tail, HAS_WL):
            pt, dst = _dst_tile(st, dpt, t, n_mt_div, mt_lo, hk, group, row_b, stride_lh, Sq, o_n, offset, span,
                                qk_scale, scale, softcap, SL, stride_sh, alibi_off, LSE, LSE_LO, DELTA, col_s, CAUSAL,
                                HAS_WL, HAS_SOFTCAP, HAS_ALIBI, True, BLOCK_M, USE_LO, FUSE=FUSE, Sk=Sk,
                                SK_MASK=True)
        else:
            pt, dst = _dst_tile(st, dpt, t, n_mt_div, mt_lo, hk, group, row_b, stride_lh, Sq, o_n, offset, span,
                                qk_scale, scale, softcap, SL, stride_sh, alibi_off, LSE, LSE_LO, DELTA, col_s, CAUSAL,
                                HAS_WL, HAS_SOFTCAP, HAS_ALIBI, False, BLOCK_M, USE_LO, FUSE=FUSE)
        dst16 = dst.to(dtype)
        _ds_wait_free(ds_free, t, ME, SHARED_DQ)
        ds_smem.store(dst16)
        fence_async_shared()
        pt_op = gl.convert_layout(pt.to(dtype), op_layout)
        dst_op = gl.convert_layout(dst16, op_layout)
        # one tile at a time (its products retire before the next tile's scores: in flight across
        # tiles, their register operands left ptxas short of registers and it serialized them);
        # the other consumer's products fill the tensor cores meanwhile
        if SHARED_DQ:
            mbarrier.arrive(ds_ready, count=1)
            if t % 2 == ME:
                mbarrier.wait(ds_ready, t & 1)
                dq = warpgroup_mma(ds_smem.permute((1, 0)), k_t, dq_zero, use_acc=False, is_async=True)
                dq = warpgroup_mma(ds_other.permute((1, 0)), k_o, dq, is_async=True)
                dv = warpgroup_mma(pt_op, do_s, dv, is_async=True)
                dk = warpgroup_mma(dst_op, q_s, dk, is_async=True)
                dq, dv, dk, pt_op, dst_op = warpgroup_mma_wait(0, deps=(dq, dv, dk, pt_op, dst_op))
                mbarrier.arrive(ds_free_other, count=1)
                mbarrier.arrive(empty.index(t % STAGES), count=1)
                _store_dq(dq, dq_smem, dq_full, dq_empty, t // 2, BLOCK_M, D, DQ_N)
            else:
                dv = warpgroup_mma(pt_op, do_s, dv, is_async=True)
                dk = warpgroup_mma(dst_op, q_s, dk, is_async=True)
                dv, dk, pt_op, dst_op = warpgroup_mma_wait(0, deps=(dv, dk, pt_op, dst_op))
                mbarrier.arrive(empty.index(t % STAGES), count=1)
        else:
            dq = warpgroup_mma(ds_smem.permute((1, 0)), k_t, dq_zero, use_acc=False, is_async=True)
            dv = warpgroup_mma(pt_op, do_s, dv, is_async=True)
            dk = warpgroup_mma(dst_op, q_s, dk, is_async=True)
            dq, dv, dk, pt_op, dst_op = warpgroup_mma_wait(0, deps=(dq, dv, dk, pt_op, dst_op))
            mbarrier.arrive(empty.index(t % STAGES), count=1)
            _store_dq(dq, dq_smem, dq_full, dq_empty, t, BLOCK_M, D, DQ_N)
    _dkdv_out(dk, dv, dk_desc, dv_desc, k_smem, v_smem, empty, ds_free, b, nc, hk, k_start, Sk, T, scale, ME, D,
              STAGES, VARLEN, SHARED_DQ, False)


@gluon.jit
def _resident_kv(k_smem, v_smem, kv_bar, k_other, kv_bar_other, D: gl.constexpr, SHARED_DQ: gl.constexpr):
    """(K, V, the other half's K) once landed, as [64, D] tiles; the other's K (SHARED_DQ: read by
    this consumer's dQ turns) is this half's K without SHARED_DQ, never read."""
    mbarrier.wait(kv_bar, 0)
    k_t = k_smem.reshape([HALF, D])
    if SHARED_DQ:
        mbarrier.wait(kv_bar_other, 0)
        k_o = k_other.reshape([HALF, D])
    else:
        k_o = k_t
    return k_t, v_smem.reshape([HALF, D]), k_o


@gluon.jit
def _tile_masked(t, n_mt_div, n_masked_c, n_lfull_c, tail, HAS_WL: gl.constexpr):
    """Whether flattened tile t needs the mask: its place among its head's query tiles is before
    n_masked_c (the causal diagonal) or from n_lfull_c on (a window's left edge), or this half's
    keys cross Sk -- zero-filled keys are masked too: their P, exp2(-lse), could overflow where
    lse is far below 0, and inf * 0 in dS K would put NaN into dQ."""
    i = t - (t // n_mt_div) * n_mt_div
    if HAS_WL:
        edge = (i < n_masked_c) | (i >= n_lfull_c)
    else:
        edge = i < n_masked_c
    return edge | tail


@gluon.jit
def _half_masks(n0, n_masked, n_lfull, Sk, offset, span, n_mt, mt_lo, ME: gl.constexpr, CAUSAL: gl.constexpr,
                HAS_WL: gl.constexpr, BLOCK_M: gl.constexpr):
    """(first key, masked query tiles before, first masked one after, keys cross Sk) of consumer
    ME's half: the causal diagonal crosses the tiles before n_masked (tiles wholly before these keys
    are masked whole), a window's left edge those from n_lfull on."""
    nc = n0 + ME * HALF
    if CAUSAL:
        mt_full = gl.maximum(gl.cdiv(gl.maximum(nc + HALF - 1 - offset, 0), BLOCK_M), mt_lo)
        n_masked_c = gl.minimum(mt_full - mt_lo, n_mt)
    else:
        n_masked_c = n_masked
    if HAS_WL:
        n_lfull_c = gl.maximum(nc - offset + span + 1, 0) // BLOCK_M - mt_lo
    else:
        n_lfull_c = n_lfull
    return nc, n_masked_c, n_lfull_c, nc + HALF > Sk


@gluon.jit
def _ds_wait_free(ds_free, t, ME: gl.constexpr, SHARED_DQ: gl.constexpr):
    # SHARED_DQ: before writing tile t's dS, the other consumer's dQ of tile t - 1 must have read it
    if SHARED_DQ:
        if (t % 2 == ME) & (t > 0):
            mbarrier.wait(ds_free, ((t + ME) // 2 - 1) & 1)


@gluon.jit
def _dkdv_out(dk, dv, dk_desc, dv_desc, k_smem, v_smem, empty, ds_free, b, nc, hk, k_start, Sk, T, scale,
              ME: gl.constexpr, D: gl.constexpr, STAGES: gl.constexpr, VARLEN: gl.constexpr, SHARED_DQ: gl.constexpr,
              RELEASE_LAST: gl.constexpr):
    """The last tile's Q and dO slot released (RELEASE_LAST: not yet); dK, dV through K's and
    V's buffers (read no more) and TMA, which clips rows past Sk."""
    dtype: gl.constexpr = k_smem.dtype
    if RELEASE_LAST:
        if T > 0:
            mbarrier.arrive(empty.index((T - 1) % STAGES), count=1)
    if SHARED_DQ:
        if (T > 0) & ((T - 1) % 2 != ME):  # K's buffer takes dK: the other's last dQ must have read it
            mbarrier.wait(ds_free, ((T + ME) // 2 - 1) & 1)
    k_smem.reshape([HALF, D]).store((dk * scale).to(dtype))
    v_smem.reshape([HALF, D]).store(dv.to(dtype))
    fence_async_shared()
    copy_out(dk_desc, b, nc, hk, k_start, Sk, k_smem, VARLEN)
    copy_out(dv_desc, b, nc, hk, k_start, Sk, v_smem, VARLEN)
    tma.store_wait(0)


@gluon.jit
def _store_dq(dq, dq_smem, dq_full, dq_empty, use, BLOCK_M: gl.constexpr, D: gl.constexpr, DQ_N: gl.constexpr):
    """A tile's dQ_t (unscaled: the caller scales the sum) into this consumer's buffer, its
    `use`-th, once the writer has handed the previous one to the copy engine, in boxes of DQ_N
    columns (a float32 TMA box is 32 wide): halves of the register tile, each thread's own
    registers (no data moves)."""
    mbarrier.wait(dq_empty, (use & 1) ^ 1)
    _put_dq(dq, dq_smem, BLOCK_M, D, DQ_N)
    mbarrier.arrive(dq_full, count=1)


@gluon.jit
def _put_dq(dq, dq_smem, BLOCK_M: gl.constexpr, D: gl.constexpr, DQ_N: gl.constexpr):
    """`_store_dq`'s stores and the fence that hands them to the copy engine."""
    NP: gl.constexpr = D // DQ_N
    lo_half, hi_half = dq.reshape([BLOCK_M, 2, D // 2]).permute(0, 2, 1).split()
    if NP == 2:
        dq_smem.index(0).reshape([BLOCK_M, DQ_N]).store(lo_half)
        dq_smem.index(1).reshape([BLOCK_M, DQ_N]).store(hi_half)
    else:
        q0, q1 = lo_half.reshape([BLOCK_M, 2, DQ_N]).permute(0, 2, 1).split()
        q2, q3 = hi_half.reshape([BLOCK_M, 2, DQ_N]).permute(0, 2, 1).split()
        dq_smem.index(0).reshape([BLOCK_M, DQ_N]).store(q0)
        dq_smem.index(1).reshape([BLOCK_M, DQ_N]).store(q1)
        dq_smem.index(2).reshape([BLOCK_M, DQ_N]).store(q2)
        dq_smem.index(3).reshape([BLOCK_M, DQ_N]).store(q3)
    fence_async_shared()


@gluon.jit
def _consumer(dk_desc, dv_desc, LSE, LSE_LO, DELTA, k_smem, v_smem, kv_bar, q_ring, do_ring, ready, empty, ds_smem,
              dq_smem, dq_full, dq_empty, b, hk, group, n0, k_start, Sk, q_start, Sq, offset, span, T, n_mt, mt_lo,
              n_masked, n_lfull, row_b, stride_lh, qk_scale, scale, softcap, SL, stride_sh, alibi_off,
              ME: gl.constexpr, CAUSAL: gl.constexpr, HAS_WL: gl.constexpr, HAS_SOFTCAP: gl.constexpr,
              HAS_ALIBI: gl.constexpr, BLOCK_M: gl.constexpr, D: gl.constexpr, STAGES: gl.constexpr,
              VARLEN: gl.constexpr, USE_LO: gl.constexpr, DQ_N: gl.constexpr, p_smem, k_other, kv_bar_other,
              ds_other, ds_ready, ds_free, ds_free_other, SHARED_DQ: gl.constexpr, RS: gl.constexpr):
    # consumer ME: scores keys by queries with register operands (RS, `_rs_consumer`), else
    # queries by keys (`_kv_consumer`)
    if RS:
        _rs_consumer(dk_desc, dv_desc, LSE, LSE_LO, DELTA, k_smem, v_smem, kv_bar, q_ring, do_ring, ready, empty,
                     ds_smem, dq_smem, dq_full, dq_empty, b, hk, group, n0, k_start, Sk, q_start, Sq, offset, span, T,
                     n_mt, mt_lo, n_masked, n_lfull, row_b, stride_lh, qk_scale, scale, softcap, SL, stride_sh,
                     alibi_off, ME, CAUSAL, HAS_WL, HAS_SOFTCAP, HAS_ALIBI, BLOCK_M, D, STAGES, VARLEN, USE_LO, DQ_N,
                     k_other, kv_bar_other, ds_other, ds_ready, ds_free, ds_free_other, SHARED_DQ)
    else:
        _kv_consumer(dk_desc, dv_desc, LSE, LSE_LO, DELTA, k_smem, v_smem, kv_bar, q_ring, do_ring, ready, empty,
                     ds_smem, dq_smem, dq_full, dq_empty, b, hk, group, n0, k_start, Sk, q_start, Sq, offset, span, T,
                     n_mt, mt_lo, n_masked, n_lfull, row_b, stride_lh, qk_scale, scale, softcap, SL, stride_sh,
                     alibi_off, ME, CAUSAL, HAS_WL, HAS_SOFTCAP, HAS_ALIBI, BLOCK_M, D, STAGES, VARLEN, USE_LO, DQ_N,
                     p_smem, k_other, kv_bar_other, ds_other, ds_ready, ds_free, ds_free_other, SHARED_DQ)


@gluon.jit
def _kv_consumer1(dk_desc, dv_desc, LSE, LSE_LO, DELTA, k_smem, v_smem, kv_bar, q_ring, do_ring, ready, empty, ds_smem,
                  dq_smem, dq_full, dq_empty, b, hk, group, n0, k_start, Sk, q_start, Sq, offset, span, T, n_mt, mt_lo,
                  n_masked, n_lfull, row_b, stride_lh, qk_scale, scale, softcap, SL, stride_sh, alibi_off,
                  CAUSAL: gl.constexpr, HAS_WL: gl.constexpr, HAS_SOFTCAP: gl.constexpr, HAS_ALIBI: gl.constexpr,
                  BLOCK_M: gl.constexpr, D: gl.constexpr, STAGES: gl.constexpr, VARLEN: gl.constexpr,
                  USE_LO: gl.constexpr, DQ_N: gl.constexpr, p_smem, k_other, kv_bar_other, ds_other, ds_ready,
                  ds_free, ds_free_other, SHARED_DQ: gl.constexpr, RS: gl.constexpr):
    # the second half's keys, in a worker partition
    _consumer(dk_desc, dv_desc, LSE, LSE_LO, DELTA, k_smem, v_smem, kv_bar, q_ring, do_ring, ready, empty, ds_smem,
                 dq_smem, dq_full, dq_empty, b, hk, group, n0, k_start, Sk, q_start, Sq, offset, span, T, n_mt, mt_lo,
                 n_masked, n_lfull, row_b, stride_lh, qk_scale, scale, softcap, SL, stride_sh, alibi_off, 1, CAUSAL,
                 HAS_WL, HAS_SOFTCAP, HAS_ALIBI, BLOCK_M, D, STAGES, VARLEN, USE_LO, DQ_N, p_smem, k_other,
                 kv_bar_other, ds_other, ds_ready, ds_free, ds_free_other, SHARED_DQ, RS)


@gluon.jit
def _kv_loader(q_desc, k_desc, v_desc, do_desc, k_smem0, v_smem0, k_smem1, v_smem1, kv_bars, q_ring, do_ring, ready,
               empty, b, hk, group, n0, k_start, Sk, q_start, Sq, T, n_mt, mt_lo, BLOCK_M: gl.constexpr,
               STAGES: gl.constexpr, VARLEN: gl.constexpr):
    """Each half's K and V, then the block's query tiles (Q and dO together), each into the ring's
    next slot once both consumers have released it (empty barriers start complete)."""
    copy_pair(k_desc, v_desc, b, n0, hk, k_start, Sk, kv_bars.index(0), k_smem0, v_smem0, VARLEN)
    copy_pair(k_desc, v_desc, b, n0 + HALF, hk, k_start, Sk, kv_bars.index(1), k_smem1, v_smem1, VARLEN)
    n_mt_div = gl.maximum(n_mt, 1)
    for t in range(T):
        s = t % STAGES
        mbarrier.wait(empty.index(s), ((t // STAGES) & 1) ^ 1)
        m, h = _tile_rows(t, n_mt_div, mt_lo, hk, group, BLOCK_M)
        copy_pair(q_desc, do_desc, b, m, h, q_start, Sq, ready.index(s), q_ring.index(s), do_ring.index(s), VARLEN)


@gluon.jit
def _dq_writer(dq_desc, dq_smem0, dq_smem1, dq_full, dq_empty, b, hk, group, q_start, Sq, T, n_mt, mt_lo,
               BLOCK_M: gl.constexpr, D: gl.constexpr, DQ_N: gl.constexpr, VARLEN: gl.constexpr,
               SHARED_DQ: gl.constexpr):
    """Each tile's two dQ buffers (one a consumer; SHARED_DQ: the one of consumer t % 2) into the
    float32 accumulator by the copy engine's reduce-add; a buffer goes back to its consumer once
    the reduces have read it."""
    n_mt_div = gl.maximum(n_mt, 1)
    for t in range(T):
        m, h = _tile_rows(t, n_mt_div, mt_lo, hk, group, BLOCK_M)
        if SHARED_DQ:
            if t % 2 == 0:
                _reduce_buffer(dq_desc, dq_smem0, dq_full.index(0), dq_empty.index(0), t // 2, b, m, h, q_start, Sq,
                               D, DQ_N, VARLEN)
            else:
                _reduce_buffer(dq_desc, dq_smem1, dq_full.index(1), dq_empty.index(1), t // 2, b, m, h, q_start, Sq,
                               D, DQ_N, VARLEN)
        else:
            _reduce_buffer(dq_desc, dq_smem0, dq_full.index(0), dq_empty.index(0), t, b, m, h, q_start, Sq, D, DQ_N,
                           VARLEN)
            _reduce_buffer(dq_desc, dq_smem1, dq_full.index(1), dq_empty.index(1), t, b, m, h, q_start, Sq, D, DQ_N,
                           VARLEN)


@gluon.jit
def _reduce_buffer(dq_desc, buf, full, empty, use, b, m, h, q_start, Sq, D: gl.constexpr, DQ_N: gl.constexpr,
                   VARLEN: gl.constexpr):
    # one consumer's dQ parts (the buffer's `use`-th filling), once written, added by the copy
    # engine; the buffer is free again once the reduces have read it
    mbarrier.wait(full, use & 1)
    for p in gl.static_range(D // DQ_N):
        reduce_out(dq_desc, b, m, h, p * DQ_N, q_start, Sq, buf.index(p), VARLEN)
    tma.store_wait(0)
    mbarrier.arrive(empty, count=1)


@gluon.jit
def attn_bwd_dkdv_ws_sm90_kernel(q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, LSE, LSE_LO, DELTA, FAR, stride_lb,
                                 stride_lh, CU_Q, CU_K, ORDER, Hq, Sq, Sk, total_q, total_k, group, offset,
                                 bottom_right, span, qk_scale, scale, softcap, SLOPES, stride_sb, stride_sh, right,
                                 dq_desc, CAUSAL: gl.constexpr, HAS_WL: gl.constexpr, HAS_SOFTCAP: gl.constexpr,
                                 HAS_ALIBI: gl.constexpr, BLOCK_M: gl.constexpr, D: gl.constexpr,
                                 STAGES: gl.constexpr, VARLEN: gl.constexpr, HAS_LO: gl.constexpr,
                                 LO_PASS: gl.constexpr, FAR_READY: gl.constexpr, CONSUMER_REGS: gl.constexpr,
                                 LOADER_REGS: gl.constexpr, SHARED_DQ: gl.constexpr, RS: gl.constexpr,
                                 num_warps: gl.constexpr):
    """dK, dV of one 128-key block and its adds to dQ (the arguments mean attn_bwd_dkdv_sm90_kernel's
    with FUSED_DQ and PART 0; k, v, dK, dV boxes are one consumer's 64 rows).  With lse_lo, two
    launches: the first (LO_PASS=False) leaves the blocks of GQA groups with a row far from 0 to
    the second (LO_PASS=True), which subtracts lse_lo; there the other programs do nothing."""
    dtype: gl.constexpr = q_desc.dtype
    DQ_N: gl.constexpr = dq_desc.block_type.shape[len(dq_desc.block_type.shape) - 1]
    BLOCK_N: gl.constexpr = 2 * HALF
    bh, b, hk, n0, q_start, Sq, k_start, Sk, offset, row_b = key_block(CU_Q, CU_K, ORDER, Hq, group, Sq, Sk, total_q,
                                                                       total_k, offset, bottom_right, stride_lb,
                                                                       BLOCK_N, VARLEN, CAUSAL, D)
    SL = SLOPES + b * stride_sb
    alibi_off = offset - right

    # the block's query tiles, as attn_bwd_dkdv_sm90_kernel's over 128 keys (`query_window`)
    mt_lo, n_mt, n_masked, n_lfull = query_window(n0, Sq, Sk, offset, span, BLOCK_M, BLOCK_N, CAUSAL, HAS_WL)
    T = n_mt * group
    # lse_lo's two launches: which programs this one runs, and whether they subtract it
    USE_LO: gl.constexpr = LO_PASS
    T, active = _lo_launch(FAR, LSE, bh, row_b, stride_lh, hk, group, Sq, n0, T, HAS_LO, LO_PASS, FAR_READY, num_warps)

    k_smem0 = gl.allocate_shared_memory(dtype, k_desc.block_type.shape, k_desc.layout)
    v_smem0 = gl.allocate_shared_memory(dtype, v_desc.block_type.shape, v_desc.layout)
    k_smem1 = gl.allocate_shared_memory(dtype, k_desc.block_type.shape, k_desc.layout)
    v_smem1 = gl.allocate_shared_memory(dtype, v_desc.block_type.shape, v_desc.layout)
    q_ring = gl.allocate_shared_memory(dtype, [STAGES] + q_desc.block_type.shape, q_desc.layout)
    do_ring = gl.allocate_shared_memory(dtype, [STAGES] + do_desc.block_type.shape, do_desc.layout)
    ds_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    # P and dS of a tile, [queries, keys], one pair a consumer
    p_smem0 = gl.allocate_shared_memory(dtype, [BLOCK_M, HALF], ds_layout)
    p_smem1 = gl.allocate_shared_memory(dtype, [BLOCK_M, HALF], ds_layout)
    ds_smem0 = gl.allocate_shared_memory(dtype, [BLOCK_M, HALF], ds_layout)
    ds_smem1 = gl.allocate_shared_memory(dtype, [BLOCK_M, HALF], ds_layout)
    dq_smem0 = gl.allocate_shared_memory(gl.float32, [D // DQ_N] + dq_desc.block_type.shape, dq_desc.layout)
    dq_smem1 = gl.allocate_shared_memory(gl.float32, [D // DQ_N] + dq_desc.block_type.shape, dq_desc.layout)
    kv_bars = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    dq_full = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    dq_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    # SHARED_DQ: both consumers' dS written (index 2: arrived by both), a consumer's dS read by
    # the other's dQ product (indices 0, 1)
    ds_bars = gl.allocate_shared_memory(gl.int64, [3, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(2):
        mbarrier.init(kv_bars.index(i), count=1)
        mbarrier.init(dq_full.index(i), count=1)
        mbarrier.init(dq_empty.index(i), count=1)
        mbarrier.init(ds_bars.index(i), count=1)
    mbarrier.init(ds_bars.index(2), count=2)
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=2)
    fence_async_shared()

    if active:
        gl.warp_specialize([
            (_consumer, (dk_desc, dv_desc, LSE, LSE_LO, DELTA, k_smem0, v_smem0, kv_bars.index(0), q_ring, do_ring,
                            ready, empty, ds_smem0, dq_smem0, dq_full.index(0), dq_empty.index(0), b, hk, group, n0,
                            k_start, Sk, q_start, Sq, offset, span, T, n_mt, mt_lo, n_masked, n_lfull, row_b,
                            stride_lh, qk_scale, scale, softcap, SL, stride_sh, alibi_off, 0, CAUSAL, HAS_WL,
                            HAS_SOFTCAP, HAS_ALIBI, BLOCK_M, D, STAGES, VARLEN, USE_LO, DQ_N, p_smem0, k_smem1,
                            kv_bars.index(1), ds_smem1, ds_bars.index(2), ds_bars.index(0), ds_bars.index(1),
                            SHARED_DQ, RS)),
            (_kv_consumer1, (dk_desc, dv_desc, LSE, LSE_LO, DELTA, k_smem1, v_smem1, kv_bars.index(1), q_ring, do_ring,
                             ready, empty, ds_smem1, dq_smem1, dq_full.index(1), dq_empty.index(1), b, hk, group, n0,
                             k_start, Sk, q_start, Sq, offset, span, T, n_mt, mt_lo, n_masked, n_lfull, row_b,
                             stride_lh, qk_scale, scale, softcap, SL, stride_sh, alibi_off, CAUSAL, HAS_WL,
                             HAS_SOFTCAP, HAS_ALIBI, BLOCK_M, D, STAGES, VARLEN, USE_LO, DQ_N, p_smem1, k_smem0,
                             kv_bars.index(0), ds_smem0, ds_bars.index(2), ds_bars.index(1), ds_bars.index(0),
                             SHARED_DQ, RS)),
            (_kv_loader, (q_desc, k_desc, v_desc, do_desc, k_smem0, v_smem0, k_smem1, v_smem1, kv_bars, q_ring,
                          do_ring, ready, empty, b, hk, group, n0, k_start, Sk, q_start, Sq, T, n_mt, mt_lo, BLOCK_M,
                          STAGES, VARLEN)),
            (_dq_writer, (dq_desc, dq_smem0, dq_smem1, dq_full, dq_empty, b, hk, group, q_start, Sq, T, n_mt, mt_lo,
                          BLOCK_M, D, DQ_N, VARLEN, SHARED_DQ)),
        ], [4, 1, 1], [CONSUMER_REGS, LOADER_REGS, LOADER_REGS])
