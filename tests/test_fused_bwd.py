"""The opt-in fused backward (`TileConfig.fused_dq` on the dK/dV entry): dQ accumulated
with atomics inside the dK/dV kernel must equal the split backward's dQ (and leave dK,
dV, dmask unchanged), over the features that touch the score tile; deterministic=True
must ignore it.  Likewise `TileConfig.split_kv` (dV and dK in two launches of the dK/dV
kernel): bitwise the one-launch gradients, alone and with fused_dq.  On the CPU the kernels run in the Triton interpreter; on a GPU these
run as they are."""
import pytest
import torch

import flashforge
from flashforge.ops.triton import configs
from helpers import HAS_TRITON, INTERPRET

pytestmark = pytest.mark.skipif(not (HAS_TRITON and (INTERPRET or torch.cuda.is_available())),
                                reason="needs triton, with CUDA or TRITON_INTERPRET=1")
DEV = "cuda" if torch.cuda.is_available() and not INTERPRET else "cpu"


def _grads(fn, leaves, fused, monkeypatch, split_kv=False):
    real = configs.get_config

    def pick(kind, d, e, i, **kw):
        cfg = real(kind, d, e, i, **kw)
        return configs.TileConfig(cfg.block_m, cfg.block_n, cfg.num_warps, cfg.num_stages,
                                  fused_dq=fused and kind == "bwd_kv", split_kv=split_kv and kind == "bwd_kv")
    monkeypatch.setattr("flashforge.ops.triton.attention.get_config", pick)
    xs = [t.detach().clone().requires_grad_(True) for t in leaves]
    out = fn(*xs)
    out = out[0] if isinstance(out, tuple) else out
    gen = torch.Generator().manual_seed(5)
    out.backward(torch.randn(out.shape, generator=gen).to(out.device))
    return [x.grad for x in xs]


CASES = {
    "plain-D40": dict(shape=(2, 19, 19, 2, 2, 40), kw=dict()),
    "causal-gqa": dict(shape=(2, 37, 37, 4, 2, 32), kw=dict(causal=True)),
    "window-offset-softcap": dict(shape=(1, 20, 45, 2, 1, 16), kw=dict(window=(7, 3), causal_offset=20, softcap=3.0)),
    "dropout-alibi": dict(shape=(2, 33, 40, 2, 2, 16), kw=dict(dropout_p=0.25, seed=11, causal=True,
                                                               alibi=True)),
    "bias-grad": dict(shape=(2, 21, 35, 2, 1, 16), kw=dict(bias=True)),
}


def _case(name):
    c = CASES[name]
    B, Sq, Sk, Hq, Hkv, D = c["shape"]
    kw = dict(c["kw"])
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(B, Sq, Hq, D, generator=gen).to(DEV)
    k, v = (torch.randn(B, Sk, Hkv, D, generator=gen).to(DEV) for _ in range(2))
    leaves = [q, k, v]
    if kw.pop("alibi", False):
        kw["alibi_slopes"] = torch.rand(B, Hq, generator=gen).to(DEV)
    if kw.pop("bias", False):
        leaves.append(torch.randn(B, 1, Sq, Sk, generator=gen).to(DEV))

        def fn(q, k, v, m):
            return flashforge.attention(q, k, v, mask=m, backend="triton", **kw)
    else:
        def fn(q, k, v):
            return flashforge.attention(q, k, v, backend="triton", return_lse=True, **kw)
    return fn, leaves


@pytest.mark.parametrize("name", list(CASES))
def test_fused_dq_matches_split(name, monkeypatch):
    fn, leaves = _case(name)
    split = _grads(fn, leaves, False, monkeypatch)
    fused = _grads(fn, leaves, True, monkeypatch)
    for name_, a, b in zip("q k v mask".split(), fused, split):
        assert torch.isfinite(a).all(), name_
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=f"d{name_}")


def test_fused_dq_varlen(monkeypatch):
    gen = torch.Generator().manual_seed(3)
    lens = [5, 17, 1, 30]
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32).to(DEV)
    total, H, D = sum(lens), 2, 16
    q, k, v = (torch.randn(total, H, D, generator=gen).to(DEV) for _ in range(3))

    def fn(q, k, v):
        return flashforge.attention_varlen(q, k, v, cu, cu, max(lens), max(lens), causal=True, backend="triton")
    split = _grads(fn, [q, k, v], False, monkeypatch)
    fused = _grads(fn, [q, k, v], True, monkeypatch)
    for a, b in zip(fused, split):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_deterministic_ignores_fused_dq(monkeypatch):
    gen = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(1, 24, 2, 16, generator=gen).to(DEV) for _ in range(3))

    def fn(q, k, v):
        return flashforge.attention(q, k, v, causal=True, deterministic=True, backend="triton")
    split = _grads(fn, [q, k, v], False, monkeypatch)
    fused = _grads(fn, [q, k, v], True, monkeypatch)
    for a, b in zip(fused, split):
        assert torch.equal(a, b)


@pytest.mark.parametrize("name", list(CASES))
def test_split_kv_is_bitwise_the_one_launch_backward(name, monkeypatch):
    """dV (PART 1) and dK (PART 2) in two launches: the same tiles in the same order, so the
    same bits as PART 0; with fused_dq the dQ atomics move to the dK launch."""
    fn, leaves = _case(name)
    one = _grads(fn, leaves, False, monkeypatch)
    two = _grads(fn, leaves, False, monkeypatch, split_kv=True)
    for name_, a, b in zip("q k v mask".split(), two, one):
        assert torch.isfinite(a).all(), name_
        assert torch.equal(a, b), f"d{name_}"
    fused = _grads(fn, leaves, True, monkeypatch)
    fused_two = _grads(fn, leaves, True, monkeypatch, split_kv=True)
    for name_, a, b in zip("q k v mask".split(), fused_two, fused):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=f"d{name_}")


def test_split_kv_varlen_deterministic(monkeypatch):
    gen = torch.Generator().manual_seed(6)
    lens = [5, 17, 1, 30]
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32).to(DEV)
    total, Hq, Hkv, D = sum(lens), 4, 2, 16
    q = torch.randn(total, Hq, D, generator=gen).to(DEV)
    k, v = (torch.randn(total, Hkv, D, generator=gen).to(DEV) for _ in range(2))

    def fn(q, k, v):
        return flashforge.attention_varlen(q, k, v, cu, cu, max(lens), max(lens), causal=True, window=(9, 0),
                                           deterministic=True, backend="triton")
    one = _grads(fn, [q, k, v], False, monkeypatch)
    two = _grads(fn, [q, k, v], False, monkeypatch, split_kv=True)
    again = _grads(fn, [q, k, v], True, monkeypatch, split_kv=True)  # deterministic: fused_dq ignored
    for a, b, c in zip(two, one, again):
        assert torch.equal(a, b) and torch.equal(c, b)
