"""What the warp-specialized sm_90 kernels share (attention_fwd_ws_sm90, attention_bwd_dq_ws_sm90):
a program of NC 64-row consumers (two; the forward also three), their rings with "ready" barriers
(the copy engine completes them) and "empty" barriers (every consumer arrives once a slot's
products are done), and the ping-pong turns (two consumers).

A ring's slot r % STAGES holds tile r of the program's union of key tiles (`ws_program`); use
r of a slot is phase (r // STAGES) & 1 of both its barriers.  A fresh empty barrier reads as
complete for phase 1, so the loader's first STAGES fills do not wait."""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier

from .pipeline import copy_in, key_window, query_program, wait

HALF = gl.constexpr(64)  # query rows per consumer warpgroup (one wgmma tall)


@gluon.jit
def ws_program(Sq, Hq, group, CU_Q, CU_K, ORDER, Sk, total_q, total_k, offset, bottom_right, span, right, SLOPES,
               stride_sb, stride_sh, stride_lb, stride_lh, BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr,
               HAS_WL: gl.constexpr, HAS_ALIBI: gl.constexpr, VARLEN: gl.constexpr, D: gl.constexpr,
               NC: gl.constexpr = 2, tile=None, grid_bh=None):
    """(kv_row, b, h, hk, m0, q_start, Sq, k_start, Sk, offset, alibi_off, slope, u_lo, u_tiles, row) of
    this program's NC * 64 query rows: `query_block` and `sequence` as the one-warpgroup kernels
    use them; kv_row, the dK/dV kernel's program row of this (b, hk) before `sequence` maps b;
    the union of the consumers' key tiles [u_lo, u_lo + u_tiles); row, where this head's lse rows
    start.  tile, grid_bh: a persistent program's work item (`query_block`)."""
    kv_row, b, h, hk, m0, q_start, Sq, k_start, Sk, offset, alibi_off, slope = query_program(
        Sq, Hq, group, CU_Q, CU_K, ORDER, Sk, total_q, total_k, offset, bottom_right, right, SLOPES, stride_sb,
        stride_sh, NC * HALF, CAUSAL, HAS_ALIBI, VARLEN, D, tile, grid_bh)
    u_lo, u_tiles, _, _ = key_window(m0, Sq, Sk, offset, span, NC * HALF, BLOCK_N, CAUSAL, HAS_WL)
    u_tiles = gl.maximum(u_tiles, 0)
    row = b.to(gl.int64) * stride_lb + h.to(gl.int64) * stride_lh + q_start
    return kv_row, b, h, hk, m0, q_start, Sq, k_start, Sk, offset, alibi_off, slope, u_lo, u_tiles, row


@gluon.jit
def ws_rings(k_desc, v_desc, STAGES: gl.constexpr, V_STAGES: gl.constexpr, PINGPONG: gl.constexpr,
             NC: gl.constexpr = 2):
    """(k_ring, v_ring, q_bars, turn, k_ready, k_empty, v_ready, v_empty): the K and V rings in
    shared memory and the program's barriers, initialized: one count for the copy engine's
    barriers (one Q barrier a consumer) and the turns, NC (every consumer) for the empty ones."""
    dtype: gl.constexpr = k_desc.dtype
    k_ring = gl.allocate_shared_memory(dtype, [STAGES] + k_desc.block_type.shape, k_desc.layout)
    v_ring = gl.allocate_shared_memory(dtype, [V_STAGES] + v_desc.block_type.shape, v_desc.layout)
    q_bars = gl.allocate_shared_memory(gl.int64, [NC, 1], mbarrier.MBarrierLayout())
    turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [V_STAGES, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [V_STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(NC):
        mbarrier.init(q_bars.index(i), count=1)
    for i in gl.static_range(2):
        mbarrier.init(turn.index(i), count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(k_empty.index(i), count=NC)
    for i in gl.static_range(V_STAGES):
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(v_empty.index(i), count=NC)
    fence_async_shared()
    if PINGPONG:  # consumer 0 issues first
        mbarrier.arrive(turn.index(0), count=1)
    return k_ring, v_ring, q_bars, turn, k_ready, k_empty, v_ready, v_empty


@gluon.jit
def consumer_tiles(m0, Sq, Sk, offset, span, u_lo, u_tiles, ME: gl.constexpr, BLOCK_N: gl.constexpr,
                   CAUSAL: gl.constexpr, HAS_WL: gl.constexpr, PINGPONG: gl.constexpr):
    """(mc, n_lo, n_tiles, n_lfull, n_full, first, n_other, o_first) of consumer ME: its rows' first
    row, `key_window` over them, the ring index of its first tile, and (PINGPONG) the other
    consumer's issue count (n_tiles + 1 each: the first tile's S alone, then one a tile, then the
    last P V) and the ring index of its first tile (`spare_turns`)."""
    mc = m0 + ME * HALF
    n_lo, n_tiles, n_lfull, n_full = key_window(mc, Sq, Sk, offset, span, HALF, BLOCK_N, CAUSAL, HAS_WL)
    if n_tiles <= 0:
        n_tiles = 0
        n_lo = u_lo + u_tiles
    if PINGPONG:
        o_lo, o_tiles, _, _ = key_window(m0 + (1 - ME) * HALF, Sq, Sk, offset, span, HALF, BLOCK_N, CAUSAL, HAS_WL)
        n_other = gl.where(o_tiles > 0, o_tiles + 1, 0)
    else:
        o_lo = u_lo
        n_other = 0
    return mc, n_lo, n_tiles, n_lfull, n_full, n_lo - u_lo, n_other, o_lo - u_lo


@gluon.jit
def release(ready, empty, r, STAGES: gl.constexpr):
    """Ring index r's slot, not computed by this consumer: once its copy has landed (so the
    arrival counts toward this use of the slot, not an earlier one), hand it back."""
    wait(ready, r, STAGES)
    mbarrier.arrive(empty.index(r % STAGES), count=1)


@gluon.jit
def release_tiles(k_ready, k_empty, v_ready, v_empty, r0, r1, STAGES: gl.constexpr, V_STAGES: gl.constexpr):
    """`release` of ring indices [r0, r1) in both rings: the union's tiles this consumer skips."""
    for r in range(r0, r1):
        release(k_ready, k_empty, r, STAGES)
        release(v_ready, v_empty, r, V_STAGES)


@gluon.jit
def fill(desc, ring, ready, empty, r, row, b, h, start, length, STAGES: gl.constexpr, VARLEN: gl.constexpr):
    """The loader's copy of tile r (rows from `row`) into its slot, once every consumer has
    released the slot's previous tile."""
    s = r % STAGES
    mbarrier.wait(empty.index(s), ((r // STAGES) & 1) ^ 1)
    mbarrier.expect(ready.index(s), desc.block_type.nbytes)
    copy_in(desc, b, row, h, start, length, ready.index(s), ring.index(s), True, VARLEN)


@gluon.jit
def turn_wait(bars, i, n_other, ME: gl.constexpr, PINGPONG: gl.constexpr):
    """PINGPONG: wait until it is this consumer's turn to issue products (its i-th issue), while
    the other consumer still issues (it makes n_other issues; consumer 0 goes first)."""
    if PINGPONG:
        if ME == 0:
            mbarrier.wait(bars.index(0), i & 1, pred=i <= n_other)
        else:
            mbarrier.wait(bars.index(1), i & 1, pred=i < n_other)


@gluon.jit
def turn_pass(bars, ME: gl.constexpr, PINGPONG: gl.constexpr):
    if PINGPONG:
        mbarrier.arrive(bars.index(1 - ME), count=1)


@gluon.jit
def spare_turns(turn, k_ready, k_empty, v_ready, v_empty, r, end, o_first, t0, n_own, n_turns, ME: gl.constexpr,
                STAGES: gl.constexpr, V_STAGES: gl.constexpr):
    """A persistent ping-pong consumer's turns [n_own, n_turns) of an item, which it passes without
    issuing (the other consumer has more), interleaved with its releases of the union's tiles from
    ring index r on that it does not read; returns the first tile not yet released.

    Why interleaved: the other consumer's turn i reads K at ring index o_first + i (and V one
    behind), which the loader can only fill once this consumer has released the tile a ring's depth
    earlier, so those releases go before the turn that needs them; and a release waits for its tile
    to land, so releasing them all first (the first version, 2026-12-07) waited on tiles that only
    the other's later turns free, while the other waited on this one's turn: a hang on every item
    with a consumer whose rows are past the sequence's end (tests/ws_protocol_model.py replays it)."""
    for i in range(n_own, n_turns):
        lim = gl.minimum(gl.minimum(o_first + i + 2 - STAGES, o_first + i + 2 - V_STAGES), end)
        release_tiles(k_ready, k_empty, v_ready, v_empty, r, lim, STAGES, V_STAGES)
        r = gl.maximum(r, lim)
        turn_wait(turn, t0 + i, t0 + n_turns, ME, True)
        turn_pass(turn, ME, True)
    return r
