"""How the sm_90 Gluon kernels round the softmax's exponent, exactly as the portable kernels
do (ops/triton/common.py `fused_score`): for bfloat16 one fused multiply-add from the raw
product, ``fma(s, c, -shift)``; for float16 the score as one float32 product never fused into
the subtraction that follows (`mul_rn`), so no unnormalised weight exceeds 1 (float16's range
ends at 2**16).  Either way a Gluon forward and a portable backward (or the reverse) recompute
the same P even where scores reach 1e7 and lse's ulp is 1 (`flashforge.ops.params`,
"Log-sum-exp for the backward")."""
from triton import constexpr_function
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from ..triton.common import fused_score  # (one rule for both families)

LOG2E = gl.constexpr(1.4426950408889634)
LN2 = gl.constexpr(0.6931471805599453)


@gluon.jit
def mul_rn(a, b):
    """a * b rounded once and never fused into a neighbouring add (`mul.rn`)."""
    return gl.inline_asm_elementwise("mul.rn.f32 $0, $1, $2;", "=r,r,r", [a, gl.zeros_like(a) + b],
                                     dtype=gl.float32, is_pure=True, pack=1)


@gluon.jit
def fms_rn(a, b, c):
    """a * b - c rounded once (`fma.rn`); b a scalar, c broadcast to a's shape.  The negation sits
    inside the asm, where ptxas folds it into the FFMA's operand: negated outside, it would be one
    more instruction per element of c's broadcast."""
    return gl.inline_asm_elementwise("{ .reg .f32 t; neg.f32 t, $3; fma.rn.f32 $0, $1, $2, t; }", "=r,r,r,r",
                                     [a, gl.zeros_like(a) + b, c], dtype=gl.float32, is_pure=True, pack=1)


@constexpr_function
def backward_fuse(dtype, NEAR, HAS_SOFTCAP=False, HAS_ALIBI=False):
    """FUSE for a Gluon backward: `fused_score`'s rule, and float16 fused too where NEAR (the first
    of lse_lo's launches, whose programs have every |lse2| below LO_FROM = 256).

    Why float16 may fuse there: a weight float16 holds (>= 2**-24) has its exponent within 24 of
    lse2, so |score| < 2**9, and the product's rounding that the forward keeps (`fused_score`)
    moves such a score by at most ulp / 2 = 2**-16: fused, the backward's P differs from the
    forward's by under 2**-16 in the exponent (1.1e-5 relative) and stays at most 2**(2**-16),
    which float16 holds.  Past LO_FROM the ulp grows with lse2, so those programs stay rounded.
    (The forward stays rounded: fusing it near 0 measured slower, benchmarks/RESULTS.md v0.9.17.)"""
    return bool(fused_score(dtype, HAS_SOFTCAP=HAS_SOFTCAP, HAS_ALIBI=HAS_ALIBI)
                or (NEAR and dtype == gl.float16 and not (HAS_SOFTCAP or HAS_ALIBI)))


@gluon.jit
def exponent(s, c, shift, FUSE: gl.constexpr):
    """P's exponent s * c - shift (log2 units) from the raw float32 product s: fused where FUSE
    (`fused_score`), else the product rounded first."""
    if FUSE:
        x = fms_rn(s, c, shift)
    else:
        x = mul_rn(s, c) - shift
    return x


@gluon.jit
def exp2_fma(x):
    """2^x for finite x <= 0 on the FMA pipes, as the portable kernels' `common.exp2_fma` (the same
    polynomial and bit trick, so both families give the same P): the special-function unit does 16
    exp2 a clock per SM on sm_90, and at D = 64 a tile's exponentials take as long as its two
    products on the tensor cores.  x is clamped at -125 (2^-125 ~ 2e-38 stands for 0)."""
    x = gl.maximum(x, -125.0)
    t = x + 12582912.0  # 1.5 * 2^23: x rounded to an integer, held in t's low mantissa bits
    j = t - 12582912.0
    f = x - j
    p = 0.99992806 + f * (0.69326097 + f * (0.24261115 + f * 0.05517166))
    # (bits of t) << 23 keeps exactly j's low 9 bits as an exponent increment (two's complement)
    bits = p.to(gl.int32, bitcast=True) + (t.to(gl.int32, bitcast=True) << 23)
    return bits.to(gl.float32, bitcast=True)


@gluon.jit
def exp2_split(x, POLY: gl.constexpr, layout: gl.constexpr):
    """2^x of a [BM, BN] tile in `layout` (a wgmma accumulator's), the work shared between units:
    POLY = 0 all on the special-function unit, 1 every other column through `exp2_fma`, 2 all.
    The column pairs split here are held by one thread in a wgmma accumulator, so the split and
    the join move no data between threads."""
    if POLY == 0:
        y = gl.exp2(x)
    elif POLY == 2:
        y = exp2_fma(x)
    else:
        a, b = gl.split(gl.reshape(x, [x.shape[0], x.shape[1] // 2, 2]))
        y = gl.convert_layout(gl.reshape(gl.join(gl.exp2(a), exp2_fma(b)), [x.shape[0], x.shape[1]]), layout)
    return y
