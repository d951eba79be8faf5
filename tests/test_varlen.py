"""`flashforge.attention_varlen`: a packed batch equals running each sequence
alone (the float64 reference per sequence), on both backends; with dropout it
equals the padded dense batch (sequence b draws the dropout mask of batch row b)."""
import pytest
import torch

import flashforge
from flashforge import reference
from helpers import backend_device, backend_params

BACKENDS = backend_params()


def _pack(lengths, H, D, gen, dtype, device):
    total = sum(lengths)
    x = torch.randn(total, H, D, generator=gen).to(device=device, dtype=dtype).requires_grad_()
    cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0).tolist()), dtype=torch.int32, device=device)
    return x, cu


def _per_sequence_reference(q, k, v, cu_q, cu_k, do, dlse, offsets, **kw):
    """float64 reference run on each sequence alone: (o, lse [Hq, total_q], dq, dk, dv)."""
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    outs, lses = [], []
    cq, ck = cu_q.tolist(), cu_k.tolist()
    for b in range(len(cq) - 1):
        qb, kb, vb = q64[cq[b]:cq[b + 1]], k64[ck[b]:ck[b + 1]], v64[ck[b]:ck[b + 1]]
        extra = dict(kw)
        if "alibi_slopes" in kw and kw["alibi_slopes"] is not None and kw["alibi_slopes"].dim() == 2:
            extra["alibi_slopes"] = kw["alibi_slopes"][b]
        o, lse = reference.attention(qb[None], kb[None], vb[None], causal_offset=offsets[b], return_lse=True,
                                     **extra)
        outs.append(o[0])
        lses.append(lse[0])
    o = torch.cat(outs)
    lse = torch.cat(lses, dim=1)
    loss = (o * do.double()).sum() + (lse.masked_fill(torch.isinf(lse), 0) * dlse.double()).sum()
    dq, dk, dv = torch.autograd.grad(loss, (q64, k64, v64))
    return o, lse, dq, dk, dv


CASES = [
    pytest.param(dict(lq=[5, 17, 1, 9], lk=[5, 17, 1, 9]), dict(), id="self-attention"),
    pytest.param(dict(lq=[5, 17, 1, 9], lk=[5, 17, 1, 9]), dict(causal=True), id="causal-top-left"),
    pytest.param(dict(lq=[3, 17, 1, 9], lk=[20, 17, 6, 2]), dict(causal=True, causal_offset="bottom_right"),
                 id="causal-bottom-right-cross"),
    pytest.param(dict(lq=[3, 17, 4], lk=[20, 17, 6]), dict(causal=True, causal_offset=(17, 0, -2)),
                 id="causal-per-seq-offsets"),
    pytest.param(dict(lq=[12, 33, 7], lk=[12, 33, 7], Hq=6, Hkv=2, D=40, Dv=24),
                 dict(window=(4, 2), softcap=3.0), id="gqa-window-softcap-D40-Dv24"),
    pytest.param(dict(lq=[12, 20], lk=[15, 20], Hq=4, Hkv=1), dict(alibi_slopes="BH", causal=True,
                 causal_offset="bottom_right"), id="mqa-alibi-per-seq"),
    pytest.param(dict(lq=[0, 7, 5], lk=[4, 0, 5]), dict(causal=True), id="empty-sequences"),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("shape, kw", CASES)
def test_packed_equals_each_sequence_alone(backend, shape, kw):
    dev = backend_device(backend)
    gen = torch.Generator().manual_seed(0)
    Hq, Hkv, D = shape.get("Hq", 2), shape.get("Hkv", 2), shape.get("D", 16)
    Dv = shape.get("Dv", D)
    q, cu_q = _pack(shape["lq"], Hq, D, gen, torch.float32, dev)
    k, cu_k = _pack(shape["lk"], Hkv, D, gen, torch.float32, dev)
    v, _ = _pack(shape["lk"], Hkv, Dv, gen, torch.float32, dev)
    B = len(shape["lq"])
    kw = dict(kw)
    offset = kw.pop("causal_offset", 0)
    if offset == "bottom_right":
        offsets = [lk - lq for lq, lk in zip(shape["lq"], shape["lk"])]
        arg = offset
    elif isinstance(offset, tuple):
        offsets, arg = list(offset), torch.tensor(offset, device=dev)
    else:
        offsets, arg = [offset] * B, offset
    if kw.get("alibi_slopes") == "BH":
        kw["alibi_slopes"] = torch.rand(B, Hq, generator=gen).to(dev)
    before = [t.detach().clone() for t in (q, k, v)]

    o, lse = flashforge.attention_varlen(q, k, v, cu_q, cu_k, max(shape["lq"]), max(shape["lk"]),
                                         causal_offset=arg, return_lse=True, backend=backend, **kw)
    assert o.shape == (q.shape[0], Hq, Dv) and lse.shape == (Hq, q.shape[0])
    do = torch.randn(o.shape, generator=gen).to(dev)
    dlse = torch.randn(lse.shape, generator=gen).to(dev)
    loss = (o * do).sum() + (lse.masked_fill(torch.isinf(lse), 0) * dlse).sum()
    dq, dk, dv = torch.autograd.grad(loss, (q, k, v))
    ref = _per_sequence_reference(q, k, v, cu_q, cu_k, do, dlse, offsets, **kw)

    for name, got, want in zip(("o", "lse", "dq", "dk", "dv"), (o, lse, dq, dk, dv), ref):
        assert not torch.isnan(got).any(), f"{name} has NaN"
        got, want = got.detach().double().cpu(), want.detach().cpu()
        finite = torch.isfinite(want)
        assert torch.equal(torch.isinf(got), ~finite), f"{name}: -inf entries differ"
        err = (got[finite] - want[finite]).abs().max().item() if finite.any() else 0.0
        assert err <= 1e-4 * max(1.0, want[finite].abs().max().item() if finite.any() else 1.0), f"{name}: {err:.2e}"
    for t, b in zip((q, k, v), before):
        assert torch.equal(t.detach(), b), "an input was modified"


@pytest.mark.parametrize("backend", BACKENDS)
def test_dropout_equals_padded_dense_batch(backend):
    """Sequence b of the pack draws batch row b's dropout mask: padded dense and packed agree."""
    dev = backend_device(backend)
    gen = torch.Generator().manual_seed(1)
    lengths, H, D = [6, 13, 9], 2, 16
    q, cu = _pack(lengths, H, D, gen, torch.float32, dev)
    k, _ = _pack(lengths, H, D, gen, torch.float32, dev)
    v, _ = _pack(lengths, H, D, gen, torch.float32, dev)
    o = flashforge.attention_varlen(q, k, v, cu, cu, 13, 13, causal=True, dropout_p=0.3, seed=42, backend=backend)
    S, c = max(lengths), cu.tolist()
    for b, L in enumerate(lengths):
        qd, kd, vd = (t.detach()[c[b]:c[b + 1]] for t in (q, k, v))
        pad = lambda x: torch.cat([x, x.new_zeros(S - L, *x.shape[1:])])[None]  # noqa: E731
        # batch row b of a dense batch: put the sequence at row b, other rows random
        dense = [torch.randn(len(lengths), S, H, D, generator=gen).to(dev) for _ in range(3)]
        for t, x in zip(dense, (qd, kd, vd)):
            t[b] = pad(x)[0]
        keep = torch.zeros(len(lengths), 1, 1, S, dtype=torch.bool, device=dev)
        keep[b, ..., :L] = True
        od = flashforge.attention(*dense, causal=True, mask=keep, dropout_p=0.3, seed=42, backend=backend)
        torch.testing.assert_close(o[c[b]:c[b + 1]].detach(), od[b, :L], rtol=1e-5, atol=1e-6)


def test_rejects_bad_cu_seqlens():
    q = torch.randn(10, 2, 16)
    cu = torch.tensor([0, 4, 10], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"cu_seqlens_q has dtype torch\.float32; accepted: int32"):
        flashforge.attention_varlen(q, q, q, cu.float(), cu, 6, 6)
    with pytest.raises(ValueError, match=r"cu_seqlens_k has shape \(1,\); accepted: \[B \+ 1\]"):
        flashforge.attention_varlen(q, q, q, cu, cu[:1], 6, 6)
    with pytest.raises(ValueError, match=r"cu_seqlens_q has 2 sequences but cu_seqlens_k has 1"):
        flashforge.attention_varlen(q, q, q, cu, cu[[0, 2]], 6, 6)
    with pytest.raises(TypeError, match=r"max_seqlen_q must be an int, got Tensor"):
        flashforge.attention_varlen(q, q, q, cu, cu, torch.tensor(6), 6)
    with pytest.raises(ValueError, match=r"q has rank 4 .* accepted: \[total_q, Hq, D\]"):
        flashforge.attention_varlen(q[None], q[None], q[None], cu, cu, 6, 6)
