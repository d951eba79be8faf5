"""Hopper (sm_90) attention forward in Gluon, warp-specialized: one loader warp, two or three
consumer warpgroups sharing each key tile.

Why (issue 18): `attention_fwd_sm90` runs one warpgroup of 64 query rows per program and two
programs per SM, so each SM copies every K and V tile twice, once per program.  At D = 128 with
128-key tiles that is 64 KB per 4.2 MFLOP of products: ~9 TB/s out of L2 at the 570 TFLOP/s
we reach, where FA3's 128-row blocks ask half.  Here a program owns 128 query rows, one
warpgroup (a partition, `gl.warp_specialize`) per 64, and one loader warp fills the K and V
rings both read.  Each ring slot has a "ready" barrier the copy engine completes and an
"empty" barrier both consumers arrive at once the products that read the slot are done, so the
loader runs ahead by the ring's depth and no copy sits in a consumer's instruction stream.

Each consumer runs `attention_fwd_sm90`'s intra-warpgroup pipeline on its own rows (S_j issued,
then O += P_{j-1} V_{j-1}, the softmax of S_j while that product runs).  The loader fetches the
union of the two halves' key tiles (`key_window` over 128 rows); a consumer releases the tiles
of the union its rows do not see (a causal diagonal's, a window's edges) without computing them.

PINGPONG (FA3's scheduling): the consumers take turns issuing their products, through two
mbarriers, so one's softmax runs while the other's products occupy the tensor cores.

NC = 3 (D = 64; FA3's and FA4's 192-row tiles there): three consumers, 192 query rows a program,
each K and V tile copied once for all of them.  At D = 64 a tile's exponentials take as long as
its products, and two consumers (one program an SM: the register split) left the tensor cores
idle more than three one-warpgroup programs do (RESULTS.md v0.9.0: 0.66-0.97x); three consumers
at 160 registers each keep three warpgroups an SM with one copy of each tile.  No ping-pong.

Scope: `attention_fwd_sm90`'s (the launcher checks it).
"""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)

from .attention_fwd_sm90 import finish_rows, softmax_tile
from .pipeline import copy_in, copy_out, slot, wait
from .rounding import fused_score
from .ws_pipeline import (HALF, consumer_tiles, fill, release_tiles, spare_turns, turn_pass, turn_wait,
                          ws_program, ws_rings)


@gluon.jit
def consume_tile(o_desc, LSE, LSE_LO, q_smem, o_smem, k_ring, v_ring, q_bar, q_phase, q_empty, k_ready, k_empty,
                 v_ready, v_empty, turn, base, t0, b, h, m0, q_start, Sq, Sk, offset, span, u_lo, u_tiles, row_lse,
                 qk_scale, scale, softcap, slope, alibi_off, ME: gl.constexpr, CAUSAL: gl.constexpr,
                 HAS_WL: gl.constexpr, HAS_SOFTCAP: gl.constexpr, HAS_ALIBI: gl.constexpr, BLOCK_N: gl.constexpr,
                 D: gl.constexpr, STAGES: gl.constexpr, V_STAGES: gl.constexpr, VARLEN: gl.constexpr,
                 STORE_LO: gl.constexpr, PINGPONG: gl.constexpr, POLY_EXP2: gl.constexpr, PERSISTENT: gl.constexpr):
    """Query rows m0 + ME * 64 + [0, 64) of one work item: the online softmax over their key
    tiles, then o (staged in o_smem) and lse (POLY_EXP2: `attention_fwd_sm90.softmax_tile`'s, for
    the tiles after the first).  The item's union of key tiles is ring indices [base, base +
    u_tiles); its Q lands on q_bar's phase q_phase.

    PERSISTENT (a program runs several items, `attention_fwd_persistent_sm90`): Q's slot is handed
    back on q_empty once the last S product has read it, so the loader fetches the next item's Q
    while this one finishes; o is staged in a buffer of its own, whose previous store is awaited
    only when it is rewritten; and the ping-pong turns strictly alternate across items -- both
    consumers take max(their issues) turns an item, counted from t0 -- so neither runs two phases
    ahead of the other on a turn barrier.  The one with fewer issues passes its spare turns right
    after its last issue, before its epilogue, with the releases the other's turns need in between
    (`spare_turns`).  Returns the turns this item took (PERSISTENT; else 0)."""
    dtype: gl.constexpr = o_desc.dtype
    FUSE: gl.constexpr = fused_score(dtype, HAS_SOFTCAP=HAS_SOFTCAP, HAS_ALIBI=HAS_ALIBI)
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, D, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)

    mc, n_lo, n_tiles, n_lfull, n_full, first, n_other, o_first = consumer_tiles(m0, Sq, Sk, offset, span, u_lo,
                                                                                 u_tiles, ME, BLOCK_N, CAUSAL, HAS_WL,
                                                                                 PINGPONG)
    n_turns = 0
    if PERSISTENT:
        n_own = gl.where(n_tiles > 0, n_tiles + 1, 0)
        n_turns = gl.maximum(n_own, n_other)
        n_other = n_turns + t0  # every turn of the item waits (`turn_wait`'s bound), counted from t0
    first = base + first  # ring indices from here on
    lead_end = first
    if PERSISTENT:
        if PINGPONG:  # no tiles: its releases go with its spare turns (`spare_turns`)
            lead_end = gl.where(n_tiles > 0, first, base)
    release_tiles(k_ready, k_empty, v_ready, v_empty, base, lead_end, STAGES, V_STAGES)

    o_m = mc + gl.arange(0, HALF, layout=row_s)
    m_i = gl.full([HALF], float("-inf"), gl.float32, layout=row_s)
    l_i = gl.zeros([HALF], gl.float32, layout=row_s)
    acc = gl.zeros([HALF, D], gl.float32, layout=o_layout)
    s_zero = gl.zeros([HALF, BLOCK_N], gl.float32, layout=s_layout)
    mbarrier.wait(q_bar, q_phase)
    q = q_smem.reshape([HALF, D])

    if n_tiles > 0:
        wait(k_ready, first, STAGES)
        turn_wait(turn, t0, n_other, ME, PINGPONG)
        s = warpgroup_mma(q, slot(k_ring, first, BLOCK_N, D, STAGES).permute((1, 0)), s_zero, use_acc=False,
                          is_async=True)
        turn_pass(turn, ME, PINGPONG)
        s = warpgroup_mma_wait(0, deps=(s, ))
        mbarrier.arrive(k_empty.index(first % STAGES), count=1)
        p, alpha, m_i, l_i = softmax_tile(s, m_i, l_i, 0, n_lo, n_lfull, n_full, o_m, Sk, offset, span, qk_scale,
                                          scale, softcap, slope, alibi_off, s_layout, CAUSAL, HAS_WL, BLOCK_N, FUSE,
                                          HAS_SOFTCAP, HAS_ALIBI)
        p = gl.convert_layout(p.to(dtype), p_layout)

        for j in range(1, n_tiles):
            r = first + j
            wait(k_ready, r, STAGES)
            wait(v_ready, r - 1, V_STAGES)
            turn_wait(turn, t0 + j, n_other, ME, PINGPONG)
            s = warpgroup_mma(q, slot(k_ring, r, BLOCK_N, D, STAGES).permute((1, 0)), s_zero, use_acc=False,
                              is_async=True)
            acc = warpgroup_mma(p, slot(v_ring, r - 1, BLOCK_N, D, V_STAGES), acc, is_async=True)
            turn_pass(turn, ME, PINGPONG)
            s = warpgroup_mma_wait(1, deps=(s, ))  # S_j done; P_{j-1} V_{j-1} may still run
            mbarrier.arrive(k_empty.index(r % STAGES), count=1)
            p_new, alpha, m_i, l_i = softmax_tile(s, m_i, l_i, j, n_lo, n_lfull, n_full, o_m, Sk, offset, span,
                                                  qk_scale, scale, softcap, slope, alibi_off, s_layout, CAUSAL, HAS_WL,
                                                  BLOCK_N, FUSE, HAS_SOFTCAP, HAS_ALIBI, POLY_EXP2)
            acc, p = warpgroup_mma_wait(0, deps=(acc, p))
            mbarrier.arrive(v_empty.index((r - 1) % V_STAGES), count=1)
            acc = acc * gl.convert_layout(alpha, row_o)[:, None]
            p = gl.convert_layout(p_new.to(dtype), p_layout)

        if PERSISTENT:  # every S product has read Q (each was waited for)
            mbarrier.arrive(q_empty, count=1)
        last = first + n_tiles - 1
        wait(v_ready, last, V_STAGES)
        turn_wait(turn, t0 + n_tiles, n_other, ME, PINGPONG)
        acc = warpgroup_mma(p, slot(v_ring, last, BLOCK_N, D, V_STAGES), acc, is_async=True)
        turn_pass(turn, ME, PINGPONG)
        acc = warpgroup_mma_wait(0, deps=(acc, ))
        mbarrier.arrive(v_empty.index(last % V_STAGES), count=1)
    elif PERSISTENT:
        mbarrier.arrive(q_empty, count=1)
    if PERSISTENT:
        tail = lead_end + n_tiles  # the union's tiles from here on are not read by this consumer
        if PINGPONG:  # before the epilogue: the other's products wait for these turns
            tail = spare_turns(turn, k_ready, k_empty, v_ready, v_empty, tail, base + u_tiles, base + o_first, t0,
                               n_own, n_turns, ME, STAGES, V_STAGES)

    acc = finish_rows(acc, m_i, l_i, LSE, LSE_LO, row_lse, o_m, Sq, row_o, STORE_LO)
    if PERSISTENT:
        tma.store_wait(0)  # the previous item's o has left o_smem
    o_smem.reshape([HALF, D]).store(acc.to(dtype))  # (not PERSISTENT: o_smem is this half's Q, read no more)
    fence_async_shared()
    copy_out(o_desc, b, mc, h, q_start, Sq, o_smem, VARLEN)
    if PERSISTENT:
        release_tiles(k_ready, k_empty, v_ready, v_empty, tail, base + u_tiles, STAGES, V_STAGES)
    else:  # (tail's value, formed here: the one-item kernels' code stays as it was)
        release_tiles(k_ready, k_empty, v_ready, v_empty, first + n_tiles, base + u_tiles, STAGES, V_STAGES)
        tma.store_wait(0)
    return n_turns


@gluon.jit
def _consumer(o_desc, LSE, LSE_LO, q_smem, k_ring, v_ring, q_bar, k_ready, k_empty, v_ready, v_empty, turn, b, h,
              m0, q_start, Sq, Sk, offset, span, u_lo, u_tiles, row_lse, qk_scale, scale, softcap, slope, alibi_off,
              ME: gl.constexpr, CAUSAL: gl.constexpr, HAS_WL: gl.constexpr, HAS_SOFTCAP: gl.constexpr,
              HAS_ALIBI: gl.constexpr, BLOCK_N: gl.constexpr, D: gl.constexpr, STAGES: gl.constexpr,
              V_STAGES: gl.constexpr, VARLEN: gl.constexpr, STORE_LO: gl.constexpr, PINGPONG: gl.constexpr,
              POLY_EXP2: gl.constexpr):
    """The program's one work item (`consume_tile`): o staged in this half's Q buffer."""
    consume_tile(o_desc, LSE, LSE_LO, q_smem, q_smem, k_ring, v_ring, q_bar, 0, q_bar, k_ready, k_empty, v_ready,
                 v_empty, turn, 0, 0, b, h, m0, q_start, Sq, Sk, offset, span, u_lo, u_tiles, row_lse, qk_scale,
                 scale, softcap, slope, alibi_off, ME, CAUSAL, HAS_WL, HAS_SOFTCAP, HAS_ALIBI, BLOCK_N, D, STAGES,
                 V_STAGES, VARLEN, STORE_LO, PINGPONG, POLY_EXP2, False)


@gluon.jit
def _consumer1(o_desc, LSE, LSE_LO, q_smem, k_ring, v_ring, q_bar, k_ready, k_empty, v_ready, v_empty, turn, b, h,
               m0, q_start, Sq, Sk, offset, span, u_lo, u_tiles, row_lse, qk_scale, scale, softcap, slope, alibi_off,
               CAUSAL: gl.constexpr, HAS_WL: gl.constexpr, HAS_SOFTCAP: gl.constexpr, HAS_ALIBI: gl.constexpr,
               BLOCK_N: gl.constexpr, D: gl.constexpr, STAGES: gl.constexpr, V_STAGES: gl.constexpr,
               VARLEN: gl.constexpr, STORE_LO: gl.constexpr, PINGPONG: gl.constexpr, POLY_EXP2: gl.constexpr):
    # the second consumer's rows, in a worker partition (warp_specialize's partitions are functions)
    _consumer(o_desc, LSE, LSE_LO, q_smem, k_ring, v_ring, q_bar, k_ready, k_empty, v_ready, v_empty, turn, b, h, m0,
              q_start, Sq, Sk, offset, span, u_lo, u_tiles, row_lse, qk_scale, scale, softcap, slope, alibi_off, 1,
              CAUSAL, HAS_WL, HAS_SOFTCAP, HAS_ALIBI, BLOCK_N, D, STAGES, V_STAGES, VARLEN, STORE_LO, PINGPONG,
              POLY_EXP2)


@gluon.jit
def _consumer2(o_desc, LSE, LSE_LO, q_smem, k_ring, v_ring, q_bar, k_ready, k_empty, v_ready, v_empty, turn, b, h,
               m0, q_start, Sq, Sk, offset, span, u_lo, u_tiles, row_lse, qk_scale, scale, softcap, slope, alibi_off,
               CAUSAL: gl.constexpr, HAS_WL: gl.constexpr, HAS_SOFTCAP: gl.constexpr, HAS_ALIBI: gl.constexpr,
               BLOCK_N: gl.constexpr, D: gl.constexpr, STAGES: gl.constexpr, V_STAGES: gl.constexpr,
               VARLEN: gl.constexpr, STORE_LO: gl.constexpr, POLY_EXP2: gl.constexpr):
    # NC = 3: the third 64 rows (no ping-pong)
    _consumer(o_desc, LSE, LSE_LO, q_smem, k_ring, v_ring, q_bar, k_ready, k_empty, v_ready, v_empty, turn, b, h, m0,
              q_start, Sq, Sk, offset, span, u_lo, u_tiles, row_lse, qk_scale, scale, softcap, slope, alibi_off, 2,
              CAUSAL, HAS_WL, HAS_SOFTCAP, HAS_ALIBI, BLOCK_N, D, STAGES, V_STAGES, VARLEN, STORE_LO, False, POLY_EXP2)


@gluon.jit
def load_tile(q_desc, k_desc, v_desc, q_all, k_ring, v_ring, q_bars, q_empty, q_phase, k_ready, k_empty, v_ready,
              v_empty, base, b, h, hk, m0, q_start, Sq, k_start, Sk, u_lo, u_tiles, BLOCK_N: gl.constexpr,
              STAGES: gl.constexpr, V_STAGES: gl.constexpr, VARLEN: gl.constexpr, NC: gl.constexpr,
              PERSISTENT: gl.constexpr):
    """One work item's copies: each consumer's Q (PERSISTENT: once the consumer has handed its
    slot back, q_empty's phase q_phase ^ 1), then the union's key tiles into ring indices [base,
    base + u_tiles), K_r before V_{r-1}: the order the consumers read them in, so a copy waiting
    for its slot never holds back one a consumer needs first.  A slot is refilled once every
    consumer has released it (empty barriers start complete)."""
    for i in gl.static_range(NC):
        if PERSISTENT:
            mbarrier.wait(q_empty.index(i), q_phase ^ 1)
        mbarrier.expect(q_bars.index(i), q_desc.block_type.nbytes)
        copy_in(q_desc, b, m0 + i * HALF, h, q_start, Sq, q_bars.index(i), q_all.index(i), True, VARLEN)
    for r in range(0, u_tiles + 1):
        if r < u_tiles:
            fill(k_desc, k_ring, k_ready, k_empty, base + r, (u_lo + r) * BLOCK_N, b, hk, k_start, Sk, STAGES, VARLEN)
        if r > 0:
            fill(v_desc, v_ring, v_ready, v_empty, base + r - 1, (u_lo + r - 1) * BLOCK_N, b, hk, k_start, Sk,
                 V_STAGES, VARLEN)


@gluon.jit
def _loader(q_desc, k_desc, v_desc, q_all, k_ring, v_ring, q_bars, k_ready, k_empty, v_ready, v_empty, b, h, hk, m0,
            q_start, Sq, k_start, Sk, u_lo, u_tiles, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
            V_STAGES: gl.constexpr, VARLEN: gl.constexpr, NC: gl.constexpr):
    """The program's one work item (`load_tile`)."""
    load_tile(q_desc, k_desc, v_desc, q_all, k_ring, v_ring, q_bars, q_bars, 0, k_ready, k_empty, v_ready, v_empty, 0,
              b, h, hk, m0, q_start, Sq, k_start, Sk, u_lo, u_tiles, BLOCK_N, STAGES, V_STAGES, VARLEN, NC, False)


@gluon.jit
def attn_fwd_ws_sm90_kernel(q_desc, k_desc, v_desc, o_desc, LSE, LSE_LO, stride_lb, stride_lh, CU_Q, CU_K, ORDER, Hq,
                            Sq, Sk, total_q, total_k, group, offset, bottom_right, span, qk_scale, scale, softcap,
                            SLOPES, stride_sb, stride_sh, right, CAUSAL: gl.constexpr, HAS_WL: gl.constexpr,
                            HAS_SOFTCAP: gl.constexpr, HAS_ALIBI: gl.constexpr, BLOCK_N: gl.constexpr,
                            D: gl.constexpr, STAGES: gl.constexpr, V_STAGES: gl.constexpr, VARLEN: gl.constexpr,
                            STORE_LO: gl.constexpr, PINGPONG: gl.constexpr, CONSUMER_REGS: gl.constexpr,
                            LOADER_REGS: gl.constexpr, num_warps: gl.constexpr, NC: gl.constexpr = 2,
                            POLY_EXP2: gl.constexpr = 0):
    # the arguments mean attention_fwd_sm90's; a program owns NC * 64 query rows (num_warps = 4:
    # the default partition is the first consumer; PINGPONG with NC = 2 only)
    dtype: gl.constexpr = q_desc.dtype
    gl.static_assert((NC == 2) or ((NC == 3) and not PINGPONG), "two consumers, or three without ping-pong")
    _, b, h, hk, m0, q_start, Sq, k_start, Sk, offset, alibi_off, slope, u_lo, u_tiles, row_lse = ws_program(
        Sq, Hq, group, CU_Q, CU_K, ORDER, Sk, total_q, total_k, offset, bottom_right, span, right, SLOPES, stride_sb,
        stride_sh, stride_lb, stride_lh, BLOCK_N, CAUSAL, HAS_WL, HAS_ALIBI, VARLEN, D, NC)

    q_all = gl.allocate_shared_memory(dtype, [NC] + q_desc.block_type.shape, q_desc.layout)  # one Q a consumer
    k_ring, v_ring, q_bars, turn, k_ready, k_empty, v_ready, v_empty = ws_rings(k_desc, v_desc, STAGES, V_STAGES,
                                                                                PINGPONG, NC)
    # (the partitions are spelled out in each branch: a jit function cannot be held in a variable)
    if NC == 3:
        gl.warp_specialize([
            (_consumer, (o_desc, LSE, LSE_LO, q_all.index(0), k_ring, v_ring, q_bars.index(0), k_ready, k_empty,
                         v_ready, v_empty, turn, b, h, m0, q_start, Sq, Sk, offset, span, u_lo, u_tiles, row_lse,
                         qk_scale, scale, softcap, slope, alibi_off, 0, CAUSAL, HAS_WL, HAS_SOFTCAP, HAS_ALIBI,
                         BLOCK_N, D, STAGES, V_STAGES, VARLEN, STORE_LO, False, POLY_EXP2)),
            (_consumer1, (o_desc, LSE, LSE_LO, q_all.index(1), k_ring, v_ring, q_bars.index(1), k_ready, k_empty,
                          v_ready, v_empty, turn, b, h, m0, q_start, Sq, Sk, offset, span, u_lo, u_tiles, row_lse,
                          qk_scale, scale, softcap, slope, alibi_off, CAUSAL, HAS_WL, HAS_SOFTCAP, HAS_ALIBI, BLOCK_N,
                          D, STAGES, V_STAGES, VARLEN, STORE_LO, False, POLY_EXP2)),
            (_consumer2, (o_desc, LSE, LSE_LO, q_all.index(2), k_ring, v_ring, q_bars.index(2), k_ready, k_empty,
                          v_ready, v_empty, turn, b, h, m0, q_start, Sq, Sk, offset, span, u_lo, u_tiles, row_lse,
                          qk_scale, scale, softcap, slope, alibi_off, CAUSAL, HAS_WL, HAS_SOFTCAP, HAS_ALIBI, BLOCK_N,
                          D, STAGES, V_STAGES, VARLEN, STORE_LO, POLY_EXP2)),
            (_loader, (q_desc, k_desc, v_desc, q_all, k_ring, v_ring, q_bars, k_ready, k_empty, v_ready, v_empty, b,
                       h, hk, m0, q_start, Sq, k_start, Sk, u_lo, u_tiles, BLOCK_N, STAGES, V_STAGES, VARLEN, NC)),
        ], [4, 4, 1], [CONSUMER_REGS, CONSUMER_REGS, LOADER_REGS])
    else:
        gl.warp_specialize([
            (_consumer, (o_desc, LSE, LSE_LO, q_all.index(0), k_ring, v_ring, q_bars.index(0), k_ready, k_empty,
                         v_ready, v_empty, turn, b, h, m0, q_start, Sq, Sk, offset, span, u_lo, u_tiles, row_lse,
                         qk_scale, scale, softcap, slope, alibi_off, 0, CAUSAL, HAS_WL, HAS_SOFTCAP, HAS_ALIBI,
                         BLOCK_N, D, STAGES, V_STAGES, VARLEN, STORE_LO, PINGPONG, POLY_EXP2)),
            (_consumer1, (o_desc, LSE, LSE_LO, q_all.index(1), k_ring, v_ring, q_bars.index(1), k_ready, k_empty,
                          v_ready, v_empty, turn, b, h, m0, q_start, Sq, Sk, offset, span, u_lo, u_tiles, row_lse,
                          qk_scale, scale, softcap, slope, alibi_off, CAUSAL, HAS_WL, HAS_SOFTCAP, HAS_ALIBI, BLOCK_N,
                          D, STAGES, V_STAGES, VARLEN, STORE_LO, PINGPONG, POLY_EXP2)),
            (_loader, (q_desc, k_desc, v_desc, q_all, k_ring, v_ring, q_bars, k_ready, k_empty, v_ready, v_empty, b,
                       h, hk, m0, q_start, Sq, k_start, Sk, u_lo, u_tiles, BLOCK_N, STAGES, V_STAGES, VARLEN, NC)),
        ], [4, 1], [CONSUMER_REGS, LOADER_REGS])
