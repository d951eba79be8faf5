"""How the sm_90 Gluon kernels round the softmax's exponent, exactly as the portable kernels
do (ops/triton/common.py `fused_score`): for bfloat16 one fused multiply-add from the raw
product, ``fma(s, c, -shift)``; for float16 the score as one float32 product never fused into
the subtraction that follows (`mul_rn`), so no unnormalised weight exceeds 1 (float16's range
ends at 2**16).  Either way a Gluon forward and a portable backward (or the reverse) recompute
the same P even where scores reach 1e7 and lse's ulp is 1 (`flashforge.ops.params`,
"Log-sum-exp for the backward")."""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from ..triton.common import fused_score  # noqa: F401  (one rule for both families)

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


@gluon.jit
def exponent(s, c, shift, FUSE: gl.constexpr):
    """P's exponent s * c - shift (log2 units) from the raw float32 product s: fused where FUSE
    (`fused_score`), else the product rounded first."""
    if FUSE:
        x = fms_rn(s, c, shift)
    else:
        x = mul_rn(s, c) - shift
    return x
