"""Hardware named barriers (PTX `bar.sync` / `bar.arrive`) for the warp-specialized sm_90 kernels.

Why not mbarriers everywhere: Triton 3.6 arrives on an mbarrier from one thread of the partition
and puts a partition-wide `bar.sync` before it (so the other threads' stores are done) and
another after, so every hand-off costs two syncs of the arriving warpgroup besides the arrive
(the half-dQ consumer's key loop at D = 128: eight `BAR.SYNC` a tile, RESULTS.md v0.9.17).  A
named barrier is both the hand-off and the ordering: `bar.arrive` by every producing thread and
`bar.sync` by every consuming thread complete together once `count` threads have come, and order
the producers' shared-memory writes before the consumers' reads (FlashAttention-3 hands dS and
dQ between its warpgroups this way).

Rules of use (PTX ISA, "bar"):
- count is the number of threads of every warp that takes part (a multiple of 32), the same in
  each call on that id;
- a barrier has no phases: an id may be used again only once its previous use has completed,
  which each caller's protocol must guarantee (say how where it is used);
- ids 0 to 2 are Triton's (0: the default partition's own syncs, 1: the whole CTA's at the
  warp_specialize boundaries, 2: a worker partition's; one-warp partitions use `bar.warp.sync`),
  so the kernels take theirs from FIRST_ID on (tools/sm90_compile_check.py fails a kernel
  whose PTX has a literal id at or above it; tests/test_sm90_compile.py runs it).
- Writes by the generic proxy that an async-proxy reader (wgmma, TMA) will read still need
  `fence_async_shared()` by the writing threads before they arrive.

The asm is given scalar operands: each thread of the partition runs it once.  It is not pure,
so neither Triton nor LLVM drops or reorders it against memory operations."""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

FIRST_ID = gl.constexpr(8)  # ids below are left to Triton (docstring)


@gluon.jit
def named_sync(bar_id, count: gl.constexpr):
    """Wait at barrier bar_id until count threads (this one included) have arrived or synced."""
    gl.inline_asm_elementwise("bar.sync $1, $2; mov.u32 $0, 0;", "=r,r,r", [gl.to_tensor(bar_id), gl.to_tensor(count)],
                              dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def named_arrive(bar_id, count: gl.constexpr):
    """Count this thread as arrived at barrier bar_id without waiting (a producer's signal)."""
    gl.inline_asm_elementwise("bar.arrive $1, $2; mov.u32 $0, 0;", "=r,r,r", [gl.to_tensor(bar_id), gl.to_tensor(count)],
                              dtype=gl.int32, is_pure=False, pack=1)
