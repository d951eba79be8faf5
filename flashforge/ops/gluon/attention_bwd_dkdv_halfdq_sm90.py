"""Hopper (sm_90) dK/dV kernel in Gluon, warp-specialized, dQ fused, each consumer computing half of
every query tile's dQ from both consumers' dS (FA3's backward layout; issue 18).

Why: `attention_bwd_dkdv_ws_sm90` is bound by shared-memory traffic (RESULTS.md v0.9.1-v0.9.3).
Its scores are 64 x 64 products whose operands both come from shared memory (at 64 columns a
wgmma reads as many bytes as it has clocks of work), P and dS make a round trip through shared
memory as the dV and dK products' A operands, and one consumer's dQ_t is D wide, so at D = 128
the register-operand form (`_rs_consumer`) does not fit.  Here, a program owning 128 keys (two
consumer warpgroups of 64, a loader warp, a dQ writer warp, as there):

- scores are formed keys by queries, S^T = K_c Q^T and dP^T = V_c dO^T, with query tiles of
  BLOCK_M = 128 at D = 64 (64 x 128 products: a third fewer operand bytes a flop than 64 x 64)
  and 64 at D = 128;
- P^T and dS^T stay in registers as the A operands of dV += P^T dO and dK += dS^T Q; only dS^T is
  stored, into a two-slot ring of [64 keys, 64 queries] tiles, one ring a consumer;
- once both consumers' dS^T of a tile are stored, each computes half of that tile's dQ over all
  128 keys: at BLOCK_M = 128 the query rows [64 c, 64 c + 64) (dS's rows from both rings, by K),
  at D = 128 the columns [64 c, 64 c + 64) (dS by K's column half).  A [64, 64] float32 part a
  consumer (32 registers, where a D-wide dQ_t took 64), which is what makes D = 128 fit;
- the writer warp hands each part to the copy engine's reduce-add into the zeroed float32
  accumulator, as there.

A tile's S^T is awaited before dP^T, so P^T is formed (and lse dropped) while dP^T runs; delta is
read after.  Shared scope with the ws kernel: D in {64, 128}, not deterministic, lse_lo's two
launches (LO_PASS), causal, windows, softcap, ALiBi, GQA, packed batches.
"""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)

from .attention_bwd_dkdv_ws_sm90 import _half_masks, _lo_launch, _resident_kv, _tile_masked, _tile_rows
from .named_barrier import FIRST_ID, named_arrive, named_sync
from .pipeline import copy_out, copy_pair, key_block, query_window, reduce_out, wait
from .rounding import backward_fuse, exponent
from .scores import modified_score
from .ws_pipeline import HALF

DS_STAGES = gl.constexpr(2)  # dS^T slots a consumer: tile t + 1's is stored while tile t's dQ reads
# A consumer releases a Q / dO stage (`empty`) and, in the DEFER form, a dS^T slot (`ds_free`) by
# every thread's own arrival (`async_copy.mbarrier_arrive` with no count increment, so the
# barriers count 2 x 128 arrivals).  Why: triton 3.6 arrives from thread 0 with a warpgroup barrier
# before and after (`named_barrier`'s docstring); these releases order only reads -- the products'
# (retired by the wait before) and each thread's own loads -- so no thread needs the others'.
CONSUMER_THREADS = gl.constexpr(128)
# Named barriers of the lockstep (not DEFER) form, `named_barrier`: consumer c's dS^T of a tile in
# slot s stored (DS_READY + 2 c + s: c's 128 threads arrive, the other's 128 sync), and each
# consumer c's dQ part handed to the writer warp (DQ_FULL + c) and back (DQ_EMPTY + c; 128 + 32
# threads).  A barrier a slot: c arrives on DS_READY + 2 c + s again two tiles on, after it has
# met the other's arrival of the tile between, which the other made after its sync of this one.
DS_READY = gl.constexpr(FIRST_ID)
DQ_FULL = gl.constexpr(FIRST_ID + 4)
DQ_EMPTY = gl.constexpr(FIRST_ID + 6)


@gluon.jit
def _probs(st, cols, rows, m, nc, lse2, lo, Sk, offset, span, qk_scale, scale, softcap, slope, alibi_off,
           MASKED: gl.constexpr, CAUSAL: gl.constexpr, HAS_WL: gl.constexpr, HAS_SOFTCAP: gl.constexpr,
           HAS_ALIBI: gl.constexpr, USE_LO: gl.constexpr, FUSE: gl.constexpr):
    """(P^T, the softcap's tanh) of S^T [keys nc + rows, queries m + cols], as
    `attention_bwd_sm90._dst_tile` forms them (the forward's score exactly); a masked tile also
    masks keys from Sk on (zero-filled, and their P^T, exp2(-lse), could overflow where lse is far
    below 0).  The masks compare the tile-relative rows and cols with scalars: index vectors of
    128 queries cost 32 registers a thread each (64 as addresses), which spilled."""
    if HAS_SOFTCAP or HAS_ALIBI:
        s2, tc = modified_score(st, cols[None, :], rows[:, None], qk_scale, scale, softcap, slope,
                                alibi_off + (m - nc), HAS_SOFTCAP, HAS_ALIBI)
        x = s2 - lse2[None, :]
    else:
        x = exponent(st, qk_scale, lse2[None, :], FUSE)
        tc = x
    if MASKED:  # key n visible from query i iff n <= i + offset (CAUSAL) and n >= i + offset - span (HAS_WL)
        # each bound a per-key-row vector against the query columns: the [keys, queries] difference
        # tile the comparisons used to share costs a register an element (sm_90 compile, training
        # launch: D = 64 causal 112 spill loads / 115 stores -> 29 / 32, as without the mask;
        # D = 128 causal 12 / 17 -> 4 / 4)
        if CAUSAL:
            x = gl.where(cols[None, :] >= (rows - (m + offset - nc))[:, None], x, float("-inf"))
        if HAS_WL:
            x = gl.where(cols[None, :] <= (rows - (m + (offset - span) - nc))[:, None], x, float("-inf"))
        x = gl.where(rows[:, None] < Sk - nc, x, float("-inf"))
    if USE_LO:
        x = x - lo[None, :]
    return gl.exp2(x), tc


@gluon.jit
def _tile_lse(lse_ring, LO, s, cols, n, layout: gl.constexpr, USE_LO: gl.constexpr, GUARD: gl.constexpr):
    """(lse in log2 units, its low part) of a tile's queries: lse2 (the preprocess kernel's: lse
    scaled, a fully masked row's -inf as 0, `attention_bwd_sm90._lse2`'s meaning) from slot s of
    the ring the loader fills (zeros past the sequence's end), the low part (second launch only)
    from global memory at LO, this tile's first row (a third ring would take D = 128's three-stage
    tiles past the shared memory).

    Queries past n need no mask on plain scores: the copy engine zero-fills their Q, dO, lse2 and
    delta, so their S is 0, P = exp2(0 - 0) = 1 and dP = delta = 0, and they add exactly 0 to
    dV (P^T dO), dK (dS^T Q with dS = 0) and dQ (clipped on its way out).  GUARD sets lse2 to
    +inf there, so P = 0: needed with softcap and ALiBi (a padded query's modified score is not
    0, and ALiBi's can overflow exp2), and kept with causal and window masks, where the unmasked
    form compiled worse (sm_90, D = 64 causal: 9 / 4 spill loads / stores a tile -> 40 / 31).
    On plain scores the mask cost 32 selects a thread a tile at BLOCK_M = 128 (D = 64: 821 -> 755
    instructions in the loop; D = 128 lockstep 487 -> 466)."""
    if GUARD:
        lse2 = gl.where(cols < n, lse_ring.index(s).load(layout), float("inf"))
    else:
        lse2 = lse_ring.index(s).load(layout)
    if USE_LO:
        lo = gl.load(LO + cols, mask=cols < n, other=0.0)
    else:
        lo = lse2
    return lse2, lo


@gluon.jit
def _store_ds(dst16, ds_ring, s, BLOCK_M: gl.constexpr):
    # dS^T [64 keys, BLOCK_M queries] into slot s: one [64, 64] tile a 64-query half, each half
    # its own ring (`_ds_rings`; at 128 queries, each thread's own registers split by column half:
    # no data moves)
    if BLOCK_M == 128:
        lo_half, hi_half = dst16.reshape([HALF, 2, HALF]).permute(0, 2, 1).split()
        ds_ring[0].index(s).store(lo_half)
        ds_ring[1].index(s).store(hi_half)
    else:
        ds_ring[0].index(s).store(dst16)


@gluon.jit
def _ds_rings(dtype: gl.constexpr, NQH: gl.constexpr):
    """A consumer's dS^T ring: one allocation of DS_STAGES [64, 64] slots a 64-query half (the
    second the first again at NQH = 1).  Why not one allocation of all slots: the compiler's
    shared-memory hazard analysis cannot tell its slots apart through an index, and put a
    warpgroup barrier between the two halves' stores of every tile."""
    layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    lo = gl.allocate_shared_memory(dtype, [DS_STAGES, HALF, HALF], layout)
    if NQH == 2:
        hi = gl.allocate_shared_memory(dtype, [DS_STAGES, HALF, HALF], layout)
    else:
        hi = lo
    return lo, hi


@gluon.jit
def _dq_buffers(dq_desc):
    """A consumer's dQ part buffer: one allocation a DQ_N-column box (two: 64 columns of 32), for
    `_ds_rings`' reason (one allocation of both boxes: a warpgroup barrier between their stores)."""
    gl.static_assert(HALF // dq_desc.block_type.shape[len(dq_desc.block_type.shape) - 1] == 2,
                     "a dQ part is two boxes")
    lo = gl.allocate_shared_memory(gl.float32, dq_desc.block_type.shape, dq_desc.layout)
    hi = gl.allocate_shared_memory(gl.float32, dq_desc.block_type.shape, dq_desc.layout)
    return lo, hi


@gluon.jit
def _put_part(dq, dq_bufs, DQ_N: gl.constexpr):
    """A [64, 64] dQ part into its two boxes' buffers (each thread's own registers split by column
    half: no data moves), and the fence that hands them to the copy engine."""
    lo_half, hi_half = dq.reshape([HALF, 2, DQ_N]).permute(0, 2, 1).split()
    dq_bufs[0].reshape([HALF, DQ_N]).store(lo_half)
    dq_bufs[1].reshape([HALF, DQ_N]).store(hi_half)
    fence_async_shared()


@gluon.jit
def _hand_part(dq, dq_bufs, dq_full, dq_empty, use, DQ_N: gl.constexpr):
    # the DEFER form's hand-off of its use-th part to the writer warp, by mbarriers
    mbarrier.wait(dq_empty, (use & 1) ^ 1)
    _put_part(dq, dq_bufs, DQ_N)
    mbarrier.arrive(dq_full, count=1)


@gluon.jit
def _dq_part(ds_mine, ds_other, k_t, k_o, s, dq_zero, ME: gl.constexpr, BLOCK_M: gl.constexpr):
    """This consumer's half of tile dQ_t = dS K over the block's 128 keys (unscaled), issued: at
    BLOCK_M = 128 query rows [64 ME, 64 ME + 64), else (D = 128) columns [64 ME, 64 ME + 64).
    A: dS from the consumers' dS^T rings (a transposed view), B: their K."""
    if BLOCK_M == 128:
        dq = warpgroup_mma(ds_mine[ME].index(s).permute((1, 0)), k_t, dq_zero, use_acc=False, is_async=True)
        dq = warpgroup_mma(ds_other[ME].index(s).permute((1, 0)), k_o, dq, is_async=True)
    else:
        dq = warpgroup_mma(ds_mine[0].index(s).permute((1, 0)), k_t.slice(ME * HALF, HALF, dim=1), dq_zero,
                           use_acc=False, is_async=True)
        dq = warpgroup_mma(ds_other[0].index(s).permute((1, 0)), k_o.slice(ME * HALF, HALF, dim=1), dq,
                           is_async=True)
    return dq


@gluon.jit
def _half_consumer(dk_desc, dv_desc, lse_ring, LSE_LO, delta_ring, k_ring, v_ring, kv_bar, k_ring_other, kv_bar_other, q_ring,
                   do_ring, ready, empty, ds_mine, ds_other, ds_ready, ds_free, dq_smem, dq_full, dq_empty, b, hk,
                   group, n0, k_start, Sk, Sq, offset, span, T, n_mt, mt_lo, n_masked, n_lfull, row_b, stride_lh,
                   qk_scale, scale, softcap, SL, stride_sh, alibi_off, ME: gl.constexpr, CAUSAL: gl.constexpr,
                   HAS_WL: gl.constexpr, HAS_SOFTCAP: gl.constexpr, HAS_ALIBI: gl.constexpr, BLOCK_M: gl.constexpr,
                   D: gl.constexpr, STAGES: gl.constexpr, VARLEN: gl.constexpr, USE_LO: gl.constexpr,
                   DQ_N: gl.constexpr, DEFER: gl.constexpr, NEAR: gl.constexpr):
    """dK, dV of keys n0 + 64 ME + [0, 64), and half of every tile's dQ (module docstring).  K, V
    and the other half's K come as one-slot rings (the loop indexes them, below).  NEAR: every
    |lse2| of the program is below LO_FROM (lse_lo's first launch), so float16 fuses its exponent
    too (`rounding.backward_fuse`)."""
    k_smem = k_ring.index(0)
    v_smem = v_ring.index(0)
    k_other = k_ring_other.index(0)
    dtype: gl.constexpr = k_smem.dtype
    FUSE: gl.constexpr = backward_fuse(dtype, NEAR, HAS_SOFTCAP=HAS_SOFTCAP, HAS_ALIBI=HAS_ALIBI)
    # plain scores: the padded queries' lse2 needs no mask (`_tile_lse`)
    PLAIN: gl.constexpr = not (CAUSAL or HAS_WL or HAS_SOFTCAP or HAS_ALIBI)
    # S^T / dP^T: [keys, queries]; dK / dV: [keys, D]; the dQ part: [64, 64]
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_M, 16])
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, D, 16])
    dq_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, HALF, 16])
    op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    col_s: gl.constexpr = gl.SliceLayout(0, s_layout)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    nc, n_masked_c, n_lfull_c, tail = _half_masks(n0, n_masked, n_lfull, Sk, offset, span, n_mt, mt_lo, ME, CAUSAL,
                                                  HAS_WL, BLOCK_M)
    n_mt_div = gl.maximum(n_mt, 1)
    rows = gl.arange(0, HALF, layout=row_s)  # (tile-relative key and query indices)
    cols = gl.arange(0, BLOCK_M, layout=col_s)
    s_zero = gl.zeros([HALF, BLOCK_M], gl.float32, layout=s_layout)
    dq_zero = gl.zeros([HALF, HALF], gl.float32, layout=dq_layout)
    dk = gl.zeros([HALF, D], gl.float32, layout=acc_layout)
    dv = gl.zeros([HALF, D], gl.float32, layout=acc_layout)
    k_t, v_t, k_o = _resident_kv(k_smem, v_smem, kv_bar, k_other, kv_bar_other, D, True)
    for t in range(T):
        wait(ready, t, STAGES)
        # the resident K / V by an index the compiler cannot fold (t < 2**30): as constants, every
        # product's shared-memory descriptors are loop-invariant, get hoisted out of the loop and
        # spilled (sm_90 compile, D = 128: LDL/STL 12/17 -> 1/1)
        z = t >> 30
        k_t = k_ring.index(z).reshape([HALF, D])
        v_t = v_ring.index(z).reshape([HALF, D])
        k_o = k_ring_other.index(z).reshape([HALF, D])
        q_s = q_ring.index(t % STAGES).reshape([BLOCK_M, D])
        do_s = do_ring.index(t % STAGES).reshape([BLOCK_M, D])
        st = warpgroup_mma(k_t, q_s.permute((1, 0)), s_zero, use_acc=False, is_async=True)
        dpt = warpgroup_mma(v_t, do_s.permute((1, 0)), s_zero, use_acc=False, is_async=True)
        m, h = _tile_rows(t, n_mt_div, mt_lo, hk, group, BLOCK_M)
        lse2, lo = _tile_lse(lse_ring, LSE_LO + row_b + h.to(gl.int64) * stride_lh + m, t % STAGES, cols, Sq - m,
                             col_s, USE_LO, not PLAIN)
        if HAS_ALIBI:
            slope = gl.load(SL + h * stride_sh)
        else:
            slope = 0.0
        sv = warpgroup_mma_wait(1, deps=(st, ))  # (S^T retired; dP^T may still run)
        if _tile_masked(t, n_mt_div, n_masked_c, n_lfull_c, tail, HAS_WL):
            pt, tc = _probs(sv, cols, rows, m, nc, lse2, lo, Sk, offset, span, qk_scale, scale, softcap, slope,
                            alibi_off, True, CAUSAL, HAS_WL, HAS_SOFTCAP, HAS_ALIBI, USE_LO, FUSE)
        else:
            pt, tc = _probs(sv, cols, rows, m, nc, lse2, lo, Sk, offset, span, qk_scale, scale, softcap, slope,
                            alibi_off, False, CAUSAL, HAS_WL, HAS_SOFTCAP, HAS_ALIBI, USE_LO, FUSE)
        delta = delta_ring.index(t % STAGES).load(col_s)  # (read here: 32 registers a thread)
        dpv = warpgroup_mma_wait(0, deps=(dpt, ))
        dst = pt * (dpv - delta[None, :])
        if HAS_SOFTCAP:  # with respect to the raw product
            dst = dst * (1.0 - tc * tc)
        dst16 = dst.to(dtype)
        s = t % DS_STAGES
        if DEFER:
            if t >= DS_STAGES:  # both consumers' dQ of tile t - DS_STAGES have read this slot
                mbarrier.wait(ds_free.index(s), (t // DS_STAGES - 1) & 1)
        # (lockstep: the other's arrival of tile t - 1, awaited there, came after its dQ product
        # of tile t - 2 retired, so this slot is free)
        _store_ds(dst16, ds_mine, s, BLOCK_M)
        fence_async_shared()
        if DEFER:
            mbarrier.arrive(ds_ready.index(s), count=1)
        else:
            named_arrive(DS_READY + 2 * ME + s, 256)
        pt_op = gl.convert_layout(pt.to(dtype), op_layout)
        dst_op = gl.convert_layout(dst16, op_layout)
        dv = warpgroup_mma(pt_op, do_s, dv, is_async=True)
        dk = warpgroup_mma(dst_op, q_s, dk, is_async=True)
        if DEFER:
            # the dQ part of tile t - 1, not t: the consumers then wait for each other's dS^T a
            # tile late, so one's element-wise work can overlap the other's products (waiting for
            # this tile's, they meet every tile and leave the tensor cores idle together).  At
            # t = 0 the product reads a slot not yet written, and its result is dropped (no branch
            # around it: a product in a branch left ptxas short of registers and it serialized them)
            u = t - 1
            sp = (t + DS_STAGES - 1) % DS_STAGES
            if t > 0:
                mbarrier.wait(ds_ready.index(sp), (u // DS_STAGES) & 1)
            dq = _dq_part(ds_mine, ds_other, k_t, k_o, sp, dq_zero, ME, BLOCK_M)
        else:
            u = t
            sp = s
            named_sync(DS_READY + 2 * (1 - ME) + s, 256)  # the other's dS^T of this tile stored too
            dq = _dq_part(ds_mine, ds_other, k_t, k_o, s, dq_zero, ME, BLOCK_M)
        dq, dv, dk, pt_op, dst_op = warpgroup_mma_wait(0, deps=(dq, dv, dk, pt_op, dst_op))
        async_copy.mbarrier_arrive(empty.index(t % STAGES), increment_count=False)
        if DEFER:
            if u >= 0:
                async_copy.mbarrier_arrive(ds_free.index(sp), increment_count=False)
                _hand_part(dq, dq_smem, dq_full, dq_empty, u, DQ_N)
        else:
            # the writer's arrival after part t - 1 (it skips the last part's: nobody waits)
            if t > 0:
                named_sync(DQ_EMPTY + ME, 160)
            _put_part(dq, dq_smem, DQ_N)
            named_arrive(DQ_FULL + ME, 160)
    if T > 0:
        if DEFER:  # the last tile's dQ part
            s_last = (T - 1) % DS_STAGES
            mbarrier.wait(ds_ready.index(s_last), ((T - 1) // DS_STAGES) & 1)
            dq = _dq_part(ds_mine, ds_other, k_t, k_o, s_last, dq_zero, ME, BLOCK_M)
            dq = warpgroup_mma_wait(0, deps=(dq, ))
            async_copy.mbarrier_arrive(ds_free.index(s_last), increment_count=False)
            _hand_part(dq, dq_smem, dq_full, dq_empty, T - 1, DQ_N)
        # K's buffer takes dK: the other's last dQ must have read it
        if DEFER:
            mbarrier.wait(ds_free.index((T - 1) % DS_STAGES), ((T - 1) // DS_STAGES) & 1)
        else:  # (as a tile T's dS^T: the arrival says this consumer's products are done)
            named_arrive(DS_READY + 2 * ME + T % DS_STAGES, 256)
            named_sync(DS_READY + 2 * (1 - ME) + T % DS_STAGES, 256)
    k_smem.reshape([HALF, D]).store((dk * scale).to(dtype))
    v_smem.reshape([HALF, D]).store(dv.to(dtype))
    fence_async_shared()
    copy_out(dk_desc, b, nc, hk, k_start, Sk, k_smem, VARLEN)
    copy_out(dv_desc, b, nc, hk, k_start, Sk, v_smem, VARLEN)
    tma.store_wait(0)


@gluon.jit
def _half_consumer1(dk_desc, dv_desc, lse_ring, LSE_LO, delta_ring, k_smem, v_smem, kv_bar, k_other, kv_bar_other, q_ring,
                    do_ring, ready, empty, ds_mine, ds_other, ds_ready, ds_free, dq_smem, dq_full, dq_empty, b, hk,
                    group, n0, k_start, Sk, Sq, offset, span, T, n_mt, mt_lo, n_masked, n_lfull, row_b, stride_lh,
                    qk_scale, scale, softcap, SL, stride_sh, alibi_off, CAUSAL: gl.constexpr, HAS_WL: gl.constexpr,
                    HAS_SOFTCAP: gl.constexpr, HAS_ALIBI: gl.constexpr, BLOCK_M: gl.constexpr, D: gl.constexpr,
                    STAGES: gl.constexpr, VARLEN: gl.constexpr, USE_LO: gl.constexpr, DQ_N: gl.constexpr,
                    DEFER: gl.constexpr, NEAR: gl.constexpr):
    # the second half's keys, in a worker partition
    _half_consumer(dk_desc, dv_desc, lse_ring, LSE_LO, delta_ring, k_smem, v_smem, kv_bar, k_other, kv_bar_other, q_ring,
                   do_ring, ready, empty, ds_mine, ds_other, ds_ready, ds_free, dq_smem, dq_full, dq_empty, b, hk,
                   group, n0, k_start, Sk, Sq, offset, span, T, n_mt, mt_lo, n_masked, n_lfull, row_b, stride_lh,
                   qk_scale, scale, softcap, SL, stride_sh, alibi_off, 1, CAUSAL, HAS_WL, HAS_SOFTCAP, HAS_ALIBI,
                   BLOCK_M, D, STAGES, VARLEN, USE_LO, DQ_N, DEFER, NEAR)


@gluon.jit
def _stats_loader(q_desc, k_desc, v_desc, do_desc, k_smem0, v_smem0, k_smem1, v_smem1, kv_bars, q_ring, do_ring, ready,
                  empty, lse_ring, delta_ring, LSE2, DELTA, row_b, stride_lh, b, hk, group, n0, k_start, Sk,
                  q_start, Sq, T, n_mt, mt_lo, BLOCK_M: gl.constexpr, STAGES: gl.constexpr, VARLEN: gl.constexpr):
    """`attention_bwd_dkdv_ws_sm90._kv_loader`'s copies, and with each query tile its lse2 and delta
    into the stats rings, by asynchronous copies that complete on the tile's
    ready barrier (so the consumers read them from shared memory once Q and dO have landed).  Why:
    read by the consumers from global memory, their latency was the consumers' largest stall
    (ncu, D = 64 S = 4k: 27% of the consumers' samples on the instructions that used them).
    Queries past the sequence's end are not read (zero-filled)."""
    copy_pair(k_desc, v_desc, b, n0, hk, k_start, Sk, kv_bars.index(0), k_smem0, v_smem0, VARLEN)
    copy_pair(k_desc, v_desc, b, n0 + HALF, hk, k_start, Sk, kv_bars.index(1), k_smem1, v_smem1, VARLEN)
    stat_layout: gl.constexpr = gl.BlockedLayout([BLOCK_M // 32], [32], [1], [0])
    idx = gl.arange(0, BLOCK_M, layout=stat_layout)
    n_mt_div = gl.maximum(n_mt, 1)
    for t in range(T):
        s = t % STAGES
        mbarrier.wait(empty.index(s), ((t // STAGES) & 1) ^ 1)
        m, h = _tile_rows(t, n_mt_div, mt_lo, hk, group, BLOCK_M)
        row0 = row_b + h.to(gl.int64) * stride_lh + m
        ok = idx < Sq - m
        async_copy.async_copy_global_to_shared(lse_ring.index(s), LSE2 + row0 + idx, mask=ok)
        async_copy.async_copy_global_to_shared(delta_ring.index(s), DELTA + row0 + idx, mask=ok)
        # (before the copy engine's expect-arrive: each thread's pending copies hold the phase open)
        async_copy.mbarrier_arrive(ready.index(s))
        copy_pair(q_desc, do_desc, b, m, h, q_start, Sq, ready.index(s), q_ring.index(s), do_ring.index(s), VARLEN)


@gluon.jit
def _part_writer(dq_desc, dq_smem0, dq_smem1, dq_full, dq_empty, b, hk, group, q_start, Sq, T, n_mt, mt_lo,
                 BLOCK_M: gl.constexpr, DQ_N: gl.constexpr, VARLEN: gl.constexpr, NAMED: gl.constexpr):
    """Each tile's two dQ parts into the float32 accumulator by the copy engine's reduce-add; a
    part's buffer goes back to its consumer once the reduces have read it.  NAMED: the hand-offs
    are named barriers (the lockstep consumers'), else mbarriers."""
    n_mt_div = gl.maximum(n_mt, 1)
    for t in range(T):
        m, h = _tile_rows(t, n_mt_div, mt_lo, hk, group, BLOCK_M)
        _reduce_part(dq_desc, dq_smem0, dq_full.index(0), dq_empty.index(0), t, T, b, m, h, q_start, Sq, 0, BLOCK_M,
                     DQ_N, VARLEN, NAMED)
        _reduce_part(dq_desc, dq_smem1, dq_full.index(1), dq_empty.index(1), t, T, b, m, h, q_start, Sq, 1, BLOCK_M,
                     DQ_N, VARLEN, NAMED)


@gluon.jit
def _reduce_part(dq_desc, buf, full, empty, use, T, b, m, h, q_start, Sq, ME: gl.constexpr, BLOCK_M: gl.constexpr,
                 DQ_N: gl.constexpr, VARLEN: gl.constexpr, NAMED: gl.constexpr):
    # consumer ME's part (rows or columns, `_dq_part`) once written; rows past the sequence's end
    # are clipped by the copy engine
    if BLOCK_M == 128:
        row = m + ME * HALF
        col = 0
    else:
        row = m
        col = ME * HALF
    if NAMED:
        named_sync(DQ_FULL + ME, 160)
    else:
        mbarrier.wait(full, use & 1)
    for p in gl.static_range(HALF // DQ_N):
        reduce_out(dq_desc, b, row, h, col + p * DQ_N, q_start, Sq, buf[p], VARLEN)
    tma.store_wait(0)
    if NAMED:
        # (the consumer waits before its parts 1 .. T - 1: an arrival after the last would be
        # left over; the copy's issuing lane arrives only after its wait, and the barrier
        # needs every lane)
        if use < T - 1:
            named_arrive(DQ_EMPTY + ME, 160)
    else:
        mbarrier.arrive(empty, count=1)


@gluon.jit
def attn_bwd_dkdv_halfdq_sm90_kernel(q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, LSE2, LSE_LO, DELTA, FAR,
                                     stride_lb, stride_lh, CU_Q, CU_K, ORDER, Hq, Sq, Sk, total_q, total_k, group,
                                     offset, bottom_right, span, qk_scale, scale, softcap, SLOPES, stride_sb,
                                     stride_sh, right, dq_desc, CAUSAL: gl.constexpr, HAS_WL: gl.constexpr,
                                     HAS_SOFTCAP: gl.constexpr, HAS_ALIBI: gl.constexpr, BLOCK_M: gl.constexpr,
                                     D: gl.constexpr, STAGES: gl.constexpr, VARLEN: gl.constexpr,
                                     HAS_LO: gl.constexpr, LO_PASS: gl.constexpr, FAR_READY: gl.constexpr,
                                     CONSUMER_REGS: gl.constexpr, LOADER_REGS: gl.constexpr,
                                     DEFER: gl.constexpr, num_warps: gl.constexpr):
    """dK, dV of one 128-key block and its adds to dQ (unscaled); the arguments mean
    `attn_bwd_dkdv_ws_sm90_kernel`'s (k, v, dK, dV boxes: one consumer's 64 rows; q, dO boxes:
    BLOCK_M rows, 128 at D = 64 and 64 at D = 128), but LSE2 is lse in log2 units (the preprocess
    kernel's) and, with lse_lo, FAR comes filled (FAR_READY): no program scans lse."""
    gl.static_assert(((BLOCK_M == 128) & (D == 64)) | ((BLOCK_M == 64) & (D == 128)),
                     "128-query tiles at D = 64, 64-query tiles at D = 128")
    gl.static_assert(FAR_READY or not HAS_LO, "with lse_lo, FAR comes filled (LSE2 is not lse: no scan)")
    dtype: gl.constexpr = q_desc.dtype
    DQ_N: gl.constexpr = dq_desc.block_type.shape[len(dq_desc.block_type.shape) - 1]
    BLOCK_N: gl.constexpr = 2 * HALF
    NQH: gl.constexpr = BLOCK_M // HALF  # dS^T tiles a slot (one a 64-query half)
    bh, b, hk, n0, q_start, Sq, k_start, Sk, offset, row_b = key_block(CU_Q, CU_K, ORDER, Hq, group, Sq, Sk, total_q,
                                                                       total_k, offset, bottom_right, stride_lb,
                                                                       BLOCK_N, VARLEN, CAUSAL, D)
    SL = SLOPES + b * stride_sb
    alibi_off = offset - right
    mt_lo, n_mt, n_masked, n_lfull = query_window(n0, Sq, Sk, offset, span, BLOCK_M, BLOCK_N, CAUSAL, HAS_WL)
    T = n_mt * group
    # lse_lo's two launches, as the ws kernel's
    USE_LO: gl.constexpr = LO_PASS
    # the first launch's active programs are those with every |lse2| < LO_FROM (`_lo_launch`)
    NEAR: gl.constexpr = HAS_LO and not LO_PASS
    T, active = _lo_launch(FAR, LSE2, bh, row_b, stride_lh, hk, group, Sq, n0, T, HAS_LO, LO_PASS, FAR_READY, num_warps)

    # one-slot rings: the consumers index them in their loops (see _half_consumer)
    k_ring0 = gl.allocate_shared_memory(dtype, [1] + k_desc.block_type.shape, k_desc.layout)
    v_ring0 = gl.allocate_shared_memory(dtype, [1] + v_desc.block_type.shape, v_desc.layout)
    k_ring1 = gl.allocate_shared_memory(dtype, [1] + k_desc.block_type.shape, k_desc.layout)
    v_ring1 = gl.allocate_shared_memory(dtype, [1] + v_desc.block_type.shape, v_desc.layout)
    q_ring = gl.allocate_shared_memory(dtype, [STAGES] + q_desc.block_type.shape, q_desc.layout)
    do_ring = gl.allocate_shared_memory(dtype, [STAGES] + do_desc.block_type.shape, do_desc.layout)
    ds_ring0 = _ds_rings(dtype, NQH)
    ds_ring1 = _ds_rings(dtype, NQH)
    dq_smem0 = _dq_buffers(dq_desc)
    dq_smem1 = _dq_buffers(dq_desc)
    stat_smem: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0])
    lse_ring = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_M], stat_smem)
    delta_ring = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_M], stat_smem)
    kv_bars = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    dq_full = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    dq_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    # a dS^T slot: stored by both consumers (ready), read by both consumers' dQ parts (free)
    ds_ready = gl.allocate_shared_memory(gl.int64, [DS_STAGES, 1], mbarrier.MBarrierLayout())
    ds_free = gl.allocate_shared_memory(gl.int64, [DS_STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(2):
        mbarrier.init(kv_bars.index(i), count=1)
        mbarrier.init(dq_full.index(i), count=1)
        mbarrier.init(dq_empty.index(i), count=1)
    for i in gl.static_range(DS_STAGES):
        mbarrier.init(ds_ready.index(i), count=2)
        mbarrier.init(ds_free.index(i), count=2 * CONSUMER_THREADS)
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=2 * CONSUMER_THREADS)
    fence_async_shared()

    if active:
        gl.warp_specialize([
            (_half_consumer, (dk_desc, dv_desc, lse_ring, LSE_LO, delta_ring, k_ring0, v_ring0, kv_bars.index(0), k_ring1,
                              kv_bars.index(1), q_ring, do_ring, ready, empty, ds_ring0, ds_ring1, ds_ready, ds_free,
                              dq_smem0, dq_full.index(0), dq_empty.index(0), b, hk, group, n0, k_start, Sk, Sq,
                              offset, span, T, n_mt, mt_lo, n_masked, n_lfull, row_b, stride_lh, qk_scale, scale,
                              softcap, SL, stride_sh, alibi_off, 0, CAUSAL, HAS_WL, HAS_SOFTCAP, HAS_ALIBI, BLOCK_M,
                              D, STAGES, VARLEN, USE_LO, DQ_N, DEFER, NEAR)),
            (_half_consumer1, (dk_desc, dv_desc, lse_ring, LSE_LO, delta_ring, k_ring1, v_ring1, kv_bars.index(1), k_ring0,
                               kv_bars.index(0), q_ring, do_ring, ready, empty, ds_ring1, ds_ring0, ds_ready, ds_free,
                               dq_smem1, dq_full.index(1), dq_empty.index(1), b, hk, group, n0, k_start, Sk, Sq,
                               offset, span, T, n_mt, mt_lo, n_masked, n_lfull, row_b, stride_lh, qk_scale, scale,
                               softcap, SL, stride_sh, alibi_off, CAUSAL, HAS_WL, HAS_SOFTCAP, HAS_ALIBI, BLOCK_M, D,
                               STAGES, VARLEN, USE_LO, DQ_N, DEFER, NEAR)),
            (_stats_loader, (q_desc, k_desc, v_desc, do_desc, k_ring0.index(0), v_ring0.index(0), k_ring1.index(0),
                             v_ring1.index(0), kv_bars, q_ring,
                             do_ring, ready, empty, lse_ring, delta_ring, LSE2, DELTA, row_b, stride_lh, b, hk,
                             group, n0, k_start, Sk, q_start, Sq, T, n_mt, mt_lo, BLOCK_M, STAGES, VARLEN)),
            (_part_writer, (dq_desc, dq_smem0, dq_smem1, dq_full, dq_empty, b, hk, group, q_start, Sq, T, n_mt,
                            mt_lo, BLOCK_M, DQ_N, VARLEN, not DEFER)),
        ], [4, 1, 1], [CONSUMER_REGS, LOADER_REGS, LOADER_REGS])
