"""The decoding-step route on the CPU (`flashforge.ops.attention_cpu_decode`): PyTorch's CPU flash
kernel a chunk of keys at a time, the parts merged once by their lse.

Served calls are checked against the float64 reference with the chunk shrunk (`small_chunks`), so
that odd key counts end in a short chunk and many parts are merged, and each test asserts that
the route really served the call (`calls`): a `serves` that stopped accepting would otherwise pass
on another path.  The calls it must not take and reproducibility are checked on their own.
"""
import pytest
import torch

import flashforge
from flashforge import reference
from flashforge.ops import attention_cpu_aten as aten
from flashforge.ops import attention_cpu_decode as decode
from flashforge.ops.params import AttnParams
from helpers import Case, check_case, make_inputs, with_


@pytest.fixture
def calls(monkeypatch):
    """Counts the route's forwards and the kernel backward's runs: {"fwd": n, "bwd": n}."""
    count = {"fwd": 0, "bwd": 0}

    def counted(name, module, fn):
        def run(*args, **kw):
            count[name] += 1
            return fn(*args, **kw)
        monkeypatch.setattr(module, fn.__name__, run)
    counted("fwd", decode, decode.forward)
    counted("bwd", aten, aten.backward)
    return count


@pytest.fixture(params=[1, 5, 16], ids=["chunk1", "chunk5", "chunk16"])
def small_chunks(request, monkeypatch):
    monkeypatch.setattr(decode, "KEY_CHUNK", request.param)


def case(id, **kw):
    return pytest.param(Case(**{"Sq": 1, **kw}), id=id)


SERVED = [
    case("Sk17", Sk=17),
    case("Sk40-D40-B1", B=1, Sk=40, D=40, Hq=3, Hkv=3),
    case("Sk33-D64-B3", B=3, Sk=33, D=64),
    case("causal-offset-Sk-1", Sk=37, causal=True, causal_offset=36),
    case("causal-offset-beyond", Sk=20, causal=True, causal_offset=50),
    case("causal-bottom-right", Sk=29, causal=True, causal_offset="bottom_right"),
    case("bhsd", Sk=31, layout="bhsd"),
    case("scale", Sk=23, scale=0.7),
    case("sharp", Sk=26, input_scale=3.0),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("c", SERVED)
def test_served_against_reference(c, dtype, small_chunks, calls):
    """o, lse, dq, dk, dv against float64 (helpers.compare), o and lse contiguous; the backward is
    the kernel's unless lse has a gradient (then the chunked path's)."""
    if decode.KEY_CHUNK >= c.Sk:
        pytest.skip("one chunk: not this route")
    ours = check_case(c, "torch", dtype=dtype)
    assert ours["o"].is_contiguous() and ours["lse"].is_contiguous()
    assert calls["fwd"] == 1
    assert calls["bwd"] == 0
    check_case(with_(c, lse_grad=False), "torch", dtype=dtype)
    assert calls == {"fwd": 2, "bwd": 1}


def _params(**kw) -> AttnParams:
    return AttnParams(**{"scale": 0.25, **kw})


NOT_SERVED = {
    "two-queries": dict(Sq=2),
    "gqa": dict(Hkv=1),
    "one-chunk": dict(Sk=decode.KEY_CHUNK),
    "causal-offset-short": dict(params=_params(window_right=0, offset=decode.KEY_CHUNK)),  # sees Sk - 1 keys
    "mask": dict(mask=True),
    "dropout": dict(params=_params(dropout_p=0.1, seed=1)),
    "window": dict(params=_params(window_left=3, window_right=0, offset=10**6)),
    "float64": dict(dtype=torch.float64),
}


def _call(Sq=1, Sk=decode.KEY_CHUNK + 2, Hkv=2, dtype=torch.float32):
    return (torch.zeros(2, Sq, 2, 8, dtype=dtype), torch.zeros(2, Sk, Hkv, 8, dtype=dtype),
            torch.zeros(2, Sk, Hkv, 8, dtype=dtype))


@pytest.mark.parametrize("why", NOT_SERVED, ids=list(NOT_SERVED))
def test_serves_only_decoding_steps(why):
    spec = dict(NOT_SERVED[why])
    assert decode.serves(*_call(), None, _params())
    assert decode.serves(*_call(), None, _params(window_right=0, offset=decode.KEY_CHUNK + 1))  # sees every key
    params = spec.pop("params", _params())
    with_mask = spec.pop("mask", False)
    q, k, v = _call(**spec)
    mask = torch.ones(1, 1, q.shape[1], k.shape[1], dtype=torch.bool) if with_mask else None
    assert not decode.serves(q, k, v, mask, params)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_bitwise_reproducible(dtype, calls, monkeypatch):
    monkeypatch.setattr(decode, "KEY_CHUNK", 6)
    c = Case(B=2, Sq=1, Sk=45, Hq=3, Hkv=3, lse_grad=False)
    runs = []
    for _ in range(2):
        inputs = make_inputs(c, dtype=dtype)
        o, lse = flashforge.attention(inputs.q, inputs.k, inputs.v, return_lse=True)
        runs.append((o, lse))
    assert calls["fwd"] == 2
    assert torch.equal(runs[0][0], runs[1][0]) and torch.equal(runs[0][1], runs[1][1])


def test_large_lse_takes_the_chunked_path(calls, monkeypatch):
    """|lse| above the kernel route's bound with a backward to follow: the chunked forward runs
    (it writes the lse_lo the backward needs); without one the route's result stands."""
    monkeypatch.setattr(decode, "KEY_CHUNK", 4)
    c = Case(B=1, Sq=1, Sk=16, D=16, lse_grad=False)
    inputs = make_inputs(c)
    for t in (inputs.q, inputs.k):
        t.detach()[..., 0] = 200.0
    q, k, v = (t.detach() for t in (inputs.q, inputs.k, inputs.v))
    want, want_lse = reference.attention(q.double(), k.double(), v.double(), return_lse=True)
    with torch.no_grad():
        o, lse = flashforge.attention(q, k, v, return_lse=True)
    assert calls == {"fwd": 1, "bwd": 0}
    assert bool(lse.abs().max() > aten.LSE_BOUND)
    # scores ~1e4 carry float32 rounding of ~1e-3 (on every path): P, and o, to about that
    torch.testing.assert_close(o.double(), want, rtol=0, atol=5e-3)
    torch.testing.assert_close(lse.double(), want_lse, rtol=1e-6, atol=0)
    flashforge.attention(inputs.q, inputs.k, inputs.v).backward(inputs.do)
    assert calls == {"fwd": 2, "bwd": 0}
