"""How the sm_90 Gluon kernels round the softmax's exponent, exactly as the portable kernels
do (ops/triton/common.py `mul_rn`): each score is one float32 product never fused into the
subtraction that follows, so that a Gluon forward and a portable backward (or the reverse)
recompute the same P even where scores reach 1e7 and lse's ulp is 1, and no unnormalised weight
exceeds 1 (`flashforge.ops.params`, "Log-sum-exp for the backward")."""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

LOG2E = gl.constexpr(1.4426950408889634)
LN2 = gl.constexpr(0.6931471805599453)


@gluon.jit
def mul_rn(a, b):
    """a * b rounded once and never fused into a neighbouring add (`mul.rn`)."""
    return gl.inline_asm_elementwise("mul.rn.f32 $0, $1, $2;", "=r,r,r", [a, gl.zeros_like(a) + b],
                                     dtype=gl.float32, is_pure=True, pack=1)
