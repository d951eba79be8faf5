"""Scores with a modifier (softcap, ALiBi) in the sm_90 Gluon kernels, formed exactly as the
portable kernels' `score_tile` forms them (ops/triton/common.py), so that a Gluon forward and a
portable backward (or the reverse) recompute the same P:

    softcap:  t = tanh(qk * (scale / softcap)),  s2 = mul_rn(t, softcap * LOG2E)
    plain:    s2 = mul_rn(qk, scale * LOG2E)
    ALiBi:    s2 -= mul_rn(|i + offset - j|, slope * LOG2E)

in log2 units; P's exponent is then s2 - shift, never fused (`fused_score` is False with either
modifier).  t is kept for the softcap gradient, dS * (1 - t^2)."""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from .rounding import LOG2E, mul_rn


@gluon.jit
def tanh(x):
    """The portable kernels' tanh (ops/triton/common.py), operation for operation: saturates at
    +-1 for large |x| (exp2 overflows to inf, 2 / inf = 0)."""
    return 1.0 - 2.0 / (gl.exp2(x * (2.0 * LOG2E)) + 1.0)


@gluon.jit
def modified_score(s, i2, j2, qk_scale, scale, softcap, slope, alibi_off, HAS_SOFTCAP: gl.constexpr,
                   HAS_ALIBI: gl.constexpr):
    """(s2, t) of the raw float32 products s for query indices i2 and key indices j2 (broadcastable
    to s's shape); alibi_off: the call's own offset (the kernels' offset less a window's right
    side), so the distance is the portable kernels' |i + off - j|."""
    if HAS_SOFTCAP:
        t = tanh(s * (scale / softcap))
        s2 = mul_rn(t, softcap * LOG2E)
    else:
        s2 = mul_rn(s, qk_scale)
        t = s2
    if HAS_ALIBI:
        s2 = s2 - mul_rn(gl.abs((i2 + alibi_off - j2).to(gl.float32)), slope * LOG2E)
    return s2, t
