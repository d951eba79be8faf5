"""Triton twin of `flashforge.ops.dropout`: the same keep-mask, one Philox call
per eight keys (the four output words, each two 16-bit draws, are interleaved
back into key order)."""
import triton
import triton.language as tl


@triton.jit
def dropout_keep(seed, threshold, bh, offs_m, offs_n, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Keep-mask tile [BLOCK_M, BLOCK_N] for rows offs_m and keys offs_n.

    offs_n must be BLOCK_N consecutive keys starting at a multiple of 8.
    bh (= b * H + h) is a scalar, or [BLOCK_M, 1] when the rows mix heads.
    threshold is the 16-bit keep threshold (passed as an int).
    """
    # counter c0 = j >> 3 for the tile's BLOCK_N // 8 groups of eight keys
    n0 = tl.min(offs_n, axis=0)
    groups = (n0 >> 3) + tl.arange(0, BLOCK_N // 8)
    c0 = tl.zeros([BLOCK_M, BLOCK_N // 8], dtype=tl.uint32) + groups.to(tl.uint32)[None, :]
    c1 = tl.zeros([BLOCK_M, BLOCK_N // 8], dtype=tl.uint32) + offs_m.to(tl.uint32)[:, None]
    c2 = tl.zeros([BLOCK_M, BLOCK_N // 8], dtype=tl.uint32) + tl.cast(bh, tl.uint32)
    c3 = tl.zeros([BLOCK_M, BLOCK_N // 8], dtype=tl.uint32)
    r0, r1, r2, r3 = tl.philox(seed, c0, c1, c2, c3)
    # join(join(r0, r2), join(r1, r3))[..., a, b] = r_{2a + b}: word w = 2a + b of each group
    words = tl.reshape(tl.join(tl.join(r0, r2), tl.join(r1, r3)), [BLOCK_M, BLOCK_N // 2])
    # each word's low then high half: key 8g + 2w + half
    halves = tl.reshape(tl.join(words & 0xFFFF, words >> 16), [BLOCK_M, BLOCK_N])
    return halves >= threshold.to(tl.uint32)
