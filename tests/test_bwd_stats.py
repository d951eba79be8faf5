"""The preprocess kernel's statistics for the sm_90 fused dK/dV kernels (`triton.attention.gluon_stats`):
lse in log2 units, bitwise what those kernels computed from lse themselves (fl32(lse * log2 e), a
row that sees no key as 0), and with lse_lo the flags of the GQA groups with a row whose |lse2|
reaches LO_FROM (the flags the dK/dV kernels scanned lse for); and `dq_from_acc`, the fused
backward's dQ from its unscaled float32 accumulator.  The kernels run in the Triton interpreter
on the CPU, as they are on a GPU."""
import pytest
import torch

from flashforge.ops.launch import cdiv
from flashforge.ops.triton import attention as launchers
from flashforge.ops.triton.attention_bwd import attn_bwd_preprocess_kernel
from helpers import HAS_TRITON, INTERPRET

pytestmark = pytest.mark.skipif(not (HAS_TRITON and (INTERPRET or torch.cuda.is_available())),
                                reason="needs triton, with CUDA or TRITON_INTERPRET=1")
DEV = "cuda" if torch.cuda.is_available() and not INTERPRET else "cpu"
LOG2E = 1.4426950408889634
LO_FROM = 256.0


def _preprocess(o, do, lse, group, cu=None, far=True, block_m=16):
    """Run the preprocess kernel with HAS_LSE2 (and HAS_FAR) on dense [B, S, H, Dv] or packed
    [1, total, H, Dv] (cu: the sequences' bounds); (delta, lse2, far flags)."""
    vl = cu is not None
    B = cu.numel() - 1 if vl else o.shape[0]
    Hq, Dv = o.shape[2], o.shape[3]
    Sq = int((cu[1:] - cu[:-1]).max()) if vl else o.shape[1]
    rows = lse.shape[-1]
    delta = torch.full_like(lse, float("nan"))
    lse2 = torch.full_like(lse, float("nan"))
    flags = torch.zeros(B * (Hq // group), dtype=torch.int32, device=o.device)

    def strides(x):
        return (0, x.stride(1), x.stride(2)) if vl else (x.stride(0), x.stride(1), x.stride(2))
    attn_bwd_preprocess_kernel[(cdiv(Sq, block_m), B * Hq)](
        o, do, delta, delta, cu if vl else o, lse, lse2, flags, *strides(o), *strides(do), Hq,
        rows if vl else Sq, group, Dv, HAS_DLSE=False, IS_VARLEN=vl, BLOCK_M=block_m, BLOCK_DV=16,
        HAS_LSE2=True, HAS_FAR=far)
    return delta, lse2, flags


def _expected_lse2(lse):
    return torch.where(lse == float("-inf"), torch.zeros_like(lse), lse * torch.tensor(LOG2E, dtype=torch.float32))


def test_lse2_is_bitwise_the_kernels_own_and_far_marks_each_group():
    gen = torch.Generator().manual_seed(3)
    B, S, Hq, group, Dv = 2, 37, 4, 2, 12
    o = torch.randn(B, S, Hq, Dv, generator=gen).to(DEV)
    do = torch.randn(B, S, Hq, Dv, generator=gen).to(DEV)
    lse = (torch.randn(B, Hq, S, generator=gen) * 50).to(DEV)
    lse[0, 1, 5] = float("-inf")  # a row that sees no key
    lse[1, 3, 36] = -200.0  # |lse2| = 288.5: batch 1's second group is far, from its last row
    lse[0, 0, 2] = LO_FROM / LOG2E * 0.999  # near, just
    delta, lse2, flags = _preprocess(o, do, lse, group)
    assert torch.equal(lse2, _expected_lse2(lse))
    assert lse2[0, 1, 5] == 0
    torch.testing.assert_close(delta, (o.double() * do.double()).sum(-1).transpose(1, 2).float(), rtol=1e-5, atol=1e-5)
    assert flags.tolist() == [0, 0, 0, 1]


def test_far_flags_varlen_and_a_group_with_one_far_row():
    gen = torch.Generator().manual_seed(4)
    cu = torch.tensor([0, 5, 29, 40], dtype=torch.int32)
    total, Hq, group, Dv = 40, 3, 3, 8
    o = torch.randn(1, total, Hq, Dv, generator=gen).to(DEV)
    do = torch.randn(1, total, Hq, Dv, generator=gen).to(DEV)
    lse = (torch.randn(Hq, total, generator=gen) * 10).to(DEV)
    lse[2, 20] = 400.0  # sequence 1 (rows 5..28), head 2: its only group is far
    delta, lse2, flags = _preprocess(o, do, lse, group, cu=cu.to(DEV))
    assert torch.equal(lse2, _expected_lse2(lse))
    assert flags.tolist() == [0, 1, 0]
    # without lse_lo (HAS_FAR=False) the flags are not touched
    _, _, untouched = _preprocess(o, do, lse, group, cu=cu.to(DEV), far=False)
    assert untouched.tolist() == [0, 0, 0]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_dq_from_acc_scales_once_and_rounds_once(dtype):
    gen = torch.Generator().manual_seed(5)
    acc = (torch.randn(2, 4099, 3, 5, generator=gen) * 30).to(DEV)  # not a multiple of the block
    before = acc.clone()
    dq = launchers.dq_from_acc(acc, 0.125 ** 0.5, dtype)
    assert dq.dtype == dtype and dq.shape == acc.shape and dq.is_contiguous()
    want = (acc * (0.125 ** 0.5)).to(dtype)
    if dtype == torch.bfloat16 and INTERPRET:
        # the interpreter's bfloat16 stores truncate (the GPU's round to nearest even): one ulp
        assert ((dq.float() - want.float()).abs() <= want.float().abs() * 2.0 ** -7).all()
    else:
        assert torch.equal(dq, want)
    assert torch.equal(acc, before)  # the accumulator is read, not scaled in place
