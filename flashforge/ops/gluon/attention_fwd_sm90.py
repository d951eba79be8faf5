"""Hopper (sm_90) attention forward in Gluon: the dense 16-bit fast path.

Why a second forward: Triton 3.6 issues each `tl.dot` as a wgmma and waits for
it at once, so a tile's softmax never overlaps a tensor-core product (checked in
the PTX, benchmarks/RESULTS.md v0.3.0).  Here the products are issued
asynchronously and waited for explicitly, FA3's intra-warpgroup pipeline:

    S_j = Q K_j^T            issued
    O  += P_{j-1} V_{j-1}    issued
    wait for S_j             (O's product still running)
    softmax(S_j) -> P_j      overlaps the P V product on the tensor cores
    wait for O; O *= alpha_j

K and V tiles arrive by TMA into rings of STAGES slots, each refilled as soon
as the product that read the slot is known to be done.  A warpgroup owns 64
query rows.  With one warpgroup per program (BLOCK_M = 64) two programs share
an SM and interleave freely; two warpgroups in one program run in step (the
compiler puts a block-wide barrier before each copy into a slot both read),
which measured slower (benchmarks/RESULTS.md v0.4.0).

Scope (the launcher checks it; everything else takes the portable kernel):
bf16/fp16, D = Dv in {64, 128, 256}, dense [B, S, H, D] or packed (varlen) inputs
with 16-byte aligned strides, GQA, no mask/bias, no dropout, softcap, ALiBi,
RoPE, split or paged keys; causal with an integer diagonal offset (key j
visible from query i iff j <= i + offset; packed: per sequence, optionally
bottom-right aligned) and sliding windows (also j >= i + offset - span).  A
window's query block visits only the key tiles of its band (`key_window`).
"""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)

from .pipeline import (copy_in, copy_out, init_barriers, invalidate_barriers, key_window, load_rows, query_program,
                       slot, visible, wait)
from .rounding import LN2, LOG2E, exp2_split, exponent, fused_score, mul_rn
from .scores import modified_score


@gluon.jit
def _softmax_step(s, m_i, l_i, n0, o_m, Sk, offset, span, qk_scale, scale, softcap, slope, alibi_off,
                  s_layout: gl.constexpr, MASKED: gl.constexpr, CAUSAL: gl.constexpr, HAS_WL: gl.constexpr,
                  BLOCK_N: gl.constexpr, FUSE: gl.constexpr = False, HAS_SOFTCAP: gl.constexpr = False,
                  HAS_ALIBI: gl.constexpr = False, POLY_EXP2: gl.constexpr = 0):
    """One tile's online-softmax update: (p, alpha, m_new, l_new) in log2 units.  With softcap or
    ALiBi the scores are formed first (`scores.modified_score`) and the max taken over them.
    POLY_EXP2 (tiles without a mask or modifier): half (1) or all (2) of P's exponentials on the
    FMA pipes (`rounding.exp2_split`)."""
    MOD: gl.constexpr = HAS_SOFTCAP or HAS_ALIBI
    if MASKED or MOD:
        o_n = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
    if MOD:
        s, _ = modified_score(s, o_m[:, None], o_n[None, :], qk_scale, scale, softcap, slope, alibi_off, HAS_SOFTCAP,
                              HAS_ALIBI)
    if MASKED:  # keys past Sk (zero-filled by TMA), past the causal diagonal or before the window
        if CAUSAL:
            # `pipeline.visible`'s rule with its two upper bounds folded into one a row and the key
            # counted from the tile's first, n0 + c <= min(i + offset, Sk - 1): one comparison an
            # element against a column index that is a constant of its register.  sm_90 SASS of a
            # diagonal tile, instructions (the unmasked tile 281): D = 128 causal 719 -> 415, with a
            # window 849 -> 549; D = 64 three consumers 744 -> 505; one warpgroup 274 -> 240
            cols = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
            keep = cols[None, :] <= gl.minimum(o_m + (offset - n0), Sk - 1 - n0)[:, None]
            if HAS_WL:
                keep = keep & (cols[None, :] >= (o_m + (offset - span - n0))[:, None])
        else:  # (Sk's end alone: the absolute form compiles to fewer instructions and no spills)
            keep = visible(o_m[:, None], o_n[None, :], Sk, offset, span, CAUSAL, HAS_WL)
        s = gl.where(keep, s, float("-inf"))
    if MOD:
        m_new = gl.maximum(m_i, gl.max(s, axis=1))
    else:
        m_new = gl.maximum(m_i, gl.max(s, axis=1) * qk_scale)
    if MASKED:  # a row with nothing visible so far keeps m = -inf; shift by 0 so exp2 gives 0, not NaN
        m_shift = gl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_shift = m_new
    if MOD:
        p = gl.exp2(s - m_shift[:, None])
    else:
        x = exponent(s, qk_scale, m_shift[:, None], FUSE)  # the max's exponent: 0, or its product's rounding
        if MASKED:
            p = gl.exp2(x)
        else:
            p = exp2_split(x, POLY_EXP2, s_layout)
    alpha = gl.exp2(m_i - m_shift)
    l_new = l_i * alpha + gl.sum(p, axis=1)
    return p, alpha, m_new, l_new


@gluon.jit
def softmax_tile(s, m_i, l_i, j, n_lo, n_lfull, n_full, o_m, Sk, offset, span, qk_scale, scale, softcap, slope,
                 alibi_off, s_layout: gl.constexpr, CAUSAL: gl.constexpr, HAS_WL: gl.constexpr, BLOCK_N: gl.constexpr,
                 FUSE: gl.constexpr, HAS_SOFTCAP: gl.constexpr, HAS_ALIBI: gl.constexpr, POLY_EXP2: gl.constexpr = 0):
    """`_softmax_step` of key tile n_lo + j (`key_window`'s counting), with the mask where the tile
    needs one (before n_lfull or from n_full on): one copy of the element-wise code for each."""
    if (j < n_full) & (j >= n_lfull):
        p, alpha, m_new, l_new = _softmax_step(s, m_i, l_i, (n_lo + j) * BLOCK_N, o_m, Sk, offset, span, qk_scale,
                                               scale, softcap, slope, alibi_off, s_layout, False, CAUSAL, HAS_WL,
                                               BLOCK_N, FUSE=FUSE, HAS_SOFTCAP=HAS_SOFTCAP, HAS_ALIBI=HAS_ALIBI,
                                               POLY_EXP2=POLY_EXP2)
    else:
        p, alpha, m_new, l_new = _softmax_step(s, m_i, l_i, (n_lo + j) * BLOCK_N, o_m, Sk, offset, span, qk_scale,
                                               scale, softcap, slope, alibi_off, s_layout, True, CAUSAL, HAS_WL,
                                               BLOCK_N, FUSE=FUSE, HAS_SOFTCAP=HAS_SOFTCAP, HAS_ALIBI=HAS_ALIBI)
    return p, alpha, m_new, l_new


@gluon.jit
def finish_rows(acc, m_i, l_i, LSE, LSE_LO, row, o_m, Sq, row_o: gl.constexpr, STORE_LO: gl.constexpr):
    """o = acc / l (rows with no visible key, l = 0: o = 0, lse = -inf) and the rows' lse (and,
    STORE_LO, its low part) stored at LSE + row + o_m for the rows before Sq."""
    empty = l_i == 0.0
    l_safe = gl.where(empty, 1.0, l_i)
    log2_l = gl.log2(l_safe)
    lse = gl.where(empty, float("-inf"), (m_i + log2_l) * LN2)
    gl.store(LSE + row + o_m, lse, mask=o_m < Sq)
    if STORE_LO:  # near a large m the two terms are close, so m - hi is exact
        gl.store(LSE_LO + row + o_m, gl.where(empty, 0.0, (m_i - mul_rn(lse, LOG2E)) + log2_l), mask=o_m < Sq)
    return acc / gl.convert_layout(l_safe, row_o)[:, None]


@gluon.jit
def attn_fwd_sm90_kernel(q_desc, k_desc, v_desc, o_desc, LSE, LSE_LO, stride_lb, stride_lh, CU_Q, CU_K, ORDER, Hq, Sq,
                         Sk, total_q, total_k, group, offset, bottom_right, span, qk_scale, scale, softcap, SLOPES,
                         stride_sb, stride_sh, right, CAUSAL: gl.constexpr, HAS_WL: gl.constexpr,
                         HAS_SOFTCAP: gl.constexpr, HAS_ALIBI: gl.constexpr, BLOCK_M: gl.constexpr,
                         BLOCK_N: gl.constexpr, D: gl.constexpr, STAGES: gl.constexpr, V_STAGES: gl.constexpr,
                         Q_IN_REGS: gl.constexpr, VARLEN: gl.constexpr, STORE_LO: gl.constexpr,
                         num_warps: gl.constexpr, POLY_EXP2: gl.constexpr = 0):
    # STORE_LO: also write LSE_LO (lse's strides), what the backward's lse * LOG2E misses of
    # m + log2(l) (`flashforge.ops.params`).  Visibility: key j from query i iff j <= i + offset
    # (CAUSAL: the launcher folds a window's right side into the offset) and j >= i + offset - span
    # (HAS_WL: a window's left side).  HAS_SOFTCAP, HAS_ALIBI: scores as `scores.modified_score`
    # forms them (ALiBi: SLOPES[b * stride_sb + h * stride_sh], at distances from offset - right)
    dtype: gl.constexpr = q_desc.dtype
    FUSE: gl.constexpr = fused_score(dtype, HAS_SOFTCAP=HAS_SOFTCAP, HAS_ALIBI=HAS_ALIBI)  # (rounding.py)
    _, b, h, hk, m0, q_start, Sq, k_start, Sk, offset, alibi_off, slope = query_program(
        Sq, Hq, group, CU_Q, CU_K, ORDER, Sk, total_q, total_k, offset, bottom_right, right, SLOPES, stride_sb,
        stride_sh, BLOCK_M, CAUSAL, HAS_ALIBI, VARLEN, D)

    # one warp per 16 rows (a warpgroup per 64); the MMA's N is the whole tile
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                       instr_shape=[16, D, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)

    # key tiles n_lo + [0, n_tiles); those before n_lfull or from n_full on need a mask (the
    # window's edges, or Sk's end); the rings count tiles from n_lo
    n_lo, n_tiles, n_lfull, n_full = key_window(m0, Sq, Sk, offset, span, BLOCK_M, BLOCK_N, CAUSAL, HAS_WL)

    q_smem = gl.allocate_shared_memory(dtype, q_desc.block_type.shape, q_desc.layout)
    k_ring = gl.allocate_shared_memory(dtype, [STAGES] + k_desc.block_type.shape, k_desc.layout)
    v_ring = gl.allocate_shared_memory(dtype, [V_STAGES] + v_desc.block_type.shape, v_desc.layout)
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    k_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_bars = gl.allocate_shared_memory(gl.int64, [V_STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=1)
    init_barriers(k_bars, STAGES)
    init_barriers(v_bars, V_STAGES)
    fence_async_shared()

    mbarrier.expect(q_bar, q_desc.block_type.nbytes)
    copy_in(q_desc, b, m0, h, q_start, Sq, q_bar, q_smem, True, VARLEN)
    for i in gl.static_range(STAGES):
        load_rows(k_desc, k_ring, k_bars, i, n_lo, b, hk, k_start, Sk, n_tiles, BLOCK_N, STAGES, VARLEN)
    for i in gl.static_range(V_STAGES):
        load_rows(v_desc, v_ring, v_bars, i, n_lo, b, hk, k_start, Sk, n_tiles, BLOCK_N, V_STAGES, VARLEN)

    o_m = m0 + gl.arange(0, BLOCK_M, layout=row_s)
    m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, layout=row_s)
    l_i = gl.zeros([BLOCK_M], gl.float32, layout=row_s)
    acc = gl.zeros([BLOCK_M, D], gl.float32, layout=o_layout)
    s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=s_layout)
    mbarrier.wait(q_bar, 0)
    if Q_IN_REGS:  # read once: the q k^T products then take only K from shared memory
        q = q_smem.reshape([BLOCK_M, D]).load(gl.DotOperandLayout(operand_index=0, parent=s_layout, k_width=2))
    else:
        q = q_smem.reshape([BLOCK_M, D])

    if n_tiles > 0:
        # tile 0: its scores alone, so the loop always has a P to multiply
        wait(k_bars, 0, STAGES)
        s = warpgroup_mma(q, slot(k_ring, 0, BLOCK_N, D, STAGES).permute((1, 0)), s_zero, use_acc=False,
                          is_async=True)
        s = warpgroup_mma_wait(0, deps=(s, ))
        load_rows(k_desc, k_ring, k_bars, STAGES, n_lo, b, hk, k_start, Sk, n_tiles, BLOCK_N, STAGES, VARLEN)
        p, alpha, m_i, l_i = softmax_tile(s, m_i, l_i, 0, n_lo, n_lfull, n_full, o_m, Sk, offset, span, qk_scale,
                                          scale, softcap, slope, alibi_off, s_layout, CAUSAL, HAS_WL, BLOCK_N, FUSE,
                                          HAS_SOFTCAP, HAS_ALIBI)
        p = gl.convert_layout(p.to(dtype), p_layout)

        for j in range(1, n_tiles):
            wait(k_bars, j, STAGES)
            s = warpgroup_mma(q, slot(k_ring, j, BLOCK_N, D, STAGES).permute((1, 0)), s_zero, use_acc=False,
                              is_async=True)
            wait(v_bars, j - 1, V_STAGES)
            acc = warpgroup_mma(p, slot(v_ring, j - 1, BLOCK_N, D, V_STAGES), acc, is_async=True)
            # S_j is done (the older group); P_{j-1} V_{j-1} may still run.  K_j's slot is free.
            s = warpgroup_mma_wait(1, deps=(s, ))
            load_rows(k_desc, k_ring, k_bars, j + STAGES, n_lo, b, hk, k_start, Sk, n_tiles, BLOCK_N, STAGES, VARLEN)
            p_new, alpha, m_i, l_i = softmax_tile(s, m_i, l_i, j, n_lo, n_lfull, n_full, o_m, Sk, offset, span,
                                                  qk_scale, scale, softcap, slope, alibi_off, s_layout, CAUSAL, HAS_WL,
                                                  BLOCK_N, FUSE, HAS_SOFTCAP, HAS_ALIBI, POLY_EXP2)
            acc, p = warpgroup_mma_wait(0, deps=(acc, p))
            load_rows(v_desc, v_ring, v_bars, j - 1 + V_STAGES, n_lo, b, hk, k_start, Sk, n_tiles, BLOCK_N, V_STAGES,
                      VARLEN)
            acc = acc * gl.convert_layout(alpha, row_o)[:, None]
            p = gl.convert_layout(p_new.to(dtype), p_layout)

        last = n_tiles - 1
        wait(v_bars, last, V_STAGES)
        acc = warpgroup_mma(p, slot(v_ring, last, BLOCK_N, D, V_STAGES), acc, is_async=True)
        acc = warpgroup_mma_wait(0, deps=(acc, ))

    mbarrier.invalidate(q_bar)
    invalidate_barriers(k_bars, STAGES)
    invalidate_barriers(v_bars, V_STAGES)

    # lse [B, Hq, Sq]; packed, [1, Hq, total] (stride_lb = 0) from the sequence's first row
    row = b.to(gl.int64) * stride_lb + h.to(gl.int64) * stride_lh + q_start
    acc = finish_rows(acc, m_i, l_i, LSE, LSE_LO, row, o_m, Sq, row_o, STORE_LO)
    # o through shared memory (q's buffer, no longer read) and TMA, which clips rows past Sq
    q_smem.reshape([BLOCK_M, D]).store(acc.to(dtype))
    fence_async_shared()
    copy_out(o_desc, b, m0, h, q_start, Sq, q_smem, VARLEN)
    tma.store_wait(0)
