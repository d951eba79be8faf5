"""The forward's tensor-descriptor (TMA) loads, opt-in per tile config, give the
same results as the pointer loads: dense, GQA-packed decoding, a KV cache whose
unused slots hold NaN, a paged cache (pages of one and two key tiles), split-KV, a head
dim narrower than the tile."""
import pytest
import torch

import flashforge
from flashforge.ops.triton import configs
from helpers import HAS_TRITON, INTERPRET

pytestmark = pytest.mark.skipif(not (HAS_TRITON and (INTERPRET or torch.cuda.is_available())),
                                reason="needs triton, with CUDA or TRITON_INTERPRET=1")
DEV = "cuda" if torch.cuda.is_available() and not INTERPRET else "cpu"


def _both(fn, monkeypatch):
    """fn() with the table's configs (pointer loads), then with descriptors turned on for the forward."""
    real = configs.get_config

    def with_tma(on):
        return lambda kind, d, e, i, **kw: configs.TileConfig(
            *[getattr(real(kind, d, e, i, **kw), f) for f in ("block_m", "block_n", "num_warps", "num_stages")],
            tma=on and kind == "fwd")
    # the table itself turns TMA on for some forward shapes: force both ways
    monkeypatch.setattr("flashforge.ops.triton.attention.get_config", with_tma(False))
    plain = fn()
    monkeypatch.setattr("flashforge.ops.triton.attention.get_config", with_tma(True))
    return plain, fn()


@pytest.mark.parametrize("kw", [dict(causal=True), dict(window=(5, 3), softcap=2.0), dict(dropout_p=0.2, seed=4)],
                         ids=["causal", "window-softcap", "dropout"])
@pytest.mark.parametrize("shape", [(2, 17, 37, 4, 2, 40), (1, 2, 50, 6, 2, 32)], ids=["D40", "gqa-packed-decode"])
def test_dense_matches_pointer_loads(kw, shape, monkeypatch):
    B, Sq, Sk, Hq, Hkv, D = shape
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(B, Sq, Hq, D, generator=gen).to(DEV)
    k, v = (torch.randn(B, Sk, Hkv, D, generator=gen).to(DEV) for _ in range(2))
    plain, tma = _both(lambda: flashforge.attention(q, k, v, backend="triton", return_lse=True, **kw), monkeypatch)
    torch.testing.assert_close(tma[0], plain[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(tma[1], plain[1], rtol=1e-5, atol=1e-6)


def _cache_with_nan(gen, lens, Sq=1, Hq=4, Hkv=2, D=32, S=48):
    """q [2, Sq, Hq, D] and caches [2, S, Hkv, D] holding NaN past each row's length (what an
    uninitialised cache may hold there), with the lengths as an int32 tensor."""
    q = torch.randn(len(lens), Sq, Hq, D, generator=gen).to(DEV)
    kc, vc = (torch.randn(len(lens), S, Hkv, D, generator=gen).to(DEV) for _ in range(2))
    for c in (kc, vc):
        for b, n in enumerate(lens):
            c[b, n:] = float("nan")
    return q, kc, vc, torch.tensor(lens, dtype=torch.int32, device=DEV)


@pytest.mark.parametrize("splits", [1, 3])
def test_kvcache_with_nan_in_unused_slots(splits, monkeypatch):
    q, kc, vc, lens = _cache_with_nan(torch.Generator().manual_seed(1), [7, 30])
    plain, tma = _both(lambda: flashforge.attention_with_kvcache(q, kc, vc, cache_seqlens=lens, num_splits=splits,
                                                                backend="triton"), monkeypatch)
    assert not torch.isnan(tma).any()
    torch.testing.assert_close(tma, plain, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("page", [16, 32])
def test_paged_kvcache_matches_pointer_loads_and_contiguous(page, monkeypatch):
    gen = torch.Generator().manual_seed(2)
    B, Hkv, D, S = 2, 2, 32, 64
    q, kc, vc, lens = _cache_with_nan(gen, [9, 50], Sq=2, Hkv=Hkv, D=D, S=S)
    nb = B * S // page
    perm = torch.randperm(nb, generator=gen).to(DEV)  # pages in shuffled order
    kp, vp = (torch.empty(nb, page, Hkv, D, device=DEV) for _ in range(2))
    kp[perm], vp[perm] = kc.reshape(nb, page, Hkv, D), vc.reshape(nb, page, Hkv, D)
    table = perm.view(B, S // page).to(torch.int32)
    contiguous = flashforge.attention_with_kvcache(q, kc, vc, cache_seqlens=lens, backend="triton")
    for splits in (1, 3):
        plain, tma = _both(lambda: flashforge.attention_with_kvcache(q, kp, vp, cache_seqlens=lens, block_table=table,
                                                                    num_splits=splits, backend="triton"),
                           monkeypatch)
        assert not torch.isnan(tma).any()
        torch.testing.assert_close(tma, plain, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(tma, contiguous, rtol=1e-5, atol=1e-6)
