"""Attention backward kernels (FA2 split, no atomics, so deterministic by default).

- `attn_bwd_preprocess_kernel`: delta_i = rowsum(o_i * do_i) - dlse_i.
  (The lse gradient adds dlse_i * P_ij to dS_ij, i.e. it shifts delta.)  For the sm_90 fused
  kernels also lse in log2 units and, with lse_lo, the GQA groups with a row far from 0.
- `attn_bwd_dq_cast_kernel`: a fused backward's dQ from its unscaled float32 accumulator.
- `attn_bwd_dkdv_kernel`: one program per (key block, batch * kv head); loops
  over the query heads of its group and the query blocks that see the keys,
  so dK/dV are summed over the group in registers.  Works on transposed
  [keys, queries] tiles.  PART (opt-in, `TileConfig.split_kv`): 1 computes dV only,
  2 dK only (and the fused dQ), 0 both.  Run as two launches (1, then 2), each program
  holds one float32 [block_n, D] accumulator instead of two: at D = 256 that is what lets
  128-key tiles (two warpgroups, no duplicated q k^T) fit the registers, for one more
  q k^T product per tile.  The same tiles in the same order: bitwise PART 0's dK and dV.
- `attn_bwd_dq_kernel`: one program per (query block, batch * query head).
  (Opt-in, `TileConfig.fused_dq` on the dK/dV entry, never with deterministic=True:
  the dK/dV kernel also adds dQ with float32 atomics and this kernel is skipped.)

- `attn_bwd_dmask_kernel`: one program per tile of the mask's own shape; loops
  over the dims the mask broadcasts over, so dmask is reduced in a fixed order.

All recompute P = exp(score - lse) with the forward's `score_tile` (and the low part of
lse, LSE_LO, with HAS_LO: `flashforge.ops.params`), and
dS = P * (dP' - delta) where dP' is dO V^T with the dropout mask applied.
"""
import triton
import triton.language as tl

from .common import (LO_FROM, LOG2E, batch_head, full_key_range, full_query_range, fused_score, key_range, load_offset,
                     load_slope, load_tile, lse_row0, mul_rn, query_range, score_exponent,
                     score_tile, seq_bounds)
from .dropout import dropout_keep


@triton.jit
def attn_bwd_preprocess_kernel(
    O, DO, DLSE, DELTA, CU_Q, LSE, LSE2, FAR,
    stride_ob, stride_os, stride_oh,
    stride_dob, stride_dos, stride_doh,
    Hq, Sq, group, DV: tl.constexpr,
    HAS_DLSE: tl.constexpr, IS_VARLEN: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_DV: tl.constexpr,
    HAS_LSE2: tl.constexpr = False, HAS_FAR: tl.constexpr = False,
):
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // Hq
    h = bh % Hq
    q_start, Sq_b, _, _ = seq_bounds(CU_Q, CU_Q, b, Sq, 0, IS_VARLEN)
    row0 = lse_row0(b, h, Hq, Sq, q_start, IS_VARLEN)
    b64 = tl.cast(b, tl.int64)
    O += b64 * stride_ob + tl.cast(q_start, tl.int64) * stride_os
    DO += b64 * stride_dob + tl.cast(q_start, tl.int64) * stride_dos
    o_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    o_dv = tl.arange(0, BLOCK_DV)
    m_io = (o_m[:, None] < Sq_b) & (o_dv[None, :] < DV)
    # [BM, BDV]
    b_o = tl.load(O + h * stride_oh + o_m[:, None].to(tl.int64) * stride_os + o_dv[None, :],
                  mask=m_io, other=0.0).to(tl.float32)
    b_do = tl.load(DO + h * stride_doh + o_m[:, None].to(tl.int64) * stride_dos + o_dv[None, :],
                   mask=m_io, other=0.0).to(tl.float32)
    delta = tl.sum(b_o * b_do, axis=1)
    if HAS_DLSE:
        delta -= tl.load(DLSE + row0 + o_m, mask=o_m < Sq_b, other=0.0)
    tl.store(DELTA + row0 + o_m, delta, mask=o_m < Sq_b)
    if HAS_LSE2:
        # lse in log2 units as the sm_90 half-dQ and wide dK/dV kernels use it (a row that sees no
        # key: 0), so that their consumers do not scale it again for every tile of every key block
        lse = tl.load(LSE + row0 + o_m, mask=o_m < Sq_b, other=0.0)
        lse2 = tl.where(lse == float("-inf"), 0.0, mul_rn(lse, LOG2E))
        tl.store(LSE2 + row0 + o_m, lse2, mask=o_m < Sq_b)
        if HAS_FAR:
            # with lse_lo: mark the GQA group (FAR[b * Hkv + h // group], zeroed) whose rows include
            # one with |lse2| >= LO_FROM, as the Gluon dQ kernel's `lo_rows` does, so that no dK/dV
            # program scans the group's lse itself (`attention_bwd_dkdv_ws_sm90._lo_launch`)
            far = tl.max(tl.where(o_m < Sq_b, tl.abs(lse2), 0.0), axis=0) >= LO_FROM
            if far:
                tl.atomic_or(FAR + b * (Hq // group) + h // group, 1)


@triton.jit
def attn_bwd_dq_cast_kernel(ACC, DQ, n, scale, BLOCK: tl.constexpr):
    """dQ = scale * ACC, rounded once into DQ's dtype: the fused backward's float32 accumulator of
    dS K (the kernels add it unscaled, so no kernel multiplies every part it adds)."""
    o = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(ACC + o, mask=o < n, other=0.0)
    tl.store(DQ + o, (x * scale).to(DQ.dtype.element_ty), mask=o < n)


@triton.jit
def _ds_tile(qk, dp, o_m, o_n, lse2, lo, delta, b, h, bh, Sq, Sk, off, win_left, win_right,
             scale, softcap, slope, seed, drop_threshold, drop_scale,
             MASK, stride_mb, stride_mh, stride_mm, stride_mn,
             HAS_MASK: tl.constexpr, MASK_BOOL: tl.constexpr, HAS_WL: tl.constexpr, HAS_WR: tl.constexpr,
             HAS_SOFTCAP: tl.constexpr, HAS_DROPOUT: tl.constexpr, HAS_ALIBI: tl.constexpr,
             TRANSPOSED: tl.constexpr,
             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CHECK: tl.constexpr = True,
             HAS_LO: tl.constexpr = False, IN_DTYPE: tl.constexpr = None):
    """From qk = <q, k> and dp = dO V^T (both [BM, BN], or [BN, BM] if TRANSPOSED),
    return (P' = P with dropout applied and scaled, dS w.r.t. the score,
    dS w.r.t. the raw product <q, k> divided by scale).  lse2, lo: the row's
    `_load_row_stats` (lo read only with HAS_LO).  IN_DTYPE: q's and k's (`fused_score`)."""
    FUSE: tl.constexpr = fused_score(IN_DTYPE, HAS_MASK, MASK_BOOL, HAS_SOFTCAP, HAS_ALIBI)
    if TRANSPOSED:
        i2 = o_m[None, :]
        j2 = o_n[:, None]
        lse2b = lse2[None, :]
        lob = lo[None, :]
        deltab = delta[None, :]
    else:
        i2 = o_m[:, None]
        j2 = o_n[None, :]
        lse2b = lse2[:, None]
        lob = lo[:, None]
        deltab = delta[:, None]
    s2, t = score_tile(qk, i2, j2, b, h, Sq, Sk, off, win_left, win_right, scale, softcap, slope,
                       MASK, stride_mb, stride_mh, stride_mm, stride_mn,
                       HAS_MASK, MASK_BOOL, HAS_WL, HAS_WR, HAS_SOFTCAP, HAS_ALIBI, CHECK)
    x = score_exponent(qk, s2, scale * LOG2E, lse2b, FUSE, CHECK or HAS_MASK)  # the forward's, exactly
    if HAS_LO:
        x = x - lob
    p = tl.exp2(x)
    if HAS_DROPOUT:
        keep = dropout_keep(seed, drop_threshold, bh, o_m, o_n, BLOCK_M, BLOCK_N)
        if TRANSPOSED:
            keep = tl.trans(keep)
        p_drop = tl.where(keep, p * drop_scale, 0.0)
        dp = tl.where(keep, dp * drop_scale, 0.0)
    else:
        p_drop = p
    ds = p * (dp - deltab)
    if HAS_SOFTCAP:
        ds_raw = ds * (1.0 - t * t)
    else:
        ds_raw = ds
    return p_drop, ds, ds_raw


@triton.jit
def _load_row_stats(LSE, LSE_LO, DELTA, row0, o_m, Sq, HAS_LO: tl.constexpr):
    """(lse2, lo, delta) of rows o_m: P = exp2((s2 - lse2) - lo) (`flashforge.ops.params`)."""
    lse = tl.load(LSE + row0 + o_m, mask=o_m < Sq, other=0.0)
    # fully masked rows (lse = -inf) have every score -inf: shift by 0 so P = 0, not NaN
    lse2 = tl.where(lse == float("-inf"), 0.0, mul_rn(lse, LOG2E))
    if HAS_LO:
        lo = tl.load(LSE_LO + row0 + o_m, mask=o_m < Sq, other=0.0)
    else:
        lo = lse2
    delta = tl.load(DELTA + row0 + o_m, mask=o_m < Sq, other=0.0)
    return lse2, lo, delta


@triton.jit
def _dkdv_tiles(dk, dv, b_k, b_v, p_q, p_do, LSE, LSE_LO, DELTA, row0, m_lo, m_hi, o_n, o_d, o_dv, b, h, bh, Sq, Sk, off,
                stride_qs, stride_dos, win_left, win_right, scale, softcap, slope, seed, drop_threshold, drop_scale,
                MASK, stride_mb, stride_mh, stride_mm, stride_mn,
                HAS_MASK: tl.constexpr, MASK_BOOL: tl.constexpr, HAS_WL: tl.constexpr, HAS_WR: tl.constexpr,
                HAS_SOFTCAP: tl.constexpr, HAS_DROPOUT: tl.constexpr, HAS_ALIBI: tl.constexpr,
                DOT_PRECISION: tl.constexpr, D: tl.constexpr, DV: tl.constexpr, CHECK: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
                p_dq, stride_dqs, FUSED_DQ: tl.constexpr, HAS_LO: tl.constexpr, PART: tl.constexpr = 0):
    """dK/dV contributions of the query tiles [m_lo, m_hi) of one query head.
    CHECK=False: the tiles lie inside Sq and every query sees every key of the
    tile (`full_query_range`), so the range and window tests are skipped.
    FUSED_DQ: also add this key tile's share of dQ / scale (dS K) into the float32
    buffer p_dq with atomics: five matrix products per tile instead of the split
    backward's seven, in an order that varies run to run.
    PART: 0 both dK and dV; 1 dV only (no dO V^T, no dS; dk is returned as it came);
    2 dK only (dv returned as it came)."""
    EVEN_D: tl.constexpr = (D == BLOCK_D) and (DV == BLOCK_DV)
    for m_start in range(m_lo, m_hi, BLOCK_M):
        o_m = m_start + tl.arange(0, BLOCK_M)
        # Q^T [BD, BM], dO^T [BDV, BM]
        b_qt = load_tile(p_q + o_m[None, :].to(tl.int64) * stride_qs + o_d[:, None],
                         o_m[None, :], Sq, o_d[:, None], D, CHECK, EVEN_D)
        b_dot = load_tile(p_do + o_m[None, :].to(tl.int64) * stride_dos + o_dv[:, None],
                          o_m[None, :], Sq, o_dv[:, None], DV, CHECK, EVEN_D)
        lse2, lo, delta = _load_row_stats(LSE, LSE_LO, DELTA, row0, o_m, Sq, HAS_LO)
        # [BN, BM]
        qkt = tl.dot(b_k, b_qt, input_precision=DOT_PRECISION)
        if PART == 1:  # P' only: dp is a stand-in whose products (dS) are dead code
            dpt = qkt
        else:
            dpt = tl.dot(b_v, b_dot, input_precision=DOT_PRECISION)
        p_dropt, _, ds_rawt = _ds_tile(qkt, dpt, o_m, o_n, lse2, lo, delta, b, h, bh, Sq, Sk, off,
                                       win_left, win_right, scale, softcap, slope, seed, drop_threshold, drop_scale,
                                       MASK, stride_mb, stride_mh, stride_mm, stride_mn,
                                       HAS_MASK, MASK_BOOL, HAS_WL, HAS_WR, HAS_SOFTCAP, HAS_DROPOUT, HAS_ALIBI,
                                       True, BLOCK_M, BLOCK_N, CHECK, HAS_LO, b_k.dtype)
        # [BN, BDV] += P'^T dO ; [BN, BD] += dS^T Q
        if PART != 2:
            dv = tl.dot(p_dropt.to(b_dot.dtype), tl.trans(b_dot), dv, input_precision=DOT_PRECISION)
        if PART != 1:
            ds_lp = ds_rawt.to(b_qt.dtype)
            dk = tl.dot(ds_lp, tl.trans(b_qt), dk, input_precision=DOT_PRECISION)
            if FUSED_DQ:
                # [BM, BD] = dS K; rows past Sq are masked off (their dS is 0 anyway)
                dq_part = tl.dot(tl.trans(ds_lp), b_k, input_precision=DOT_PRECISION)
                tl.atomic_add(p_dq + o_m[:, None].to(tl.int64) * stride_dqs + o_d[None, :], dq_part,
                              mask=(o_m[:, None] < Sq) & (o_d[None, :] < D), sem="relaxed")
    return dk, dv


@triton.jit
def attn_bwd_dkdv_kernel(
    Q, K, V, DO, LSE, LSE_LO, DELTA, DK, DV_OUT, MASK, OFFSETS, ALIBI, CU_Q, CU_K, SEED, DQ_ACC, ORDER,
    stride_qb, stride_qs, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_dob, stride_dos, stride_doh,
    stride_dkb, stride_dks, stride_dkh,
    stride_dvb, stride_dvs, stride_dvh,
    stride_mb, stride_mh, stride_mm, stride_mn, stride_ab, stride_ah,
    stride_dqb, stride_dqs, stride_dqh,
    Hq, Hkv, Sq, Sk, D: tl.constexpr, DV: tl.constexpr, GROUP,
    scale, softcap, offset, win_left, win_right, seed, drop_threshold, drop_scale,
    HAS_MASK: tl.constexpr, MASK_BOOL: tl.constexpr, HAS_WL: tl.constexpr, HAS_WR: tl.constexpr,
    OFFSET_PER_BATCH: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_DROPOUT: tl.constexpr,
    HAS_ALIBI: tl.constexpr, IS_VARLEN: tl.constexpr, OFFSET_BR: tl.constexpr, SEED_FROM_PTR: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    FUSED_DQ: tl.constexpr = False, HAS_LO: tl.constexpr = False, PART: tl.constexpr = 0,
):
    # Tiles here are transposed ([keys, queries]) so that dV += P'^T dO and
    # dK += dS^T Q take the accumulator tiles as they come out of the MMA,
    # with no register transpose.
    if SEED_FROM_PTR:  # an unseeded call: the seed was drawn on the device
        seed = tl.load(SEED)
    pid_n = tl.program_id(0)
    b, hk = batch_head(ORDER, tl.program_id(1), Hkv, IS_VARLEN)
    b64 = b.to(tl.int64)
    n_start = pid_n * BLOCK_N
    o_n = n_start + tl.arange(0, BLOCK_N)
    o_d = tl.arange(0, BLOCK_D)
    o_dv = tl.arange(0, BLOCK_DV)
    q_start, Sq_b, k_start, Sk_b = seq_bounds(CU_Q, CU_K, b, Sq, Sk, IS_VARLEN)
    q_rows = Sq  # rows per (b, h) in lse / delta (the packed total for varlen)
    Sq = Sq_b
    Sk = Sk_b
    off, win_left, win_right = load_offset(OFFSETS, b, offset, Sq, Sk, win_left, win_right, OFFSET_PER_BATCH,
                                           OFFSET_BR, HAS_WL, HAS_WR, HAS_ALIBI)
    Q += tl.cast(q_start, tl.int64) * stride_qs
    DO += tl.cast(q_start, tl.int64) * stride_dos
    K += tl.cast(k_start, tl.int64) * stride_ks
    V += tl.cast(k_start, tl.int64) * stride_vs
    DK += tl.cast(k_start, tl.int64) * stride_dks
    DV_OUT += tl.cast(k_start, tl.int64) * stride_dvs
    DQ_ACC += tl.cast(q_start, tl.int64) * stride_dqs

    # K [BN, BD], V [BN, BDV]
    b_k = tl.load(K + b64 * stride_kb + hk * stride_kh + o_n[:, None].to(tl.int64) * stride_ks + o_d[None, :],
                  mask=(o_n[:, None] < Sk) & (o_d[None, :] < D), other=0.0)
    if PART == 1:  # (V is not read: dV needs P only)
        b_v = b_k
    else:
        b_v = tl.load(V + b64 * stride_vb + hk * stride_vh + o_n[:, None].to(tl.int64) * stride_vs + o_dv[None, :],
                      mask=(o_n[:, None] < Sk) & (o_dv[None, :] < DV), other=0.0)
    # PART 1 / 2: the accumulator the program does not compute is a small placeholder
    if PART == 1:
        dk = tl.zeros([16, 16], dtype=tl.float32)
    else:
        dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    if PART == 2:
        dv = tl.zeros([16, 16], dtype=tl.float32)
    else:
        dv = tl.zeros([BLOCK_N, BLOCK_DV], dtype=tl.float32)

    lo, hi = query_range(n_start, off, win_left, win_right, Sq, BLOCK_M, BLOCK_N, HAS_WL, HAS_WR)
    if IS_VARLEN:  # grids cover the longest sequence: blocks past this one's end do nothing
        hi = tl.where(n_start < Sk, hi, lo)
    # query tiles [full_lo, full_hi) need no range / window test
    full_lo, full_hi = full_query_range(n_start, off, win_left, win_right, Sq, Sk, lo, hi, BLOCK_M, BLOCK_N,
                                        HAS_WL, HAS_WR)
    for g in range(0, GROUP):
        h = hk * GROUP + g
        bh = b * Hq + h
        row0 = lse_row0(b, h, Hq, q_rows, q_start, IS_VARLEN)
        slope = load_slope(ALIBI, b, h, stride_ab, stride_ah, HAS_ALIBI)
        p_q = Q + b64 * stride_qb + h * stride_qh
        p_do = DO + b64 * stride_dob + h * stride_doh
        p_dq = DQ_ACC + b64 * stride_dqb + h * stride_dqh
        # (every tile with lse_lo where it is given: a second copy of the loop for programs whose rows
        # do not need it, as the Gluon kernels have, raised this kernel's spills by 40-60%)
        dk, dv = _dkdv_tiles(dk, dv, b_k, b_v, p_q, p_do, LSE, LSE_LO, DELTA, row0, full_lo, full_hi, o_n, o_d,
                             o_dv, b, h, bh, Sq, Sk, off, stride_qs, stride_dos, win_left, win_right, scale,
                             softcap, slope, seed, drop_threshold, drop_scale, MASK, stride_mb, stride_mh,
                             stride_mm, stride_mn, HAS_MASK, MASK_BOOL, HAS_WL, HAS_WR, HAS_SOFTCAP, HAS_DROPOUT,
                             HAS_ALIBI, DOT_PRECISION, D, DV, False, BLOCK_M, BLOCK_N, BLOCK_D, BLOCK_DV,
                             p_dq, stride_dqs, FUSED_DQ, HAS_LO, PART)
        dk, dv = _dkdv_tiles(dk, dv, b_k, b_v, p_q, p_do, LSE, LSE_LO, DELTA, row0, lo, full_lo, o_n, o_d, o_dv, b, h, bh, Sq, Sk, off,
                             stride_qs, stride_dos, win_left, win_right, scale, softcap, slope, seed,
                             drop_threshold, drop_scale, MASK, stride_mb, stride_mh, stride_mm, stride_mn,
                             HAS_MASK, MASK_BOOL, HAS_WL, HAS_WR, HAS_SOFTCAP, HAS_DROPOUT, HAS_ALIBI,
                             DOT_PRECISION, D, DV, True, BLOCK_M, BLOCK_N, BLOCK_D, BLOCK_DV,
                             p_dq, stride_dqs, FUSED_DQ, HAS_LO, PART)
        dk, dv = _dkdv_tiles(dk, dv, b_k, b_v, p_q, p_do, LSE, LSE_LO, DELTA, row0, full_hi, hi, o_n, o_d, o_dv, b, h, bh, Sq, Sk, off,
                             stride_qs, stride_dos, win_left, win_right, scale, softcap, slope, seed,
                             drop_threshold, drop_scale, MASK, stride_mb, stride_mh, stride_mm, stride_mn,
                             HAS_MASK, MASK_BOOL, HAS_WL, HAS_WR, HAS_SOFTCAP, HAS_DROPOUT, HAS_ALIBI,
                             DOT_PRECISION, D, DV, True, BLOCK_M, BLOCK_N, BLOCK_D, BLOCK_DV,
                             p_dq, stride_dqs, FUSED_DQ, HAS_LO, PART)

    if PART != 1:
        dk *= scale
        m_nd = (o_n[:, None] < Sk) & (o_d[None, :] < D)
        tl.store(DK + b64 * stride_dkb + hk * stride_dkh + o_n[:, None].to(tl.int64) * stride_dks + o_d[None, :],
                 dk.to(DK.dtype.element_ty), mask=m_nd)
    if PART != 2:
        m_ndv = (o_n[:, None] < Sk) & (o_dv[None, :] < DV)
        tl.store(DV_OUT + b64 * stride_dvb + hk * stride_dvh + o_n[:, None].to(tl.int64) * stride_dvs
                 + o_dv[None, :], dv.to(DV_OUT.dtype.element_ty), mask=m_ndv)


@triton.jit
def _dq_tiles(dq, b_q, b_do, K, V, lse2, lo, delta, n_lo, n_hi, o_m, o_d, o_dv, b, h, bh, Sq, Sk, off,
              stride_ks, stride_vs, win_left, win_right, scale, softcap, slope, seed, drop_threshold, drop_scale,
              MASK, stride_mb, stride_mh, stride_mm, stride_mn,
              HAS_MASK: tl.constexpr, MASK_BOOL: tl.constexpr, HAS_WL: tl.constexpr, HAS_WR: tl.constexpr,
              HAS_SOFTCAP: tl.constexpr, HAS_DROPOUT: tl.constexpr, HAS_ALIBI: tl.constexpr,
              DOT_PRECISION: tl.constexpr, D: tl.constexpr, DV: tl.constexpr, CHECK: tl.constexpr,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
              HAS_LO: tl.constexpr):
    """dQ contributions of the key tiles [n_lo, n_hi).  CHECK=False: tiles from
    `full_key_range` (inside Sk, seen in full by every query of the block)."""
    EVEN_D: tl.constexpr = (D == BLOCK_D) and (DV == BLOCK_DV)
    for n_start in range(n_lo, n_hi, BLOCK_N):
        o_n = n_start + tl.arange(0, BLOCK_N)
        # K^T [BD, BN], V^T [BDV, BN]
        b_kt = load_tile(K + o_n[None, :].to(tl.int64) * stride_ks + o_d[:, None],
                         o_n[None, :], Sk, o_d[:, None], D, CHECK, EVEN_D)
        b_vt = load_tile(V + o_n[None, :].to(tl.int64) * stride_vs + o_dv[:, None],
                         o_n[None, :], Sk, o_dv[:, None], DV, CHECK, EVEN_D)
        # [BM, BN]
        qk = tl.dot(b_q, b_kt, input_precision=DOT_PRECISION)
        dp = tl.dot(b_do, b_vt, input_precision=DOT_PRECISION)
        _, _, ds_raw = _ds_tile(qk, dp, o_m, o_n, lse2, lo, delta, b, h, bh, Sq, Sk, off,
                                win_left, win_right, scale, softcap, slope, seed, drop_threshold, drop_scale,
                                MASK, stride_mb, stride_mh, stride_mm, stride_mn,
                                HAS_MASK, MASK_BOOL, HAS_WL, HAS_WR, HAS_SOFTCAP, HAS_DROPOUT, HAS_ALIBI,
                                False, BLOCK_M, BLOCK_N, CHECK, HAS_LO, b_q.dtype)
        # [BM, BD] += dS K
        dq = tl.dot(ds_raw.to(b_kt.dtype), tl.trans(b_kt), dq, input_precision=DOT_PRECISION)
    return dq


@triton.jit
def attn_bwd_dq_kernel(
    Q, K, V, DO, LSE, LSE_LO, DELTA, DQ, MASK, OFFSETS, ALIBI, CU_Q, CU_K, SEED, ORDER,
    stride_qb, stride_qs, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_dob, stride_dos, stride_doh,
    stride_dqb, stride_dqs, stride_dqh,
    stride_mb, stride_mh, stride_mm, stride_mn, stride_ab, stride_ah,
    Hq, Sq, Sk, D: tl.constexpr, DV: tl.constexpr, GROUP,
    scale, softcap, offset, win_left, win_right, seed, drop_threshold, drop_scale,
    HAS_MASK: tl.constexpr, MASK_BOOL: tl.constexpr, HAS_WL: tl.constexpr, HAS_WR: tl.constexpr,
    OFFSET_PER_BATCH: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_DROPOUT: tl.constexpr,
    HAS_ALIBI: tl.constexpr, IS_VARLEN: tl.constexpr, OFFSET_BR: tl.constexpr, SEED_FROM_PTR: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    HAS_LO: tl.constexpr = False,
):
    if SEED_FROM_PTR:  # an unseeded call: the seed was drawn on the device
        seed = tl.load(SEED)
    pid_m = tl.program_id(0)
    if HAS_WR:  # causal-like: the longest query blocks (the last ones) first
        pid_m = tl.num_programs(0) - 1 - pid_m
    b, h = batch_head(ORDER, tl.program_id(1), Hq, IS_VARLEN)
    bh = b * Hq + h
    hk = h // GROUP
    b64 = b.to(tl.int64)
    m_start = pid_m * BLOCK_M
    o_m = m_start + tl.arange(0, BLOCK_M)
    o_d = tl.arange(0, BLOCK_D)
    o_dv = tl.arange(0, BLOCK_DV)
    q_start, Sq_b, k_start, Sk_b = seq_bounds(CU_Q, CU_K, b, Sq, Sk, IS_VARLEN)
    row0 = lse_row0(b, h, Hq, Sq, q_start, IS_VARLEN)
    Sq = Sq_b
    Sk = Sk_b
    off, win_left, win_right = load_offset(OFFSETS, b, offset, Sq, Sk, win_left, win_right, OFFSET_PER_BATCH,
                                           OFFSET_BR, HAS_WL, HAS_WR, HAS_ALIBI)
    Q += tl.cast(q_start, tl.int64) * stride_qs
    DO += tl.cast(q_start, tl.int64) * stride_dos
    DQ += tl.cast(q_start, tl.int64) * stride_dqs
    K += tl.cast(k_start, tl.int64) * stride_ks
    V += tl.cast(k_start, tl.int64) * stride_vs

    m_qd = (o_m[:, None] < Sq) & (o_d[None, :] < D)
    # [BM, BD], [BM, BDV]
    b_q = tl.load(Q + b64 * stride_qb + h * stride_qh + o_m[:, None].to(tl.int64) * stride_qs + o_d[None, :],
                  mask=m_qd, other=0.0)
    b_do = tl.load(DO + b64 * stride_dob + h * stride_doh + o_m[:, None].to(tl.int64) * stride_dos + o_dv[None, :],
                   mask=(o_m[:, None] < Sq) & (o_dv[None, :] < DV), other=0.0)
    lse2, lo_row, delta = _load_row_stats(LSE, LSE_LO, DELTA, row0, o_m, Sq, HAS_LO)
    slope = load_slope(ALIBI, b, h, stride_ab, stride_ah, HAS_ALIBI)
    K += b64 * stride_kb + hk * stride_kh
    V += b64 * stride_vb + hk * stride_vh
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    lo, hi = key_range(m_start, m_start + BLOCK_M - 1, off, win_left, win_right, Sk, BLOCK_N, HAS_WL, HAS_WR)
    if IS_VARLEN:  # grids cover the longest sequence: blocks past this one's end do nothing
        hi = tl.where(m_start < Sq, hi, lo)
    # key tiles [full_lo, full_hi) need no range / window test
    full_lo, full_hi = full_key_range(m_start, m_start + BLOCK_M - 1, off, win_left, win_right, Sk, lo, hi,
                                      BLOCK_N, HAS_WL, HAS_WR)
    # (every tile with lse_lo where it is given: a second copy of this loop, as the dK/dV kernel has,
    # would double the software pipeline's buffers, past sm_90's shared memory at D = 128 and 256)
    dq = _dq_tiles(dq, b_q, b_do, K, V, lse2, lo_row, delta, full_lo, full_hi, o_m, o_d, o_dv, b, h, bh, Sq, Sk, off,
                   stride_ks, stride_vs, win_left, win_right, scale, softcap, slope, seed, drop_threshold,
                   drop_scale, MASK, stride_mb, stride_mh, stride_mm, stride_mn,
                   HAS_MASK, MASK_BOOL, HAS_WL, HAS_WR, HAS_SOFTCAP, HAS_DROPOUT, HAS_ALIBI,
                   DOT_PRECISION, D, DV, False, BLOCK_M, BLOCK_N, BLOCK_D, BLOCK_DV, HAS_LO)
    dq = _dq_tiles(dq, b_q, b_do, K, V, lse2, lo_row, delta, lo, full_lo, o_m, o_d, o_dv, b, h, bh, Sq, Sk, off,
                   stride_ks, stride_vs, win_left, win_right, scale, softcap, slope, seed, drop_threshold,
                   drop_scale, MASK, stride_mb, stride_mh, stride_mm, stride_mn,
                   HAS_MASK, MASK_BOOL, HAS_WL, HAS_WR, HAS_SOFTCAP, HAS_DROPOUT, HAS_ALIBI,
                   DOT_PRECISION, D, DV, True, BLOCK_M, BLOCK_N, BLOCK_D, BLOCK_DV, HAS_LO)
    dq = _dq_tiles(dq, b_q, b_do, K, V, lse2, lo_row, delta, full_hi, hi, o_m, o_d, o_dv, b, h, bh, Sq, Sk, off,
                   stride_ks, stride_vs, win_left, win_right, scale, softcap, slope, seed, drop_threshold,
                   drop_scale, MASK, stride_mb, stride_mh, stride_mm, stride_mn,
                   HAS_MASK, MASK_BOOL, HAS_WL, HAS_WR, HAS_SOFTCAP, HAS_DROPOUT, HAS_ALIBI,
                   DOT_PRECISION, D, DV, True, BLOCK_M, BLOCK_N, BLOCK_D, BLOCK_DV, HAS_LO)

    dq *= scale
    tl.store(DQ + b64 * stride_dqb + h * stride_dqh + o_m[:, None].to(tl.int64) * stride_dqs + o_d[None, :],
             dq.to(DQ.dtype.element_ty), mask=m_qd)


@triton.jit
def attn_bwd_dmask_kernel(
    Q, K, V, DO, LSE, LSE_LO, DELTA, DMASK, MASK, OFFSETS, ALIBI, CU_Q, CU_K, SEED,
    stride_qb, stride_qs, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_dob, stride_dos, stride_doh,
    stride_mb, stride_mh, stride_mm, stride_mn, stride_ab, stride_ah,
    stride_gb, stride_gh, stride_gm, stride_gn,
    B, Hq, Sq, Sk, D: tl.constexpr, DV: tl.constexpr, GROUP, Hm, Sqm, Skm,
    scale, softcap, offset, win_left, win_right, seed, drop_threshold, drop_scale,
    MASK_BOOL: tl.constexpr, HAS_WL: tl.constexpr, HAS_WR: tl.constexpr,
    OFFSET_PER_BATCH: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_DROPOUT: tl.constexpr,
    HAS_ALIBI: tl.constexpr, IS_VARLEN: tl.constexpr, OFFSET_BR: tl.constexpr, SEED_FROM_PTR: tl.constexpr,
    B_BCAST: tl.constexpr, H_BCAST: tl.constexpr, M_BCAST: tl.constexpr, N_BCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    OUT_M: tl.constexpr, OUT_N: tl.constexpr, HAS_LO: tl.constexpr = False,
):
    """dmask[bm, hm, i, j] = sum of dS over the (b, h, i, j) that broadcast onto it."""
    if SEED_FROM_PTR:  # an unseeded call: the seed was drawn on the device
        seed = tl.load(SEED)
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    bhm = tl.program_id(2)
    bm = bhm // Hm
    hm = bhm % Hm
    o_d = tl.arange(0, BLOCK_D)
    o_dv = tl.arange(0, BLOCK_DV)
    # ranges over the broadcast dims; a full-size dim is a range of one
    b_lo = 0 if B_BCAST else bm
    b_hi = B if B_BCAST else bm + 1
    h_lo = 0 if H_BCAST else hm
    h_hi = Hq if H_BCAST else hm + 1
    m_lo = 0 if M_BCAST else pid_m * BLOCK_M
    m_hi = Sq if M_BCAST else pid_m * BLOCK_M + 1
    n_lo = 0 if N_BCAST else pid_n * BLOCK_N
    n_hi = Sk if N_BCAST else pid_n * BLOCK_N + 1

    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for b in range(b_lo, b_hi):
        b64 = tl.cast(b, tl.int64)
        # this batch row's sides, folded with its offset (the arguments stay as given for the next)
        off, wl, wr = load_offset(OFFSETS, b, offset, Sq, Sk, win_left, win_right, OFFSET_PER_BATCH, OFFSET_BR,
                                  HAS_WL, HAS_WR, HAS_ALIBI)
        for h in range(h_lo, h_hi):
            hk = h // GROUP
            bh = b * Hq + h
            slope = load_slope(ALIBI, b, h, stride_ab, stride_ah, HAS_ALIBI)
            for m_start in range(m_lo, m_hi, BLOCK_M):
                o_m = m_start + tl.arange(0, BLOCK_M)
                b_q = tl.load(Q + b64 * stride_qb + h * stride_qh + o_m[:, None].to(tl.int64) * stride_qs
                              + o_d[None, :], mask=(o_m[:, None] < Sq) & (o_d[None, :] < D), other=0.0)
                b_do = tl.load(DO + b64 * stride_dob + h * stride_doh + o_m[:, None].to(tl.int64) * stride_dos
                               + o_dv[None, :], mask=(o_m[:, None] < Sq) & (o_dv[None, :] < DV), other=0.0)
                lse2, lo, delta = _load_row_stats(LSE, LSE_LO, DELTA, lse_row0(b, h, Hq, Sq, 0, False), o_m, Sq,
                                                  HAS_LO)
                for n_start in range(n_lo, n_hi, BLOCK_N):
                    o_n = n_start + tl.arange(0, BLOCK_N)
                    b_kt = tl.load(K + b64 * stride_kb + hk * stride_kh + o_n[None, :].to(tl.int64) * stride_ks
                                   + o_d[:, None], mask=(o_n[None, :] < Sk) & (o_d[:, None] < D), other=0.0)
                    b_vt = tl.load(V + b64 * stride_vb + hk * stride_vh + o_n[None, :].to(tl.int64) * stride_vs
                                   + o_dv[:, None], mask=(o_n[None, :] < Sk) & (o_dv[:, None] < DV), other=0.0)
                    qk = tl.dot(b_q, b_kt, input_precision=DOT_PRECISION)
                    dp = tl.dot(b_do, b_vt, input_precision=DOT_PRECISION)
                    _, ds, _ = _ds_tile(qk, dp, o_m, o_n, lse2, lo, delta, b, h, bh, Sq, Sk, off,
                                        wl, wr, scale, softcap, slope, seed, drop_threshold, drop_scale,
                                        MASK, stride_mb, stride_mh, stride_mm, stride_mn,
                                        True, MASK_BOOL, HAS_WL, HAS_WR, HAS_SOFTCAP, HAS_DROPOUT, HAS_ALIBI,
                                        False, BLOCK_M, BLOCK_N, True, HAS_LO, b_q.dtype)
                    acc += ds

    # reduce the tile over broadcast rows / columns; such a dim has size 1 in dmask
    if M_BCAST:
        acc = tl.sum(acc, axis=0)[None, :]
    if N_BCAST:
        acc = tl.sum(acc, axis=1)[:, None]
    # OUT_M / OUT_N: 1 for a broadcast dim, else the block size
    o_gm = pid_m * BLOCK_M + tl.arange(0, OUT_M)
    o_gn = pid_n * BLOCK_N + tl.arange(0, OUT_N)
    p_g = (DMASK + tl.cast(bm, tl.int64) * stride_gb + hm * stride_gh + o_gm[:, None].to(tl.int64) * stride_gm
           + o_gn[None, :] * stride_gn)
    tl.store(p_g, acc, mask=(o_gm[:, None] < Sqm) & (o_gn[None, :] < Skm))
