"""Gradients at the logits of a diverging run (|q|, |k| ~ 1e2-1e4, scores 1e6-1e8), Triton
kernels (issue 19, part 2).  There one ulp of a float32 lse is 0.06-8, so P recomputed from
lse alone is off by up to e**8 per row; the forward also writes lse's low part (`lse_lo`,
`flashforge.ops.params`) and the backward adds it back.  Checks: with dO = 1 each key's
``dv`` sums the probabilities it received, so ``dv.sum(over keys) == Sq`` exactly when every
row of P sums to 1; and dq, dk, dv against the float64 reference.  Pairs of identical keys
make ties at each row's maximum (l = 2 there), where a rounded lse visibly loses log2(l).

Under the interpreter a fixture makes the dot products order-independent: numpy's float32
matmul (BLAS) sums each product in an order that depends on the operand shapes, so the
forward's q.k and the dK/dV kernel's k.q differ in the last bit, which at 1e7 is itself a
factor of e in P.  The GPU's MMA sums the same products alike in either orientation (the
GPU test below has no such fixture).  The CPU path has its own test (test_attention_torch).
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

import flashforge
from flashforge import reference
from helpers import HAS_TRITON, INTERPRET

needs_triton = pytest.mark.skipif(not (HAS_TRITON and (INTERPRET or torch.cuda.is_available())),
                                  reason="triton is not installed, or neither CUDA nor TRITON_INTERPRET=1")
DEVICE = "cuda" if torch.cuda.is_available() and not INTERPRET else "cpu"
TOL = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 3e-2}
# the column sums of dv: P is 1 or 1/2 at the tied maxima, exact in every dtype
SUM_TOL = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 4e-3}


@pytest.fixture
def consistent_dots(monkeypatch):
    """Under the interpreter: every tl.dot from float64 sums, rounded once (see the module docstring)."""
    if not INTERPRET:
        return
    from triton.runtime import interpreter

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        out = np.matmul(a.data.astype(np.float64), b.data.astype(np.float64)).astype(d.data.dtype)
        return interpreter.TensorHandle(out + d.data, d.dtype.scalar)

    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_dot", create_dot)


def _check(dtype, magnitude, *, B=1, S=16, Hq=2, Hkv=2, D=16, causal=False, ties=True, seed=0):
    """magnitude: a number, or one per (batch, KV head) as nested lists [B][Hkv] (each GQA group
    then gets its own size, and is checked against the reference on its own)."""
    gen = torch.Generator().manual_seed(seed)
    mags = torch.as_tensor(magnitude, dtype=torch.float32).expand(B, Hkv)
    group = Hq // Hkv
    q = torch.randn(B, S, Hq, D, generator=gen) * mags.repeat_interleave(group, dim=1)[:, None, :, None]
    k = torch.randn(B, S, Hkv, D, generator=gen) * mags[:, None, :, None]
    if ties:
        k[:, 1::2] = k[:, 0::2]
    v = torch.randn(B, S, Hkv, D, generator=gen)
    leaves = [t.to(DEVICE, dtype).requires_grad_() for t in (q, k, v)]
    o, lse = flashforge.attention(*leaves, causal=causal, backend="triton", return_lse=True)
    o.backward(torch.ones_like(o))
    ref_leaves = [t.detach().double().cpu().requires_grad_() for t in leaves]
    ref_o, ref_lse = reference.attention(*ref_leaves, causal=causal, return_lse=True)
    ref_o.backward(torch.ones_like(ref_o))

    col = leaves[2].grad.double().cpu().sum(dim=1)  # [B, Hkv, D]: each of Hq // Hkv heads sums to S
    torch.testing.assert_close(col, torch.full_like(col, S * Hq // Hkv), rtol=SUM_TOL[dtype], atol=0,
                               msg="rows of P do not sum to 1")
    if isinstance(magnitude, (int, float)):
        parts = [(slice(None), slice(None), slice(None), float(magnitude))]
    else:
        parts = [(b, slice(h * group, (h + 1) * group), slice(h, h + 1), float(mags[b, h]))
                 for b in range(B) for h in range(Hkv)]
    grads = [t.grad.double().cpu() for t in leaves]
    refs = [t.grad for t in ref_leaves]
    for b, hq, hk, mag in parts:
        # lse carries the float32 dot product's own rounding: D terms of size magnitude^2 (H200: up
        # to 6 at 1e3, D = 40, in a causal row of two keys), so an absolute bound in magnitude^2
        torch.testing.assert_close(lse.double().cpu()[b, hq], ref_lse[b, hq], rtol=1e-6,
                                   atol=2e-5 * mag ** 2 * D ** 0.5)
        # dq and dk are sums of terms of size ~magnitude that cancel at ties: errors are measured
        # against that size (an rms of `magnitude` per element), o and dv against 1
        for name, ours, ref, size in (("o", o.double().cpu()[b, :, hq], ref_o[b, :, hq], 1.0),
                                      ("dq", grads[0][b, :, hq], refs[0][b, :, hq], mag),
                                      ("dk", grads[1][b, :, hk], refs[1][b, :, hk], mag),
                                      ("dv", grads[2][b, :, hk], refs[2][b, :, hk], 1.0)):
            if dtype == torch.float16:
                # at 1e4 the exact dk can pass float16's largest value (65504; H200: 1.1e5 at D = 128), and
                # inf is then its correct rounding: both sides are compared clipped to the float16 range
                big = torch.finfo(torch.float16).max
                assert torch.isfinite(ours[ref.abs() < big / 2]).all(), f"{name}: non-finite where the exact value fits"
                ours, ref = ours.clamp(-big, big), ref.clamp(-big, big)
            err = (ours - ref).norm() / max(ref.norm(), size * ref.numel() ** 0.5)
            assert err < TOL[dtype], f"{name} (batch {b}, heads {hq}): relative error {err:.2e} >= {TOL[dtype]}"


@needs_triton
@pytest.mark.parametrize("dtype,magnitude", [(torch.float16, 3e2), (torch.float16, 1e4), (torch.float32, 1e3),
                                             (torch.float32, 1e4)], ids=["fp16-3e2", "fp16-1e4", "fp32-1e3", "fp32-1e4"])
@pytest.mark.parametrize("causal", [False, True])
def test_extreme_logits_kernels(consistent_dots, dtype, magnitude, causal):
    # (bfloat16 runs on the GPU only: the interpreter's bfloat16 is not faithful)
    _check(dtype, magnitude, causal=causal)


@needs_triton
def test_extreme_logits_gqa_without_ties(consistent_dots):
    _check(torch.float32, 1e4, Hq=4, Hkv=2, ties=False, causal=True, seed=3)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,magnitude", [(torch.float16, 1e4), (torch.bfloat16, 3e3), (torch.float32, 1e3),
                                             (torch.float32, 1e4)], ids=["fp16-1e4", "bf16-3e3", "fp32-1e3", "fp32-1e4"])
@pytest.mark.parametrize("D,S", [(40, 80), (64, 128), (128, 200), (256, 150)],
                         ids=["portable-D40", "D64", "D128", "D256"])
@pytest.mark.parametrize("causal", [False, True])
def test_extreme_logits_gpu(dtype, magnitude, D, S, causal):
    """D = 64 / 128 / 256 with 16-bit inputs and >= 64 rows take the sm_90 Gluon kernels on an
    H100/H200 (D = 256: dV and dK in two launches of the dK/dV kernel, each with its far pass)."""
    _check(dtype, magnitude, B=2, S=S, Hq=4, Hkv=2, D=D, causal=causal)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("D", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
def test_extreme_logits_gpu_mixed_groups(dtype, D, causal):
    """Far and ordinary GQA groups in one call: the sm_90 dK/dV kernel's first launch computes the
    ordinary groups and marks the far ones, its second launch computes those (with lse_lo).  A
    block computed by neither, or by the wrong launch, fails the per-group checks."""
    _check(dtype, [[3e3 if dtype == torch.bfloat16 else 1e4, 1.0], [1.0, 3e2]], B=2, S=200, Hq=4, Hkv=2, D=D,
           causal=causal)
