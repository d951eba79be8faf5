"""Attention forward kernel (FA2 online softmax): writes o and lse.

One program per (query block, batch * query head).  Every feature is a
constexpr flag of this one kernel.
"""
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from .common import (LN2, LOG2E, batch_head, exp2_split, full_key_range, fused_score, key_range, key_rows,
                     load_offset, load_slope, load_tile, lse_row0, mul_rn, score_exponent, score_tile, seq_bounds)
from .dropout import dropout_keep
from .rope import rope_cos_sin, rope_partner, rope_rotate


@triton.jit
def _fwd_tiles(acc, l_i, m_i, b_q, K, V, BT, n_pages, K_DESC, V_DESC, hk, n_lo, n_hi, o_m, o_d, o_dv, b, h, bh, Sq, Sk, off,
               stride_ks, stride_vs, stride_kp, stride_vp, scale, softcap, slope, win_left, win_right, seed,
               drop_threshold,
               MASK, stride_mb, stride_mh, stride_mm, stride_mn,
               HAS_MASK: tl.constexpr, MASK_BOOL: tl.constexpr, HAS_WL: tl.constexpr, HAS_WR: tl.constexpr,
               HAS_SOFTCAP: tl.constexpr, HAS_DROPOUT: tl.constexpr, HAS_ALIBI: tl.constexpr,
               DOT_PRECISION: tl.constexpr,
               D: tl.constexpr, DV: tl.constexpr, CHECK: tl.constexpr, PAGED: tl.constexpr, PAGE: tl.constexpr,
               USE_TMA: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
               BLOCK_DV: tl.constexpr, SCALE_POS: tl.constexpr = False, WS: tl.constexpr = False,
               POLY_EXP2: tl.constexpr = 0):
    """Online-softmax update over the key tiles [n_lo, n_hi).  CHECK=False: the
    tiles are known to be in range and inside the window for every query.
    USE_TMA: K/V tiles come through tensor descriptors over [B, Sk, Hkv, D], or a paged
    cache's [blocks, PAGE, Hkv, D] (the copy engine zero-fills past the tensor's end).
    SCALE_POS (scale > 0): interior tiles without score modifiers take the row
    max of the raw products and one fused multiply-add per score.
    WS: ask Triton to warp-specialize the loop (producer / consumer warps).
    POLY_EXP2 (interior tiles without modifiers): 1 or 2 computes half or all of P's
    exponentials on the FMA pipes (`exp2_split`), 0 all on MUFU.
    n_pages: a paged cache's block count; each block-table entry is clamped into [0, n_pages)
    (per tile, or per key where pages are narrower than tiles)."""
    # head dims that fill their padded width need no column masks on the loads
    EVEN_D: tl.constexpr = (D == BLOCK_D) and (DV == BLOCK_DV)
    PLAIN: tl.constexpr = SCALE_POS and not (CHECK or HAS_MASK or HAS_SOFTCAP or HAS_ALIBI)
    FUSE: tl.constexpr = fused_score(b_q.dtype, HAS_MASK, MASK_BOOL, HAS_SOFTCAP, HAS_ALIBI)
    # a paged cache whose pages hold whole key tiles (tiles start at multiples of BLOCK_N):
    # one block-table entry per tile, read one iteration ahead -- looked up in the same
    # iteration, it sat in front of every tile's load (H200 decode, B = 4, 128k keys:
    # 3.0 TB/s, against 4.45 read ahead and 4.5 for a contiguous cache)
    PAGE_TILES: tl.constexpr = PAGED and PAGE >= BLOCK_N
    if PAGE_TILES:
        t_next = tl.load(BT + n_lo // PAGE, mask=n_lo < n_hi, other=0)
    for n_start in tl.range(n_lo, n_hi, BLOCK_N, warp_specialize=WS):
        o_n = n_start + tl.arange(0, BLOCK_N)
        # the tile's place: (batch row, key) of [B, Sk, Hkv, D], or (page, row in page)
        if PAGE_TILES:
            t_row = tl.minimum(tl.maximum(t_next, 0), n_pages - 1)
            t_next = tl.load(BT + (n_start + BLOCK_N) // PAGE, mask=n_start + BLOCK_N < n_hi, other=0)
            t_key = n_start % PAGE
            in_page = (t_key + tl.arange(0, BLOCK_N)).to(tl.int64)
            k_rows = t_row.to(tl.int64) * stride_kp + in_page * stride_ks
            v_rows = t_row.to(tl.int64) * stride_vp + in_page * stride_vs
        else:
            t_row = b
            t_key = n_start
            k_rows = key_rows(o_n, Sk, BT, stride_kp, stride_ks, n_pages, PAGED, PAGE)
            v_rows = key_rows(o_n, Sk, BT, stride_vp, stride_vs, n_pages, PAGED, PAGE)
        # [BD, BN]
        if USE_TMA:
            b_kt = tl.trans(tl.reshape(K_DESC.load([t_row, t_key, hk, 0]), [BLOCK_N, BLOCK_D]))
        else:
            b_kt = load_tile(K + k_rows[None, :] + o_d[:, None], o_n[None, :], Sk, o_d[:, None], D, CHECK, EVEN_D)
        # [BM, BN]
        qk = tl.dot(b_q, b_kt, input_precision=DOT_PRECISION)
        if PLAIN:
            # every score of the tile is finite, so the row max is too
            c = scale * LOG2E
            m_new = tl.maximum(m_i, tl.max(qk, axis=1) * c)
            m_shift = m_new
            # (mul_rn(qk, c): score_tile's score, dead code where FUSE)
            p = exp2_split(score_exponent(qk, mul_rn(qk, c), c, m_shift[:, None], FUSE, False), POLY_EXP2, BLOCK_N)
        else:
            s2, _ = score_tile(qk, o_m[:, None], o_n[None, :], b, h, Sq, Sk, off, win_left, win_right, scale,
                               softcap, slope, MASK, stride_mb, stride_mh, stride_mm, stride_mn,
                               HAS_MASK, MASK_BOOL, HAS_WL, HAS_WR, HAS_SOFTCAP, HAS_ALIBI, CHECK)
            m_new = tl.maximum(m_i, tl.max(s2, axis=1))
            # a row with nothing visible so far keeps m = -inf; shift by 0 so exp2 gives 0, not NaN
            m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.exp2(score_exponent(qk, s2, scale * LOG2E, m_shift[:, None], FUSE, True))
        alpha = tl.exp2(m_i - m_shift)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if HAS_DROPOUT:
            # the softmax normaliser counts every weight; dropout only zeroes the numerator
            keep = dropout_keep(seed, drop_threshold, bh, o_m, o_n, BLOCK_M, BLOCK_N)
            p = tl.where(keep, p, 0.0)
        # [BN, BDV]
        if USE_TMA:
            b_v = tl.reshape(V_DESC.load([t_row, t_key, hk, 0]), [BLOCK_N, BLOCK_DV])
            if CHECK:  # rows past this row's keys (a KV cache's unused slots) may hold anything
                b_v = tl.where(o_n[:, None] < Sk, b_v, 0.0)
        else:
            b_v = load_tile(V + v_rows[:, None] + o_dv[None, :], o_n[:, None], Sk, o_dv[None, :], DV, CHECK, EVEN_D)
        acc = tl.dot(p.to(b_v.dtype), b_v, acc * alpha[:, None], input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def attn_fwd_kernel(
    Q, K, V, O, LSE, LSE_LO, MASK, OFFSETS, ALIBI, CU_Q, CU_K, BT, SEED, TURNS, K_DESC, V_DESC, ORDER,
    stride_qb, stride_qs, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_ob, stride_os, stride_oh,
    stride_mb, stride_mh, stride_mm, stride_mn, stride_ab, stride_ah,
    stride_btb, stride_kp, stride_vp, stride_os_split, stride_ls_split, num_splits, seqlens_k_add, num_pages,
    Hq, Sq, Sk, D: tl.constexpr, DV: tl.constexpr, GROUP,
    scale, softcap, offset, win_left, win_right, seed, drop_threshold, drop_scale,
    HAS_MASK: tl.constexpr, MASK_BOOL: tl.constexpr, HAS_WL: tl.constexpr, HAS_WR: tl.constexpr,
    OFFSET_PER_BATCH: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_DROPOUT: tl.constexpr,
    HAS_ALIBI: tl.constexpr, IS_VARLEN: tl.constexpr, OFFSET_BR: tl.constexpr, SEED_FROM_PTR: tl.constexpr,
    HAS_SEQLENS_K: tl.constexpr, ROPE_DIM: tl.constexpr, ROPE_INTERLEAVED: tl.constexpr, PAGED: tl.constexpr,
    PAGE: tl.constexpr, IS_SPLIT: tl.constexpr, PACK_GQA: tl.constexpr, USE_TMA: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    SCALE_POS: tl.constexpr = False, WS: tl.constexpr = False, POLY_EXP2: tl.constexpr = 0,
    PDL: tl.constexpr = False, STORE_LO: tl.constexpr = False,
):
    # Sq, Sk: the lengths of a dense batch; for a packed (varlen) batch, the total
    # rows, with each sequence's bounds read from CU_Q / CU_K (batch strides are 0).
    # A KV cache: CU_K holds each row's key count before this call's seqlens_k_add new keys
    # (HAS_SEQLENS_K), Sk its capacity; PAGED reads
    # keys through the block table BT [B, max_blocks] (num_pages pages of PAGE rows).
    # IS_SPLIT (split-KV): axis 0 also spans num_splits slices of the keys; each
    # writes its normalised partial o and lse at split * stride_*_split, and
    # `attn_fwd_combine_kernel` merges them.
    # PACK_GQA: axis 1 is (batch, kv head) and the tile's rows are (query, head of
    # the group) pairs, so one program reads each K/V tile once for the whole group
    # (decoding: Sq is tiny, the group fills the tile).
    # ROPE_DIM > 0: q is rotated at its absolute positions after loading (TURNS from
    # `rope_turns`).  USE_TMA: K/V tiles through the descriptors K_DESC / V_DESC.
    # STORE_LO: also write LSE_LO, what the backward's lse * LOG2E misses of m + log2(l)
    # (`flashforge.ops.params`).
    # PDL (a split call on sm_90+): let the merge kernel, launched as a programmatic
    # dependent, start now; it waits (`gdc_wait`) for this grid's partials before reading
    # them, so its launch latency overlaps this kernel instead of following it.
    if PDL:
        gdc_launch_dependents()
    if SEED_FROM_PTR:  # an unseeded call: the seed was drawn on the device
        seed = tl.load(SEED)
    pid_m = tl.program_id(0)
    split = 0
    if IS_SPLIT:
        split = pid_m % num_splits
        pid_m = pid_m // num_splits
    elif HAS_WR:
        # causal-like: the last query blocks see the most keys; start them first so
        # the grid's tail is made of short programs (longest-processing-time first)
        pid_m = tl.num_programs(0) - 1 - pid_m
    m_start = pid_m * BLOCK_M
    r = m_start + tl.arange(0, BLOCK_M)
    if PACK_GQA:
        b, hk = batch_head(ORDER, tl.program_id(1), Hq // GROUP, IS_VARLEN)
        h = hk * GROUP + (r % GROUP)  # [BM]: each row's query head
        o_m = r // GROUP  # [BM]: each row's query position
        rows_total = Sq * GROUP
    else:
        b, h = batch_head(ORDER, tl.program_id(1), Hq, IS_VARLEN)
        bh = b * Hq + h
        hk = h // GROUP
        o_m = r
        rows_total = Sq
    b64 = b.to(tl.int64)
    o_d = tl.arange(0, BLOCK_D)
    o_dv = tl.arange(0, BLOCK_DV)
    q_start, Sq_b, k_start, Sk_b = seq_bounds(CU_Q, CU_K, b, Sq, Sk, IS_VARLEN, HAS_SEQLENS_K,
                                                   seqlens_k_add)
    row0 = lse_row0(b, h, Hq, Sq, q_start, IS_VARLEN)  # scalar, or [BM] when packed
    if IS_SPLIT:
        O += tl.cast(split, tl.int64) * stride_os_split
        LSE += tl.cast(split, tl.int64) * stride_ls_split
    BT += b64 * stride_btb
    Sq = Sq_b
    Sk = Sk_b
    off, win_left, win_right = load_offset(OFFSETS, b, offset, Sq, Sk, win_left, win_right, OFFSET_PER_BATCH,
                                           OFFSET_BR, HAS_WL, HAS_WR, HAS_ALIBI)
    slope = load_slope(ALIBI, b, h, stride_ab, stride_ah, HAS_ALIBI)
    Q += tl.cast(q_start, tl.int64) * stride_qs
    O += tl.cast(q_start, tl.int64) * stride_os
    K += tl.cast(k_start, tl.int64) * stride_ks
    V += tl.cast(k_start, tl.int64) * stride_vs
    if PACK_GQA:  # per-row heads, broadcast against [BM, BN] tiles
        h2 = h[:, None]
        slope2 = slope
        if HAS_ALIBI:
            slope2 = slope[:, None]
        bh2 = (b * Hq + h)[:, None]
        q_first = m_start // GROUP
        q_last = (m_start + BLOCK_M - 1) // GROUP
    else:
        h2 = h
        slope2 = slope
        bh2 = bh
        q_first = m_start
        q_last = m_start + BLOCK_M - 1
    m_row = (o_m < Sq) & (r < rows_total)  # [BM]

    # [BM, BD]
    p_q = (Q + b64 * stride_qb + h2 * stride_qh + o_m[:, None].to(tl.int64) * stride_qs
           + o_d[None, :])
    b_q = tl.load(p_q, mask=m_row[:, None] & (o_d[None, :] < D), other=0.0)
    if ROPE_DIM > 0:  # rotate q at its absolute positions i + off (TURNS: `rope_turns`)
        o_p = rope_partner(o_d, ROPE_DIM, ROPE_INTERLEAVED)
        b_qp = tl.load(p_q - o_d[None, :] + o_p[None, :], mask=m_row[:, None] & (o_p[None, :] < D), other=0.0)
        b_cos, b_sin = rope_cos_sin(o_m + off, TURNS, o_d, ROPE_DIM, ROPE_INTERLEAVED)
        b_q = rope_rotate(b_q, b_qp, b_cos, b_sin, o_d, ROPE_DIM, ROPE_INTERLEAVED, False).to(Q.dtype.element_ty)
    K += b64 * stride_kb + hk * stride_kh
    V += b64 * stride_vb + hk * stride_vh

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)

    # key tiles: [lo, full_lo) and [full_hi, hi) need the range/window test, the rest do not
    lo, hi = key_range(q_first, q_last, off, win_left, win_right, Sk, BLOCK_N, HAS_WL, HAS_WR)
    if IS_VARLEN:  # grids cover the longest sequence: blocks past this one's end do nothing
        hi = tl.where(q_first < Sq, hi, lo)
    if IS_SPLIT:  # this program's share: whole tiles, in order
        per = tl.cdiv(tl.cdiv(hi - lo, BLOCK_N), num_splits) * BLOCK_N
        lo = lo + split * per
        hi = tl.maximum(tl.minimum(hi, lo + per), lo)
    full_lo, full_hi = full_key_range(q_first, q_last, off, win_left, win_right, Sk, lo, hi, BLOCK_N,
                                      HAS_WL, HAS_WR)
    acc, l_i, m_i = _fwd_tiles(acc, l_i, m_i, b_q, K, V, BT, num_pages, K_DESC, V_DESC, hk, full_lo, full_hi, o_m, o_d, o_dv, b, h2, bh2, Sq, Sk,
                               off, stride_ks, stride_vs, stride_kp, stride_vp, scale, softcap, slope2, win_left,
                               win_right, seed, drop_threshold, MASK, stride_mb, stride_mh, stride_mm, stride_mn,
                               HAS_MASK, MASK_BOOL, HAS_WL, HAS_WR, HAS_SOFTCAP, HAS_DROPOUT, HAS_ALIBI,
                               DOT_PRECISION,
                               D, DV, False, PAGED, PAGE, USE_TMA, BLOCK_M, BLOCK_N, BLOCK_D, BLOCK_DV, SCALE_POS, WS,
                               POLY_EXP2)
    acc, l_i, m_i = _fwd_tiles(acc, l_i, m_i, b_q, K, V, BT, num_pages, K_DESC, V_DESC, hk, lo, full_lo, o_m, o_d, o_dv, b, h2, bh2, Sq, Sk,
                               off, stride_ks, stride_vs, stride_kp, stride_vp, scale, softcap, slope2, win_left,
                               win_right, seed, drop_threshold, MASK, stride_mb, stride_mh, stride_mm, stride_mn,
                               HAS_MASK, MASK_BOOL, HAS_WL, HAS_WR, HAS_SOFTCAP, HAS_DROPOUT, HAS_ALIBI,
                               DOT_PRECISION,
                               D, DV, True, PAGED, PAGE, USE_TMA, BLOCK_M, BLOCK_N, BLOCK_D, BLOCK_DV, SCALE_POS)
    acc, l_i, m_i = _fwd_tiles(acc, l_i, m_i, b_q, K, V, BT, num_pages, K_DESC, V_DESC, hk, full_hi, hi, o_m, o_d, o_dv, b, h2, bh2, Sq, Sk,
                               off, stride_ks, stride_vs, stride_kp, stride_vp, scale, softcap, slope2, win_left,
                               win_right, seed, drop_threshold, MASK, stride_mb, stride_mh, stride_mm, stride_mn,
                               HAS_MASK, MASK_BOOL, HAS_WL, HAS_WR, HAS_SOFTCAP, HAS_DROPOUT, HAS_ALIBI,
                               DOT_PRECISION,
                               D, DV, True, PAGED, PAGE, USE_TMA, BLOCK_M, BLOCK_N, BLOCK_D, BLOCK_DV, SCALE_POS)

    empty = l_i == 0.0  # fully masked row: o = 0, lse = -inf
    l_safe = tl.where(empty, 1.0, l_i)
    acc = acc * (drop_scale / l_safe)[:, None]
    log2_l = tl.log2(l_safe)
    lse = tl.where(empty, float("-inf"), (m_i + log2_l) * LN2)
    if STORE_LO:
        # near a large m the two terms are close, so m - hi is exact
        lo = tl.where(empty, 0.0, (m_i - mul_rn(lse, LOG2E)) + log2_l)
        tl.store(LSE_LO + row0 + o_m, lo, mask=m_row)

    p_o = (O + b64 * stride_ob + h2 * stride_oh + o_m[:, None].to(tl.int64) * stride_os
           + o_dv[None, :])
    tl.store(p_o, acc.to(O.dtype.element_ty), mask=m_row[:, None] & (o_dv[None, :] < DV))
    tl.store(LSE + row0 + o_m, lse, mask=m_row)


@triton.jit
def attn_fwd_combine_kernel(
    O_PART, LSE_PART, O, LSE,
    stride_ps, stride_pb, stride_pm, stride_ph,
    stride_ob, stride_om, stride_oh,
    stride_ls, Hq, Sq, num_splits, DV: tl.constexpr,
    BLOCK_S: tl.constexpr, BLOCK_DV: tl.constexpr, PDL: tl.constexpr = False,
):
    """Merge split-KV partials of one query row: lse = logsumexp_s lse_s,
    o = sum_s exp(lse_s - lse) o_s.  The splits are read BLOCK_S at a time as one
    [BLOCK_S, DV] tile (a decoding step's merge is then one round trip to memory,
    not one per split).  PDL: launched as a programmatic dependent of the split kernel,
    so wait for that grid (and its writes) before reading the partials."""
    if PDL:
        gdc_wait()
    m = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // Hq
    h = bh % Hq
    o_s = tl.arange(0, BLOCK_S)
    o_dv = tl.arange(0, BLOCK_DV)
    p_lse = LSE_PART + tl.cast(bh, tl.int64) * Sq + m
    p_o = O_PART + tl.cast(b, tl.int64) * stride_pb + h * stride_ph + tl.cast(m, tl.int64) * stride_pm + o_dv[None, :]
    mx = float("-inf")
    for s0 in range(0, num_splits, BLOCK_S):
        mx = tl.maximum(mx, tl.max(tl.load(p_lse + (s0 + o_s) * stride_ls, mask=s0 + o_s < num_splits,
                                           other=float("-inf")), axis=0))
    m_shift = tl.where(mx == float("-inf"), 0.0, mx)
    l = 0.0
    acc = tl.zeros([BLOCK_DV], dtype=tl.float32)
    for s0 in range(0, num_splits, BLOCK_S):
        ok = s0 + o_s < num_splits
        # empty splits have lse = -inf (weight 0) and wrote o = 0
        w = tl.exp(tl.load(p_lse + (s0 + o_s) * stride_ls, mask=ok, other=float("-inf")) - m_shift)  # [BS]
        l += tl.sum(w, axis=0)
        part = tl.load(p_o + (s0 + o_s)[:, None].to(tl.int64) * stride_ps, mask=ok[:, None] & (o_dv[None, :] < DV),
                       other=0.0)
        acc += tl.sum(w[:, None] * part, axis=0)
    empty = l == 0.0
    acc = acc / tl.where(empty, 1.0, l)
    lse = tl.where(empty, float("-inf"), m_shift + tl.log(tl.where(empty, 1.0, l)))
    tl.store(O + tl.cast(b, tl.int64) * stride_ob + h * stride_oh + tl.cast(m, tl.int64) * stride_om + o_dv,
             acc.to(O.dtype.element_ty), mask=o_dv < DV)
    tl.store(LSE + tl.cast(bh, tl.int64) * Sq + m, lse)
