"""Pieces shared by the attention kernels: the score rule and the tile ranges.

Scores are kept in log2 units (``s2 = score * log2(e)``) so the softmax uses
``exp2``; lse is stored in natural log.  One helper computes the score tile for
forward and backward alike, so the two can never disagree on what is visible.
"""
import os

import triton
import triton.language as tl

LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)
# flashforge.api.validate's SAFE_INDEX and MAX_OFFSET (see `load_offset`)
SAFE_INDEX = tl.constexpr(2**29)
MAX_OFFSET = tl.constexpr(2**61)
# Below this |lse * log2(e)| an sm_90 Gluon backward program leaves lse_lo out
# (`ops.gluon.attention_bwd_sm90._lo_needed`; the preprocess kernel flags the GQA groups past it for
# the fused dK/dV kernels).  lse_lo is at most ~2**-22 of it (two float32 roundings), so there P
# moves by at most 4e-5 of itself (float16's ulp is 1e-3): no more than the lse the backward had
# before lse_lo, and flash-attn's.  (The portable kernels, float32 inputs included, always subtract it.)
LO_FROM = tl.constexpr(256.0)
# Triton reads TRITON_INTERPRET once, at import; so do we (inline PTX has no interpreter twin)
INTERPRETING = tl.constexpr(os.environ.get("TRITON_INTERPRET") == "1")


@triton.jit
def mul_rn(a, b):
    """a * b rounded once to float32 and never fused into a neighbouring add (PTX contracts a
    multiply without a rounding modifier into a following add; `mul.rn` it leaves alone).
    Scores and ``lse * LOG2E`` go through it, so that every kernel, forward or backward, whatever
    its tiles, forms the same float32 score, the row maximum is one of them, and P's exponent
    ``s2 - max`` is exact and <= 0: fused, ``qk * c - max`` keeps the product's rounding error,
    which at a score of 1e9 (ulp 64) makes an unnormalised weight 2**32 (inf in float16)."""
    if INTERPRETING:
        r = a * b
    else:
        r = tl.inline_asm_elementwise("mul.rn.f32 $0, $1, $2;", "=r,r,r", [a, tl.zeros_like(a) + b],
                                      dtype=tl.float32, is_pure=True, pack=1)
    return r


@triton.jit
def fms_rn(a, b, c):
    """a * b - c rounded once (`fma.rn`).  The negation sits inside the asm, where ptxas folds it
    into the FFMA's operand (negated outside, it costs an instruction per element of c's
    broadcast).  The interpreter forms it in float64: a float32 product is exact there, so only
    the difference rounds (to float64, then to float32: twice, a tie apart)."""
    if INTERPRETING:
        r = (a.to(tl.float64) * b - c).to(tl.float32)
    else:
        r = tl.inline_asm_elementwise("{ .reg .f32 t; neg.f32 t, $3; fma.rn.f32 $0, $1, $2, t; }", "=r,r,r,r",
                                      [a, tl.zeros_like(a) + b, c], dtype=tl.float32, is_pure=True, pack=1)
    return r


@triton.constexpr_function
def fused_score(dtype, HAS_MASK=False, MASK_BOOL=False, HAS_SOFTCAP=False, HAS_ALIBI=False):
    """Whether P's exponent is formed as ``fma(qk, c, -shift)``, the product unrounded, one
    instruction (bfloat16 inputs whose score is the plain product: no softcap, ALiBi or additive
    bias; a boolean mask only hides scores), or as ``mul_rn(qk, c) - shift``, two (float16 and
    float32, and every score with a modifier).  Forward and backward take the same form from the
    same inputs, so either way they recompute the same P.  The fused form's exponent at a row's
    maximum is the product's rounding error, up to ulp(max) / 2, not 0: an unnormalised weight
    reaches 2**(ulp / 2), harmless in bfloat16's range while |score * log2(e)| < 2**32 (at 1e4 per
    element and D = 64 it is 2**30) but inf in float16's past 2**16 (a score of 1e8); float32
    inputs keep the exact form at any magnitude."""
    plain = not (HAS_SOFTCAP or HAS_ALIBI or (HAS_MASK and not MASK_BOOL))
    return dtype == tl.bfloat16 and plain


@triton.jit
def score_exponent(qk, s2, c, shift, FUSE: tl.constexpr, MASKED: tl.constexpr):
    """P's exponent ``s2 - shift`` (log2 units) for s2 = `score_tile`(qk), shift the row's max
    (forward) or lse2 (backward), broadcastable to qk's shape; with FUSE (`fused_score`, c =
    scale * LOG2E as score_tile forms it) straight from the product.  MASKED: s2 may hold -inf
    (invisible keys), which stays -inf."""
    if FUSE:
        x = fms_rn(qk, c, shift)
        if MASKED:
            x = tl.where(s2 == float("-inf"), float("-inf"), x)
    else:
        x = s2 - shift
    return x


@triton.jit
def tanh(x):
    # tl has no tanh that also runs in the interpreter; this form saturates
    # cleanly at +-1 for large |x| (exp2 overflows to inf, 2/inf = 0).
    return 1.0 - 2.0 / (tl.exp2(x * (2.0 * LOG2E)) + 1.0)


@triton.jit
def score_tile(qk, i2, j2, b, h, Sq, Sk, off, win_left, win_right, scale, softcap, slope,
               MASK, stride_mb, stride_mh, stride_mm, stride_mn,
               HAS_MASK: tl.constexpr, MASK_BOOL: tl.constexpr, HAS_WL: tl.constexpr,
               HAS_WR: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
               CHECK: tl.constexpr = True):
    """Scores in log2 units for the float32 tile qk = <q_i, k_j>.

    i2 / j2 are the query / key indices, broadcastable to qk's shape: [BM, 1] and
    [1, BN] for a [BM, BN] tile, or [1, BM] and [BN, 1] for a transposed one.
    Returns (s2, t): s2 is -inf wherever key j is invisible from query i (out of
    range, masked, outside the window); t = tanh(scale * qk / softcap) for the
    softcap gradient (equal to s2 when softcap is off, unused then).
    CHECK=False skips the range and window tests, for tiles known to lie inside
    both (see `full_key_range`); a user mask is always applied.
    slope: the ALiBi slope of (b, h), read only when HAS_ALIBI.
    """
    # each product rounded once and never fused into the next add (`mul_rn`), so the Gluon
    # kernels (ops/gluon/scores.py) form the same s2 and either family recomputes the other's P
    if HAS_SOFTCAP:
        t = tanh(qk * (scale / softcap))
        s2 = mul_rn(t, softcap * LOG2E)
    else:
        s2 = mul_rn(qk, scale * LOG2E)
        t = s2
    if HAS_ALIBI:
        # -slope * |i + off - j|, in log2 units
        s2 = s2 - mul_rn(tl.abs((i2 + off - j2).to(tl.float32)), slope * LOG2E)
    m_in = (i2 < Sq) & (j2 < Sk)
    if HAS_MASK:
        p_mask = (MASK + tl.cast(b, tl.int64) * stride_mb + h * stride_mh
                  + i2.to(tl.int64) * stride_mm + j2 * stride_mn)
        if MASK_BOOL:
            keep = tl.load(p_mask, mask=m_in, other=0)
            s2 = tl.where(keep != 0, s2, float("-inf"))
        else:
            bias = tl.load(p_mask, mask=m_in, other=0.0).to(tl.float32)
            s2 = s2 + bias * LOG2E
    if CHECK:
        # absolute query position i + off against key j
        pos = i2 + off
        if HAS_WR:
            m_in = m_in & (j2 <= pos + win_right)
        if HAS_WL:
            m_in = m_in & (j2 >= pos - win_left)
        s2 = tl.where(m_in, s2, float("-inf"))
    return s2, t


@triton.jit
def load_tile(ptrs, o_r, n_rows, o_c, n_cols, CHECK: tl.constexpr, FULL: tl.constexpr):
    """An operand tile whose rows o_r are sequence positions (valid below n_rows) and whose
    columns o_c are head-dim indices (valid below n_cols); ptrs, o_r and o_c are already
    broadcast to the tile's shape, in either orientation.  Out-of-range entries read 0.
    CHECK=False: every row is known to be in range; with FULL as well (the head dim
    fills its padded width) the load needs no mask at all."""
    if CHECK:
        t = tl.load(ptrs, mask=(o_r < n_rows) & (o_c < n_cols), other=0.0)
    elif FULL:
        t = tl.load(ptrs)
    else:
        t = tl.load(ptrs, mask=o_c < n_cols, other=0.0)
    return t


@triton.jit
def exp2_fma(x):
    """2^x for finite x <= 0 without the special-function unit (MUFU, 16 results a clock
    per SM on sm_90, against 128 FMAs): x = j + f with j = round(x), f in [-0.5, 0.5]; 2^f
    by a degree-3 polynomial (relative error < 7.5e-5, under fp16 / bf16 rounding of P);
    j added to the result's exponent bits.  x is clamped at -125 (2^-125 ~ 2e-38 for 0)."""
    x = tl.maximum(x, -125.0)
    t = x + 12582912.0  # 1.5 * 2^23: x rounded to an integer, held in t's low mantissa bits
    j = t - 12582912.0
    f = x - j
    p = 0.99992806 + f * (0.69326097 + f * (0.24261115 + f * 0.05517166))
    # (bits of t) << 23 keeps exactly j's low 9 bits as an exponent increment (two's complement)
    bits = p.to(tl.int32, bitcast=True) + (t.to(tl.int32, bitcast=True) << 23)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def exp2_split(x, POLY: tl.constexpr, BLOCK_N: tl.constexpr):
    """2^x of a [BM, BN] tile with the work shared between units: POLY = 0 all on MUFU
    (tl.exp2), 1 every other column through `exp2_fma`, 2 all through `exp2_fma`."""
    if POLY == 0:
        y = tl.exp2(x)
    elif POLY == 2:
        y = exp2_fma(x)
    else:
        a, b = tl.split(tl.reshape(x, [x.shape[0], BLOCK_N // 2, 2]))
        y = tl.reshape(tl.join(tl.exp2(a), exp2_fma(b)), [x.shape[0], BLOCK_N])
    return y


@triton.jit
def batch_head(ORDER, pid, H, IS_VARLEN: tl.constexpr):
    """(b, h) of the grid's axis-1 index pid over (batch, H heads).  A packed batch takes
    its sequences longest first (ORDER: batch indices sorted by length, descending), so
    that the grid's tail is made of short sequences; the GPU starts programs in index order."""
    i = pid // H
    h = pid % H
    if IS_VARLEN:
        b = tl.load(ORDER + i)
    else:
        b = i
    return b, h


@triton.jit
def seq_bounds(CU_Q, CU_K, b, Sq, Sk, IS_VARLEN: tl.constexpr, HAS_SEQLENS_K: tl.constexpr = False, k_add=0):
    """(q_start, Sq_b, k_start, Sk_b): where sequence b's rows start in the packed
    tensors and how many there are.  Dense batches: (0, Sq, 0, Sk); with
    HAS_SEQLENS_K (a KV cache), CU_K holds each batch row's key count instead, to which
    k_add (the keys this call appended) is added.
    Bounds are clamped into the tensors (unchecked device values must not move a load or a
    store outside them): a packed sequence to rows [clamp(cu[b], 0, total), clamp(cu[b+1],
    start, total)) of the Sq / Sk packed rows, a KV-cache row's key count to [0, Sk], its
    capacity.  Scalar work, once per program."""
    if IS_VARLEN:
        q_start = tl.minimum(tl.maximum(tl.load(CU_Q + b), 0), Sq)
        Sq_b = tl.minimum(tl.maximum(tl.load(CU_Q + b + 1), q_start), Sq) - q_start
        k_start = tl.minimum(tl.maximum(tl.load(CU_K + b), 0), Sk)
        Sk_b = tl.minimum(tl.maximum(tl.load(CU_K + b + 1), k_start), Sk) - k_start
    else:
        q_start = 0
        Sq_b = Sq
        k_start = 0
        if HAS_SEQLENS_K:  # clamped before k_add is added: a count near the int range must not wrap
            Sk_b = tl.minimum(tl.minimum(tl.maximum(tl.load(CU_K + b), -k_add), Sk).to(tl.int32) + k_add, Sk)
        else:
            Sk_b = Sk
    return q_start, Sq_b, k_start, Sk_b


@triton.jit
def lse_row0(b, h, Hq, rows, q_start, IS_VARLEN: tl.constexpr):
    """Offset of row 0 of (b, h) in lse-shaped tensors (lse, delta, dlse): dense
    [B, Hq, Sq] (rows = Sq), or packed [Hq, total_q] (rows = total_q), flash-attn's
    varlen layout."""
    if IS_VARLEN:
        row0 = tl.cast(h, tl.int64) * rows + q_start
    else:
        row0 = tl.cast(b * Hq + h, tl.int64) * rows
    return row0


@triton.jit
def _clamp(x, lo, hi):
    return tl.minimum(tl.maximum(x, lo), hi)


@triton.jit
def load_offset(OFFSETS, b, offset, Sq_b, Sk_b, win_left, win_right, OFFSET_PER_BATCH: tl.constexpr,
                OFFSET_BR: tl.constexpr, HAS_WL: tl.constexpr, HAS_WR: tl.constexpr, HAS_ALIBI: tl.constexpr):
    """(off, win_left, win_right): query i's absolute position is i + off, the scalar or
    per-batch offset, plus Sk_b - Sq_b when aligned bottom-right (flash-attn's convention).

    An int offset and its window sides were folded on the host into int32-safe values
    (`flashforge.api.validate.canonical_visibility`).  A per-batch one (int32 or int64, read
    here) is folded with the sides the same way, per sequence: visibility depends only on
    off + right and off - left against j - i, which lies in (-n, n) for n = Sq_b + Sk_b, so
    both clamp to [-n, n] and the offset to [-n, n] between them (with ALiBi, whose distance
    uses the offset itself, only to +-SAFE_INDEX), in int64 from values within +-MAX_OFFSET.
    The same keys stay visible and every index sum of the kernel fits int32.  Scalar work."""
    if OFFSET_PER_BATCH:
        off = _clamp(tl.load(OFFSETS + b).to(tl.int64), -MAX_OFFSET, MAX_OFFSET)
        if OFFSET_BR:
            off = off + Sk_b - Sq_b
        n = (Sq_b + Sk_b).to(tl.int64)
        if HAS_ALIBI:
            off_c = _clamp(off, -SAFE_INDEX, SAFE_INDEX)
        else:
            off_c = _clamp(off, -n, n)
        if HAS_WR:
            win_right = tl.maximum(_clamp(off + win_right, -n, n) - off_c, 0).to(tl.int32)
        if HAS_WL:
            win_left = tl.maximum(off_c - _clamp(off - win_left, -n, n), 0).to(tl.int32)
        off = off_c.to(tl.int32)
    else:
        off = offset
        if OFFSET_BR:
            off = off + Sk_b - Sq_b
    return off, win_left, win_right


@triton.jit
def key_rows(o_n, Sk, BT, stride_page, stride_row, n_pages, PAGED: tl.constexpr, PAGE: tl.constexpr):
    """int64 offsets of key rows o_n: row * stride, or, in a paged cache, through
    the block table BT (already at this batch row): block * stride_page + row in block,
    the block clamped to [0, n_pages) (an unchecked entry must not leave the cache)."""
    if PAGED:
        blk = tl.load(BT + o_n // PAGE, mask=o_n < Sk, other=0)
        blk = _clamp(blk, 0, n_pages - 1).to(tl.int64)
        rows = blk * stride_page + (o_n % PAGE).to(tl.int64) * stride_row
    else:
        rows = o_n.to(tl.int64) * stride_row
    return rows


@triton.jit
def load_slope(ALIBI, b, h, stride_ab, stride_ah, HAS_ALIBI: tl.constexpr):
    """The ALiBi slope of (b, h); 0.0 (unused) without ALiBi."""
    if HAS_ALIBI:
        slope = tl.load(ALIBI + b * stride_ab + h * stride_ah)
    else:
        slope = 0.0
    return slope


@triton.jit
def key_range(q_first, q_last, off, win_left, win_right, Sk, BLOCK_N: tl.constexpr,
              HAS_WL: tl.constexpr, HAS_WR: tl.constexpr):
    """Keys [lo, hi) that any query at positions q_first .. q_last can see;
    lo is aligned to BLOCK_N (dropout draws keys in aligned groups of four)."""
    lo = 0
    hi = Sk
    if HAS_WR:
        hi = tl.minimum(hi, q_last + 1 + off + win_right)
    if HAS_WL:
        lo = tl.maximum(lo, q_first + off - win_left)
        lo = (lo // BLOCK_N) * BLOCK_N
    return lo, hi


@triton.jit
def full_key_range(q_first, q_last, off, win_left, win_right, Sk, lo, hi, BLOCK_N: tl.constexpr,
                   HAS_WL: tl.constexpr, HAS_WR: tl.constexpr):
    """The tiles of [lo, hi) (lo aligned to BLOCK_N) that every query at positions
    q_first .. q_last sees in full: keys [full_lo, full_hi), both on tile boundaries.
    Tiles there need no range or window test (about a fifth of a tile's arithmetic)."""
    full_hi = (Sk // BLOCK_N) * BLOCK_N
    if HAS_WR:
        # the first query sees keys up to q_first + off + win_right
        full_hi = tl.minimum(full_hi, (tl.maximum(q_first + off + win_right + 1, 0) // BLOCK_N) * BLOCK_N)
    full_lo = lo
    if HAS_WL:
        # the last query sees keys from q_last + off - win_left
        first = tl.maximum(q_last + off - win_left, 0)
        full_lo = tl.maximum(full_lo, ((first + BLOCK_N - 1) // BLOCK_N) * BLOCK_N)
    full_lo = tl.minimum(full_lo, hi)
    full_hi = tl.minimum(tl.maximum(full_hi, full_lo), hi)
    return full_lo, full_hi


@triton.jit
def query_range(n_start, off, win_left, win_right, Sq, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                HAS_WL: tl.constexpr, HAS_WR: tl.constexpr):
    """Queries [lo, hi) that can see any of the keys n_start .. n_start+BLOCK_N-1;
    lo is aligned to BLOCK_M."""
    lo = 0
    hi = Sq
    if HAS_WR:
        lo = tl.maximum(lo, n_start - off - win_right)
        lo = (lo // BLOCK_M) * BLOCK_M
    if HAS_WL:
        hi = tl.minimum(hi, n_start + BLOCK_N - off + win_left)
    return lo, hi


@triton.jit
def full_query_range(n_start, off, win_left, win_right, Sq, Sk, lo, hi, BLOCK_M: tl.constexpr,
                     BLOCK_N: tl.constexpr, HAS_WL: tl.constexpr, HAS_WR: tl.constexpr):
    """The query tiles of [lo, hi) (lo aligned to BLOCK_M) whose every query sees every key
    of the tile n_start .. n_start+BLOCK_N-1 (`full_key_range` with the roles swapped):
    [full_lo, full_hi), both on tile boundaries or at hi.  Empty when the key tile
    runs past Sk."""
    full_lo = lo
    full_hi = (Sq // BLOCK_M) * BLOCK_M
    if HAS_WR:
        # query i sees keys up to i + off + win_right: the tile's last key needs
        # i >= n_start + BLOCK_N - 1 - off - win_right
        first = tl.maximum(n_start + BLOCK_N - 1 - off - win_right, 0)
        full_lo = tl.maximum(full_lo, ((first + BLOCK_M - 1) // BLOCK_M) * BLOCK_M)
    if HAS_WL:
        # query i sees keys from i + off - win_left: the tile's first key needs
        # i <= n_start - off + win_left
        full_hi = tl.minimum(full_hi, (tl.maximum(n_start - off + win_left + 1, 0) // BLOCK_M) * BLOCK_M)
    full_lo = tl.minimum(full_lo, hi)
    full_hi = tl.minimum(tl.maximum(full_hi, full_lo), hi)
    full_hi = tl.where(n_start + BLOCK_N <= Sk, full_hi, full_lo)
    return full_lo, full_hi
