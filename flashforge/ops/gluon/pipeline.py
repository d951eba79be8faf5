"""TMA ring helpers shared by the sm_90 Gluon kernels: a ring is STAGES shared-memory slots of
[1, ROWS, 1, D] boxes, one mbarrier per slot; tile j lives in slot j % STAGES and its barrier
completes phase (j // STAGES) & 1 when the copy lands."""
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
