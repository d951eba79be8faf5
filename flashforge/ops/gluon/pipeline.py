"""Pieces shared by the sm_90 Gluon kernels: which query block a program owns and which key
tiles it visits, and TMA rings.  A ring is STAGES shared-memory slots of [1, ROWS, 1, D]
boxes, one mbarrier per slot; tile j lives in slot j % STAGES and its barrier completes phase
(j // STAGES) & 1 when the copy lands."""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma


@gluon.jit
def load_rows(desc, ring, bars, j, b, h, n_tiles, ROWS: gl.constexpr, STAGES: gl.constexpr):
    """Rows [j * ROWS, (j + 1) * ROWS) of (b, h) into slot j % STAGES; a tile past n_tiles is not fetched."""
    slot = j % STAGES
    mbarrier.expect(bars.index(slot), desc.block_type.nbytes, pred=j < n_tiles)
    tma.async_copy_global_to_shared(desc, [b, j * ROWS, h, 0], bars.index(slot), ring.index(slot), pred=j < n_tiles)


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
def query_block(Sq, Hq, group, BLOCK_M: gl.constexpr, CAUSAL: gl.constexpr):
    """(b, h, hk, m0) of this program: grid (query blocks, B * Hq); with a causal mask the
    longest rows run first, so the short ones fill the tail of the wave."""
    n_m = gl.cdiv(Sq, BLOCK_M)
    pid = gl.program_id(0)
    if CAUSAL:
        pid = n_m - 1 - pid
    bh = gl.program_id(1)
    b = bh // Hq
    h = bh % Hq
    return b, h, h // group, pid * BLOCK_M


@gluon.jit
def key_tiles(m0, Sk, offset, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr):
    """(n_tiles, n_full): queries [m0, m0 + BLOCK_M) see key tiles [0, n_tiles); tiles from n_full
    on need a mask (the causal diagonal -- key j visible from query i iff j <= i + offset -- or
    Sk's end)."""
    if CAUSAL:
        n_end = gl.minimum(Sk, m0 + BLOCK_M + offset)
        n_full = gl.minimum(gl.maximum(m0 + offset + 1, 0) // BLOCK_N, Sk // BLOCK_N)
    else:
        n_end = Sk
        n_full = Sk // BLOCK_N
    return gl.maximum(gl.cdiv(n_end, BLOCK_N), 0), n_full
