"""The route to PyTorch's own CPU flash kernel (`flashforge.ops.attention_cpu_aten`).

The calls it serves are checked against the float64 reference with the blocks shrunk
(`small_blocks`), so that causal calls are cut into many levels and low-precision keys
into many chunks, and each test asserts that the kernel really served the call (`calls`):
a `serves` that stopped accepting would otherwise pass on the chunked path.  The plan of
kernel calls is checked to cover every visible (query, key) pair exactly once, and the
calls it must not serve, the lse bound and reproducibility are checked on their own.
"""
import itertools

import pytest
import torch

import flashforge
from flashforge.autograd.attention import _forward_params
from flashforge.ops import attention_cpu_aten as aten
from flashforge.ops.params import AttnParams
from helpers import Case, check_case, make_inputs, with_


@pytest.fixture
def calls(monkeypatch):
    """Counts the kernel's forward and backward runs: {"fwd": n, "bwd": n}."""
    count = {"fwd": 0, "bwd": 0}

    def counted(name, fn):
        def run(*args, **kw):
            count[name] += 1
            return fn(*args, **kw)
        return run
    monkeypatch.setattr(aten, "forward", counted("fwd", aten.forward))
    monkeypatch.setattr(aten, "backward", counted("bwd", aten.backward))
    return count


@pytest.fixture(params=[(1, 3), (4, 8)], ids=["blocks1-chunks3", "blocks4-chunks8"])
def small_blocks(request, monkeypatch):
    """Causal cuts down to diagonal blocks of 1 or 4 rows; low-precision keys 3 or 8 at a time."""
    monkeypatch.setattr(aten, "MIN_BLOCK", request.param[0])
    monkeypatch.setattr(aten, "MULTI_THREAD_CUT_MAX", 2**30)  # cut whatever the thread count
    monkeypatch.setattr(aten, "KEY_CHUNK", request.param[1])


def case(id, **kw):
    return pytest.param(Case(**kw), id=id)


SERVED = [
    case("S1", B=2, Sq=1, Sk=1, D=16),
    case("S17-D40", Sq=17, Sk=17, D=40),
    case("S63-D96-causal", B=1, Sq=63, Sk=63, D=96, causal=True),
    case("S32-causal", B=2, Sq=32, Sk=32, Hq=3, Hkv=3, causal=True),
    case("S1000-causal", B=1, Sq=1000, Sk=1000, Hq=1, Hkv=1, D=16, causal=True),
    case("Sq17-Sk40", B=1, Sq=17, Sk=40, D=64),
    case("Sq64-Sk80", B=1, Sq=64, Sk=80, D=40),  # bfloat16: the kernel's own bfloat16 path
    case("decode-Sq1-Sk97", Sq=1, Sk=97, D=16),
    case("causal-offset+8", Sq=16, Sk=24, causal=True, causal_offset=8),
    case("causal-offset+5-Sk>Sq+off", Sq=16, Sk=40, causal=True, causal_offset=5),
    case("causal-Sq>Sk-off", Sq=16, Sk=10, causal=True, causal_offset=2),  # rows 8.. see every key
    case("causal-bottom-right", B=1, Sq=24, Sk=56, causal=True, causal_offset="bottom_right"),
    case("causal-decode", Sq=1, Sk=33, causal=True, causal_offset=32),
    case("causal-bhsd", Sq=32, Sk=32, causal=True, layout="bhsd"),
    case("bhsd-strides", Sq=17, Sk=33, layout="bhsd"),
    case("scale", Sq=20, Sk=20, causal=True, scale=0.3),
    case("gqa-4/2", B=2, Sq=17, Sk=33, Hq=4, Hkv=2),
    case("gqa-6/1-causal", B=2, Sq=32, Sk=32, Hq=6, Hkv=1, causal=True),
    case("gqa-4/2-causal-offset", B=2, Sq=32, Sk=48, Hq=4, Hkv=2, causal=True, causal_offset=16),
    case("gqa-4/2-causal-Sq>Sk-off", B=2, Sq=40, Sk=20, Hq=4, Hkv=2, causal=True, causal_offset=4),
    case("gqa-8/2-causal-decode", B=1, Sq=1, Sk=100, Hq=8, Hkv=2, causal=True, causal_offset=99),
    case("gqa-4/2-causal-bhsd", B=2, Sq=16, Sk=16, Hq=4, Hkv=2, causal=True, layout="bhsd"),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("c", SERVED)
def test_served_against_reference(c, dtype, small_blocks, calls):
    """o, lse, dq, dk, dv against float64 (helpers.compare), o and lse contiguous; the backward is
    the kernel's unless lse has a gradient (the kernel has none)."""
    ours = check_case(c, "torch", dtype=dtype)
    assert ours["o"].is_contiguous() and ours["lse"].is_contiguous()
    assert calls["fwd"] == 1
    assert calls["bwd"] == (0 if c.lse_grad else 1)
    check_case(with_(c, lse_grad=False), "torch", dtype=dtype)
    assert calls == {"fwd": 2, "bwd": 1}


def _params(**kw) -> AttnParams:
    return AttnParams(**{"scale": 0.25, **kw})


NOT_SERVED = {
    "mask": dict(mask=True),
    "dropout": dict(params=_params(dropout_p=0.1, seed=1)),
    "softcap": dict(params=_params(softcap=5.0)),
    "alibi": dict(params=_params(alibi_slopes=torch.ones(2, 2))),
    "window": dict(params=_params(window_left=3, window_right=0)),
    "window-right": dict(params=_params(window_right=2)),
    "causal-negative-offset": dict(params=_params(window_right=0, offset=-1)),
    "causal-offset-tensor": dict(params=_params(window_right=0, offset_tensor=torch.tensor([0, 0]).int())),
    "dv-not-d": dict(Dv=8),
    "float64": dict(dtype=torch.float64),
    "varlen": dict(params=_params(cu_seqlens_q=torch.tensor([0, 3]).int(), cu_seqlens_k=torch.tensor([0, 3]).int())),
}


def _call(dtype=torch.float32, Hkv=2, Dv=16):
    q = torch.zeros(2, 5, 2, 16, dtype=dtype)
    return q, torch.zeros(2, 7, Hkv, 16, dtype=dtype), torch.zeros(2, 7, Hkv, Dv, dtype=dtype)


@pytest.mark.parametrize("why", NOT_SERVED, ids=list(NOT_SERVED))
def test_serves_only_what_it_computes(why):
    spec = dict(NOT_SERVED[why])
    assert aten.serves(*_call(), None, _params(window_right=0))  # plain causal: served
    params = spec.pop("params", _params())
    mask = torch.ones(1, 1, 5, 7, dtype=torch.bool) if spec.pop("mask", False) else None
    assert not aten.serves(*_call(**spec), mask, params)


@pytest.mark.parametrize("Sq,Sk,c", [(16, 16, 0), (16, 16, 3), (13, 30, 5), (16, 10, 2), (24, 24, None),
                                     (8, 8, 7), (8, 8, 9), (1, 20, 19), (32, 32, 0), (12, 20, 0)])
@pytest.mark.parametrize("min_block,key_chunk", [(1, None), (2, None), (4, 3), (128, 5)])
def test_plan_covers_each_visible_pair_once(Sq, Sk, c, min_block, key_chunk, monkeypatch):
    """Each kernel call covers its rows x keys (a causal one the top-left triangle of each block):
    together they cover every visible (i, j) exactly once and nothing else."""
    monkeypatch.setattr(aten, "MIN_BLOCK", min_block)
    count = torch.zeros(Sq, Sk, dtype=torch.int64)
    for part in aten._plan(Sq, Sk, c, key_chunk):
        assert part.rows.n == part.keys.n
        rows = part.rows.of(torch.arange(Sq).view(1, Sq), 1)[0]  # [n, size]
        keys = part.keys.of(torch.arange(Sk).view(1, Sk), 1)[0]
        for r, k in zip(rows, keys):
            tile = torch.ones(len(r), len(k), dtype=torch.int64)
            if part.causal:
                tile = tile.tril()
            count[r.view(-1, 1), k.view(1, -1)] += tile
    i, j = torch.arange(Sq).view(-1, 1), torch.arange(Sk).view(1, -1)
    visible = torch.ones(Sq, Sk, dtype=torch.bool) if c is None else j <= i + c
    assert torch.equal(count, visible.long())


def test_causal_cut_levels():
    """A square of 2048 cut to blocks of 256: diagonal blocks (one call) and three levels of rectangles."""
    parts = aten._plan(2048, 2048, 0)
    assert [(p.rows.n, p.rows.size, p.causal) for p in parts] == [
        (8, 256, True), (1, 1024, False), (2, 512, False), (4, 256, False)]


@pytest.mark.parametrize("threads,N,cut", [(1, 1024, True), (2, 1024, False), (2, 512, True), (2, 2048, False)])
def test_cut_depends_on_threads(threads, N, cut):
    """On one thread every causal triangle is cut; on more, only those of at most
    MULTI_THREAD_CUT_MAX queries (the others run as one causal call)."""
    q = torch.zeros(1, N, 1, 8)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        parts = aten._parts(q, q, _params(window_right=0))
    finally:
        torch.set_num_threads(before)
    assert (len(parts) > 1) == cut
    if not cut:
        assert parts[0].causal and parts[0].rows.size == N


def test_large_lse_takes_the_chunked_path(calls):
    """|lse| above LSE_BOUND: the kernel's float32 lse is too coarse for the backward, so the chunked
    path computes the forward (writing lse_lo) and the backward; below it the kernel serves both
    and lse_lo is 0."""
    c = Case(B=1, Sq=16, Sk=16, D=16, causal=True, lse_grad=False)
    params = _params(window_right=0)
    for shift, kernel in ((10.0, True), (200.0, False)):
        inputs = make_inputs(c)
        for t in (inputs.q, inputs.k):
            t.detach()[..., 0] = shift  # every score + shift**2 / 4: lse ~ 28, then ~ 1e4
        q, k, v = (t.detach() for t in (inputs.q, inputs.k, inputs.v))
        _, lse, lse_lo = _forward_params(q, k, v, None, params, "torch")
        assert bool(lse.abs().max() <= aten.LSE_BOUND) == kernel
        assert bool((lse_lo == 0).all()) == kernel
        before = dict(calls)
        flashforge.attention(inputs.q, inputs.k, inputs.v, causal=True).backward(inputs.do)
        assert calls["bwd"] - before["bwd"] == int(kernel)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_bitwise_reproducible(dtype, small_blocks, calls):
    """The same call twice (a causal cut into levels, offset keys, deterministic=True): equal bits."""
    c = Case(B=2, Sq=32, Sk=40, Hq=2, Hkv=2, causal=True, causal_offset=8, lse_grad=False)
    runs = []
    for _ in range(2):
        inputs = make_inputs(c, dtype=dtype)
        o = flashforge.attention(inputs.q, inputs.k, inputs.v, causal=True, causal_offset=8, deterministic=True)
        runs.append([o.detach(), *torch.autograd.grad(o, (inputs.q, inputs.k, inputs.v), inputs.do)])
    assert calls == {"fwd": 2, "bwd": 2}
    for a, b in itertools.zip_longest(*runs):
        assert torch.equal(a, b)


@pytest.mark.parametrize("Sq,Sk,want", [(64, 80, torch.bfloat16), (64, 600, torch.float32), (8, 80, torch.float32)])
def test_bfloat16_runs_natively_only_when_short(Sq, Sk, want, monkeypatch):
    """A bfloat16 call of >= 64 queries and <= NATIVE_MAX_KEYS keys runs the kernel in bfloat16,
    others on float32 copies; both against the reference."""
    seen = []

    def fwd(q, *args, **kw):
        seen.append(q.dtype)
        return aten_fwd(q, *args, **kw)
    aten_fwd = aten._FWD
    monkeypatch.setattr(aten, "_FWD", fwd)
    check_case(Case(B=1, Sq=Sq, Sk=Sk, D=40, lse_grad=False), "torch", dtype=torch.bfloat16)
    assert seen and set(seen) == {want}
