"""`flashforge.reference`: the float64 meaning every backend is tested against,
itself checked against softmaxes worked out by hand on tiny inputs."""
import math

import pytest
import torch

from flashforge import reference
from flashforge.ops.dropout import dropout_mask

F64 = torch.float64


def t(rows) -> torch.Tensor:
    return torch.tensor(rows, dtype=F64)


def bshd(x: torch.Tensor) -> torch.Tensor:
    """[S, D] -> [1, S, 1, D]."""
    return x[None, :, None, :]


def softmax_by_hand(scores):
    """o-weights and lse of one row, with math.exp; -inf entries get weight 0."""
    m = max(s for s in scores if s != -math.inf)
    e = [math.exp(s - m) if s != -math.inf else 0.0 for s in scores]
    z = sum(e)
    return [x / z for x in e], m + math.log(z)


def test_one_query_three_keys():
    q = t([[1.0, 0.0]])
    k = t([[1.0, 0.0], [0.0, 1.0], [-1.0, 0.0]])
    v = t([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]])
    o, lse = reference.attention(bshd(q), bshd(k), bshd(v), scale=1.0, return_lse=True)
    z = math.e + 1.0 + 1.0 / math.e  # scores 1, 0, -1
    p = [math.e / z, 1.0 / z, (1.0 / math.e) / z]
    expected = [p[0] * 1 + p[1] * 3 + p[2] * 5, p[0] * 2 + p[1] * 4 + p[2] * 6]
    assert o.shape == (1, 1, 1, 2) and lse.shape == (1, 1, 1)
    assert o[0, 0, 0].tolist() == pytest.approx(expected, rel=1e-12)
    assert lse.item() == pytest.approx(math.log(z), rel=1e-12)


def test_default_scale_is_inverse_sqrt_head_dim():
    q = t([[1.0, 1.0, 1.0, 1.0]])
    k = t([[1.0, 1.0, 1.0, 1.0], [0.0, 0.0, 0.0, 0.0]])
    v = t([[1.0], [0.0]])
    o, lse = reference.attention(bshd(q), bshd(k), bshd(v), return_lse=True)
    # scores: 4 / sqrt(4) = 2 and 0
    assert o.item() == pytest.approx(math.exp(2) / (math.exp(2) + 1), rel=1e-12)
    assert lse.item() == pytest.approx(math.log(math.exp(2) + 1), rel=1e-12)


def test_two_queries_gradients_flow():
    q = t([[0.5, -1.0], [2.0, 0.0]]).requires_grad_()
    k = t([[1.0, 0.0], [0.0, 1.0]]).requires_grad_()
    v = t([[1.0, 0.0], [0.0, 1.0]]).requires_grad_()
    o = reference.attention(bshd(q), bshd(k), bshd(v), scale=1.0)
    # o row i is the softmax row itself (v = identity)
    for i, scores in enumerate([[0.5, -1.0], [2.0, 0.0]]):
        p, _ = softmax_by_hand(scores)
        assert o[0, i, 0].tolist() == pytest.approx(p, rel=1e-12)
    assert torch.autograd.gradcheck(
        lambda a, b, c: reference.attention(bshd(a), bshd(b), bshd(c), scale=0.7), (q, k, v))


def test_softcap():
    q = t([[3.0]])
    k = t([[1.0], [-2.0]])
    v = t([[1.0], [-1.0]])
    cap = 2.0
    o, lse = reference.attention(bshd(q), bshd(k), bshd(v), scale=1.0, softcap=cap, return_lse=True)
    p, l = softmax_by_hand([cap * math.tanh(3.0 / cap), cap * math.tanh(-6.0 / cap)])
    assert o.item() == pytest.approx(p[0] - p[1], rel=1e-12)
    assert lse.item() == pytest.approx(l, rel=1e-12)


# visibility: rows are queries i, columns keys j
@pytest.mark.parametrize("Sq, Sk, causal, offset, window, expected", [
    pytest.param(3, 3, True, 0, None, [[1, 0, 0],
                                       [1, 1, 0],
                                       [1, 1, 1]], id="causal"),
    pytest.param(3, 5, True, 1, None, [[1, 1, 0, 0, 0],
                                       [1, 1, 1, 0, 0],
                                       [1, 1, 1, 1, 0]], id="causal-offset+1"),
    pytest.param(3, 5, True, 2, None, [[1, 1, 1, 0, 0],
                                       [1, 1, 1, 1, 0],
                                       [1, 1, 1, 1, 1]], id="causal-bottom-right"),
    pytest.param(3, 3, True, -1, None, [[0, 0, 0],
                                        [1, 0, 0],
                                        [1, 1, 0]], id="causal-offset-1"),
    pytest.param(4, 4, False, 0, 2, [[1, 1, 0, 0],
                                     [1, 1, 1, 0],
                                     [0, 1, 1, 1],
                                     [0, 0, 1, 1]], id="window-int"),
    pytest.param(4, 4, False, 0, (1, 0), [[1, 0, 0, 0],
                                          [1, 1, 0, 0],
                                          [0, 1, 1, 0],
                                          [0, 0, 1, 1]], id="window-(1,0)"),
    pytest.param(4, 4, False, 0, (0, 2), [[1, 1, 1, 0],
                                          [0, 1, 1, 1],
                                          [0, 0, 1, 1],
                                          [0, 0, 0, 1]], id="window-(0,2)"),
    pytest.param(4, 4, False, 0, (2, -1), [[1, 1, 1, 1],
                                           [1, 1, 1, 1],
                                           [1, 1, 1, 1],
                                           [0, 1, 1, 1]], id="window-(2,-1)"),
    pytest.param(4, 4, False, 0, (-1, 1), [[1, 1, 0, 0],
                                           [1, 1, 1, 0],
                                           [1, 1, 1, 1],
                                           [1, 1, 1, 1]], id="window-(-1,1)"),
    pytest.param(4, 4, True, 0, (1, 3), [[1, 0, 0, 0],
                                         [1, 1, 0, 0],
                                         [0, 1, 1, 0],
                                         [0, 0, 1, 1]], id="window-causal-clamps-right"),
    pytest.param(4, 4, True, 0, 2, [[1, 0, 0, 0],
                                    [1, 1, 0, 0],
                                    [0, 1, 1, 0],
                                    [0, 0, 1, 1]], id="window-int-causal"),
    pytest.param(2, 6, False, 3, (1, 1), [[0, 0, 1, 1, 1, 0],
                                          [0, 0, 0, 1, 1, 1]], id="window-offset"),
    pytest.param(3, 2, False, 0, (0, 0), [[1, 0],
                                          [0, 1],
                                          [0, 0]], id="window-diagonal-empty-row"),
])
def test_visible(Sq, Sk, causal, offset, window, expected):
    vis = reference.visible(Sq, Sk, causal, offset, window)
    assert vis.shape == (1, 1, Sq, Sk)
    assert vis[0, 0].int().tolist() == expected


def test_visible_per_batch_offset():
    off = torch.tensor([0, 2, -1], dtype=torch.int32)
    vis = reference.visible(2, 3, True, off, None, B=3)
    assert vis.shape == (3, 1, 2, 3)
    assert vis[:, 0].int().tolist() == [[[1, 0, 0], [1, 1, 0]],
                                        [[1, 1, 1], [1, 1, 1]],
                                        [[0, 0, 0], [1, 0, 0]]]


def test_causal_attention_matches_visibility():
    q = t([[1.0], [2.0], [3.0]])
    k = t([[1.0], [-1.0], [0.5]])
    v = t([[10.0], [20.0], [30.0]])
    o = reference.attention(bshd(q), bshd(k), bshd(v), scale=1.0, causal=True)
    for i in range(3):
        p, _ = softmax_by_hand([q[i, 0].item() * k[j, 0].item() for j in range(i + 1)])
        assert o[0, i, 0, 0].item() == pytest.approx(sum(pj * v[j, 0].item() for j, pj in enumerate(p)), rel=1e-12)


def test_bool_mask_keeps_true():
    q = t([[1.0, 0.0]])
    k = t([[1.0, 0.0], [0.0, 1.0], [-1.0, 0.0]])
    v = t([[1.0], [3.0], [5.0]])
    mask = torch.tensor([[True, False, True]])  # [Sq, Sk]
    o, lse = reference.attention(bshd(q), bshd(k), bshd(v), scale=1.0, mask=mask, return_lse=True)
    p, l = softmax_by_hand([1.0, -math.inf, -1.0])
    assert o.item() == pytest.approx(p[0] * 1 + p[2] * 5, rel=1e-12)
    assert lse.item() == pytest.approx(l, rel=1e-12)


def test_float_mask_is_additive():
    q = t([[1.0, 0.0]])
    k = t([[1.0, 0.0], [0.0, 1.0], [-1.0, 0.0]])
    v = t([[1.0], [3.0], [5.0]])
    bias = t([[0.0, math.log(2.0), -0.5]])
    o, lse = reference.attention(bshd(q), bshd(k), bshd(v), scale=1.0, mask=bias, return_lse=True)
    p, l = softmax_by_hand([1.0, math.log(2.0), -1.5])
    assert o.item() == pytest.approx(p[0] * 1 + p[1] * 3 + p[2] * 5, rel=1e-12)
    assert lse.item() == pytest.approx(l, rel=1e-12)


def test_mask_broadcasts_key_padding():
    torch.manual_seed(0)
    B, S, H, D = 2, 3, 2, 4
    q, k, v = (torch.randn(B, S, H, D, dtype=F64) for _ in range(3))
    pad = torch.tensor([[True, True, False], [True, False, False]]).view(B, 1, 1, S)
    o = reference.attention(q, k, v, mask=pad)
    for b, n in ((0, 2), (1, 1)):  # batch b sees its first n keys only
        o_b = reference.attention(q[b:b + 1], k[b:b + 1, :n], v[b:b + 1, :n])
        torch.testing.assert_close(o[b:b + 1], o_b, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("how", ["bool-mask", "neg-inf-bias", "causal-offset", "window"])
def test_fully_masked_rows(how):
    torch.manual_seed(0)
    q = torch.randn(1, 3, 1, 4, dtype=F64, requires_grad=True)
    k = torch.randn(1, 3, 1, 4, dtype=F64, requires_grad=True)
    v = torch.randn(1, 3, 1, 4, dtype=F64, requires_grad=True)
    kw = {}
    if how == "bool-mask":
        kw["mask"] = torch.tensor([[True, True, True], [False, False, False], [True, False, True]])
    elif how == "neg-inf-bias":
        kw["mask"] = t([[0.0, 0.0, 0.0], [-math.inf, -math.inf, -math.inf], [0.0, -math.inf, 1.0]]).requires_grad_()
    elif how == "causal-offset":
        kw.update(causal=True, causal_offset=-1)  # row 0 sees nothing
    else:
        kw.update(window=(0, 0), causal_offset=3)  # rows see key i + 3: none exists
    o, lse = reference.attention(q, k, v, return_lse=True, **kw)
    empty = {"bool-mask": [1], "neg-inf-bias": [1], "causal-offset": [0], "window": [0, 1, 2]}[how]
    for i in range(3):
        if i in empty:
            assert (o[0, i] == 0).all()
            assert lse[0, 0, i].item() == -math.inf
        else:
            assert torch.isfinite(lse[0, 0, i])
    inputs = [q, k, v] + ([kw["mask"]] if how == "neg-inf-bias" else [])
    grads = torch.autograd.grad((o * torch.randn_like(o)).sum(), inputs)
    for g in grads:
        assert torch.isfinite(g).all()
    for i in empty:
        assert (grads[0][0, i] == 0).all()
    if how == "neg-inf-bias":
        assert (grads[3][1] == 0).all()


def test_dropout_is_explicit_keep_mask():
    torch.manual_seed(1)
    B, Sq, Sk, H, D, p, seed = 2, 5, 7, 2, 3, 0.4, 1234
    q, k, v = (torch.randn(B, s, H, D, dtype=F64) for s in (Sq, Sk, Sk))
    o = reference.attention(q, k, v, dropout_p=p, seed=seed)
    keep = dropout_mask(seed, B, H, Sq, Sk, p)  # [B, H, Sq, Sk]
    scores = torch.einsum("bihd,bjhd->bhij", q, k) / math.sqrt(D)
    P = torch.softmax(scores, dim=-1) * keep / (1 - p)
    expected = torch.einsum("bhij,bjhd->bihd", P, v)
    torch.testing.assert_close(o, expected, rtol=1e-12, atol=1e-12)
    assert not torch.equal(o, reference.attention(q, k, v))


def test_gqa_head_mapping():
    torch.manual_seed(2)
    B, S, Hq, Hkv, D = 1, 4, 6, 2, 3
    q = torch.randn(B, S, Hq, D, dtype=F64)
    k = torch.randn(B, S, Hkv, D, dtype=F64)
    v = torch.randn(B, S, Hkv, D, dtype=F64)
    o = reference.attention(q, k, v)
    g = Hq // Hkv
    for h in range(Hq):
        scores = q[0, :, h] @ k[0, :, h // g].T / math.sqrt(D)
        torch.testing.assert_close(o[0, :, h], torch.softmax(scores, -1) @ v[0, :, h // g], rtol=1e-12, atol=1e-12)


def test_lse_dtype():
    q = torch.randn(1, 2, 1, 4)
    _, lse32 = reference.attention(q, q, q, return_lse=True)
    _, lse64 = reference.attention(q.double(), q.double(), q.double(), return_lse=True)
    assert lse32.dtype == torch.float32 and lse64.dtype == F64
