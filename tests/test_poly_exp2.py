"""exp2 on the FMA pipes (`common.exp2_fma`, opt-in per forward tile config as
`poly_exp2`): accurate to < 1e-4 relative where it matters, and a forward that uses
it for half or all of P's exponentials equals the forward that does not."""
import pytest
import torch

import flashforge
from flashforge.ops.triton import configs
from helpers import HAS_TRITON, INTERPRET

pytestmark = pytest.mark.skipif(not (HAS_TRITON and (INTERPRET or torch.cuda.is_available())),
                                reason="needs triton, with CUDA or TRITON_INTERPRET=1")
DEV = "cuda" if torch.cuda.is_available() and not INTERPRET else "cpu"


if HAS_TRITON:
    import triton
    import triton.language as tl

    from flashforge.ops.triton.common import exp2_split

    @triton.jit
    def _exp2_kernel(X, Y, M: tl.constexpr, N: tl.constexpr, POLY: tl.constexpr):
        offs = tl.arange(0, M)[:, None] * N + tl.arange(0, N)[None, :]
        tl.store(Y + offs, exp2_split(tl.load(X + offs), POLY, N))


def _exp2_tile(x: torch.Tensor, poly: int) -> torch.Tensor:
    y = torch.full_like(x, float("nan"))
    _exp2_kernel[(1,)](x, y, M=x.shape[0], N=x.shape[1], POLY=poly)
    return y


@pytest.mark.parametrize("poly", [1, 2])
def test_exp2_fma_accuracy(poly):
    g = torch.Generator().manual_seed(0)
    x = -torch.rand(32, 64, generator=g, dtype=torch.float64) * 130  # [-130, 0], past the clamp
    x[0, :8] = torch.tensor([0.0, -0.5, -0.49999, -1.0, -1.5, -2.5, -124.6, -125.0], dtype=torch.float64)
    x32 = x.float().to(DEV)
    y = _exp2_tile(x32, poly).double().cpu()
    want = torch.exp2(x32.double().cpu())
    assert torch.isfinite(y).all() and (y >= 0).all()
    big = x > -124
    rel = ((y - want).abs() / want)[big]
    assert rel.max() < 1e-4, rel.max()
    assert (y[~big] < 1e-36).all()  # where 2^x is ~0 for fp16 / bf16 weights, the result is too
    if poly == 1:  # even columns go through the MUFU path: equal to exp2 to float32 rounding, where
        # 2^x is a normal float (the GPU's ex2.approx.ftz flushes subnormals, below 2^-126, to 0)
        normal = x[:, 0::2] > -126
        torch.testing.assert_close(y[:, 0::2][normal], want[:, 0::2][normal], rtol=1e-6, atol=0)


@pytest.mark.parametrize("poly", [1, 2])
def test_forward_with_poly_exp2_matches(poly, monkeypatch):
    g = torch.Generator().manual_seed(1)
    # 300 keys: interior key tiles (the only ones the polynomial serves) with the H200's 128-key tiles too
    q, k, v = (torch.randn(1, 300, 2, 32, generator=g).half().to(DEV) for _ in range(3))
    real = configs.get_config

    def with_poly(p):
        return lambda kind, d, e, i, **kw: configs.TileConfig(
            *[getattr(real(kind, d, e, i, **kw), f) for f in ("block_m", "block_n", "num_warps", "num_stages")],
            poly_exp2=p if kind == "fwd" else 0)
    monkeypatch.setattr("flashforge.ops.triton.attention.get_config", with_poly(0))
    o0, lse0 = flashforge.attention(q, k, v, backend="triton", return_lse=True)
    monkeypatch.setattr("flashforge.ops.triton.attention.get_config", with_poly(poly))
    o1, lse1 = flashforge.attention(q, k, v, backend="triton", return_lse=True)
    ref = flashforge.reference.attention(q.double(), k.double(), v.double())
    assert (o1.double() - ref).abs().max() < 2e-3
    torch.testing.assert_close(o1, o0, rtol=2e-3, atol=2e-3)
    torch.testing.assert_close(lse1, lse0, rtol=1e-4, atol=1e-4)
    assert not torch.equal(o1, o0) or poly == 0  # the polynomial path really ran (it rounds differently)
