"""Pieces shared by the sm_90 Gluon kernels: which sequence and query block a program owns,
which key tiles it visits, and TMA copies and rings.

Copies.  A dense batch [B, S, H, D] is read through a 4-D descriptor with [1, ROWS, 1, D]
boxes at (b, row, h, 0).  A packed batch (VARLEN: [1, total, H, D], sequences delimited by
cu_seqlens) through a 5-D "ragged" descriptor (attention.ragged_shape_strides, the scheme of
triton.tools.ragged_tma): two leading dimensions whose strides cancel modulo 2**64 let the
coordinates name both a sequence's first row and its length, so the copy engine zero-fills
rows past the sequence's end and clips stores there, exactly as it does at S in a dense
batch -- no tile reads or writes another sequence's rows.

A ring is STAGES shared-memory slots of boxes, one mbarrier per slot; tile j lives in slot
j % STAGES and its barrier completes phase (j // STAGES) & 1 when the copy lands."""
import os

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language._core import builtin
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma
from triton._C.libtriton import ir


RAGGED = gl.constexpr(0x40000000)  # 2**30: the ragged descriptors' row extent (attention.ragged_shape_strides)
# Bytes of streamed inputs (K and V for query programs, Q and dO for key programs) that the heads of
# one causal section (`program_order`) may ask of L2 together, at most; 0 keeps the grid's own order
# (each head's blocks in turn).  A tuning knob, read once at import.  H100, bf16, one process a
# setting (RESULTS.md v0.9.9): a fixed 8 MiB lifted the causal forward 2-5% and lost no row; a fixed
# 32 MiB gave the GQA 32/8 backward +8% but D = 128 at 1k -5% forward, -8% forward+backward.  Every
# row's best setting held about one wave of programs or less, hence WAVE below, with this as the cap.
L2_SECTION = gl.constexpr(int(os.environ.get("FLASHFORGE_L2_SECTION", 32 << 20)))


def _wave() -> int:
    """Programs the GPU runs at once, taken as one a multiprocessor (the causal sm_90 kernels' tiles
    leave no room in shared memory for a second): $FLASHFORGE_WAVE, else device 0's multiprocessors,
    else an H100 / H200's 132."""
    if "FLASHFORGE_WAVE" in os.environ:
        return int(os.environ["FLASHFORGE_WAVE"])
    try:
        import torch
        if torch.cuda.is_available():
            return torch.cuda.get_device_properties(0).multi_processor_count
    except Exception:  # no usable driver: the default is only a section size
        pass
    return 132


WAVE = gl.constexpr(_wave())


def section_heads(head_bytes: int, n_blk: int, n_bh: int) -> int:
    """Heads in one causal section of a grid (n_blk blocks, n_bh heads): `program_order`'s rule, on
    the host (the persistent forward's program count, `attention.persistent_programs`).  With
    L2_SECTION = 0 the grid's own order runs each head's blocks in turn, so groups of as many whole
    heads as a wave holds describe it too."""
    cap = L2_SECTION.value // max(head_bytes, 1) if L2_SECTION.value > 0 else n_bh
    return max(min(cap, WAVE.value // n_blk, n_bh), 1)


@gluon.jit
def copy_in(desc, b, row, h, start, length, bar, dst, pred, VARLEN: gl.constexpr):
    """Rows [row, row + box) of head h of sequence b (dense), or of the packed sequence at rows
    [start, start + length) (VARLEN), into dst; rows past the sequence's end read as zeros."""
    if VARLEN:
        tma.async_copy_global_to_shared(desc, [RAGGED, start + length, RAGGED - length + row, h, 0], bar, dst,
                                        pred=pred)
    else:
        tma.async_copy_global_to_shared(desc, [b, row, h, 0], bar, dst, pred=pred)


@gluon.jit
def copy_pair(desc0, desc1, b, row, h, start, length, bar, dst0, dst1, VARLEN: gl.constexpr):
    """`copy_in` of the same rows through two descriptors (Q and dO, or K and V) onto one barrier,
    which then expects both boxes' bytes."""
    mbarrier.expect(bar, desc0.block_type.nbytes + desc1.block_type.nbytes)
    copy_in(desc0, b, row, h, start, length, bar, dst0, True, VARLEN)
    copy_in(desc1, b, row, h, start, length, bar, dst1, True, VARLEN)


@gluon.jit
def copy_out(desc, b, row, h, start, length, src, VARLEN: gl.constexpr, col=0):
    """src into rows [row, row + box) of copy_in's addressing, from column col (a box narrower than
    the head dim); rows past the end are not written."""
    if VARLEN:
        tma.async_copy_shared_to_global(desc, [RAGGED, start + length, RAGGED - length + row, h, col], src)
    else:
        tma.async_copy_shared_to_global(desc, [b, row, h, col], src)


@builtin
def _reduce_add(desc, coord, src, _semantic=None):
    # TMA's bulk reduce (cp.reduce.async.bulk.tensor .add): Triton 3.6 builds the op but its Gluon
    # has no Python wrapper for it (`tma_reduce_ready` says whether this Triton has the builder)
    coord = _semantic._convert_to_ir_values(coord, require_i64=False)
    _semantic.builder.create_async_tma_reduce(ir.DESCRIPTOR_REDUCE_KIND.ADD, desc.handle, coord, src.handle)


def tma_reduce_ready() -> bool:
    """Whether this Triton's Gluon builder has the TMA reduce `reduce_out` issues."""
    from triton._C.libtriton import gluon_ir
    return hasattr(gluon_ir.GluonOpBuilder, "create_async_tma_reduce") and hasattr(ir, "DESCRIPTOR_REDUCE_KIND")


@gluon.jit
def reduce_out(desc, b, row, h, col, start, length, src, VARLEN: gl.constexpr):
    """src added (float32, by the copy engine, asynchronously: `tma.store_wait` before src is
    rewritten) into rows [row, row + box), columns [col, col + box) of copy_in's addressing;
    rows past the sequence's end are not touched."""
    if VARLEN:
        _reduce_add(desc, [RAGGED, start + length, RAGGED - length + row, h, col], src)
    else:
        _reduce_add(desc, [b, row, h, col], src)


@gluon.jit
def load_rows(desc, ring, bars, j, first, b, h, start, length, n_tiles, ROWS: gl.constexpr, STAGES: gl.constexpr,
              VARLEN: gl.constexpr):
    """Rows [(first + j) * ROWS, (first + j + 1) * ROWS) of (b, h) into slot j % STAGES: the ring
    counts a program's tiles from its first (`first`, a sliding window's first tile); a tile
    past n_tiles (counted from `first` too) is not fetched."""
    slot = j % STAGES
    mbarrier.expect(bars.index(slot), desc.block_type.nbytes, pred=j < n_tiles)
    copy_in(desc, b, (first + j) * ROWS, h, start, length, bars.index(slot), ring.index(slot), j < n_tiles, VARLEN)


@gluon.jit
def _span(CU, b, total):
    """(start, length) of sequence b, its bounds clamped into [0, total]: the ragged descriptors
    bound nothing (their extents are 2**30 and more), so a cu_seqlens entry past the packed
    rows would otherwise move copies and stores outside the tensors."""
    start = gl.minimum(gl.maximum(gl.load(CU + b), 0), total)
    end = gl.minimum(gl.maximum(gl.load(CU + b + 1), start), total)
    return start, end - start


@gluon.jit
def sequence(CU_Q, CU_K, ORDER, b, Sq, Sk, total_q, total_k, offset, bottom_right, VARLEN: gl.constexpr):
    """(b, q_start, Sq_b, k_start, Sk_b, offset_b) of grid row b: dense, (b, 0, Sq, 0, Sk, offset);
    packed, sequence ORDER[b] (longest first) with its rows in the packed tensors (total_q,
    total_k rows; see `_span`) and its causal offset (plus Sk_b - Sq_b where bottom_right is 1,
    flash-attn's varlen alignment)."""
    if VARLEN:
        b = gl.load(ORDER + b)
        q_start, Sq = _span(CU_Q, b, total_q)
        k_start, Sk = _span(CU_K, b, total_k)
        offset = offset + bottom_right * (Sk - Sq)
    else:
        q_start = 0
        k_start = 0
    return b, q_start, Sq, k_start, Sk, offset



@gluon.jit
def key_program(Sq, group, CAUSAL: gl.constexpr, D: gl.constexpr):
    """(key block, grid row b * Hkv + hk) of a dK/dV program, in `program_order`: a program streams
    the group's queries (Q and dO, 16-bit) from its keys on, 4 D bytes a query a head (to_tensor: a
    length of 1 arrives as a constant int)."""
    return program_order(gl.to_tensor(Sq).to(gl.int64) * (4 * D * group), CAUSAL)


@gluon.jit
def key_block(CU_Q, CU_K, ORDER, Hq, group, Sq, Sk, total_q, total_k, offset, bottom_right, stride_lb,
              BLOCK_N: gl.constexpr, VARLEN: gl.constexpr, CAUSAL: gl.constexpr, D: gl.constexpr):
    """(bh, b, hk, n0, q_start, Sq, k_start, Sk, offset, row_b) of a dK/dV program: grid
    (key blocks, B * Hkv) in `program_order` (causal: the first key blocks see the most queries, so
    they run first), keys [n0, n0 + BLOCK_N) of KV head hk; `sequence` maps b and the lengths
    (packed); row_b is where the sequence's lse / delta rows start (head 0's)."""
    blk, bh = key_program(Sq, group, CAUSAL, D)
    Hkv = Hq // group
    b = bh // Hkv
    hk = bh % Hkv
    n0 = blk * BLOCK_N
    b, q_start, Sq, k_start, Sk, offset = sequence(CU_Q, CU_K, ORDER, b, Sq, Sk, total_q, total_k, offset,
                                                   bottom_right, VARLEN)
    row_b = b.to(gl.int64) * stride_lb + q_start
    return bh, b, hk, n0, q_start, Sq, k_start, Sk, offset, row_b

@gluon.jit
def slot(ring, j, ROWS: gl.constexpr, D: gl.constexpr, STAGES: gl.constexpr):
    """Slot j % STAGES of a [STAGES, 1, ROWS, 1, D] ring, as the [ROWS, D] matrix an MMA reads."""
    return ring.index(j % STAGES).reshape([ROWS, D])


@gluon.jit
def wait(bars, j, STAGES: gl.constexpr):
    """Until tile j's copy has landed."""
    mbarrier.wait(bars.index(j % STAGES), (j // STAGES) & 1)


@gluon.jit
def init_barriers(bars, N: gl.constexpr):
    for i in gl.static_range(N):
        mbarrier.init(bars.index(i), count=1)


@gluon.jit
def invalidate_barriers(bars, N: gl.constexpr):
    for i in gl.static_range(N):
        mbarrier.invalidate(bars.index(i))


@gluon.jit
def program_order(head_bytes, CAUSAL: gl.constexpr, tile=None, grid_blk=None, grid_bh=None):
    """(block, bh) of this program in a grid (blocks, heads) whose block 0 is each head's longest
    (a causal mask's: the last query block, the first key block).

    Why: the hardware starts programs in the order of their linear index, program_id(0) fastest,
    which runs each head's blocks in turn, long to short, and the next head's longest blocks then
    start while the machine is full: the last wave ends ragged, up to a longest program late.  In
    a model of the standard grid (equal tiles, 132 SMs) that is 7% of a causal D = 128 call at 1k
    and 4k and 14% of the GQA 32/8 backward (a program walks the group's four heads), against
    <= 1% longest-first over every head.  Longest-first over every head would stream every head's
    inputs at once, out of L2, so the heads go in sections (L2 swizzling, as FA3's scheduler): in
    each section of `sect` heads -- as many as one wave of programs (WAVE) holds and their streamed
    inputs (head_bytes each, int64) fit in L2_SECTION -- block 0 of every head, then block 1, ...; the
    model puts that within 1-2% of longest-first.  (Measured: L2_SECTION's note.)  Without
    CAUSAL (equal programs) or with L2_SECTION = 0, the grid's own order.

    tile (a persistent program's work item, int32): the position of grid (grid_blk, grid_bh)'s
    program tile in its linear order, instead of this program's own."""
    if tile is None:
        blk = gl.program_id(0)
        bh = gl.program_id(1)
        n_blk = gl.num_programs(0)
        n_bh = gl.num_programs(1)
    else:
        n_blk = grid_blk
        n_bh = grid_bh
        bh = tile // n_blk
        blk = tile - bh * n_blk
    if CAUSAL and L2_SECTION > 0:
        # as many heads as one wave of programs holds (the next section's longest then fill the
        # wave's tail), at least one, no more than L2_SECTION's bytes hold.  (RESULTS.md v0.9.10:
        # sections one head past a wave -- 5 x 32 and 17 x 8 blocks -- read 3-4% under 4 x 32 and
        # 16 x 8 in the D = 128 causal forward at 4k and 1k, on an H100 and an H200).  The host's
        # twin: `section_heads`
        wave = WAVE // n_blk
        sect = gl.minimum(gl.minimum(L2_SECTION // gl.maximum(head_bytes, 1), wave), n_bh)
        sect = gl.maximum(sect, 1).to(gl.int32)
        size = sect * n_blk  # programs of a full section (<= the grid's, an int32)
        pid = bh * n_blk + blk
        s = pid // size
        r = pid - s * size
        g = gl.minimum(sect, n_bh - s * sect)  # heads in this section (the last may hold fewer)
        blk = r // g
        bh = s * sect + (r - blk * g)
    return blk, bh


@gluon.jit
def query_block(Sq, Sk, Hq, group, BLOCK_M: gl.constexpr, CAUSAL: gl.constexpr, D: gl.constexpr, tile=None,
                grid_bh=None):
    """(b, h, hk, m0) of this program: grid (query blocks of the longest sequence, B * Hq) in
    `program_order`; with a causal mask the longest rows run first, so the short ones fill the
    tail of the wave.  tile: a persistent program's work item instead (grid_bh = B * Hq)."""
    n_m = gl.cdiv(Sq, BLOCK_M)
    # a program streams K and V (16-bit) of its KV head, which the group's heads share
    pid, bh = program_order(gl.to_tensor(Sk).to(gl.int64) * (4 * D) // group, CAUSAL, tile, n_m, grid_bh)
    if CAUSAL:
        pid = n_m - 1 - pid
    b = bh // Hq
    h = bh % Hq
    return b, h, h // group, pid * BLOCK_M



@gluon.jit
def query_program(Sq, Hq, group, CU_Q, CU_K, ORDER, Sk, total_q, total_k, offset, bottom_right, right, SLOPES,
                  stride_sb, stride_sh, BLOCK_M: gl.constexpr, CAUSAL: gl.constexpr, HAS_ALIBI: gl.constexpr,
                  VARLEN: gl.constexpr, D: gl.constexpr, tile=None, grid_bh=None):
    """(kv_row, b, h, hk, m0, q_start, Sq, k_start, Sk, offset, alibi_off, slope) of a program over
    query rows (the forward's, the dQ kernel's): `query_block`, then `sequence` (packed: this
    sequence's rows and lengths; Sq, Sk, offset become its own); kv_row is the dK/dV kernel's
    grid row of this (b, hk) (`key_program`), before `sequence` maps b; ALiBi's slope of head h and the
    distance offset (`scores.modified_score`).  tile, grid_bh: `query_block`'s."""
    b, h, hk, m0 = query_block(Sq, Sk, Hq, group, BLOCK_M, CAUSAL, D, tile, grid_bh)
    kv_row = b * (Hq // group) + hk
    b, q_start, Sq, k_start, Sk, offset = sequence(CU_Q, CU_K, ORDER, b, Sq, Sk, total_q, total_k, offset,
                                                   bottom_right, VARLEN)
    alibi_off = offset - right
    if HAS_ALIBI:
        slope = gl.load(SLOPES + b * stride_sb + h * stride_sh)
    else:
        slope = 0.0
    return kv_row, b, h, hk, m0, q_start, Sq, k_start, Sk, offset, alibi_off, slope

@gluon.jit
def key_tiles(m0, Sq, Sk, offset, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr):
    """(n_tiles, n_full): queries [m0, m0 + BLOCK_M) see key tiles [0, n_tiles); tiles from n_full
    on need a mask (the causal diagonal -- key j visible from query i iff j <= i + offset -- or
    Sk's end).  A query block past the sequence's end (a packed batch's grid covers its longest
    sequence) sees none: nothing to compute or write."""
    if CAUSAL:
        n_end = gl.minimum(Sk, m0 + BLOCK_M + offset)
        n_full = gl.minimum(gl.maximum(m0 + offset + 1, 0) // BLOCK_N, Sk // BLOCK_N)
    else:
        n_end = Sk
        n_full = Sk // BLOCK_N
    n_tiles = gl.maximum(gl.cdiv(n_end, BLOCK_N), 0)
    if m0 >= Sq:
        n_tiles = 0
    return n_tiles, n_full


@gluon.jit
def visible(i2, j2, Sk, offset, span, CAUSAL: gl.constexpr, HAS_WL: gl.constexpr):
    """Whether key j2 < Sk is visible from query i2 (broadcastable index tensors): j <= i + offset
    where CAUSAL, j >= i + offset - span where HAS_WL (`key_window`'s rule, element by element)."""
    keep = j2 < Sk
    if CAUSAL:
        keep = keep & (j2 <= i2 + offset)
    if HAS_WL:
        keep = keep & (j2 >= i2 + (offset - span))
    return keep


@gluon.jit
def query_window(n0, Sq, Sk, offset, span, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr,
                 HAS_WL: gl.constexpr):
    """(mt_lo, n_mt, n_masked, n_lfull), the dK/dV kernels' mirror of `key_window`: keys
    [n0, n0 + BLOCK_N) are seen by query tiles [mt_lo, mt_lo + n_mt); of those, the first n_masked
    cross the causal diagonal and those from n_lfull on a window's left edge (query m sees key n
    iff n >= m + offset - span), so they need a mask; n_mt = 0 for a key block past a packed
    sequence's end (nothing to compute or write)."""
    if CAUSAL:
        mt_lo = gl.maximum(n0 - offset, 0) // BLOCK_M
        mt_full = gl.maximum(gl.cdiv(gl.maximum(n0 + BLOCK_N - 1 - offset, 0), BLOCK_M), mt_lo)
    else:
        mt_lo = 0
        mt_full = 0
    if HAS_WL:
        mt_end = gl.minimum(gl.cdiv(Sq, BLOCK_M), gl.cdiv(gl.maximum(n0 + BLOCK_N - offset + span, 0), BLOCK_M))
        n_lfull = gl.maximum(n0 - offset + span + 1, 0) // BLOCK_M - mt_lo
    else:
        mt_end = gl.cdiv(Sq, BLOCK_M)
        n_lfull = 0
    n_mt = gl.maximum(mt_end - mt_lo, 0)
    if n0 >= Sk:
        n_mt = 0
    return mt_lo, n_mt, gl.minimum(mt_full - mt_lo, n_mt), n_lfull


@gluon.jit
def key_window(m0, Sq, Sk, offset, span, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr,
               HAS_WL: gl.constexpr):
    """(n_lo, n_tiles, n_lfull, n_full), tiles counted from n_lo: queries [m0, m0 + BLOCK_M) see
    key tiles [n_lo, n_lo + n_tiles); tile n_lo + i needs a mask where i < n_lfull (a sliding
    window's left edge: key j visible from query i iff j >= i + offset - span, HAS_WL) or
    i >= n_full (`key_tiles`: the right edge, or Sk's end)."""
    n_tiles, n_full = key_tiles(m0, Sq, Sk, offset, BLOCK_M, BLOCK_N, CAUSAL)
    if HAS_WL:
        n_lo = gl.minimum(gl.maximum(m0 + offset - span, 0) // BLOCK_N, n_tiles)
        # the first tile every row of the block sees whole
        n_lfull = gl.cdiv(gl.maximum(m0 + BLOCK_M - 1 + offset - span, 0), BLOCK_N) - n_lo
        n_tiles -= n_lo
        n_full -= n_lo
    else:
        n_lo = 0
        n_lfull = 0
    return n_lo, n_tiles, n_lfull, n_full
