"""SPEC section 5: bad input raises ValueError / TypeError at the public layer,
before any kernel, with a message naming the argument and the value received."""
import math

import numpy as np
import pytest
import torch

import flashforge
import flashforge.api.attention as api

B, SQ, SK, HQ, HKV, D, DV = 2, 5, 7, 4, 2, 16, 8


def qkv(**over):
    shapes = dict(q=(B, SQ, HQ, D), k=(B, SK, HKV, D), v=(B, SK, HKV, DV))
    out = {}
    for name, shape in shapes.items():
        x = over.get(name, shape)
        out[name] = torch.randn(x) if isinstance(x, tuple) else x
    return out["q"], out["k"], out["v"]


@pytest.fixture(autouse=True)
def no_kernels(monkeypatch):
    """Validation must finish before any backend runs: reaching one is a test failure."""
    def forbidden(*args, **kwargs):
        raise AssertionError("a backend was reached: the input should have been rejected first")
    monkeypatch.setattr(api, "attention_function", forbidden)


def call(**kw):
    tensors = {n: kw.pop(n) for n in ("q", "k", "v") if n in kw}
    q, k, v = qkv(**tensors)
    return flashforge.attention(q, k, v, **kw)


CASES = [
    # what is wrong, exception, message pattern, call arguments
    pytest.param(TypeError, r"q must be a torch\.Tensor, got list", dict(q=[[1.0]]), id="q-list"),
    pytest.param(TypeError, r"k must be a torch\.Tensor, got NoneType", dict(k=None), id="k-None"),
    pytest.param(TypeError, r"v must be a torch\.Tensor, got ndarray", dict(v=np.zeros((B, SK, HKV, DV))),
                 id="v-numpy"),
    pytest.param(ValueError, r"q has rank 5", dict(q=(1, B, SQ, HQ, D)), id="q-rank-5"),
    pytest.param(ValueError, r"q has rank 1", dict(q=(D,), k=(D,), v=(D,)), id="q-rank-1"),
    pytest.param(ValueError, r"k has rank 3 .* but q has rank 4", dict(k=(B, SK, D)), id="k-rank"),
    pytest.param(ValueError, r"v has rank 3 .* but q has rank 4", dict(v=(B, SK, DV)), id="v-rank"),
    pytest.param(ValueError, r"batch sizes differ: q has 2, k has 3", dict(k=(3, SK, HKV, D)), id="batch-k"),
    pytest.param(ValueError, r"batch sizes differ: q has 2, k has 2, v has 1", dict(v=(1, SK, HKV, DV)),
                 id="batch-v"),
    pytest.param(ValueError, r"head_dim of q \(16\) and k \(8\) must match", dict(k=(B, SK, HKV, 8)),
                 id="head-dim-qk"),
    pytest.param(ValueError, r"k and v must have the same sequence length; got 7 and 6",
                 dict(v=(B, 6, HKV, DV)), id="seq-kv"),
    pytest.param(ValueError, r"k and v must have the same number of heads; got 2 and 1",
                 dict(v=(B, SK, 1, DV)), id="heads-kv"),
    pytest.param(ValueError, r"num_heads \(12\) must be a multiple of num_kv_heads \(5\)",
                 dict(q=(B, SQ, 12, D), k=(B, SK, 5, D), v=(B, SK, 5, DV)), id="gqa-12-5"),
    pytest.param(ValueError, r"num_heads \(2\) must be a multiple of num_kv_heads \(4\)",
                 dict(q=(B, SQ, 2, D), k=(B, SK, 4, D), v=(B, SK, 4, DV)), id="gqa-fewer-q-heads"),
    pytest.param(ValueError, r"head_dim of q/k is 257; accepted: 1\.\.256",
                 dict(q=(1, 2, 1, 257), k=(1, 2, 1, 257), v=(1, 2, 1, 4)), id="D-257"),
    pytest.param(ValueError, r"head_dim of q/k is 0; accepted: 1\.\.256",
                 dict(q=(1, 2, 1, 0), k=(1, 2, 1, 0), v=(1, 2, 1, 4)), id="D-0"),
    pytest.param(ValueError, r"head_dim of v is 300; accepted: 1\.\.256",
                 dict(q=(1, 2, 1, 4), k=(1, 2, 1, 4), v=(1, 2, 1, 300)), id="Dv-300"),
    # dtypes and devices
    pytest.param(ValueError, r"q has dtype torch\.int64; accepted: float16, bfloat16, float32",
                 dict(q=torch.ones(B, SQ, HQ, D, dtype=torch.int64)), id="q-int"),
    pytest.param(ValueError, r"q has dtype torch\.float64", dict(q=torch.ones(B, SQ, HQ, D, dtype=torch.float64)),
                 id="q-float64"),
    pytest.param(ValueError, r"v has dtype torch\.bool", dict(v=torch.ones(B, SK, HKV, DV, dtype=torch.bool)),
                 id="v-bool"),
    pytest.param(ValueError, r"q, k, v must share a dtype; got torch\.float32, torch\.float16",
                 dict(k=torch.ones(B, SK, HKV, D, dtype=torch.float16)), id="dtype-mismatch"),
    pytest.param(ValueError, r"k is on meta but q is on cpu", dict(k=torch.empty(B, SK, HKV, D, device="meta")),
                 id="device-mismatch"),
    # mask
    pytest.param(TypeError, r"mask must be a torch\.Tensor, got list", dict(mask=[[True]]), id="mask-list"),
    pytest.param(ValueError, r"mask has dtype torch\.int64; accepted: torch\.bool .* or a float dtype",
                 dict(mask=torch.ones(SQ, SK, dtype=torch.int64)), id="mask-int"),
    pytest.param(ValueError, r"mask has shape \(7,\); it must have rank 2\.\.4",
                 dict(mask=torch.ones(SK, dtype=torch.bool)), id="mask-rank-1"),
    pytest.param(ValueError, r"mask has shape \(1, 2, 4, 5, 7\); it must have rank 2\.\.4",
                 dict(mask=torch.ones(1, B, HQ, SQ, SK, dtype=torch.bool)), id="mask-rank-5"),
    pytest.param(ValueError, r"mask of shape \(2, 4, 5, 8\) is not broadcastable to the scores' shape "
                             r"\(2, 4, 5, 7\)", dict(mask=torch.ones(B, HQ, SQ, SK + 1, dtype=torch.bool)),
                 id="mask-Sk"),
    pytest.param(ValueError, r"mask of shape \(3, 5, 7\) is not broadcastable",
                 dict(mask=torch.ones(3, SQ, SK)), id="mask-heads"),
    pytest.param(ValueError, r"mask of shape \(2, 1, 7\) is not broadcastable",
                 dict(mask=torch.ones(B, 1, SK)), id="mask-B-as-heads"),
    pytest.param(ValueError, r"mask is on meta but q is on cpu",
                 dict(mask=torch.empty(SQ, SK, dtype=torch.bool, device="meta")), id="mask-device"),
    # dropout and seed
    pytest.param(ValueError, r"dropout_p must be < 1\.0, got 1\.0", dict(dropout_p=1.0), id="dropout-1"),
    pytest.param(ValueError, r"dropout_p must be >= 0\.0, got -0\.1", dict(dropout_p=-0.1), id="dropout-neg"),
    pytest.param(ValueError, r"dropout_p must be finite", dict(dropout_p=math.nan), id="dropout-nan"),
    pytest.param(TypeError, r"dropout_p must be a float, got str", dict(dropout_p="0.1"), id="dropout-str"),
    pytest.param(TypeError, r"dropout_p must be a float, got bool", dict(dropout_p=True), id="dropout-bool"),
    pytest.param(ValueError, r"seed must be >= 0, got -1", dict(dropout_p=0.1, seed=-1), id="seed-neg"),
    pytest.param(ValueError, r"seed must be <= 9223372036854775807", dict(dropout_p=0.1, seed=2**63),
                 id="seed-2**63"),
    pytest.param(TypeError, r"seed must be an int, got float", dict(dropout_p=0.1, seed=1.5), id="seed-float"),
    pytest.param(TypeError, r"seed must be an int, got float", dict(seed=3.0), id="seed-float-no-dropout"),
    # window
    pytest.param(ValueError, r"window must be a positive int .*, got 0", dict(window=0), id="window-0"),
    pytest.param(ValueError, r"window must be a positive int .*, got -3", dict(window=-3), id="window-neg"),
    pytest.param(ValueError, r"window left must be >= 0, or -1 for unbounded; got -2", dict(window=(-2, 0)),
                 id="window-left-(-2)"),
    pytest.param(ValueError, r"window right must be >= 0, or -1 for unbounded; got -5", dict(window=(3, -5)),
                 id="window-right-(-5)"),
    pytest.param(TypeError, r"window\[0\] \(left\) must be an int, got str", dict(window=("a", 1)),
                 id="window-str"),
    pytest.param(TypeError, r"window\[1\] \(right\) must be an int, got float", dict(window=(1, 2.0)),
                 id="window-float-side"),
    pytest.param(TypeError, r"window must be None, an int or a \(left, right\) pair, got \(1, 2, 3\)",
                 dict(window=(1, 2, 3)), id="window-3-tuple"),
    pytest.param(TypeError, r"window must be None, an int or a \(left, right\) pair, got True", dict(window=True),
                 id="window-bool"),
    pytest.param(TypeError, r"window must be None, an int or a \(left, right\) pair, got 2\.5", dict(window=2.5),
                 id="window-float"),
    # causal and its offset
    pytest.param(TypeError, r"causal must be a bool, got str", dict(causal="yes"), id="causal-str"),
    pytest.param(TypeError, r"causal_offset must be an int, an int32/int64 tensor \[B\] or 'bottom_right', "
                 r"got float \(1\.5\)", dict(causal_offset=1.5), id="offset-float"),
    pytest.param(TypeError, r"causal_offset must be an int, an int32/int64 tensor \[B\] or 'bottom_right', got bool",
                 dict(causal=True, causal_offset=True), id="offset-bool"),
    pytest.param(ValueError, r"causal_offset string must be 'bottom_right' \(offset Sk - Sq per sequence\), "
                 r"got 'top_left'", dict(causal=True, causal_offset="top_left"), id="offset-str"),
    pytest.param(ValueError, r"causal_offset tensor has dtype torch\.float32; accepted: int32 or int64",
                 dict(causal=True, causal_offset=torch.zeros(B)), id="offset-tensor-float"),
    pytest.param(ValueError, r"causal_offset tensor has shape \(3,\); accepted: \[B\] = \[2\]",
                 dict(causal=True, causal_offset=torch.zeros(B + 1, dtype=torch.int32)), id="offset-tensor-B+1"),
    pytest.param(ValueError, r"causal_offset tensor has shape \(2, 1\); accepted: \[B\] = \[2\]",
                 dict(causal=True, causal_offset=torch.zeros(B, 1, dtype=torch.int64)), id="offset-tensor-2d"),
    pytest.param(ValueError, r"causal_offset tensor has shape \(\); accepted: \[B\] = \[2\]",
                 dict(causal=True, causal_offset=torch.tensor(3)), id="offset-tensor-0d"),
    pytest.param(ValueError, r"causal_offset is on meta but q is on cpu",
                 dict(causal=True, causal_offset=torch.zeros(B, dtype=torch.int32, device="meta")),
                 id="offset-tensor-device"),
    # ALiBi slopes
    pytest.param(ValueError, r"alibi_slopes has shape \(3,\); accepted: \[Hq\] = \[4\] or \[B, Hq\] = \[2, 4\]",
                 dict(alibi_slopes=torch.ones(3)), id="alibi-shape"),
    pytest.param(ValueError, r"alibi_slopes has dtype torch\.int64; accepted: a float dtype",
                 dict(alibi_slopes=torch.ones(4, dtype=torch.int64)), id="alibi-int"),
    pytest.param(TypeError, r"alibi_slopes must be a torch\.Tensor, got list",
                 dict(alibi_slopes=[0.5] * 4), id="alibi-list"),
    pytest.param(ValueError, r"alibi_slopes is on meta but q is on cpu",
                 dict(alibi_slopes=torch.ones(4, device="meta")), id="alibi-device"),
    # scalars
    pytest.param(ValueError, r"softcap must be >= 0\.0, got -1\.0", dict(softcap=-1.0), id="softcap-neg"),
    pytest.param(ValueError, r"softcap must be finite, got inf", dict(softcap=math.inf), id="softcap-inf"),
    pytest.param(TypeError, r"softcap must be a float, got str", dict(softcap="1"), id="softcap-str"),
    pytest.param(TypeError, r"scale must be a float, got str", dict(scale="0.1"), id="scale-str"),
    pytest.param(ValueError, r"scale must be finite, got nan", dict(scale=math.nan), id="scale-nan"),
    pytest.param(ValueError, r"backend must be None, 'triton' or 'torch', got 'cuda'", dict(backend="cuda"),
                 id="backend-cuda"),
    pytest.param(ValueError, r"backend must be None, 'triton' or 'torch', got 'Torch'", dict(backend="Torch"),
                 id="backend-case"),
]


@pytest.mark.parametrize("exc, match, kwargs", CASES)
def test_attention_rejects(exc, match, kwargs):
    with pytest.raises(exc, match=match):
        call(**kwargs)


@pytest.mark.parametrize("exc, match, args", [
    pytest.param(ValueError, r"seed must be >= 0", (-1, 1, 1, 2, 2, 0.5), id="seed-neg"),
    pytest.param(TypeError, r"seed must be an int", (0.5, 1, 1, 2, 2, 0.5), id="seed-float"),
    pytest.param(ValueError, r"B must be >= 0, got -1", (0, -1, 1, 2, 2, 0.5), id="B-neg"),
    pytest.param(TypeError, r"Sk must be an int", (0, 1, 1, 2, 2.0, 0.5), id="Sk-float"),
    pytest.param(ValueError, r"p must be < 1\.0", (0, 1, 1, 2, 2, 1.0), id="p-1"),
    pytest.param(ValueError, r"p must be >= 0\.0", (0, 1, 1, 2, 2, -0.5), id="p-neg"),
])
def test_dropout_mask_rejects(exc, match, args):
    with pytest.raises(exc, match=match):
        flashforge.dropout_mask(*args)


def test_mask_rank_limited_by_input_rank():
    """A [S, D] call has scores [Sq, Sk]: a 3-D mask is not accepted."""
    q = torch.randn(SQ, D)
    k = torch.randn(SK, D)
    with pytest.raises(ValueError, match=r"mask has shape \(1, 5, 7\); it must have rank 2\.\.2"):
        flashforge.attention(q, k, k, mask=torch.ones(1, SQ, SK, dtype=torch.bool))


def test_flat_layout_mask_batch_checked():
    """Flat [N, S, D]: scores are [N, Sq, Sk]; a mask with another N is rejected."""
    q = torch.randn(3, SQ, D)
    k = torch.randn(3, SK, D)
    with pytest.raises(ValueError, match=r"mask of shape \(2, 5, 7\) is not broadcastable .* \(3, 5, 7\)"):
        flashforge.attention(q, k, k, mask=torch.ones(2, SQ, SK, dtype=torch.bool))


def test_valid_call_reaches_backend():
    """The `no_kernels` guard itself: a valid call gets past validation."""
    with pytest.raises(AssertionError, match="a backend was reached"):
        call(causal=True, window=(3, -1), mask=torch.zeros(SQ, SK), dropout_p=0.1, seed=7, softcap=5.0)
