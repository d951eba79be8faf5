"""flash-attn's exact meaning where flashforge's drop-in differed (issue 19, part 3), each
against flashforge's float64 reference with flash-attn's rules written out independently:

* ``window_size`` as any pair of integers (flash-attn's tests pass ``torch.randint(0, n, (2,))``);
* ``flash_attn_with_kvcache`` rotary positions: new key i at ``cache_seqlens + i``; query i at
  ``cache_seqlens + i`` when causal or local, every query at ``cache_seqlens`` otherwise;
* ``cache_leftpad`` (row b's keys start at ``cache_leftpad[b]``);
* ``flash_attn_varlen_func`` with a paged cache (``block_table``);
* a paged cache's lengths past what its block table addresses raise (flash-attn checks on the host);
* ``cache_batch_idx`` (query batch b reads cache ``cache_batch_idx[b]``);
* ``softmax_lse = +inf`` on rows that see no key (flash-attn's kernels write INFINITY there).
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from flashforge import reference
from flashforge.flash_attn_interface import flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache


def _tables(n: int, rd: int, gen):
    ang = torch.rand(n, rd // 2, generator=gen, dtype=torch.float64) * 6.283
    return ang.cos(), ang.sin()


def _rotate(x, cos, sin, pos, interleaved):
    """flash-attn's rotary with tables, in float64: x [S, H, D] with S positions pos [S]."""
    c, s = cos[pos][:, None], sin[pos][:, None]
    rd = 2 * cos.shape[1]
    xr = x[..., :rd]
    if interleaved:
        a, b = xr[..., 0::2], xr[..., 1::2]
        rot = torch.stack([a * c - b * s, b * c + a * s], dim=-1).flatten(-2)
    else:
        a, b = xr[..., :rd // 2], xr[..., rd // 2:]
        rot = torch.cat([a * c - b * s, b * c + a * s], dim=-1)
    return torch.cat([rot, x[..., rd:]], dim=-1)


@pytest.mark.parametrize("window", [torch.tensor([3, 1]), np.array([3, 1]), [torch.tensor(3), 1], (3, 1)],
                         ids=["tensor", "numpy", "list-of-0d", "tuple"])
def test_window_size_takes_any_pair_of_integers(window):
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 9, 2, 8, generator=gen) for _ in range(3))
    torch.testing.assert_close(flash_attn_func(q, k, v, window_size=window), flash_attn_func(q, k, v, window_size=(3, 1)),
                               rtol=0, atol=0)


@pytest.mark.parametrize("window", [(2.0, 1), ("3", 1), (3,)])
def test_window_size_rejects_non_integers(window):
    q = torch.randn(1, 4, 1, 8)
    with pytest.raises(TypeError, match="window_size"):
        flash_attn_func(q, q, q, window_size=window)


@pytest.mark.parametrize("causal,local", [(True, False), (False, False), (False, True)], ids=["causal", "plain", "local"])
@pytest.mark.parametrize("interleaved", [False, True])
def test_kvcache_rotary_positions_follow_flash_attn(causal, local, interleaved):
    """Sq = 3 queries and S_new = 2 new keys (S_new != Sq): where flash-attn rotates each."""
    gen = torch.Generator().manual_seed(1)
    B, Sq, s_new, S_cache, H, D, rd = 2, 3, 2, 24, 2, 16, 8
    q = torch.randn(B, Sq, H, D, generator=gen)
    k_new, v_new = (torch.randn(B, s_new, H, D, generator=gen) for _ in range(2))
    kc, vc = (torch.randn(B, S_cache, H, D, generator=gen) for _ in range(2))
    lens = torch.tensor([4, 11], dtype=torch.int32)
    cos, sin = _tables(S_cache + 4, rd, gen)
    window = (5, 2) if local else (-1, -1)
    kc0, vc0 = kc.clone(), vc.clone()
    out = flash_attn_with_kvcache(q, kc, vc, k_new, v_new, rotary_cos=cos.float(), rotary_sin=sin.float(),
                                  cache_seqlens=lens, causal=causal, window_size=window,
                                  rotary_interleaved=interleaved)
    for b in range(B):
        n = int(lens[b])
        k_r = _rotate(k_new[b].double(), cos, sin, n + torch.arange(s_new), interleaved)
        q_pos = n + torch.arange(Sq) if causal or local else torch.full((Sq,), n)
        q_r = _rotate(q[b].double(), cos, sin, q_pos, interleaved)
        keys = torch.cat([kc0[b, :n].double(), k_r])[None]
        vals = torch.cat([vc0[b, :n].double(), v_new[b].double()])[None]
        want = reference.attention(q_r[None], keys, vals, causal=causal, causal_offset=n + s_new - Sq,
                                   window=window if local else None)
        torch.testing.assert_close(out[b:b + 1].double(), want, rtol=2e-5, atol=2e-5)
        torch.testing.assert_close(kc[b, n:n + s_new].double(), k_r, rtol=1e-6, atol=1e-6)


def test_kvcache_rotary_without_new_keys_rotates_nothing():
    """flash-attn's kernel applies the tables only while appending (its tests skip the rest)."""
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(1, 2, 2, 16, generator=gen)
    kc, vc = (torch.randn(1, 10, 2, 16, generator=gen) for _ in range(2))
    cos, sin = _tables(12, 8, gen)
    lens = torch.tensor([7], dtype=torch.int32)
    got = flash_attn_with_kvcache(q, kc, vc, rotary_cos=cos.float(), rotary_sin=sin.float(), cache_seqlens=lens,
                                  causal=True)
    torch.testing.assert_close(got, flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, causal=True))


@pytest.mark.parametrize("causal,alibi", [(True, False), (False, True)], ids=["causal", "alibi"])
def test_kvcache_leftpad(causal, alibi):
    gen = torch.Generator().manual_seed(3)
    B, Sq, S_cache, H, D = 2, 2, 16, 2, 8
    q = torch.randn(B, Sq, H, D, generator=gen)
    k_new, v_new = (torch.randn(B, Sq, H, D, generator=gen) for _ in range(2))
    kc, vc = (torch.randn(B, S_cache, H, D, generator=gen) for _ in range(2))
    lens = torch.tensor([5, 9], dtype=torch.int32)
    pad = torch.tensor([2, 0], dtype=torch.int32)
    slopes = torch.rand(B, H, generator=gen) if alibi else None
    kc0, vc0 = kc.clone(), vc.clone()
    out, lse = flash_attn_with_kvcache(q, kc, vc, k_new, v_new, cache_seqlens=lens, cache_leftpad=pad, causal=causal,
                                       alibi_slopes=slopes, return_softmax_lse=True)
    for b in range(B):
        n, p = int(lens[b]), int(pad[b])
        keys = torch.cat([kc0[b, :n], k_new[b]]).double()
        vals = torch.cat([vc0[b, :n], v_new[b]]).double()
        keep = torch.arange(n + Sq) >= p
        want, want_lse = reference.attention(q[b:b + 1].double(), keys[None], vals[None], causal=causal,
                                             causal_offset=n, mask=keep.view(1, 1, 1, -1), return_lse=True,
                                             alibi_slopes=None if slopes is None else slopes[b:b + 1].double())
        torch.testing.assert_close(out[b:b + 1].double(), want, rtol=2e-5, atol=2e-5)
        torch.testing.assert_close(lse[b:b + 1].double(), want_lse, rtol=2e-5, atol=2e-5)
        torch.testing.assert_close(kc[b, n:n + Sq], k_new[b], rtol=0, atol=0)
    with pytest.raises(RuntimeError, match="leftpad"):
        flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, cache_leftpad=pad, block_table=torch.zeros(
            B, 1, dtype=torch.int32))


def test_varlen_with_a_paged_cache_matches_packed_keys():
    gen = torch.Generator().manual_seed(4)
    lq, lk, page, H, D = [3, 5], [20, 9], 16, 2, 8
    blocks = torch.randn(6, page, H, D, generator=gen, requires_grad=True)
    vblocks = torch.randn(6, page, H, D, generator=gen, requires_grad=True)
    table = torch.tensor([[4, 1], [2, 5]], dtype=torch.int32)
    q = torch.randn(sum(lq), H, D, generator=gen, requires_grad=True)
    cu_q = torch.tensor([0, 3, 8], dtype=torch.int32)
    cu_k = torch.tensor([0, 20, 29], dtype=torch.int32)
    out = flash_attn_varlen_func(q, blocks, vblocks, cu_q, cu_k, 5, 20, causal=True, block_table=table)
    rows = [blocks[table[b].long()].flatten(0, 1)[:lk[b]] for b in range(2)]
    vrows = [vblocks[table[b].long()].flatten(0, 1)[:lk[b]] for b in range(2)]
    want = flash_attn_varlen_func(q, torch.cat(rows), torch.cat(vrows), cu_q, cu_k, 5, 20, causal=True)
    torch.testing.assert_close(out, want, rtol=0, atol=0)
    g_out = torch.autograd.grad(out.sum(), (blocks, vblocks))
    g_want = torch.autograd.grad(want.sum(), (blocks, vblocks))
    for a, b in zip(g_out, g_want):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("append", [False, True])
def test_paged_cache_longer_than_its_block_table_raises(append):
    """flash-attn's test_flash_attn_kvcache_paged_block_table_bounds, on the CPU."""
    page = 16
    kc, vc = torch.randn(4, page, 1, 8), torch.randn(4, page, 1, 8)
    table = torch.zeros(1, 1, dtype=torch.int32)
    q = torch.randn(1, 1, 1, 8)
    new = (torch.randn(1, 1, 1, 8), torch.randn(1, 1, 1, 8)) if append else (None, None)
    lens = torch.full((1,), page if append else page + 1, dtype=torch.int32)
    before = kc.clone()
    with pytest.raises(RuntimeError, match="block_table"):
        flash_attn_with_kvcache(q, kc, vc, *new, cache_seqlens=lens, block_table=table)
    assert torch.equal(kc, before)
    out = flash_attn_with_kvcache(q, kc, vc, cache_seqlens=torch.full((1,), page, dtype=torch.int32),
                                  block_table=table)
    assert out.shape == (1, 1, 1, 8) and torch.isfinite(out).all()


@pytest.mark.parametrize("append", [False, True], ids=["read", "append"])
def test_kvcache_batch_idx_selects_the_caches(append):
    gen = torch.Generator().manual_seed(5)
    n_cache, B, Sq, S_cache, H, D = 4, 2, 2, 12, 2, 8
    q = torch.randn(B, Sq, H, D, generator=gen)
    kc, vc = (torch.randn(n_cache, S_cache, H, D, generator=gen) for _ in range(2))
    k_new, v_new = (torch.randn(B, Sq, H, D, generator=gen) for _ in range(2)) if append else (None, None)
    lens = torch.tensor([3, 7], dtype=torch.int32)
    idx = torch.tensor([3, 1], dtype=torch.int32)
    kc0, vc0 = kc.clone(), vc.clone()
    out, lse = flash_attn_with_kvcache(q, kc, vc, k_new, v_new, cache_seqlens=lens, cache_batch_idx=idx,
                                       causal=True, return_softmax_lse=True)
    s_new = Sq if append else 0
    for b in range(B):
        c, n = int(idx[b]), int(lens[b])
        keys, vals = kc0[c, :n], vc0[c, :n]
        if append:
            keys, vals = torch.cat([keys, k_new[b]]), torch.cat([vals, v_new[b]])
        want, want_lse = reference.attention(q[b:b + 1].double(), keys[None].double(), vals[None].double(),
                                             causal=True, causal_offset=n + s_new - Sq, return_lse=True)
        torch.testing.assert_close(out[b:b + 1].double(), want, rtol=2e-5, atol=2e-5)
        torch.testing.assert_close(lse[b:b + 1].double(), want_lse, rtol=2e-5, atol=2e-5)
        if append:  # the new rows landed in the selected cache, nothing else moved
            torch.testing.assert_close(kc[c, n:n + Sq], k_new[b], rtol=0, atol=0)
            torch.testing.assert_close(vc[c, n:n + Sq], v_new[b], rtol=0, atol=0)
    untouched = [c for c in range(n_cache) if c not in idx.tolist()]
    assert torch.equal(kc[untouched], kc0[untouched]) and torch.equal(vc[untouched], vc0[untouched])
    if not append:
        assert torch.equal(kc, kc0) and torch.equal(vc, vc0)
    for bad in ([0, 4], [-1, 0]):
        with pytest.raises(ValueError, match="cache_batch_idx"):
            flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, cache_batch_idx=torch.tensor(bad))
    with pytest.raises(RuntimeError, match="cache_batch_idx"):
        flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, cache_batch_idx=idx,
                                block_table=torch.zeros(B, 1, dtype=torch.int32))


def test_lse_is_plus_inf_where_no_key_is_seen():
    """flash-attn writes +inf (a zero sum) where flashforge's own functions give -inf."""
    gen = torch.Generator().manual_seed(6)
    q = torch.randn(1, 4, 2, 8, generator=gen)
    k, v = (torch.randn(1, 2, 2, 8, generator=gen) for _ in range(2))
    # window (0, 0) with Sq > Sk: query i sees key i - 2 only, so rows 0 and 1 see nothing
    o, lse, _ = flash_attn_func(q, k, v, window_size=(0, 0), return_attn_probs=True)
    assert torch.isposinf(lse[..., :2]).all() and torch.isfinite(lse[..., 2:]).all()
    assert (o[:, :2] == 0).all()
    kc, vc = (torch.randn(1, 4, 2, 8, generator=gen) for _ in range(2))
    o, lse = flash_attn_with_kvcache(q[:, :1], kc, vc, cache_seqlens=torch.tensor([0], dtype=torch.int32),
                                     return_softmax_lse=True)
    assert torch.isposinf(lse).all() and (o == 0).all()
