"""The dropout keep-mask: one counter-based (Philox) definition, bit-identical in
`flashforge.dropout_mask`, the CPU path, the Triton kernels (GPU or interpreter)."""
import math

import pytest
import torch

import flashforge
from flashforge.ops.dropout import keep_threshold, philox4x32
from helpers import HAS_TRITON, attention_keep_mask, backend_device, backend_params

BACKENDS = backend_params()


def test_philox_known_answers():
    """Philox-4x32-10 known-answer vectors of Random123 (kat_vectors): the mask is standard Philox,
    so `tl.philox` and this PyTorch implementation can agree."""
    def run(key, ctr):
        c = [torch.tensor(x, dtype=torch.int64) for x in ctr]
        return [int(x) for x in philox4x32(key, *c)]

    assert run(0, [0, 0, 0, 0]) == [0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8]
    assert run(0xFFFFFFFF_FFFFFFFF, [0xFFFFFFFF] * 4) == [0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD]
    assert run(0x299F31D0_A4093822, [0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344]) == [
        0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1]


def test_mask_is_pure_function_of_position():
    """Entry (b, h, i, j) does not depend on the shape it is drawn in."""
    big = flashforge.dropout_mask(5, 3, 4, 20, 37, 0.3)
    small = flashforge.dropout_mask(5, 2, 4, 7, 11, 0.3)
    # same (b*H + h) numbering needs the same H; rows and columns are absolute
    assert torch.equal(big[:2, :, :7, :11], small)
    assert big.shape == (3, 4, 20, 37) and big.dtype == torch.bool


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("seed, B, Hq, Hkv, Sq, Sk, p", [
    pytest.param(0, 1, 1, 1, 1, 1, 0.5, id="1x1"),
    pytest.param(1234, 2, 3, 3, 19, 37, 0.3, id="odd-sizes"),
    pytest.param(2**40 + 17, 1, 4, 2, 33, 64, 0.5, id="seed>2**32-gqa"),
    pytest.param(2**63 - 1, 2, 2, 1, 5, 130, 0.1, id="max-seed-long-rows"),
    pytest.param(99, 1, 2, 2, 70, 9, 0.9, id="p0.9-Sq>Sk"),
])
def test_attention_uses_dropout_mask(backend, seed, B, Hq, Hkv, Sq, Sk, p):
    keep = attention_keep_mask(backend, backend_device(backend), seed, B, Hq, Hkv, Sq, Sk, p)
    assert torch.equal(keep, flashforge.dropout_mask(seed, B, Hq, Sq, Sk, p))


if HAS_TRITON:
    import triton
    import triton.language as tl

    from flashforge.ops.triton.dropout import dropout_keep

    @triton.jit
    def _keep_kernel(out, seed, threshold, Sq, Sk, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        """Writes dropout_keep's tiles as int8 into out [B*H, Sq, Sk]."""
        bh = tl.program_id(2)
        offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        keep = dropout_keep(seed, threshold, bh, offs_m, offs_n, BLOCK_M, BLOCK_N)  # [BLOCK_M, BLOCK_N]
        m_in = (offs_m[:, None] < Sq) & (offs_n[None, :] < Sk)
        tl.store(out + bh * Sq * Sk + offs_m[:, None] * Sk + offs_n[None, :], keep.to(tl.int8), mask=m_in)


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_triton_twin_matches_torch():
    """`flashforge.ops.triton.dropout.dropout_keep` tile by tile against the PyTorch definition,
    for several tile shapes, seeds with a high word, and tiles starting away from key 0."""
    device = backend_device("triton")
    B, H, Sq, Sk = 2, 3, 21, 45
    for seed, p, bm, bn in [(0, 0.5, 16, 16), (7, 0.3, 16, 32), (2**33 + 5, 0.1, 32, 64), (2**62, 0.9, 64, 16)]:
        out = torch.zeros(B * H, Sq, Sk, dtype=torch.int8, device=device)
        grid = (triton.cdiv(Sq, bm), triton.cdiv(Sk, bn), B * H)
        _keep_kernel[grid](out, seed, keep_threshold(p), Sq, Sk, BLOCK_M=bm, BLOCK_N=bn)
        expected = flashforge.dropout_mask(seed, B, H, Sq, Sk, p).view(B * H, Sq, Sk)
        assert torch.equal(out.cpu().bool(), expected), f"seed={seed} p={p} tile={bm}x{bn}"


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_keep_rate(p):
    """Keep rate within 5 sigma of 1 - p overall, per Philox lane (j % 8: word and half), and per head."""
    B, H, Sq, Sk = 2, 4, 64, 128
    keep = flashforge.dropout_mask(2024, B, H, Sq, Sk, p).double()

    def check(x, what):
        n = x.numel()
        sigma = math.sqrt(p * (1 - p) / n)
        assert abs(x.mean().item() - (1 - p)) < 5 * sigma, f"{what}: keep rate {x.mean().item():.4f}, p={p}"

    check(keep, "all")
    for lane in range(8):
        check(keep[..., lane::8], f"lane {lane}")
    for h in range(H):
        check(keep[:, h], f"head {h}")
    # neighbouring heads / rows are not copies of each other: agreement ~ p^2 + (1-p)^2
    agree = p * p + (1 - p) ** 2
    for a, b, what in ((keep[:, 0], keep[:, 1], "heads 0/1"), (keep[..., 0, :], keep[..., 1, :], "rows 0/1")):
        same = (a == b).double()
        sigma = math.sqrt(agree * (1 - agree) / same.numel())
        assert abs(same.mean().item() - agree) < 5 * sigma, f"{what} agree {same.mean().item():.4f}"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_keep_rate_through_attention(backend, p):
    B, Hq, Sq, Sk = 1, 2, 48, 64
    keep = attention_keep_mask(backend, backend_device(backend), 31337, B, Hq, 1, Sq, Sk, p).double()
    sigma = math.sqrt(p * (1 - p) / keep.numel())
    assert abs(keep.mean().item() - (1 - p)) < 5 * sigma


def test_different_seeds_differ():
    a = flashforge.dropout_mask(1, 2, 2, 16, 32, 0.5)
    b = flashforge.dropout_mask(2, 2, 2, 16, 32, 0.5)
    c = flashforge.dropout_mask(1 + 2**32, 2, 2, 16, 32, 0.5)  # the seed's high word matters too
    n = a.numel()
    for x, y in ((a, b), (a, c), (b, c)):
        differ = (x != y).double().mean().item()  # ~ 2 p (1 - p) = 0.5
        assert abs(differ - 0.5) < 5 * math.sqrt(0.25 / n)


def test_p_zero_keeps_everything():
    assert flashforge.dropout_mask(3, 1, 2, 5, 9, 0.0).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_seed_none_follows_torch_manual_seed(backend):
    device = backend_device(backend)
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 17, 2, 16, generator=gen).to(device).requires_grad_() for _ in range(3))

    def run(torch_seed, perturb_before_backward=False):
        torch.manual_seed(torch_seed)
        o = flashforge.attention(q, k, v, dropout_p=0.5, backend=backend)
        if perturb_before_backward:  # backward must reuse the seed saved by forward, not draw anew
            torch.manual_seed(12345)
            torch.rand(3)
        return (o, *torch.autograd.grad(o.sum(), (q, k, v)))

    a, b, c = run(0), run(0, perturb_before_backward=True), run(1)
    for x, y in zip(a, b):
        assert torch.equal(x, y)
    assert not torch.equal(a[0], c[0])
    torch.manual_seed(0)
    o1 = flashforge.attention(q, k, v, dropout_p=0.5, backend=backend)
    o2 = flashforge.attention(q, k, v, dropout_p=0.5, backend=backend)
    assert not torch.equal(o1, o2), "consecutive calls with seed=None must draw new seeds"
