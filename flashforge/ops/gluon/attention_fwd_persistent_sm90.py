"""Hopper (sm_90) attention forward in Gluon, warp-specialized and persistent: one program an
SM, each running a share of the grid's work items (NC * 64 query rows of one head).

Why (issue 18; RESULTS.md v0.9.11): a program of `attention_fwd_ws_sm90` loads its Q and first K
tile before its consumers can start, and stores its o after they finish, with nothing else on the
SM (its shared memory allows one program).  A 1k-key call's program runs only 8 key tiles, so that
prologue and epilogue are a large part of it: D128 S1k forward reads 0.90x the faster peer,
causal 0.82x.  Here the loader runs ahead into the next item -- its Q once each consumer has read
its Q for the last time, its K and V tiles as ring slots free up -- while the consumers finish the
current one, and o is staged in a buffer of its own, so its store overlaps the next item's
products (FA3's persistent kernel and epilogue overlap; written from the design, not its code).

Items are numbered as the non-persistent grid (query blocks fastest, then heads) and put through
the same `program_order` (causal: longest-first within L2 sections of at most one wave).  P
programs take them in rounds of P, in snake order: round k gives program p item k P + p for even k,
k P + P - 1 - p for odd k.  With a causal mask P is one section's items (`attention.
persistent_programs`: 128 of 132 SMs on the standard grid), so that each round runs long to short
and the snake pairs a long item with a short one, round after round; otherwise one program an SM.
Why not p, p + P, ... over every SM: a round would then hold a section and a part of the next, and
program 0 would get the longest item of every round, program P - 1 the shortest (at 4k keys, 32
times less work).  A model of the standard grid's causal rows (benchmarks/profile/
persistent_balance.py) puts the busiest program at 1.03x the mean work of 132 SMs this way, 1.46-1.56x
striding over 132, and 1.00-1.02x for the hardware's dynamic start order, which balances the
non-persistent grid (FA3 takes items from an atomic counter: a dynamic order here is left for
later).

Ring indices and barrier phases run on across items (`attention_fwd_ws_sm90.consume_tile`,
`load_tile`: an item's key tiles are ring indices [base, base + its union's tiles)).  Scope and
arguments: `attention_fwd_ws_sm90`'s, plus grid_bh (B * Hq, the grid's heads); D <= 128 (the
extra o buffer: `attention.ws_shared_bytes`)."""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma

from .attention_fwd_ws_sm90 import consume_tile, load_tile
from .ws_pipeline import HALF, ws_program, ws_rings


@gluon.jit
def _rounds(Sq, grid_bh, NC: gl.constexpr):
    """(rounds, items): the grid's items and the rounds of one item a program they take."""
    items = gl.cdiv(Sq, NC * HALF) * grid_bh
    return gl.cdiv(items, gl.num_programs(0)), items


@gluon.jit
def _item(k):
    """This program's item of round k (snake order: the module's note)."""
    p = gl.program_id(0)
    P = gl.num_programs(0)
    return k * P + gl.where(k % 2 == 0, p, P - 1 - p)


@gluon.jit
def _consumer(o_desc, LSE, LSE_LO, q_smem, o_smem, k_ring, v_ring, q_bar, q_empty, k_ready, k_empty, v_ready,
              v_empty, turn, stride_lb, stride_lh, CU_Q, CU_K, ORDER, Hq, Sq, Sk, total_q, total_k, group, offset,
              bottom_right, span, qk_scale, scale, softcap, SLOPES, stride_sb, stride_sh, right, grid_bh,
              ME: gl.constexpr, CAUSAL: gl.constexpr, HAS_WL: gl.constexpr, HAS_SOFTCAP: gl.constexpr,
              HAS_ALIBI: gl.constexpr, BLOCK_N: gl.constexpr, D: gl.constexpr, STAGES: gl.constexpr,
              V_STAGES: gl.constexpr, VARLEN: gl.constexpr, STORE_LO: gl.constexpr, PINGPONG: gl.constexpr,
              POLY_EXP2: gl.constexpr, NC: gl.constexpr):
    """Consumer ME's rows of each of this program's items (`consume_tile`)."""
    base = 0  # ring index of the item's first key tile
    t0 = 0  # ping-pong turns taken so far
    n = 0  # items so far (Q's barrier phase)
    rounds, items = _rounds(Sq, grid_bh, NC)
    for k in range(0, rounds):
        tile = _item(k)
        if tile < items:
            _, b, h, hk, m0, q_start, sq, k_start, sk, off, alibi_off, slope, u_lo, u_tiles, row_lse = ws_program(
                Sq, Hq, group, CU_Q, CU_K, ORDER, Sk, total_q, total_k, offset, bottom_right, span, right, SLOPES,
                stride_sb, stride_sh, stride_lb, stride_lh, BLOCK_N, CAUSAL, HAS_WL, HAS_ALIBI, VARLEN, D, NC, tile,
                grid_bh)
            turns = consume_tile(o_desc, LSE, LSE_LO, q_smem, o_smem, k_ring, v_ring, q_bar, n & 1, q_empty, k_ready,
                                 k_empty, v_ready, v_empty, turn, base, t0, b, h, m0, q_start, sq, sk, off, span, u_lo,
                                 u_tiles, row_lse, qk_scale, scale, softcap, slope, alibi_off, ME, CAUSAL, HAS_WL,
                                 HAS_SOFTCAP, HAS_ALIBI, BLOCK_N, D, STAGES, V_STAGES, VARLEN, STORE_LO, PINGPONG,
                                 POLY_EXP2, True)
            base += u_tiles
            t0 += turns
            n += 1
    tma.store_wait(0)


@gluon.jit
def _consumer1(o_desc, LSE, LSE_LO, q_smem, o_smem, k_ring, v_ring, q_bar, q_empty, k_ready, k_empty, v_ready,
               v_empty, turn, stride_lb, stride_lh, CU_Q, CU_K, ORDER, Hq, Sq, Sk, total_q, total_k, group, offset,
               bottom_right, span, qk_scale, scale, softcap, SLOPES, stride_sb, stride_sh, right, grid_bh,
               CAUSAL: gl.constexpr, HAS_WL: gl.constexpr, HAS_SOFTCAP: gl.constexpr, HAS_ALIBI: gl.constexpr,
               BLOCK_N: gl.constexpr, D: gl.constexpr, STAGES: gl.constexpr, V_STAGES: gl.constexpr,
               VARLEN: gl.constexpr, STORE_LO: gl.constexpr, PINGPONG: gl.constexpr, POLY_EXP2: gl.constexpr,
               NC: gl.constexpr):
    # the second consumer, in a worker partition (warp_specialize's partitions are functions)
    _consumer(o_desc, LSE, LSE_LO, q_smem, o_smem, k_ring, v_ring, q_bar, q_empty, k_ready, k_empty, v_ready, v_empty,
              turn, stride_lb, stride_lh, CU_Q, CU_K, ORDER, Hq, Sq, Sk, total_q, total_k, group, offset, bottom_right,
              span, qk_scale, scale, softcap, SLOPES, stride_sb, stride_sh, right, grid_bh, 1, CAUSAL, HAS_WL,
              HAS_SOFTCAP, HAS_ALIBI, BLOCK_N, D, STAGES, V_STAGES, VARLEN, STORE_LO, PINGPONG, POLY_EXP2, NC)


@gluon.jit
def _consumer2(o_desc, LSE, LSE_LO, q_smem, o_smem, k_ring, v_ring, q_bar, q_empty, k_ready, k_empty, v_ready,
               v_empty, turn, stride_lb, stride_lh, CU_Q, CU_K, ORDER, Hq, Sq, Sk, total_q, total_k, group, offset,
               bottom_right, span, qk_scale, scale, softcap, SLOPES, stride_sb, stride_sh, right, grid_bh,
               CAUSAL: gl.constexpr, HAS_WL: gl.constexpr, HAS_SOFTCAP: gl.constexpr, HAS_ALIBI: gl.constexpr,
               BLOCK_N: gl.constexpr, D: gl.constexpr, STAGES: gl.constexpr, V_STAGES: gl.constexpr,
               VARLEN: gl.constexpr, STORE_LO: gl.constexpr, POLY_EXP2: gl.constexpr, NC: gl.constexpr):
    # NC = 3: the third 64 rows (no ping-pong)
    _consumer(o_desc, LSE, LSE_LO, q_smem, o_smem, k_ring, v_ring, q_bar, q_empty, k_ready, k_empty, v_ready, v_empty,
              turn, stride_lb, stride_lh, CU_Q, CU_K, ORDER, Hq, Sq, Sk, total_q, total_k, group, offset, bottom_right,
              span, qk_scale, scale, softcap, SLOPES, stride_sb, stride_sh, right, grid_bh, 2, CAUSAL, HAS_WL,
              HAS_SOFTCAP, HAS_ALIBI, BLOCK_N, D, STAGES, V_STAGES, VARLEN, STORE_LO, False, POLY_EXP2, NC)


@gluon.jit
def _loader(q_desc, k_desc, v_desc, q_all, k_ring, v_ring, q_bars, q_empty, k_ready, k_empty, v_ready, v_empty,
            stride_lb, stride_lh, CU_Q, CU_K, ORDER, Hq, Sq, Sk, total_q, total_k, group, offset, bottom_right, span,
            right, SLOPES, stride_sb, stride_sh, grid_bh, CAUSAL: gl.constexpr, HAS_WL: gl.constexpr,
            BLOCK_N: gl.constexpr, D: gl.constexpr, STAGES: gl.constexpr, V_STAGES: gl.constexpr,
            VARLEN: gl.constexpr, NC: gl.constexpr):
    """Each item's copies (`load_tile`), in the consumers' order."""
    base = 0
    n = 0
    rounds, items = _rounds(Sq, grid_bh, NC)
    for k in range(0, rounds):
        tile = _item(k)
        if tile < items:
            _, b, h, hk, m0, q_start, sq, k_start, sk, _, _, _, u_lo, u_tiles, _ = ws_program(
                Sq, Hq, group, CU_Q, CU_K, ORDER, Sk, total_q, total_k, offset, bottom_right, span, right, SLOPES,
                stride_sb, stride_sh, stride_lb, stride_lh, BLOCK_N, CAUSAL, HAS_WL, False, VARLEN, D, NC, tile,
                grid_bh)
            load_tile(q_desc, k_desc, v_desc, q_all, k_ring, v_ring, q_bars, q_empty, n & 1, k_ready, k_empty,
                      v_ready, v_empty, base, b, h, hk, m0, q_start, sq, k_start, sk, u_lo, u_tiles, BLOCK_N, STAGES,
                      V_STAGES, VARLEN, NC, True)
            base += u_tiles
            n += 1


@gluon.jit
def attn_fwd_persistent_sm90_kernel(q_desc, k_desc, v_desc, o_desc, LSE, LSE_LO, stride_lb, stride_lh, CU_Q, CU_K,
                                    ORDER, Hq, Sq, Sk, total_q, total_k, group, offset, bottom_right, span, qk_scale,
                                    scale, softcap, SLOPES, stride_sb, stride_sh, right, grid_bh,
                                    CAUSAL: gl.constexpr, HAS_WL: gl.constexpr, HAS_SOFTCAP: gl.constexpr,
                                    HAS_ALIBI: gl.constexpr, BLOCK_N: gl.constexpr, D: gl.constexpr,
                                    STAGES: gl.constexpr, V_STAGES: gl.constexpr, VARLEN: gl.constexpr,
                                    STORE_LO: gl.constexpr, PINGPONG: gl.constexpr, CONSUMER_REGS: gl.constexpr,
                                    LOADER_REGS: gl.constexpr, num_warps: gl.constexpr, NC: gl.constexpr = 2,
                                    POLY_EXP2: gl.constexpr = 0):
    # attn_fwd_ws_sm90_kernel's arguments and grid_bh; grid (programs,), one an SM at most
    dtype: gl.constexpr = q_desc.dtype
    gl.static_assert((NC == 2) or ((NC == 3) and not PINGPONG), "two consumers, or three without ping-pong")
    q_all = gl.allocate_shared_memory(dtype, [NC] + q_desc.block_type.shape, q_desc.layout)
    o_all = gl.allocate_shared_memory(dtype, [NC] + o_desc.block_type.shape, o_desc.layout)
    q_empty = gl.allocate_shared_memory(gl.int64, [NC, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(NC):
        mbarrier.init(q_empty.index(i), count=1)
    fence_async_shared()
    k_ring, v_ring, q_bars, turn, k_ready, k_empty, v_ready, v_empty = ws_rings(k_desc, v_desc, STAGES, V_STAGES,
                                                                                PINGPONG, NC)
    # (the partitions are spelled out in each branch, as attn_fwd_ws_sm90_kernel's: a jit function
    # cannot be held in a variable, nor a partition list built conditionally)
    if NC == 3:
        gl.warp_specialize([
            (_consumer, (o_desc, LSE, LSE_LO, q_all.index(0), o_all.index(0), k_ring, v_ring, q_bars.index(0),
                         q_empty.index(0), k_ready, k_empty, v_ready, v_empty, turn, stride_lb, stride_lh, CU_Q, CU_K,
                         ORDER, Hq, Sq, Sk, total_q, total_k, group, offset, bottom_right, span, qk_scale, scale,
                         softcap, SLOPES, stride_sb, stride_sh, right, grid_bh, 0, CAUSAL, HAS_WL, HAS_SOFTCAP,
                         HAS_ALIBI, BLOCK_N, D, STAGES, V_STAGES, VARLEN, STORE_LO, False, POLY_EXP2, NC)),
            (_consumer1, (o_desc, LSE, LSE_LO, q_all.index(1), o_all.index(1), k_ring, v_ring, q_bars.index(1),
                          q_empty.index(1), k_ready, k_empty, v_ready, v_empty, turn, stride_lb, stride_lh, CU_Q, CU_K,
                          ORDER, Hq, Sq, Sk, total_q, total_k, group, offset, bottom_right, span, qk_scale, scale,
                          softcap, SLOPES, stride_sb, stride_sh, right, grid_bh, CAUSAL, HAS_WL, HAS_SOFTCAP,
                          HAS_ALIBI, BLOCK_N, D, STAGES, V_STAGES, VARLEN, STORE_LO, False, POLY_EXP2, NC)),
            (_consumer2, (o_desc, LSE, LSE_LO, q_all.index(2), o_all.index(2), k_ring, v_ring, q_bars.index(2),
                          q_empty.index(2), k_ready, k_empty, v_ready, v_empty, turn, stride_lb, stride_lh, CU_Q, CU_K,
                          ORDER, Hq, Sq, Sk, total_q, total_k, group, offset, bottom_right, span, qk_scale, scale,
                          softcap, SLOPES, stride_sb, stride_sh, right, grid_bh, CAUSAL, HAS_WL, HAS_SOFTCAP,
                          HAS_ALIBI, BLOCK_N, D, STAGES, V_STAGES, VARLEN, STORE_LO, POLY_EXP2, NC)),
            (_loader, (q_desc, k_desc, v_desc, q_all, k_ring, v_ring, q_bars, q_empty, k_ready, k_empty, v_ready,
                       v_empty, stride_lb, stride_lh, CU_Q, CU_K, ORDER, Hq, Sq, Sk, total_q, total_k, group, offset,
                       bottom_right, span, right, SLOPES, stride_sb, stride_sh, grid_bh, CAUSAL, HAS_WL, BLOCK_N, D,
                       STAGES, V_STAGES, VARLEN, NC)),
        ], [4, 4, 1], [CONSUMER_REGS, CONSUMER_REGS, LOADER_REGS])
    else:
        gl.warp_specialize([
            (_consumer, (o_desc, LSE, LSE_LO, q_all.index(0), o_all.index(0), k_ring, v_ring, q_bars.index(0),
                         q_empty.index(0), k_ready, k_empty, v_ready, v_empty, turn, stride_lb, stride_lh, CU_Q, CU_K,
                         ORDER, Hq, Sq, Sk, total_q, total_k, group, offset, bottom_right, span, qk_scale, scale,
                         softcap, SLOPES, stride_sb, stride_sh, right, grid_bh, 0, CAUSAL, HAS_WL, HAS_SOFTCAP,
                         HAS_ALIBI, BLOCK_N, D, STAGES, V_STAGES, VARLEN, STORE_LO, PINGPONG, POLY_EXP2, NC)),
            (_consumer1, (o_desc, LSE, LSE_LO, q_all.index(1), o_all.index(1), k_ring, v_ring, q_bars.index(1),
                          q_empty.index(1), k_ready, k_empty, v_ready, v_empty, turn, stride_lb, stride_lh, CU_Q, CU_K,
                          ORDER, Hq, Sq, Sk, total_q, total_k, group, offset, bottom_right, span, qk_scale, scale,
                          softcap, SLOPES, stride_sb, stride_sh, right, grid_bh, CAUSAL, HAS_WL, HAS_SOFTCAP,
                          HAS_ALIBI, BLOCK_N, D, STAGES, V_STAGES, VARLEN, STORE_LO, PINGPONG, POLY_EXP2, NC)),
            (_loader, (q_desc, k_desc, v_desc, q_all, k_ring, v_ring, q_bars, q_empty, k_ready, k_empty, v_ready,
                       v_empty, stride_lb, stride_lh, CU_Q, CU_K, ORDER, Hq, Sq, Sk, total_q, total_k, group, offset,
                       bottom_right, span, right, SLOPES, stride_sb, stride_sh, grid_bh, CAUSAL, HAS_WL, BLOCK_N, D,
                       STAGES, V_STAGES, VARLEN, NC)),
        ], [4, 1], [CONSUMER_REGS, LOADER_REGS])
