"""Hopper (sm_90) attention backward in Gluon: the dense 16-bit fast path.

The same split as the portable backward (ops/triton/attention_bwd.py: FA2's, no
atomics, so deterministic; FUSED_DQ below is the opt-in exception), with the products issued as asynchronous warpgroup
MMAs so a tile's element-wise work overlaps the tensor cores (the forward's
reason, ops/gluon/attention_fwd_sm90.py):

- `attn_bwd_dkdv_sm90_kernel`: one warpgroup per 64 keys (BLOCK_N), K and V
  resident in shared memory; walks the query tiles (BLOCK_M) of every query head
  of its GQA group, Q and dO arriving by TMA into rings.  Per tile t:

      S^T_t = K Q_t^T, dP^T_t = V dO_t^T                  issued
      dV += P^T_{t-1} dO_{t-1}, dK += dS^T_{t-1} Q_{t-1}   issued (PIPE)
      wait for S^T_t, dP^T_t; P^T_t, dS^T_t from them      overlaps dV, dK
      wait for dV, dK: tile t-1's slots are free

  Past D = 128 the two float32 [keys, D] accumulators do not fit in registers, so a call
  launches it twice (`PART` 1 then 2, `TileConfig.split_kv`): dV from S^T alone, then dK
  from S^T and dP^T, one accumulator each, at one more K Q^T per tile (`_split_tiles`).

  With FUSED_DQ (opt-in, `attention.fuses_dq`; never deterministic) it also computes dQ:
  each tile's dS^T goes through shared memory, the A operand of dK's product and, transposed,
  of dQ_t = dS K, which the copy engine reduce-adds into a float32 accumulator; the dQ kernel
  then does not run (5 products a tile pair instead of 7).

- `attn_bwd_dq_sm90_kernel`: one warpgroup per 64 queries, Q and dO resident;
  walks the key tiles, K and V by TMA into separate rings (V's slot is free
  once dP is done, K's only after dQ += dS K).

Both recompute P = exp2(S * scale * log2(e) - lse * log2(e) - lse_lo) from the forward's
lse and its low part (HAS_LO; `flashforge.ops.params`); with softcap or ALiBi, from the scores
`scores.modified_score` forms, as the forward does.  A sliding window bounds the tiles either
kernel visits: the dQ kernel's key tiles as the forward's (`pipeline.key_window`), the dK/dV
kernel's query tiles by both edges of the band.  delta = rowsum(o * dO) - dlse: when
both kernels serve a call, the dQ kernel (run
first) computes it for its rows and stores it for the dK/dV kernel (DELTA_HERE: no
preprocess kernel, one launch fewer a step); otherwise the portable preprocess kernel does.
Rows past a sequence's end (dense, or packed through ragged descriptors: see
pipeline.py): TMA zero-fills them and clips the stores; their lse is read as
+inf, so their P and dS are 0.  Keys past Sk only ever reach rows of
dK / dV that the store clips (the dK/dV kernel), or are masked (the dQ kernel,
where dS K would mix them into kept rows).
"""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)

from ..triton.common import LO_FROM  # (one threshold with the preprocess kernel's far flags)
from .pipeline import (copy_in, copy_out, init_barriers, invalidate_barriers, key_block, key_program, key_window,
                       load_rows, query_program, query_window, reduce_out, slot, visible, wait)
from .rounding import LOG2E, backward_fuse, exponent, fused_score, mul_rn
from .scores import modified_score


@gluon.jit
def _lse2(LSE, LSE_LO, row0, o_m, Sq, HAS_LO: gl.constexpr):
    """(lse in log2 units, its low part): P = exp2((s2 - lse2) - lo).  +inf past Sq: P = 0
    there; fully masked rows (-inf) shift by 0, so their masked scores give P = 0, not NaN."""
    lse = gl.load(LSE + row0 + o_m, mask=o_m < Sq, other=float("inf"))
    lse2 = gl.where(lse == float("-inf"), 0.0, mul_rn(lse, LOG2E))
    if HAS_LO:
        lo = gl.load(LSE_LO + row0 + o_m, mask=o_m < Sq, other=0.0)
    else:
        lo = lse2
    return lse2, lo


@gluon.jit
def _row_stats(LSE, LSE_LO, DELTA, row0, o_m, Sq, HAS_LO: gl.constexpr):
    # _lse2 and delta
    lse2, lo = _lse2(LSE, LSE_LO, row0, o_m, Sq, HAS_LO)
    return lse2, lo, gl.load(DELTA + row0 + o_m, mask=o_m < Sq, other=0.0)


@gluon.jit
def _load_qdo(q_desc, do_desc, q_ring, do_ring, bars, t, T, n_mt, mt_lo, b, hk, group, q_start, Sq,
              BLOCK_M: gl.constexpr, STAGES: gl.constexpr, VARLEN: gl.constexpr):
    # tile t of the flattened (head of the group, query tile) walk into slot t % STAGES
    slot = t % STAGES
    g = t // n_mt
    m = (mt_lo + t - g * n_mt) * BLOCK_M
    h = hk * group + g
    mbarrier.expect(bars.index(slot), q_desc.block_type.nbytes + do_desc.block_type.nbytes, pred=t < T)
    copy_in(q_desc, b, m, h, q_start, Sq, bars.index(slot), q_ring.index(slot), t < T, VARLEN)
    copy_in(do_desc, b, m, h, q_start, Sq, bars.index(slot), do_ring.index(slot), t < T, VARLEN)


@gluon.jit
def _lo_needed(LSE, row_b, stride_lh, hk, group, Sq, num_warps: gl.constexpr):
    """Whether some row of this sequence in the GQA group's heads has |lse * log2(e)| >= LO_FROM,
    so that the group's dK/dV blocks must subtract lse_lo (the kernel's second launch does): one pass over
    the group's lse, a few loads per thread for each program's hundreds of score tiles."""
    CHUNK: gl.constexpr = 4 * 32 * num_warps
    layout: gl.constexpr = gl.BlockedLayout([4], [32], [num_warps], [0])
    far = gl.zeros([CHUNK], gl.float32, layout=layout)
    for g in range(group):
        base = row_b + (hk * group + g).to(gl.int64) * stride_lh
        for m in range(0, Sq, CHUNK):
            o = m + gl.arange(0, CHUNK, layout=layout)
            lse = gl.load(LSE + base + o, mask=o < Sq, other=0.0)
            far = gl.maximum(far, gl.where(lse == float("-inf"), 0.0, gl.abs(lse)))
    return gl.max(far, axis=0) * LOG2E >= LO_FROM


@gluon.jit
def _dst_tile(st, dpt, t, n_mt, mt_lo, hk, group, row_b, stride_lh, Sq, o_n, offset, span, qk_scale, scale, softcap, SL,
              stride_sh, alibi_off, LSE, LSE_LO, DELTA, col_s: gl.constexpr, CAUSAL: gl.constexpr, HAS_WL: gl.constexpr,
              HAS_SOFTCAP: gl.constexpr, HAS_ALIBI: gl.constexpr, MASKED: gl.constexpr, BLOCK_M: gl.constexpr,
              HAS_LO: gl.constexpr, FUSE: gl.constexpr = False, Sk=0, SK_MASK: gl.constexpr = False):
    """P^T and dS^T ([keys, queries], float32) of flattened tile t from S^T and dP^T; row_b is
    where the sequence's rows start in lse / delta, less head 0's (b * stride_lb + q_start).
    SK_MASK: a masked tile also masks keys from Sk on (zero-filled: where lse is far below 0
    their P^T, exp2(-lse), overflows, and a fused dQ_t = dS K would take inf * 0)."""
    g = t // n_mt
    m0 = (mt_lo + t - g * n_mt) * BLOCK_M
    h = hk * group + g
    o_m = m0 + gl.arange(0, BLOCK_M, layout=col_s)
    lse2, lo, delta = _row_stats(LSE, LSE_LO, DELTA, row_b + h.to(gl.int64) * stride_lh, o_m, Sq, HAS_LO)
    if HAS_SOFTCAP or HAS_ALIBI:  # the forward's score, exactly (scores.py); SL: this sequence's slopes
        if HAS_ALIBI:
            slope = gl.load(SL + h * stride_sh)
        else:
            slope = 0.0
        s2, tc = modified_score(st, o_m[None, :], o_n[:, None], qk_scale, scale, softcap, slope, alibi_off, HAS_SOFTCAP,
                                HAS_ALIBI)
        x = s2 - lse2[None, :]
    else:
        x = exponent(st, qk_scale, lse2[None, :], FUSE)  # the forward's score, exactly (rounding.py)
    if MASKED:  # key n visible from query m iff n <= m + offset (CAUSAL) and n >= m + offset - span (HAS_WL)
        if CAUSAL:
            x = gl.where(o_n[:, None] <= o_m[None, :] + offset, x, float("-inf"))
        if HAS_WL:
            x = gl.where(o_n[:, None] >= o_m[None, :] + (offset - span), x, float("-inf"))
        if SK_MASK:
            x = gl.where(o_n[:, None] < Sk, x, float("-inf"))
    if HAS_LO:
        x = x - lo[None, :]
    pt = gl.exp2(x)
    dst = pt * (dpt - delta[None, :])
    if HAS_SOFTCAP:  # with respect to the raw product
        dst = dst * (1.0 - tc * tc)
    return pt, dst


@gluon.jit
def _issue_scores(k_t, v_t, q_ring, do_ring, bars, t, s_zero, BLOCK_M: gl.constexpr, D: gl.constexpr,
                  STAGES: gl.constexpr):
    """Once tile t's Q and dO have landed: S^T_t = K Q_t^T and dP^T_t = V dO_t^T, issued (not awaited)."""
    wait(bars, t, STAGES)
    st = warpgroup_mma(k_t, slot(q_ring, t, BLOCK_M, D, STAGES).permute((1, 0)), s_zero, use_acc=False,
                       is_async=True)
    dpt = warpgroup_mma(v_t, slot(do_ring, t, BLOCK_M, D, STAGES).permute((1, 0)), s_zero, use_acc=False,
                        is_async=True)
    return st, dpt


@gluon.jit
def _tile_grads(st, dpt, t, n_mt, n_masked, n_lfull, mt_lo, hk, group, row_b, stride_lh, Sq, o_n, offset, span,
                qk_scale, scale, softcap, SL, stride_sh, alibi_off, LSE, LSE_LO, DELTA, col_s: gl.constexpr,
                CAUSAL: gl.constexpr, HAS_WL: gl.constexpr, HAS_SOFTCAP: gl.constexpr, HAS_ALIBI: gl.constexpr,
                BLOCK_M: gl.constexpr, HAS_LO: gl.constexpr, FUSE: gl.constexpr = False, Sk=0,
                SK_MASK: gl.constexpr = False):
    """P^T and dS^T of flattened tile t: with the mask on the first n_masked query tiles of each head
    (the causal diagonal) and, with a window's left side, on those from n_lfull on (SK_MASK: the
    masked tiles also mask keys from Sk on, `_dst_tile`)."""
    if HAS_WL:
        edge = (t % n_mt < n_masked) | (t % n_mt >= n_lfull)
    else:
        edge = t % n_mt < n_masked
    if edge:
        pt, dst = _dst_tile(st, dpt, t, n_mt, mt_lo, hk, group, row_b, stride_lh, Sq, o_n, offset, span, qk_scale,
                            scale, softcap, SL, stride_sh, alibi_off, LSE, LSE_LO, DELTA, col_s, CAUSAL, HAS_WL,
                            HAS_SOFTCAP, HAS_ALIBI, True, BLOCK_M, HAS_LO, FUSE=FUSE, Sk=Sk, SK_MASK=SK_MASK)
    else:
        pt, dst = _dst_tile(st, dpt, t, n_mt, mt_lo, hk, group, row_b, stride_lh, Sq, o_n, offset, span, qk_scale,
                            scale, softcap, SL, stride_sh, alibi_off, LSE, LSE_LO, DELTA, col_s, CAUSAL, HAS_WL,
                            HAS_SOFTCAP, HAS_ALIBI, False, BLOCK_M, HAS_LO, FUSE=FUSE)
    return pt, dst


@gluon.jit
def _stage_ds(dst, ds_smem, dtype: gl.constexpr):
    """FUSED_DQ: tile's dS^T [keys, queries] into shared memory, where it is the A operand of both
    dK += dS^T Q and (transposed) dQ_t = dS K."""
    ds_smem.store(dst.to(dtype))
    fence_async_shared()


@gluon.jit
def _dq_out(dq, c, t, n_mt, mt_lo, hk, group, b, q_start, Sq, dq_desc, dq_smem, BLOCK_M: gl.constexpr,
            DQ_N: gl.constexpr, VARLEN: gl.constexpr):
    """FUSED_DQ: columns [c * DQ_N, (c + 1) * DQ_N) of tile t's dQ_t = dS K (unscaled: the caller
    scales the sum once, `triton.attention.dq_from_acc`), through shared-memory buffer c into the
    float32 dQ accumulator of its head's rows by the copy engine's reduce-add (bulk, asynchronous;
    the order of the programs' adds varies, so deterministic=True never takes this path).  Rows
    past the sequence's end are not touched.  The caller waits (`tma.store_wait`) until the
    buffer's previous reduce has read it."""
    g = t // n_mt
    m0 = (mt_lo + t - g * n_mt) * BLOCK_M
    h = hk * group + g
    buf = dq_smem.index(c)
    buf.reshape([BLOCK_M, DQ_N]).store(dq)
    fence_async_shared()
    reduce_out(dq_desc, b, m0, h, c * DQ_N, q_start, Sq, buf, VARLEN)


@gluon.jit
def _serial_products(pt, dst, dv, dk, t, ds, k_t, q_ring, do_ring, bars, q_desc, do_desc, T, n_mt, mt_lo, b, hk, group,
                     q_start, Sq, dq_desc, dq_smem, op_layout: gl.constexpr, dq_layout: gl.constexpr,
                     dtype: gl.constexpr, BLOCK_M: gl.constexpr, D: gl.constexpr, STAGES: gl.constexpr,
                     VARLEN: gl.constexpr, DQ_N: gl.constexpr):
    """FUSED_DQ one tile at a time: tile t's dV, dK and dQ_t products, dQ_t one [BLOCK_M, DQ_N]
    column part at a time, each handed to the copy engine before the next; then tile t's slot refills."""
    _stage_ds(dst, ds, dtype)
    dv = warpgroup_mma(gl.convert_layout(pt.to(dtype), op_layout), slot(do_ring, t, BLOCK_M, D, STAGES), dv,
                       is_async=True)
    dk = warpgroup_mma(ds, slot(q_ring, t, BLOCK_M, D, STAGES), dk, is_async=True)
    dq_zero = gl.zeros([BLOCK_M, DQ_N], gl.float32, layout=dq_layout)
    tma.store_wait(0)  # the previous tile's reduces have read their buffers
    for c in gl.static_range(D // DQ_N):
        dq = warpgroup_mma(ds.permute((1, 0)), k_t.slice(c * DQ_N, DQ_N, dim=1), dq_zero, use_acc=False,
                           is_async=True)
        dq = warpgroup_mma_wait(0, deps=(dq, ))  # (retires dV and dK as well: they are older)
        _dq_out(dq, c, t, n_mt, mt_lo, hk, group, b, q_start, Sq, dq_desc, dq_smem, BLOCK_M, DQ_N, VARLEN)
    dv, dk = warpgroup_mma_wait(0, deps=(dv, dk))
    _load_qdo(q_desc, do_desc, q_ring, do_ring, bars, t + STAGES, T, n_mt, mt_lo, b, hk, group, q_start, Sq, BLOCK_M,
              STAGES, VARLEN)
    return dv, dk


@gluon.jit
def _dkdv_tiles(k_t, v_t, q_ring, do_ring, bars, q_desc, do_desc, dk, dv, s_zero, T, n_mt_div, n_masked, n_lfull, mt_lo,
                b, hk, group, q_start, row_b, stride_lh, Sq, o_n, offset, span, qk_scale, scale, softcap, SL, stride_sh,
                alibi_off, LSE, LSE_LO, DELTA, col_s: gl.constexpr, CAUSAL: gl.constexpr, HAS_WL: gl.constexpr,
                HAS_SOFTCAP: gl.constexpr, HAS_ALIBI: gl.constexpr, op_layout: gl.constexpr, dtype: gl.constexpr,
                BLOCK_M: gl.constexpr, D: gl.constexpr, STAGES: gl.constexpr, PIPE: gl.constexpr, VARLEN: gl.constexpr,
                HAS_LO: gl.constexpr, FUSE: gl.constexpr, ds_smem, dq_desc, dq_smem, dq_layout: gl.constexpr,
                FUSED_DQ: gl.constexpr, DQ_N: gl.constexpr, Sk=0):
    """dK, dV (float32, unscaled) over the T > 0 flattened query tiles: the kernel's main loop.
    FUSED_DQ: each tile's dS^T goes through `ds_smem`, the A operand of dK's product and of
    dQ_t = dS K, which `_dq_out` adds into dQ once the tile's products are retired."""
    # tile 0: its S^T, dP^T alone, so each loop below always has a tile's P^T, dS^T in hand
    st, dpt = _issue_scores(k_t, v_t, q_ring, do_ring, bars, 0, s_zero, BLOCK_M, D, STAGES)
    st, dpt = warpgroup_mma_wait(0, deps=(st, dpt))
    pt, dst = _tile_grads(st, dpt, 0, n_mt_div, n_masked, n_lfull, mt_lo, hk, group, row_b, stride_lh, Sq, o_n, offset,
                          span, qk_scale, scale, softcap, SL, stride_sh, alibi_off, LSE, LSE_LO, DELTA, col_s, CAUSAL,
                          HAS_WL, HAS_SOFTCAP, HAS_ALIBI, BLOCK_M, HAS_LO, FUSE=FUSE, Sk=Sk,
                              SK_MASK=FUSED_DQ)
    if PIPE and FUSED_DQ:
        # as below, with dS^T staged in shared memory (two slots: tile t's is written while tile
        # t-1's products still read the other) and dQ_t, in two column parts, handed to the copy
        # engine once tile t-1's products retire
        gl.static_assert(D == 2 * DQ_N, "overlapped FUSED_DQ: dQ_t in two column parts")
        dq_zero = gl.zeros([BLOCK_M, DQ_N], gl.float32, layout=dq_layout)
        pt = gl.convert_layout(pt.to(dtype), op_layout)
        _stage_ds(dst, ds_smem.index(0), dtype)
        k_lo = k_t.slice(0, DQ_N, dim=1)
        k_hi = k_t.slice(DQ_N, DQ_N, dim=1)
        for t in range(1, T):
            st, dpt = _issue_scores(k_t, v_t, q_ring, do_ring, bars, t, s_zero, BLOCK_M, D, STAGES)
            ds = ds_smem.index((t - 1) % 2)
            dv = warpgroup_mma(pt, slot(do_ring, t - 1, BLOCK_M, D, STAGES), dv, is_async=True)
            dk = warpgroup_mma(ds, slot(q_ring, t - 1, BLOCK_M, D, STAGES), dk, is_async=True)
            dq0 = warpgroup_mma(ds.permute((1, 0)), k_lo, dq_zero, use_acc=False, is_async=True)
            dq1 = warpgroup_mma(ds.permute((1, 0)), k_hi, dq_zero, use_acc=False, is_async=True)
            # S^T_t and dP^T_t are done (the older groups); dV, dK, dQ of tile t-1 may still run
            st, dpt = warpgroup_mma_wait(4, deps=(st, dpt))
            pt_new, dst_new = _tile_grads(st, dpt, t, n_mt_div, n_masked, n_lfull, mt_lo, hk, group, row_b, stride_lh,
                                          Sq, o_n, offset, span, qk_scale, scale, softcap, SL, stride_sh, alibi_off,
                                          LSE, LSE_LO, DELTA, col_s, CAUSAL, HAS_WL, HAS_SOFTCAP, HAS_ALIBI, BLOCK_M,
                                          HAS_LO, FUSE=FUSE, Sk=Sk,
                              SK_MASK=FUSED_DQ)
            _stage_ds(dst_new, ds_smem.index(t % 2), dtype)
            pt_new = gl.convert_layout(pt_new.to(dtype), op_layout)
            dv, dk, dq0, dq1, pt = warpgroup_mma_wait(0, deps=(dv, dk, dq0, dq1, pt))
            tma.store_wait(0)  # tile t-2's reduces have read their buffers
            _dq_out(dq0, 0, t - 1, n_mt_div, mt_lo, hk, group, b, q_start, Sq, dq_desc, dq_smem, BLOCK_M, DQ_N,
                    VARLEN)
            _dq_out(dq1, 1, t - 1, n_mt_div, mt_lo, hk, group, b, q_start, Sq, dq_desc, dq_smem, BLOCK_M, DQ_N,
                    VARLEN)
            # tile t-1's slot is free
            _load_qdo(q_desc, do_desc, q_ring, do_ring, bars, t - 1 + STAGES, T, n_mt_div, mt_lo, b, hk, group,
                      q_start, Sq, BLOCK_M, STAGES, VARLEN)
            pt = pt_new
        last = T - 1
        ds = ds_smem.index(last % 2)
        dv = warpgroup_mma(pt, slot(do_ring, last, BLOCK_M, D, STAGES), dv, is_async=True)
        dk = warpgroup_mma(ds, slot(q_ring, last, BLOCK_M, D, STAGES), dk, is_async=True)
        dq0 = warpgroup_mma(ds.permute((1, 0)), k_lo, dq_zero, use_acc=False, is_async=True)
        dq1 = warpgroup_mma(ds.permute((1, 0)), k_hi, dq_zero, use_acc=False, is_async=True)
        dv, dk, dq0, dq1 = warpgroup_mma_wait(0, deps=(dv, dk, dq0, dq1))
        tma.store_wait(0)
        _dq_out(dq0, 0, last, n_mt_div, mt_lo, hk, group, b, q_start, Sq, dq_desc, dq_smem, BLOCK_M, DQ_N,
                VARLEN)
        _dq_out(dq1, 1, last, n_mt_div, mt_lo, hk, group, b, q_start, Sq, dq_desc, dq_smem, BLOCK_M, DQ_N,
                VARLEN)
    elif PIPE:
        pt = gl.convert_layout(pt.to(dtype), op_layout)
        dst = gl.convert_layout(dst.to(dtype), op_layout)
        for t in range(1, T):
            st, dpt = _issue_scores(k_t, v_t, q_ring, do_ring, bars, t, s_zero, BLOCK_M, D, STAGES)
            dv = warpgroup_mma(pt, slot(do_ring, t - 1, BLOCK_M, D, STAGES), dv, is_async=True)
            dk = warpgroup_mma(dst, slot(q_ring, t - 1, BLOCK_M, D, STAGES), dk, is_async=True)
            # S^T_t and dP^T_t are done (the older groups); dV, dK of tile t-1 may still run
            st, dpt = warpgroup_mma_wait(2, deps=(st, dpt))
            pt_new, dst_new = _tile_grads(st, dpt, t, n_mt_div, n_masked, n_lfull, mt_lo, hk, group, row_b, stride_lh,
                                          Sq, o_n, offset, span, qk_scale, scale, softcap, SL, stride_sh, alibi_off,
                                          LSE, LSE_LO, DELTA, col_s, CAUSAL, HAS_WL, HAS_SOFTCAP, HAS_ALIBI, BLOCK_M,
                                          HAS_LO, FUSE=FUSE, Sk=Sk,
                              SK_MASK=FUSED_DQ)
            dv, dk, pt, dst = warpgroup_mma_wait(0, deps=(dv, dk, pt, dst))
            # tile t-1's slot is free
            _load_qdo(q_desc, do_desc, q_ring, do_ring, bars, t - 1 + STAGES, T, n_mt_div, mt_lo, b, hk, group,
                      q_start, Sq, BLOCK_M, STAGES, VARLEN)
            pt = gl.convert_layout(pt_new.to(dtype), op_layout)
            dst = gl.convert_layout(dst_new.to(dtype), op_layout)
        last = T - 1
        dv = warpgroup_mma(pt, slot(do_ring, last, BLOCK_M, D, STAGES), dv, is_async=True)
        dk = warpgroup_mma(dst, slot(q_ring, last, BLOCK_M, D, STAGES), dk, is_async=True)
        dv, dk = warpgroup_mma_wait(0, deps=(dv, dk))
    elif FUSED_DQ:
        # one tile at a time, and dQ_t in DQ_N-column parts, each added before the next is issued
        # (the fewest live registers: dK and dV, one part; another program on the SM fills the gaps)
        ds = ds_smem.index(0)
        dv, dk = _serial_products(pt, dst, dv, dk, 0, ds, k_t, q_ring, do_ring, bars, q_desc, do_desc, T, n_mt_div,
                                  mt_lo, b, hk, group, q_start, Sq, dq_desc, dq_smem, op_layout, dq_layout,
                                  dtype, BLOCK_M, D, STAGES, VARLEN, DQ_N)
        for t in range(1, T):
            st, dpt = _issue_scores(k_t, v_t, q_ring, do_ring, bars, t, s_zero, BLOCK_M, D, STAGES)
            st, dpt = warpgroup_mma_wait(0, deps=(st, dpt))
            pt, dst = _tile_grads(st, dpt, t, n_mt_div, n_masked, n_lfull, mt_lo, hk, group, row_b, stride_lh, Sq, o_n,
                                  offset, span, qk_scale, scale, softcap, SL, stride_sh, alibi_off, LSE, LSE_LO, DELTA,
                                  col_s, CAUSAL, HAS_WL, HAS_SOFTCAP, HAS_ALIBI, BLOCK_M, HAS_LO, FUSE=FUSE, Sk=Sk,
                              SK_MASK=FUSED_DQ)
            dv, dk = _serial_products(pt, dst, dv, dk, t, ds, k_t, q_ring, do_ring, bars, q_desc, do_desc, T,
                                      n_mt_div, mt_lo, b, hk, group, q_start, Sq, dq_desc, dq_smem, op_layout,
                                      dq_layout, dtype, BLOCK_M, D, STAGES, VARLEN, DQ_N)
    else:
        # one tile at a time (fewer live registers; another program on the SM fills the gaps):
        # tile t's dV, dK products run while tile t+1's slot is awaited and its S^T, dP^T issued
        dv = warpgroup_mma(gl.convert_layout(pt.to(dtype), op_layout), slot(do_ring, 0, BLOCK_M, D, STAGES), dv,
                           is_async=True)
        dk = warpgroup_mma(gl.convert_layout(dst.to(dtype), op_layout), slot(q_ring, 0, BLOCK_M, D, STAGES), dk,
                           is_async=True)
        for t in range(1, T):
            st, dpt = _issue_scores(k_t, v_t, q_ring, do_ring, bars, t, s_zero, BLOCK_M, D, STAGES)
            # also retires tile t-1's dV, dK: its slot is free
            st, dpt, dv, dk = warpgroup_mma_wait(0, deps=(st, dpt, dv, dk))
            _load_qdo(q_desc, do_desc, q_ring, do_ring, bars, t - 1 + STAGES, T, n_mt_div, mt_lo, b, hk, group,
                      q_start, Sq, BLOCK_M, STAGES, VARLEN)
            pt, dst = _tile_grads(st, dpt, t, n_mt_div, n_masked, n_lfull, mt_lo, hk, group, row_b, stride_lh, Sq, o_n,
                                  offset, span, qk_scale, scale, softcap, SL, stride_sh, alibi_off, LSE, LSE_LO, DELTA,
                                  col_s, CAUSAL, HAS_WL, HAS_SOFTCAP, HAS_ALIBI, BLOCK_M, HAS_LO, FUSE=FUSE, Sk=Sk,
                              SK_MASK=FUSED_DQ)
            dv = warpgroup_mma(gl.convert_layout(pt.to(dtype), op_layout), slot(do_ring, t, BLOCK_M, D, STAGES),
                               dv, is_async=True)
            dk = warpgroup_mma(gl.convert_layout(dst.to(dtype), op_layout), slot(q_ring, t, BLOCK_M, D, STAGES),
                               dk, is_async=True)
        dv, dk = warpgroup_mma_wait(0, deps=(dv, dk))
    return dk, dv


@gluon.jit
def _split_scores(k_t, v_t, q_ring, do_ring, bars, t, s_zero, BLOCK_M: gl.constexpr, D: gl.constexpr,
                  STAGES: gl.constexpr, PART: gl.constexpr):
    """`_issue_scores` for one part: S^T_t alone for dV (PART 1; returned twice), with dP^T_t for dK."""
    if PART == 1:
        wait(bars, t, STAGES)
        st = warpgroup_mma(k_t, slot(q_ring, t, BLOCK_M, D, STAGES).permute((1, 0)), s_zero, use_acc=False,
                           is_async=True)
        dpt = st
    else:
        st, dpt = _issue_scores(k_t, v_t, q_ring, do_ring, bars, t, s_zero, BLOCK_M, D, STAGES)
    return st, dpt


@gluon.jit
def _split_product(st, dpt, acc, q_ring, do_ring, t, n_mt, n_masked, n_lfull, mt_lo, hk, group, row_b, stride_lh, Sq,
                   o_n, offset, span, qk_scale, scale, softcap, SL, stride_sh, alibi_off, LSE, LSE_LO, DELTA,
                   col_s: gl.constexpr, CAUSAL: gl.constexpr, HAS_WL: gl.constexpr, HAS_SOFTCAP: gl.constexpr,
                   HAS_ALIBI: gl.constexpr, op_layout: gl.constexpr, dtype: gl.constexpr, BLOCK_M: gl.constexpr,
                   D: gl.constexpr, STAGES: gl.constexpr, HAS_LO: gl.constexpr, FUSE: gl.constexpr, PART: gl.constexpr):
    """Tile t's P^T (dS^T) from its scores, and dV += P^T dO (dK += dS^T Q) issued.  PART 1's
    dS^T (from S^T standing in for dP^T) is never used, so the compiler drops it and its delta."""
    pt, dst = _tile_grads(st, dpt, t, n_mt, n_masked, n_lfull, mt_lo, hk, group, row_b, stride_lh, Sq, o_n, offset,
                          span, qk_scale, scale, softcap, SL, stride_sh, alibi_off, LSE, LSE_LO, DELTA, col_s, CAUSAL,
                          HAS_WL, HAS_SOFTCAP, HAS_ALIBI, BLOCK_M, HAS_LO, FUSE=FUSE)
    if PART == 1:
        acc = warpgroup_mma(gl.convert_layout(pt.to(dtype), op_layout), slot(do_ring, t, BLOCK_M, D, STAGES), acc,
                            is_async=True)
    else:
        acc = warpgroup_mma(gl.convert_layout(dst.to(dtype), op_layout), slot(q_ring, t, BLOCK_M, D, STAGES), acc,
                            is_async=True)
    return acc


@gluon.jit
def _split_tiles(k_t, v_t, q_ring, do_ring, bars, q_desc, do_desc, acc, s_zero, T, n_mt_div, n_masked, n_lfull, mt_lo,
                 b, hk, group, q_start, row_b, stride_lh, Sq, o_n, offset, span, qk_scale, scale, softcap, SL,
                 stride_sh, alibi_off, LSE, LSE_LO, DELTA, col_s: gl.constexpr, CAUSAL: gl.constexpr,
                 HAS_WL: gl.constexpr, HAS_SOFTCAP: gl.constexpr, HAS_ALIBI: gl.constexpr, op_layout: gl.constexpr,
                 dtype: gl.constexpr, BLOCK_M: gl.constexpr, D: gl.constexpr, STAGES: gl.constexpr,
                 VARLEN: gl.constexpr, HAS_LO: gl.constexpr, FUSE: gl.constexpr, PART: gl.constexpr):
    """One of dV (PART 1: sum of P^T dO, from S^T alone) and dK (PART 2: sum of dS^T Q) over the
    T > 0 flattened query tiles, one tile at a time as `_dkdv_tiles` without PIPE: tile t's
    product runs while tile t+1's slot is awaited and its scores issued."""
    # PART 1 has no dP^T: S^T stands in for it, and the dS^T it would give is never used
    st, dpt = _split_scores(k_t, v_t, q_ring, do_ring, bars, 0, s_zero, BLOCK_M, D, STAGES, PART)
    if PART == 1:
        st = warpgroup_mma_wait(0, deps=(st, ))
        dpt = st
    else:
        st, dpt = warpgroup_mma_wait(0, deps=(st, dpt))
    acc = _split_product(st, dpt, acc, q_ring, do_ring, 0, n_mt_div, n_masked, n_lfull, mt_lo, hk, group, row_b,
                         stride_lh, Sq, o_n, offset, span, qk_scale, scale, softcap, SL, stride_sh, alibi_off, LSE,
                         LSE_LO, DELTA, col_s, CAUSAL, HAS_WL, HAS_SOFTCAP, HAS_ALIBI, op_layout, dtype, BLOCK_M, D,
                         STAGES, HAS_LO, FUSE, PART)
    for t in range(1, T):
        st, dpt = _split_scores(k_t, v_t, q_ring, do_ring, bars, t, s_zero, BLOCK_M, D, STAGES, PART)
        # also retires tile t-1's product: its slot is free
        if PART == 1:
            st, acc = warpgroup_mma_wait(0, deps=(st, acc))
            dpt = st
        else:
            st, dpt, acc = warpgroup_mma_wait(0, deps=(st, dpt, acc))
        _load_qdo(q_desc, do_desc, q_ring, do_ring, bars, t - 1 + STAGES, T, n_mt_div, mt_lo, b, hk, group,
                  q_start, Sq, BLOCK_M, STAGES, VARLEN)
        acc = _split_product(st, dpt, acc, q_ring, do_ring, t, n_mt_div, n_masked, n_lfull, mt_lo, hk, group, row_b,
                             stride_lh, Sq, o_n, offset, span, qk_scale, scale, softcap, SL, stride_sh, alibi_off, LSE,
                             LSE_LO, DELTA, col_s, CAUSAL, HAS_WL, HAS_SOFTCAP, HAS_ALIBI, op_layout, dtype, BLOCK_M, D,
                             STAGES, HAS_LO, FUSE, PART)
    acc = warpgroup_mma_wait(0, deps=(acc, ))
    return acc


@gluon.jit
def attn_bwd_dkdv_sm90_kernel(q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, LSE, LSE_LO, DELTA, FAR, stride_lb,
                              stride_lh, CU_Q, CU_K, ORDER, Hq, Sq, Sk, total_q, total_k, group, offset, bottom_right,
                              span, qk_scale, scale, softcap, SLOPES, stride_sb, stride_sh, right, dq_desc,
                              CAUSAL: gl.constexpr, HAS_WL: gl.constexpr,
                              HAS_SOFTCAP: gl.constexpr, HAS_ALIBI: gl.constexpr, BLOCK_M: gl.constexpr,
                              BLOCK_N: gl.constexpr, D: gl.constexpr, STAGES: gl.constexpr, PIPE: gl.constexpr,
                              VARLEN: gl.constexpr, HAS_LO: gl.constexpr, LO_PASS: gl.constexpr,
                              FAR_READY: gl.constexpr, PART: gl.constexpr, FUSED_DQ: gl.constexpr,
                              num_warps: gl.constexpr):
    """dK, dV of one key block.  With lse_lo (HAS_LO) a call is two launches of this kernel:
    the first (LO_PASS=False) serves every program whose GQA group has no row far from 0
    (`_lo_needed`) and records the answer in FAR[b * Hkv + hk]; the second (LO_PASS=True)
    redoes the programs FAR marks, subtracting lse_lo, and the others leave at once.  One copy
    of the loop per kernel: with both copies in one kernel (a branch per program), ptxas spilled
    the loop's registers (176-200 B of stack at D = 128) and the causal kernel ran ~12% slower
    on every call, far rows or not.  PART 0 computes dK and dV; past D = 128, where two float32
    [keys, D] accumulators do not fit in registers, a call launches it with PART 1 (dV only) and
    then PART 2 (dK only), one accumulator each, at the cost of one more K Q^T per tile.
    FUSED_DQ (PART 0, 64-query tiles): the program also adds each tile's dQ_t = dS K, scaled, into
    a float32 dQ accumulator through dq_desc (TMA reduce-add, [1, 64, 1, DQ_N] boxes), and no dQ
    kernel runs."""
    if LO_PASS:
        if gl.load(FAR + key_program(Sq, group, CAUSAL, D)[1]) != 0:
            _dkdv_block(q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, LSE, LSE_LO, DELTA, FAR, stride_lb,
                        stride_lh, CU_Q, CU_K, ORDER, Hq, Sq, Sk, total_q, total_k, group, offset, bottom_right, span,
                        qk_scale, scale, softcap, SLOPES, stride_sb, stride_sh, right, dq_desc, CAUSAL, HAS_WL,
                        HAS_SOFTCAP, HAS_ALIBI, BLOCK_M, BLOCK_N, D, STAGES, PIPE, VARLEN, True, False, False, PART,
                        FUSED_DQ, num_warps)
    else:
        _dkdv_block(q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, LSE, LSE_LO, DELTA, FAR, stride_lb, stride_lh,
                    CU_Q, CU_K, ORDER, Hq, Sq, Sk, total_q, total_k, group, offset, bottom_right, span, qk_scale, scale,
                    softcap, SLOPES, stride_sb, stride_sh, right, dq_desc, CAUSAL, HAS_WL, HAS_SOFTCAP, HAS_ALIBI,
                    BLOCK_M, BLOCK_N, D, STAGES, PIPE, VARLEN, False, HAS_LO, FAR_READY, PART, FUSED_DQ, num_warps)


@gluon.jit
def _dkdv_block(q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, LSE, LSE_LO, DELTA, FAR, stride_lb, stride_lh, CU_Q,
                CU_K, ORDER, Hq, Sq, Sk, total_q, total_k, group, offset, bottom_right, span, qk_scale, scale, softcap,
                SLOPES, stride_sb, stride_sh, right, dq_desc, CAUSAL: gl.constexpr,
                HAS_WL: gl.constexpr, HAS_SOFTCAP: gl.constexpr, HAS_ALIBI: gl.constexpr, BLOCK_M: gl.constexpr,
                BLOCK_N: gl.constexpr, D: gl.constexpr, STAGES: gl.constexpr, PIPE: gl.constexpr, VARLEN: gl.constexpr,
                USE_LO: gl.constexpr, SCAN: gl.constexpr, FAR_READY: gl.constexpr, PART: gl.constexpr,
                FUSED_DQ: gl.constexpr, num_warps: gl.constexpr):
    """The kernel's program: USE_LO subtracts lse_lo in the loop; SCAN leaves the loop to the
    second launch where the group has a far row, and writes FAR (FAR_READY: reads it, as the dQ
    kernel wrote it)."""
    dtype: gl.constexpr = q_desc.dtype
    # SCAN: the programs that compute have every |lse2| < LO_FROM, where float16 fuses too (rounding.py)
    FUSE: gl.constexpr = backward_fuse(dtype, SCAN, HAS_SOFTCAP=HAS_SOFTCAP, HAS_ALIBI=HAS_ALIBI)
    bh, b, hk, n0, q_start, Sq, k_start, Sk, offset, row_b = key_block(CU_Q, CU_K, ORDER, Hq, group, Sq, Sk, total_q,
                                                                       total_k, offset, bottom_right, stride_lb,
                                                                       BLOCK_N, VARLEN, CAUSAL, D)
    SL = SLOPES + b * stride_sb  # ALiBi: this sequence's slopes (read per head, `_dst_tile`)
    alibi_off = offset - right  # (the forward's)

    # S^T / dP^T: [keys, queries], one warp per 16 keys; dK / dV: [keys, D]
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                       instr_shape=[16, BLOCK_M, 16])
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                         instr_shape=[16, D, 16])
    op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    # FUSED_DQ: dQ_t in [queries, DQ_N] column parts, DQ_N = the reduce box's width (the float32
    # columns of one 128-byte swizzle row: `attention.dq_descriptor`); with two warpgroups (128 keys)
    # each takes half a part's columns, summing over all 128 keys
    DQ_N: gl.constexpr = dq_desc.block_type.shape[len(dq_desc.block_type.shape) - 1]
    dq_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, num_warps // 4],
                                                        instr_shape=[16, DQ_N // (num_warps // 4), 16])
    col_s: gl.constexpr = gl.SliceLayout(0, s_layout)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)

    # the query tiles that see these keys, and which of them need a mask (`query_window`)
    mt_lo, n_mt, n_masked, n_lfull = query_window(n0, Sq, Sk, offset, span, BLOCK_M, BLOCK_N, CAUSAL, HAS_WL)
    if FUSED_DQ:  # a block whose keys cross Sk masks every tile there (`_dst_tile`'s SK_MASK)
        if n0 + BLOCK_N > Sk:
            n_masked = n_mt
    T = n_mt * group  # flattened: (head of the group, query tile)
    n_mt_div = gl.maximum(n_mt, 1)

    k_smem = gl.allocate_shared_memory(dtype, k_desc.block_type.shape, k_desc.layout)
    if PART != 1:  # dV alone needs no V (and stores through K's buffer)
        v_smem = gl.allocate_shared_memory(dtype, v_desc.block_type.shape, v_desc.layout)
    q_ring = gl.allocate_shared_memory(dtype, [STAGES] + q_desc.block_type.shape, q_desc.layout)
    do_ring = gl.allocate_shared_memory(dtype, [STAGES] + do_desc.block_type.shape, do_desc.layout)
    if FUSED_DQ:  # one tile's dS^T, the A operand of dK's and dQ_t's products
        ds_smem = gl.allocate_shared_memory(dtype, [2 if PIPE else 1, BLOCK_N, BLOCK_M], gl.NVMMASharedLayout(
            swizzle_byte_width=128, element_bitwidth=16, rank=2))
        # dQ_t's column parts, float32, on their way to the copy engine's reduce (`_dq_out`)
        dq_smem = gl.allocate_shared_memory(gl.float32, [D // DQ_N] + dq_desc.block_type.shape, dq_desc.layout)
    else:
        ds_smem = k_smem
        dq_smem = k_smem
    kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_bar, count=1)
    init_barriers(bars, STAGES)
    fence_async_shared()

    if PART == 1:
        mbarrier.expect(kv_bar, k_desc.block_type.nbytes)
        copy_in(k_desc, b, n0, hk, k_start, Sk, kv_bar, k_smem, True, VARLEN)
    else:
        mbarrier.expect(kv_bar, k_desc.block_type.nbytes + v_desc.block_type.nbytes)
        copy_in(k_desc, b, n0, hk, k_start, Sk, kv_bar, k_smem, True, VARLEN)
        copy_in(v_desc, b, n0, hk, k_start, Sk, kv_bar, v_smem, True, VARLEN)
    for i in gl.static_range(STAGES):
        _load_qdo(q_desc, do_desc, q_ring, do_ring, bars, i, T, n_mt_div, mt_lo, b, hk, group, q_start, Sq, BLOCK_M,
                  STAGES, VARLEN)
    if SCAN:  # while the first copies arrive (scanned before them, it cost D = 64 ~3% a step)
        if FAR_READY:  # the dQ kernel, run first, found the answer (its FAR_OUT)
            far = gl.load(FAR + bh) != 0
        else:
            far = _lo_needed(LSE, row_b, stride_lh, hk, group, Sq, num_warps)
            if n0 == 0:  # (the first key block)
                gl.store(FAR + bh, far.to(gl.int32))
        if far:  # the second launch computes this block; its dK, dV here are zeros
            for i in gl.static_range(STAGES):
                if i < T:  # no copy may still be landing in shared memory when the program ends
                    wait(bars, i, STAGES)
            T = 0

    o_n = n0 + gl.arange(0, BLOCK_N, layout=row_s)
    s_zero = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, layout=s_layout)
    mbarrier.wait(kv_bar, 0)
    k_t = k_smem.reshape([BLOCK_N, D])
    if PART == 0:
        dk = gl.zeros([BLOCK_N, D], gl.float32, layout=acc_layout)
        dv = gl.zeros([BLOCK_N, D], gl.float32, layout=acc_layout)
        v_t = v_smem.reshape([BLOCK_N, D])
        if T > 0:
            dk, dv = _dkdv_tiles(k_t, v_t, q_ring, do_ring, bars, q_desc, do_desc, dk, dv, s_zero, T, n_mt_div,
                                 n_masked, n_lfull, mt_lo, b, hk, group, q_start, row_b, stride_lh, Sq, o_n, offset,
                                 span, qk_scale, scale, softcap, SL, stride_sh, alibi_off, LSE, LSE_LO, DELTA, col_s,
                                 CAUSAL, HAS_WL, HAS_SOFTCAP, HAS_ALIBI, op_layout, dtype, BLOCK_M, D, STAGES, PIPE,
                                 VARLEN, USE_LO, FUSE, ds_smem, dq_desc, dq_smem, dq_layout, FUSED_DQ, DQ_N, Sk=Sk)
    else:
        acc = gl.zeros([BLOCK_N, D], gl.float32, layout=acc_layout)
        v_t = k_t if PART == 1 else v_smem.reshape([BLOCK_N, D])  # (PART 1 never reads it)
        if T > 0:
            acc = _split_tiles(k_t, v_t, q_ring, do_ring, bars, q_desc, do_desc, acc, s_zero, T, n_mt_div, n_masked,
                               n_lfull, mt_lo, b, hk, group, q_start, row_b, stride_lh, Sq, o_n, offset, span, qk_scale,
                               scale, softcap, SL, stride_sh, alibi_off, LSE, LSE_LO, DELTA, col_s, CAUSAL, HAS_WL,
                               HAS_SOFTCAP, HAS_ALIBI, op_layout, dtype, BLOCK_M, D, STAGES, VARLEN, USE_LO, FUSE, PART)

    mbarrier.invalidate(kv_bar)
    invalidate_barriers(bars, STAGES)
    # dK, dV through K's and V's buffers (no longer read) and TMA, which clips rows past Sk
    if PART == 0:
        k_smem.reshape([BLOCK_N, D]).store((dk * scale).to(dtype))
        v_smem.reshape([BLOCK_N, D]).store(dv.to(dtype))
        fence_async_shared()
        copy_out(dk_desc, b, n0, hk, k_start, Sk, k_smem, VARLEN)
        copy_out(dv_desc, b, n0, hk, k_start, Sk, v_smem, VARLEN)
    elif PART == 1:
        k_smem.reshape([BLOCK_N, D]).store(acc.to(dtype))
        fence_async_shared()
        copy_out(dv_desc, b, n0, hk, k_start, Sk, k_smem, VARLEN)
    else:
        k_smem.reshape([BLOCK_N, D]).store((acc * scale).to(dtype))
        fence_async_shared()
        copy_out(dk_desc, b, n0, hk, k_start, Sk, k_smem, VARLEN)
    tma.store_wait(0)


@gluon.jit
def _ds_tile(s, dp, n0, o_m, lse2, lo, delta, Sk, offset, span, qk_scale, scale, softcap, slope, alibi_off,
             s_layout: gl.constexpr, MASKED: gl.constexpr, CAUSAL: gl.constexpr, HAS_WL: gl.constexpr,
             BLOCK_N: gl.constexpr, HAS_LO: gl.constexpr, FUSE: gl.constexpr = False, HAS_SOFTCAP: gl.constexpr = False,
             HAS_ALIBI: gl.constexpr = False):
    """dS ([queries, keys], float32) of one key tile; with softcap, with respect to the raw
    product (dS * (1 - t^2))."""
    _, ds = p_and_ds(s, dp, n0, o_m, lse2, lo, delta, Sk, offset, span, qk_scale, scale, softcap, slope, alibi_off,
                     s_layout, MASKED, CAUSAL, HAS_WL, BLOCK_N, HAS_LO, FUSE, HAS_SOFTCAP, HAS_ALIBI)
    return ds


@gluon.jit
def p_and_ds(s, dp, n0, o_m, lse2, lo, delta, Sk, offset, span, qk_scale, scale, softcap, slope, alibi_off,
             s_layout: gl.constexpr, MASKED: gl.constexpr, CAUSAL: gl.constexpr, HAS_WL: gl.constexpr,
             BLOCK_N: gl.constexpr, HAS_LO: gl.constexpr, FUSE: gl.constexpr = False,
             HAS_SOFTCAP: gl.constexpr = False, HAS_ALIBI: gl.constexpr = False):
    """(P, dS) ([queries, keys], float32) of one key tile (`_ds_tile`'s dS)."""
    MOD: gl.constexpr = HAS_SOFTCAP or HAS_ALIBI
    if MOD:  # the forward's score, exactly (scores.py)
        o_n = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        s2, t = modified_score(s, o_m[:, None], o_n[None, :], qk_scale, scale, softcap, slope, alibi_off, HAS_SOFTCAP,
                               HAS_ALIBI)
        x = s2 - lse2[:, None]
    else:
        x = exponent(s, qk_scale, lse2[:, None], FUSE)  # the forward's score, exactly (rounding.py)
    if MASKED:  # keys past Sk (zero-filled: dS K would still mix their scores in), the causal diagonal
        # or the window's left edge
        if not MOD:
            o_n = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        x = gl.where(visible(o_m[:, None], o_n[None, :], Sk, offset, span, CAUSAL, HAS_WL), x, float("-inf"))
    if HAS_LO:
        x = x - lo[:, None]
    p = gl.exp2(x)
    ds = p * (dp - delta[:, None])
    if HAS_SOFTCAP:
        ds = ds * (1.0 - t * t)
    return p, ds


@gluon.jit
def ds_tile_at(s, dp, j, n_lo, n_lfull, n_full, o_m, lse2, lo, delta, Sk, offset, span, qk_scale, scale, softcap,
               slope, alibi_off, s_layout: gl.constexpr, CAUSAL: gl.constexpr, HAS_WL: gl.constexpr,
               BLOCK_N: gl.constexpr, HAS_LO: gl.constexpr, FUSE: gl.constexpr, HAS_SOFTCAP: gl.constexpr,
               HAS_ALIBI: gl.constexpr):
    """`_ds_tile` of key tile n_lo + j (`key_window`'s counting), with the mask where the tile needs
    one (before n_lfull or from n_full on): one copy of the element-wise code for each."""
    if (j < n_full) & (j >= n_lfull):
        ds = _ds_tile(s, dp, (n_lo + j) * BLOCK_N, o_m, lse2, lo, delta, Sk, offset, span, qk_scale, scale, softcap,
                      slope, alibi_off, s_layout, False, CAUSAL, HAS_WL, BLOCK_N, HAS_LO, FUSE=FUSE,
                      HAS_SOFTCAP=HAS_SOFTCAP, HAS_ALIBI=HAS_ALIBI)
    else:
        ds = _ds_tile(s, dp, (n_lo + j) * BLOCK_N, o_m, lse2, lo, delta, Sk, offset, span, qk_scale, scale, softcap,
                      slope, alibi_off, s_layout, True, CAUSAL, HAS_WL, BLOCK_N, HAS_LO, FUSE=FUSE,
                      HAS_SOFTCAP=HAS_SOFTCAP, HAS_ALIBI=HAS_ALIBI)
    return ds


@gluon.jit
def delta_rows(O, DLSE, DELTA, do_t, b, h, q_start, m0, Sq, row, stride_ob, stride_os, stride_oh,
               row_s: gl.constexpr, HAS_DLSE: gl.constexpr, BLOCK_M: gl.constexpr, D: gl.constexpr,
               num_warps: gl.constexpr):
    """delta = rowsum(o * dO) - dlse of query rows m0 + [0, BLOCK_M) (dO from shared memory,
    do_t), stored for the dK/dV kernel that runs next and returned in `row_s`: computed in the dQ
    kernel rather than in a kernel of its own (one launch fewer a step, and o read once)."""
    blk: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [num_warps, 1], [1, 0])
    r = m0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, blk))
    c = gl.arange(0, D, layout=gl.SliceLayout(0, blk))
    o_rows = O + b.to(gl.int64) * stride_ob + h.to(gl.int64) * stride_oh + (q_start + r).to(gl.int64) * stride_os
    o_tile = gl.load(o_rows[:, None] + c[None, :], mask=(r < Sq)[:, None], other=0.0)
    d_rows = gl.sum(o_tile.to(gl.float32) * do_t.load(blk).to(gl.float32), axis=1)
    if HAS_DLSE:
        d_rows -= gl.load(DLSE + row + r, mask=r < Sq, other=0.0)
    gl.store(DELTA + row + r, d_rows, mask=r < Sq)
    return gl.convert_layout(d_rows, row_s)


@gluon.jit
def lo_rows(lse2, o_m, Sq, far_at, HAS_LO: gl.constexpr, FAR_OUT: gl.constexpr):
    """Whether these query rows need lse's low part (as the dK/dV kernel's `_lo_needed`, over a
    dQ program's rows); FAR_OUT: a program that does marks its GQA group at far_at for the dK/dV
    kernel launched next."""
    if HAS_LO:
        lo_here = gl.max(gl.where(o_m < Sq, gl.abs(lse2), 0.0), axis=0) >= LO_FROM
        if FAR_OUT:
            if lo_here:
                gl.atomic_or(far_at, 1)
    else:
        lo_here = False
    return lo_here


@gluon.jit
def _dq_tiles(q_t, do_t, k_ring, v_ring, k_bars, v_bars, k_desc, v_desc, dq, s_zero, n_lo, n_tiles, n_lfull, n_full, b,
              hk, k_start, Sk, o_m, lse2, lo, delta, offset, span, qk_scale, scale, softcap, slope, alibi_off,
              s_layout: gl.constexpr, op_layout: gl.constexpr, dtype: gl.constexpr, BLOCK_N: gl.constexpr,
              D: gl.constexpr, STAGES: gl.constexpr, V_STAGES: gl.constexpr, VARLEN: gl.constexpr, CAUSAL: gl.constexpr,
              HAS_WL: gl.constexpr, HAS_LO: gl.constexpr, FUSE: gl.constexpr, HAS_SOFTCAP: gl.constexpr,
              HAS_ALIBI: gl.constexpr):
    """dQ (float32, unscaled) over the n_tiles > 0 key tiles n_lo + [0, n_tiles) (`key_window`):
    the kernel's main loop."""
    wait(k_bars, 0, STAGES)
    wait(v_bars, 0, V_STAGES)
    s = warpgroup_mma(q_t, slot(k_ring, 0, BLOCK_N, D, STAGES).permute((1, 0)), s_zero, use_acc=False,
                      is_async=True)
    dp = warpgroup_mma(do_t, slot(v_ring, 0, BLOCK_N, D, V_STAGES).permute((1, 0)), s_zero, use_acc=False,
                       is_async=True)
    s, dp = warpgroup_mma_wait(0, deps=(s, dp))
    load_rows(v_desc, v_ring, v_bars, V_STAGES, n_lo, b, hk, k_start, Sk, n_tiles, BLOCK_N, V_STAGES, VARLEN)
    ds = ds_tile_at(s, dp, 0, n_lo, n_lfull, n_full, o_m, lse2, lo, delta, Sk, offset, span, qk_scale, scale, softcap,
                    slope, alibi_off, s_layout, CAUSAL, HAS_WL, BLOCK_N, HAS_LO, FUSE, HAS_SOFTCAP, HAS_ALIBI)
    ds = gl.convert_layout(ds.to(dtype), op_layout)
    for j in range(1, n_tiles):
        wait(k_bars, j, STAGES)
        wait(v_bars, j, V_STAGES)
        s = warpgroup_mma(q_t, slot(k_ring, j, BLOCK_N, D, STAGES).permute((1, 0)), s_zero, use_acc=False,
                          is_async=True)
        dp = warpgroup_mma(do_t, slot(v_ring, j, BLOCK_N, D, V_STAGES).permute((1, 0)), s_zero,
                           use_acc=False, is_async=True)
        dq = warpgroup_mma(ds, slot(k_ring, j - 1, BLOCK_N, D, STAGES), dq, is_async=True)
        # S_j, dP_j are done; dQ's product of tile j-1 may still run.  V_j's slot is free.
        s, dp = warpgroup_mma_wait(1, deps=(s, dp))
        load_rows(v_desc, v_ring, v_bars, j + V_STAGES, n_lo, b, hk, k_start, Sk, n_tiles, BLOCK_N, V_STAGES, VARLEN)
        ds_new = ds_tile_at(s, dp, j, n_lo, n_lfull, n_full, o_m, lse2, lo, delta, Sk, offset, span, qk_scale, scale,
                            softcap, slope, alibi_off, s_layout, CAUSAL, HAS_WL, BLOCK_N, HAS_LO, FUSE, HAS_SOFTCAP,
                            HAS_ALIBI)
        dq, ds = warpgroup_mma_wait(0, deps=(dq, ds))
        load_rows(k_desc, k_ring, k_bars, j - 1 + STAGES, n_lo, b, hk, k_start, Sk, n_tiles, BLOCK_N, STAGES, VARLEN)
        ds = gl.convert_layout(ds_new.to(dtype), op_layout)
    last = n_tiles - 1
    dq = warpgroup_mma(ds, slot(k_ring, last, BLOCK_N, D, STAGES), dq, is_async=True)
    dq = warpgroup_mma_wait(0, deps=(dq, ))
    return dq


@gluon.jit
def attn_bwd_dq_sm90_kernel(q_desc, k_desc, v_desc, do_desc, dq_desc, LSE, LSE_LO, DELTA, FAR, stride_lb, stride_lh,
                            CU_Q, CU_K, ORDER, Hq, Sq, Sk, total_q, total_k, group, offset, bottom_right, span,
                            qk_scale, scale, O, DLSE, stride_ob, stride_os, stride_oh, softcap, SLOPES, stride_sb,
                            stride_sh, right, CAUSAL: gl.constexpr, HAS_WL: gl.constexpr, HAS_SOFTCAP: gl.constexpr,
                            HAS_ALIBI: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, D: gl.constexpr,
                            STAGES: gl.constexpr, V_STAGES: gl.constexpr, VARLEN: gl.constexpr,
                            DELTA_HERE: gl.constexpr, HAS_DLSE: gl.constexpr, HAS_LO: gl.constexpr,
                            FAR_OUT: gl.constexpr, num_warps: gl.constexpr):
    """dQ of one query block.  FAR_OUT (with lse_lo, when the dK/dV kernel runs next): a program
    with a row far from 0 sets FAR[b * Hkv + hk] (zeroed by the caller), the answer the dK/dV
    kernel's first launch would otherwise scan the group's lse for (`_lo_needed`)."""
    dtype: gl.constexpr = q_desc.dtype
    FUSE: gl.constexpr = fused_score(dtype, HAS_SOFTCAP=HAS_SOFTCAP, HAS_ALIBI=HAS_ALIBI)  # (rounding.py)
    # rows with lse_lo and none far (`lo_rows`): float16 fuses there too
    FUSE_NEAR: gl.constexpr = backward_fuse(dtype, HAS_LO, HAS_SOFTCAP=HAS_SOFTCAP, HAS_ALIBI=HAS_ALIBI)
    kv_row, b, h, hk, m0, q_start, Sq, k_start, Sk, offset, alibi_off, slope = query_program(
        Sq, Hq, group, CU_Q, CU_K, ORDER, Sk, total_q, total_k, offset, bottom_right, right, SLOPES, stride_sb,
        stride_sh, BLOCK_M, CAUSAL, HAS_ALIBI, VARLEN, D)
    far_at = FAR + kv_row  # the dK/dV kernel's grid row (`key_program`)

    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                         instr_shape=[16, D, 16])
    op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)

    # key tiles n_lo + [0, n_tiles), masked before n_lfull and from n_full on (as the forward's)
    n_lo, n_tiles, n_lfull, n_full = key_window(m0, Sq, Sk, offset, span, BLOCK_M, BLOCK_N, CAUSAL, HAS_WL)

    q_smem = gl.allocate_shared_memory(dtype, q_desc.block_type.shape, q_desc.layout)
    do_smem = gl.allocate_shared_memory(dtype, do_desc.block_type.shape, do_desc.layout)
    k_ring = gl.allocate_shared_memory(dtype, [STAGES] + k_desc.block_type.shape, k_desc.layout)
    v_ring = gl.allocate_shared_memory(dtype, [V_STAGES] + v_desc.block_type.shape, v_desc.layout)
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    k_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_bars = gl.allocate_shared_memory(gl.int64, [V_STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=1)
    init_barriers(k_bars, STAGES)
    init_barriers(v_bars, V_STAGES)
    fence_async_shared()

    mbarrier.expect(q_bar, q_desc.block_type.nbytes + do_desc.block_type.nbytes)
    copy_in(q_desc, b, m0, h, q_start, Sq, q_bar, q_smem, True, VARLEN)
    copy_in(do_desc, b, m0, h, q_start, Sq, q_bar, do_smem, True, VARLEN)
    for i in gl.static_range(STAGES):
        load_rows(k_desc, k_ring, k_bars, i, n_lo, b, hk, k_start, Sk, n_tiles, BLOCK_N, STAGES, VARLEN)
    for i in gl.static_range(V_STAGES):
        load_rows(v_desc, v_ring, v_bars, i, n_lo, b, hk, k_start, Sk, n_tiles, BLOCK_N, V_STAGES, VARLEN)

    o_m = m0 + gl.arange(0, BLOCK_M, layout=row_s)
    row = b.to(gl.int64) * stride_lb + h.to(gl.int64) * stride_lh + q_start  # this head's lse / delta rows
    lse2, lo = _lse2(LSE, LSE_LO, row, o_m, Sq, HAS_LO)
    dq = gl.zeros([BLOCK_M, D], gl.float32, layout=acc_layout)
    s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=s_layout)
    mbarrier.wait(q_bar, 0)
    q_t = q_smem.reshape([BLOCK_M, D])
    do_t = do_smem.reshape([BLOCK_M, D])
    if DELTA_HERE:
        delta = delta_rows(O, DLSE, DELTA, do_t, b, h, q_start, m0, Sq, row, stride_ob, stride_os, stride_oh, row_s,
                           HAS_DLSE, BLOCK_M, D, num_warps)
    else:
        delta = gl.load(DELTA + row + o_m, mask=o_m < Sq, other=0.0)

    if n_tiles > 0:
        if lo_rows(lse2, o_m, Sq, far_at, HAS_LO, FAR_OUT):
            dq = _dq_tiles(q_t, do_t, k_ring, v_ring, k_bars, v_bars, k_desc, v_desc, dq, s_zero, n_lo, n_tiles,
                           n_lfull, n_full, b, hk, k_start, Sk, o_m, lse2, lo, delta, offset, span, qk_scale, scale,
                           softcap, slope, alibi_off, s_layout, op_layout, dtype, BLOCK_N, D, STAGES, V_STAGES, VARLEN,
                           CAUSAL, HAS_WL, True, FUSE, HAS_SOFTCAP, HAS_ALIBI)
        else:
            dq = _dq_tiles(q_t, do_t, k_ring, v_ring, k_bars, v_bars, k_desc, v_desc, dq, s_zero, n_lo, n_tiles,
                           n_lfull, n_full, b, hk, k_start, Sk, o_m, lse2, lo, delta, offset, span, qk_scale, scale,
                           softcap, slope, alibi_off, s_layout, op_layout, dtype, BLOCK_N, D, STAGES, V_STAGES, VARLEN,
                           CAUSAL, HAS_WL, False, FUSE_NEAR, HAS_SOFTCAP, HAS_ALIBI)

    mbarrier.invalidate(q_bar)
    invalidate_barriers(k_bars, STAGES)
    invalidate_barriers(v_bars, V_STAGES)
    # dQ through q's buffer and TMA, which clips rows past Sq
    q_smem.reshape([BLOCK_M, D]).store((dq * scale).to(dtype))
    fence_async_shared()
    copy_out(dq_desc, b, m0, h, q_start, Sq, q_smem, VARLEN)
    tma.store_wait(0)
