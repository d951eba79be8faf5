"""The drop-in replacements: `flashforge.scaled_dot_product_attention` against PyTorch's own
SDPA (float64 run as the golden result, float32 run for PyTorch's own error), and
`flashforge.flash_attn_interface` against `flashforge.reference` with flash-attn's
bottom-right alignment (flash-attn itself needs CUDA and is not installed here), plus an
independent check of that alignment from flash-attn's documented examples.

The drop-ins take no backend argument: they run on the CPU path here; one test of each
routes them through the Triton kernels (the interpreter without a GPU).
"""
from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import flashforge
import flashforge.interfaces.flash_attn as fa_module
import flashforge.interfaces.sdpa as sdpa_module
from flashforge import reference
from flashforge.flash_attn_interface import (flash_attn_func, flash_attn_kvpacked_func, flash_attn_qkvpacked_func,
                                             flash_attn_varlen_func, flash_attn_varlen_kvpacked_func,
                                             flash_attn_varlen_qkvpacked_func, flash_attn_with_kvcache)
from flashforge.interfaces import SDPAInputError, scaled_dot_product_attention
from helpers import HAS_TRITON, INTERPRET, assert_close

needs_triton = pytest.mark.skipif(not (HAS_TRITON and (INTERPRET or torch.cuda.is_available())),
                                  reason="triton is not installed, or neither CUDA nor TRITON_INTERPRET=1")


def _leaf(shape, gen, grad=True, scale=1.0):
    return (torch.randn(shape, generator=gen) * scale).requires_grad_(grad)


def _copies(tensors, dtype):
    """Detached copies in `dtype` that keep requires_grad (bool masks stay bool)."""
    out = []
    for t in tensors:
        if t is None or t.dtype == torch.bool:
            out.append(t)
        else:
            out.append(t.detach().to(dtype).requires_grad_(t.requires_grad))
    return out


def torch_sdpa(*args, **kw):
    """PyTorch's SDPA on its math backend: the plain meaning, and the backend that enforces
    SDPA's documented rules (its CPU flash kernel, for one, rejects 1-D masks and combines
    is_causal with a mask)."""
    with sdpa_kernel(SDPBackend.MATH):
        return F.scaled_dot_product_attention(*args, **kw)


def _run(fn, tensors, do, **kw):
    """fn(*tensors, **kw) and the gradients of every tensor that requires grad, for upstream `do`."""
    out = fn(*tensors, **kw)
    o = out[0] if isinstance(out, tuple) else out
    leaves = [t for t in tensors if t is not None and t.requires_grad]
    grads = torch.autograd.grad(o, leaves, do.to(o.dtype)) if leaves else []
    return o, grads


# --------------------------------------------------------------------------------------------------
# scaled_dot_product_attention vs torch.nn.functional.scaled_dot_product_attention


def sdpa_case(id, q, k, v=None, mask=None, **kw):
    """mask: None, ("bool", shape), ("float", shape) (requires grad) or ("bool_rows", shape)."""
    return pytest.param(q, k, v or k, mask, kw, id=id)


SDPA_CASES = [
    sdpa_case("bhld", (2, 3, 9, 16), (2, 3, 9, 16)),
    sdpa_case("L<S", (2, 2, 5, 16), (2, 2, 11, 16)),
    sdpa_case("Ev!=E", (2, 2, 7, 16), (2, 2, 9, 16), (2, 2, 9, 8)),
    sdpa_case("L1-decode", (2, 2, 1, 16), (2, 2, 13, 16)),
    sdpa_case("L0", (2, 2, 0, 16), (2, 2, 7, 16)),
    sdpa_case("S0-zeros", (2, 2, 5, 16), (2, 2, 0, 16)),
    sdpa_case("causal", (2, 2, 9, 16), (2, 2, 9, 16), is_causal=True),
    sdpa_case("causal-L<S-top-left", (2, 2, 5, 16), (2, 2, 11, 16), is_causal=True),
    sdpa_case("causal-L>S-top-left", (2, 2, 11, 16), (2, 2, 5, 16), is_causal=True),
    sdpa_case("scale", (2, 2, 9, 16), (2, 2, 9, 16), scale=0.3),
    sdpa_case("scale-causal", (1, 2, 9, 16), (1, 2, 12, 16), scale=1.7, is_causal=True),
    sdpa_case("gqa-6/2", (2, 6, 7, 16), (2, 2, 9, 16), enable_gqa=True),
    sdpa_case("gqa-4/1-causal", (1, 4, 9, 16), (1, 1, 9, 16), enable_gqa=True, is_causal=True),
    sdpa_case("gqa-flag-equal-heads", (2, 2, 7, 16), (2, 2, 7, 16), enable_gqa=True),
    sdpa_case("kv-head-broadcast-no-flag", (2, 4, 7, 16), (2, 1, 9, 16)),
    sdpa_case("q-head-broadcast", (2, 1, 7, 16), (2, 3, 9, 16)),
    sdpa_case("unbatched-HLE", (3, 7, 16), (3, 9, 16)),
    sdpa_case("unbatched-mask", (3, 7, 16), (3, 9, 16), mask=("float", (3, 1, 9))),
    sdpa_case("2d-LE", (7, 16), (9, 16), mask=("bool", (7, 9))),
    sdpa_case("2d-LE-causal", (9, 16), (7, 16), is_causal=True),
    sdpa_case("5d", (2, 3, 2, 7, 16), (2, 3, 2, 9, 16), mask=("float", (3, 1, 7, 9))),
    sdpa_case("5d-kv-batch-broadcast", (2, 3, 2, 7, 16), (1, 3, 2, 9, 16), mask=("bool", (2, 1, 1, 1, 9))),
    sdpa_case("mixed-rank", (2, 2, 7, 16), (2, 9, 16)),
    *(sdpa_case(f"mask-bool-{'x'.join(map(str, s))}", (2, 3, 7, 16), (2, 3, 9, 16), mask=("bool", s))
      for s in ((7, 9), (1, 9), (2, 1, 7, 9), (1, 3, 7, 9), (2, 3, 7, 9), (2, 1, 1, 9), (3, 7, 9), (9,))),
    *(sdpa_case(f"mask-float-{'x'.join(map(str, s))}", (2, 3, 7, 16), (2, 3, 9, 16), mask=("float", s))
      for s in ((7, 9), (2, 1, 7, 9), (1, 3, 7, 9), (2, 3, 7, 9), (2, 1, 1, 9), (9,), ())),
    sdpa_case("mask-bool-empty-rows", (2, 2, 7, 16), (2, 2, 9, 16), mask=("bool_rows", (2, 1, 7, 9))),
    sdpa_case("mask-float-gqa", (2, 4, 7, 16), (2, 2, 9, 16), mask=("float", (1, 4, 7, 9)), enable_gqa=True),
]


def _sdpa_inputs(q_shape, k_shape, v_shape, mask, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q, k, v = _leaf(q_shape, gen), _leaf(k_shape, gen), _leaf(v_shape, gen)
    m = None
    if mask is not None:
        kind, shape = mask
        if kind.startswith("bool"):
            m = torch.rand(shape, generator=gen) < 0.7
            if kind == "bool_rows":
                m[..., 1::3, :] = False
        else:
            m = _leaf(shape, gen)
    return q, k, v, m


@pytest.mark.parametrize("q_shape,k_shape,v_shape,mask,kw", SDPA_CASES)
def test_sdpa_matches_torch(q_shape, k_shape, v_shape, mask, kw):
    q, k, v, m = _sdpa_inputs(q_shape, k_shape, v_shape, mask)
    gen = torch.Generator().manual_seed(1)
    o_ref = torch_sdpa(*_copies((q, k, v), torch.float64), attn_mask=m, **kw)
    do = torch.randn(o_ref.shape, generator=gen)

    def call(q, k, v, m, impl):
        return impl(q, k, v, attn_mask=m, **kw)

    ours, g_ours = _run(call, [q, k, v, m], do, impl=scaled_dot_product_attention)
    ref64, g_ref64 = _run(call, _copies((q, k, v, m), torch.float64), do, impl=torch_sdpa)
    ref32, g_ref32 = _run(call, _copies((q, k, v, m), torch.float32), do, impl=torch_sdpa)
    assert ours.dtype == q.dtype
    assert_close("o", ours, ref64, ref32, torch.float32)
    for name, a, b, c in zip(("dq", "dk", "dv", "dmask"), g_ours, g_ref64, g_ref32):
        assert_close(name, a, b, c, torch.float32)


def test_sdpa_fully_masked_rows_are_zero_like_torch():
    q, k, v, _ = _sdpa_inputs((1, 2, 5, 8), (1, 2, 6, 8), (1, 2, 6, 8), None)
    m = torch.ones(5, 6, dtype=torch.bool)
    m[2] = False
    ours = scaled_dot_product_attention(q, k, v, m)
    assert (ours[:, :, 2] == 0).all()
    torch.testing.assert_close(ours, F.scaled_dot_product_attention(q, k, v, m))


def _spy(monkeypatch, module):
    """Record the arguments the drop-in hands to flashforge.attention."""
    calls = []

    def spy(*args, **kwargs):
        calls.append((args, kwargs))
        return flashforge.attention(*args, **kwargs)

    monkeypatch.setattr(module, "attention", spy)
    return calls


def _same_storage(a, b):
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


@pytest.mark.parametrize("layout", ["bhld-contiguous", "blhd-transposed"])
def test_sdpa_passes_views_not_copies(monkeypatch, layout):
    calls = _spy(monkeypatch, sdpa_module)
    gen = torch.Generator().manual_seed(0)
    if layout == "bhld-contiguous":
        q, k, v = (torch.randn(2, 4, 9, 16, generator=gen) for _ in range(3))
    else:  # the usual model code: projections [B, L, H, E] viewed as [B, H, L, E]
        q, k, v = (torch.randn(2, 9, 4, 16, generator=gen).transpose(1, 2) for _ in range(3))
    mask = torch.randn(2, 1, 9, 9)
    o = scaled_dot_product_attention(q, k, v, mask)
    (q4, k4, v4), kw = calls[0]
    for x, x4 in ((q, q4), (k, k4), (v, v4)):
        assert _same_storage(x, x4) and x4.shape == (2, 9, 4, 16)
    assert _same_storage(mask, kw["mask"])
    assert o.shape == (2, 4, 9, 16)


def test_sdpa_gqa_is_native(monkeypatch):
    """enable_gqa reaches the kernels as Hkv < Hq: k and v are not repeated per query head."""
    calls = _spy(monkeypatch, sdpa_module)
    q, k, v, _ = _sdpa_inputs((2, 6, 7, 16), (2, 2, 9, 16), (2, 2, 9, 16), None)
    scaled_dot_product_attention(q, k, v, enable_gqa=True)
    (_, k4, v4), _ = calls[0]
    assert k4.shape == v4.shape == (2, 9, 2, 16)


def test_sdpa_keyword_only_like_torch():
    q = torch.randn(1, 1, 3, 8)
    for fn in (F.scaled_dot_product_attention, scaled_dot_product_attention):
        with pytest.raises(TypeError):
            fn(q, q, q, None, 0.0, False, 0.5)


SDPA_ERRORS = [
    # id, q, k, v shapes, kwargs (mask given as a tensor), torch backend that raises too
    pytest.param((8,), (8,), (8,), {}, id="rank-1"),
    pytest.param((2, 4, 5, 8), (2, 2, 7, 8), (2, 2, 7, 8), {}, id="gqa-without-enable_gqa"),
    pytest.param((2, 3, 5, 8), (2, 2, 7, 8), (2, 2, 7, 8), dict(enable_gqa=True), id="gqa-not-divisible"),
    pytest.param((2, 2, 5, 8), (2, 2, 7, 4), (2, 2, 7, 8), {}, id="E-mismatch"),
    pytest.param((2, 2, 5, 8), (2, 2, 7, 8), (2, 2, 7, 8), dict(attn_mask=torch.ones(5, 7, dtype=torch.int64)),
                 id="mask-int"),
    pytest.param((2, 2, 5, 8), (2, 2, 7, 8), (2, 2, 7, 8), dict(attn_mask=torch.zeros(5, 7, dtype=torch.float16)),
                 id="mask-f16-on-f32"),
    pytest.param((2, 2, 5, 8), (2, 2, 7, 8), (2, 2, 7, 8), dict(attn_mask=torch.ones(1, 2, 2, 5, 7)),
                 id="mask-rank-above-scores"),
    pytest.param((2, 2, 5, 8), (2, 2, 7, 8), (2, 2, 7, 8), dict(attn_mask=torch.ones(2, 5, 8, dtype=torch.bool)),
                 id="mask-not-broadcastable"),
    pytest.param((2, 2, 5, 8), (2, 2, 7, 8), (2, 2, 7, 8),
                 dict(attn_mask=torch.ones(5, 7, dtype=torch.bool), is_causal=True), id="causal-and-mask"),
    pytest.param((2, 2, 5, 8), (2, 2, 7, 8), (2, 2, 7, 8), dict(dropout_p=1.5), id="dropout-1.5"),
    pytest.param((2, 2, 5, 8), (3, 2, 7, 8), (3, 2, 7, 8), {}, id="batch-not-broadcastable"),
]


@pytest.mark.parametrize("q_shape,k_shape,v_shape,kw", SDPA_ERRORS)
def test_sdpa_rejects_what_torch_rejects(q_shape, k_shape, v_shape, kw):
    q, k, v = torch.randn(q_shape), torch.randn(k_shape), torch.randn(v_shape)
    with pytest.raises(RuntimeError):
        torch_sdpa(q, k, v, **kw)
    with pytest.raises(SDPAInputError) as info:
        scaled_dot_product_attention(q, k, v, **kw)
    assert isinstance(info.value, RuntimeError) and isinstance(info.value, ValueError)


def test_sdpa_error_messages_name_the_fix():
    q, kv = torch.randn(2, 4, 5, 8), torch.randn(2, 2, 7, 8)
    with pytest.raises(SDPAInputError, match=r"Hq=4 and Hkv=2; try setting enable_gqa=True"):
        scaled_dot_product_attention(q, kv, kv)
    with pytest.raises(SDPAInputError, match=r"attn_mask must be None when is_causal=True"):
        scaled_dot_product_attention(q, kv, kv, torch.ones(5, 7, dtype=torch.bool), is_causal=True, enable_gqa=True)
    with pytest.raises(TypeError, match=r"attn_mask must be a torch\.Tensor"):
        scaled_dot_product_attention(q, kv, kv, [[True]], enable_gqa=True)


@pytest.mark.parametrize("kw,pattern", [
    (dict(dtype=torch.float64), r"query has dtype torch\.float64; accepted: float16, bfloat16, float32"),
    (dict(dropout_p=1.0), r"dropout_p must be < 1"),
])
def test_sdpa_documented_differences_raise_valueerror(kw, pattern):
    x = torch.randn(1, 2, 5, 8, dtype=kw.pop("dtype", torch.float32))
    with pytest.raises(ValueError, match=pattern):
        scaled_dot_product_attention(x, x, x, **kw)


def test_sdpa_dropout_follows_torch_manual_seed():
    q, k, v, _ = _sdpa_inputs((2, 2, 9, 16), (2, 2, 11, 16), (2, 2, 11, 16), None)
    plain = scaled_dot_product_attention(q, k, v)
    torch.manual_seed(7)
    a = scaled_dot_product_attention(q, k, v, dropout_p=0.3)
    torch.manual_seed(7)
    b = scaled_dot_product_attention(q, k, v, dropout_p=0.3)
    torch.manual_seed(7)  # the same draw as flashforge.attention's seed=None
    c = flashforge.attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), dropout_p=0.3)
    next_draw = scaled_dot_product_attention(q, k, v, dropout_p=0.3)
    assert torch.equal(a, b)
    assert torch.equal(a, c.transpose(1, 2))
    assert not torch.equal(a, plain) and not torch.equal(a, next_draw)


@needs_triton
def test_sdpa_through_triton(monkeypatch):
    """The drop-in on the Triton kernels (the default for CUDA tensors)."""
    monkeypatch.setattr(sdpa_module, "attention", functools.partial(flashforge.attention, backend="triton"))
    device = "cuda" if torch.cuda.is_available() and not INTERPRET else "cpu"
    q, k, v, m = _sdpa_inputs((2, 4, 9, 16), (2, 2, 12, 16), (2, 2, 12, 16), ("float", (2, 1, 9, 12)))
    q, k, v, m = (t.detach().to(device).requires_grad_() for t in (q, k, v, m))
    do = torch.randn(2, 4, 9, 16, device=device)

    def call(q, k, v, m, impl):
        return impl(q, k, v, attn_mask=m, enable_gqa=True)

    ours, g_ours = _run(call, [q, k, v, m], do, impl=scaled_dot_product_attention)
    ref64, g_ref64 = _run(call, _copies((q, k, v, m), torch.float64), do, impl=torch_sdpa)
    ref32, g_ref32 = _run(call, _copies((q, k, v, m), torch.float32), do, impl=torch_sdpa)
    assert_close("o", ours, ref64, ref32, torch.float32)
    for name, a, b, c in zip(("dq", "dk", "dv", "dmask"), g_ours, g_ref64, g_ref32):
        assert_close(name, a, b, c, torch.float32)


# --------------------------------------------------------------------------------------------------
# flash_attn_interface vs flashforge.reference with flash-attn's bottom-right alignment


def fa_case(id, B=2, Sq=9, Sk=9, Hq=2, Hkv=2, D=16, Dv=None, alibi=None, **kw):
    """alibi: None, "H" (slopes [Hq]) or "BH" ([B, Hq])."""
    return pytest.param(dict(B=B, Sq=Sq, Sk=Sk, Hq=Hq, Hkv=Hkv, D=D, Dv=Dv or D, alibi=alibi), kw, id=id)


FA_CASES = [
    fa_case("plain"),
    fa_case("Sq<Sk", Sq=5, Sk=13),
    fa_case("causal", causal=True),
    fa_case("causal-Sq<Sk-bottom-right", Sq=5, Sk=13, causal=True),
    fa_case("causal-Sq>Sk-empty-rows", Sq=13, Sk=5, causal=True),
    fa_case("causal-decode-Sq1", Sq=1, Sk=17, causal=True),
    fa_case("window-(2,1)-Sq<Sk", Sq=7, Sk=12, window_size=(2, 1)),
    fa_case("window-(3,-1)-causal", Sq=9, Sk=14, window_size=(3, -1), causal=True),
    fa_case("window-(-1,2)", Sq=9, Sk=9, window_size=(-1, 2)),
    fa_case("window-(4,4)-causal-right-ignored", Sq=9, Sk=11, window_size=(4, 4), causal=True),
    fa_case("softcap", softcap=2.0, softmax_scale=0.8),
    fa_case("softmax_scale", Sq=7, Sk=11, softmax_scale=0.3, causal=True),
    fa_case("gqa-6/2", Hq=6, Hkv=2, Sq=7, Sk=10, causal=True),
    fa_case("mqa-4/1", Hq=4, Hkv=1, Sq=9, Sk=9),
    fa_case("Dv!=D", D=16, Dv=8, Sq=7, Sk=9),
    fa_case("deterministic", Sq=9, Sk=12, causal=True, deterministic=True),
    fa_case("alibi-H", alibi="H", Sq=7, Sk=11),
    fa_case("alibi-BH-causal", alibi="BH", Sq=7, Sk=11, causal=True),
    fa_case("alibi-causal-Sq>Sk", alibi="H", Sq=11, Sk=7, causal=True),
    fa_case("alibi-window-softcap-gqa", alibi="BH", Hq=4, Hkv=2, Sq=9, Sk=12, window_size=(3, 2), softcap=3.0),
]


def _fa_inputs(s, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = _leaf((s["B"], s["Sq"], s["Hq"], s["D"]), gen)
    k = _leaf((s["B"], s["Sk"], s["Hkv"], s["D"]), gen)
    v = _leaf((s["B"], s["Sk"], s["Hkv"], s["Dv"]), gen)
    slopes = None
    if s["alibi"] == "H":
        slopes = torch.rand(s["Hq"], generator=gen) * 0.5
    elif s["alibi"] == "BH":
        slopes = torch.rand(s["B"], s["Hq"], generator=gen) * 0.5
    return q, k, v, slopes


def _fa_reference(q, k, v, slopes, kw):
    """flash-attn's documented meaning through flashforge.reference: offset Sk - Sq."""
    window = kw.get("window_size", (-1, -1))
    return reference.attention(q, k, v, causal=kw.get("causal", False), causal_offset=k.shape[1] - q.shape[1],
                               window=None if tuple(window) == (-1, -1) else tuple(window),
                               scale=kw.get("softmax_scale"), softcap=kw.get("softcap", 0.0),
                               alibi_slopes=slopes, return_lse=True)


def _with_lse_loss(fn, tensors, do, dlse):
    """fn -> (o, lse); gradients of the leaves for a loss on o and lse (lse's -inf rows excluded)."""
    o, lse = fn(*tensors)
    fin = torch.isfinite(lse)
    loss = (o * do.to(o.dtype)).sum() + torch.where(fin, lse * dlse.to(lse.dtype), torch.zeros_like(lse)).sum()
    leaves = [t for t in tensors if t.requires_grad]
    return o, lse, torch.autograd.grad(loss, leaves)


@pytest.mark.parametrize("shape,kw", FA_CASES)
def test_flash_attn_func_matches_bottom_right_reference(shape, kw):
    q, k, v, slopes = _fa_inputs(shape)
    gen = torch.Generator().manual_seed(1)
    do = torch.randn(shape["B"], shape["Sq"], shape["Hq"], shape["Dv"], generator=gen)
    dlse = torch.randn(shape["B"], shape["Hq"], shape["Sq"], generator=gen)

    def ours_fn(q, k, v):
        o, lse, probs = flash_attn_func(q, k, v, alibi_slopes=slopes, return_attn_probs=True, **kw)
        assert probs is None
        return o, lse

    o, lse, grads = _with_lse_loss(ours_fn, [q, k, v], do, dlse)
    ref = {}
    for dtype in (torch.float64, torch.float32):
        cq, ck, cv = _copies((q, k, v), dtype)
        s = None if slopes is None else slopes.to(dtype)
        ref[dtype] = _with_lse_loss(lambda a, b, c: _fa_reference(a, b, c, s, kw), [cq, ck, cv], do, dlse)
    (o64, lse64, g64), (o32, lse32, g32) = ref[torch.float64], ref[torch.float32]

    assert lse.dtype == torch.float32 and lse.shape == (shape["B"], shape["Hq"], shape["Sq"])
    empty = torch.isinf(lse64)
    assert torch.equal(torch.isinf(lse), empty) and (lse[empty] > 0).all(), "flash-attn: +inf where no key is seen"
    assert (o.transpose(1, 2)[empty] == 0).all(), "rows that see no key must be 0"
    assert_close("o", o, o64, o32, torch.float32)
    assert_close("lse", lse[~empty], lse64[~empty], lse32[~empty], torch.float32)
    for name, a, b, c in zip(("dq", "dk", "dv"), grads, g64, g32):
        assert_close(name, a, b, c, torch.float32)


def _visible_pattern(fn, B, Sq, Sk, **kw):
    """Which keys each query row sees: q = k = 0 spreads the weight evenly over the visible keys
    and v = identity makes o[i] that weight vector."""
    q = torch.zeros(B, Sq, 1, 16)
    k = torch.zeros(B, Sk, 1, 16)
    v = torch.eye(Sk).view(1, Sk, 1, Sk).expand(B, Sk, 1, Sk)
    return (fn(q, k, v, **kw)[:, :, 0] > 0).int()  # [B, Sq, Sk]


@pytest.mark.parametrize("Sq,Sk,kw,expected", [
    # flash-attn's docstring examples for causal=True
    (2, 5, dict(causal=True), [[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]]),
    (5, 2, dict(causal=True), [[0, 0], [0, 0], [0, 0], [1, 0], [1, 1]]),
    # window: keys [i + Sk - Sq - left, i + Sk - Sq + right]
    (3, 6, dict(window_size=(1, 0)), [[0, 0, 1, 1, 0, 0], [0, 0, 0, 1, 1, 0], [0, 0, 0, 0, 1, 1]]),
    (3, 5, dict(window_size=(0, 1)), [[0, 0, 1, 1, 0], [0, 0, 0, 1, 1], [0, 0, 0, 0, 1]]),
    (2, 4, dict(window_size=(1, -5)), [[0, 1, 1, 1], [0, 0, 1, 1]]),  # any negative side: unbounded
])
def test_flash_attn_alignment_from_its_docs(Sq, Sk, kw, expected):
    got = _visible_pattern(flash_attn_func, 2, Sq, Sk, **kw)
    assert got.tolist() == [expected] * 2


def test_flash_attn_qkvpacked_matches_unpacked():
    gen = torch.Generator().manual_seed(0)
    qkv = _leaf((2, 9, 3, 2, 16), gen)
    do = torch.randn(2, 9, 2, 16, generator=gen)
    kw = dict(causal=True, window_size=(4, -1), softcap=3.0)
    o, (dqkv,) = _run(lambda t: flash_attn_qkvpacked_func(t, **kw), [qkv], do)
    q, k, v = (t.detach().requires_grad_() for t in qkv.unbind(2))
    o2, grads = _run(lambda a, b, c: flash_attn_func(a, b, c, **kw), [q, k, v], do)
    torch.testing.assert_close(o, o2, rtol=0, atol=0)
    assert dqkv.shape == qkv.shape
    torch.testing.assert_close(dqkv, torch.stack(grads, dim=2), rtol=0, atol=0)


def test_flash_attn_kvpacked_matches_unpacked():
    gen = torch.Generator().manual_seed(0)
    q, kv = _leaf((2, 5, 4, 16), gen), _leaf((2, 11, 2, 2, 16), gen)
    do = torch.randn(2, 5, 4, 16, generator=gen)
    o, (dq, dkv) = _run(lambda a, b: flash_attn_kvpacked_func(a, b, causal=True), [q, kv], do)
    k, v = (t.detach().requires_grad_() for t in kv.unbind(2))
    q2 = q.detach().requires_grad_()
    o2, (dq2, dk, dv) = _run(lambda a, b, c: flash_attn_func(a, b, c, causal=True), [q2, k, v], do)
    torch.testing.assert_close(o, o2, rtol=0, atol=0)
    torch.testing.assert_close(dq, dq2, rtol=0, atol=0)
    assert dkv.shape == kv.shape
    torch.testing.assert_close(dkv, torch.stack([dk, dv], dim=2), rtol=0, atol=0)


@pytest.mark.parametrize("fn,args", [
    (flash_attn_func, lambda q, kv: (q, kv[:, :, 0], kv[:, :, 1])),
    (flash_attn_kvpacked_func, lambda q, kv: (q, kv)),
])
def test_flash_attn_return_attn_probs(fn, args):
    """(out, softmax_lse, None): no probabilities, lse [B, H, Sq] float32; out alone otherwise."""
    gen = torch.Generator().manual_seed(0)
    q, kv = torch.randn(2, 5, 4, 16, generator=gen), torch.randn(2, 8, 2, 2, 16, generator=gen)
    out = fn(*args(q, kv), causal=True, return_attn_probs=True)
    assert isinstance(out, tuple) and len(out) == 3
    o, lse, probs = out
    assert probs is None
    assert lse.shape == (2, 4, 5) and lse.dtype == torch.float32
    plain = fn(*args(q, kv), causal=True)
    assert isinstance(plain, torch.Tensor) and torch.equal(plain, o)
    _, lse_ref = reference.attention(q.double(), kv[:, :, 0].double(), kv[:, :, 1].double(), causal=True,
                                     causal_offset=3, return_lse=True)
    torch.testing.assert_close(lse.double(), lse_ref, rtol=1e-5, atol=1e-5)


def test_flash_attn_softcap_nonpositive_is_off():
    q, k, v, _ = _fa_inputs(dict(B=1, Sq=5, Sk=7, Hq=2, Hkv=2, D=16, Dv=16, alibi=None))
    base = flash_attn_func(q, k, v)
    assert torch.equal(flash_attn_func(q, k, v, softcap=-1.0), base)
    assert not torch.equal(flash_attn_func(q, k, v, softcap=0.5), base)


def test_flash_attn_dropout_follows_torch_manual_seed():
    q, k, v, _ = _fa_inputs(dict(B=2, Sq=5, Sk=9, Hq=2, Hkv=1, D=16, Dv=16, alibi=None))
    plain = flash_attn_func(q, k, v, causal=True)
    torch.manual_seed(3)
    a = flash_attn_func(q, k, v, dropout_p=0.25, causal=True)
    torch.manual_seed(3)
    b = flash_attn_func(q, k, v, dropout_p=0.25, causal=True)
    torch.manual_seed(3)
    c = flashforge.attention(q, k, v, dropout_p=0.25, causal=True, causal_offset=4)
    assert torch.equal(a, b) and torch.equal(a, c)
    assert not torch.equal(a, plain)
    # the same mask in backward: the gradient matches flashforge.attention with the same draw
    torch.manual_seed(3)
    g = torch.autograd.grad(flash_attn_func(q, k, v, dropout_p=0.25, causal=True).sum(), (q, k, v))
    torch.manual_seed(3)
    g2 = torch.autograd.grad(flashforge.attention(q, k, v, dropout_p=0.25, causal=True, causal_offset=4).sum(),
                             (q, k, v))
    for a, b in zip(g, g2):
        assert torch.equal(a, b)


def test_flash_attn_alibi_causal_output_is_flash_attn_kernel_bias():
    """flash-attn's kernel adds slope * j under causal; the documented -slope * |i + off - j| differs
    by a constant per row, so the outputs agree."""
    q, k, v, slopes = _fa_inputs(dict(B=2, Sq=5, Sk=9, Hq=2, Hkv=2, D=16, Dv=16, alibi="BH"))
    j = torch.arange(9, dtype=torch.float64)
    bias = (slopes.double()[:, :, None, None] * j).expand(2, 2, 5, 9)  # [B, H, Sq, Sk]
    want = reference.attention(q.double(), k.double(), v.double(), causal=True, causal_offset=4, mask=bias)
    got = flash_attn_func(q, k, v, causal=True, alibi_slopes=slopes)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


@needs_triton
def test_flash_attn_through_triton(monkeypatch):
    monkeypatch.setattr(fa_module, "attention", functools.partial(flashforge.attention, backend="triton"))
    shape = dict(B=2, Sq=7, Sk=12, Hq=4, Hkv=2, D=16, Dv=16, alibi="H")
    kw = dict(causal=True, window_size=(5, -1), softcap=3.0)
    q, k, v, slopes = _fa_inputs(shape)
    device = "cuda" if torch.cuda.is_available() and not INTERPRET else "cpu"
    q, k, v = (t.detach().to(device).requires_grad_() for t in (q, k, v))
    slopes = None if slopes is None else slopes.to(device)
    gen = torch.Generator().manual_seed(1)
    do = torch.randn(2, 7, 4, 16, generator=gen).to(device)
    dlse = torch.randn(2, 4, 7, generator=gen).to(device)

    def ours_fn(q, k, v):
        o, lse, _ = flash_attn_func(q, k, v, alibi_slopes=slopes, return_attn_probs=True, **kw)
        return o, lse

    o, lse, grads = _with_lse_loss(ours_fn, [q, k, v], do, dlse)
    refs = []
    for dtype in (torch.float64, torch.float32):
        cq, ck, cv = _copies((q, k, v), dtype)
        s = None if slopes is None else slopes.to(dtype)
        refs.append(_with_lse_loss(lambda a, b, c: _fa_reference(a, b, c, s, kw), [cq, ck, cv], do, dlse))
    (o64, lse64, g64), (o32, lse32, g32) = refs
    assert_close("o", o, o64, o32, torch.float32)
    assert_close("lse", lse, lse64, lse32, torch.float32)
    for name, a, b, c in zip(("dq", "dk", "dv"), grads, g64, g32):
        assert_close(name, a, b, c, torch.float32)


@pytest.mark.parametrize("call,exc,pattern", [
    (lambda: flash_attn_func(torch.randn(5, 2, 8), torch.randn(5, 2, 8), torch.randn(5, 2, 8)), ValueError,
     r"q has shape \(5, 2, 8\); accepted: \[batch, seqlen, nheads, headdim\]"),
    (lambda: flash_attn_qkvpacked_func(torch.randn(1, 5, 2, 2, 8)), ValueError, r"qkv .* dim 2 must be 3"),
    (lambda: flash_attn_kvpacked_func(torch.randn(1, 5, 2, 8), torch.randn(1, 5, 3, 2, 8)), ValueError,
     r"kv .* dim 2 must be 2"),
    (lambda: flash_attn_func(*(torch.randn(1, 5, 2, 8),) * 3, window_size=4), TypeError,
     r"window_size must be a \(left, right\) pair"),
    (lambda: flash_attn_func(*(torch.randn(1, 5, 2, 8),) * 3, causal=1), TypeError, r"causal must be a bool"),
    (lambda: flash_attn_func(torch.randn(1, 5, 3, 8), torch.randn(1, 5, 2, 8), torch.randn(1, 5, 2, 8)),
     ValueError, r"num_heads \(3\) must be a multiple of num_kv_heads \(2\)"),
])
def test_flash_attn_errors(call, exc, pattern):
    with pytest.raises(exc, match=pattern):
        call()


@pytest.mark.parametrize("interleaved", [True, False])
def test_flash_attn_with_kvcache_appends_rotates_and_attends(interleaved):
    gen = torch.Generator().manual_seed(5)
    B, S_cache, H, D, rd = 2, 32, 2, 16, 8
    q, k_new, v_new = (torch.randn(B, 1, H, D, generator=gen) for _ in range(3))
    kc, vc = torch.randn(B, S_cache, H, D, generator=gen), torch.randn(B, S_cache, H, D, generator=gen)
    lens = torch.tensor([3, 20], dtype=torch.int32)
    theta = 10000.0
    inv = theta ** (-torch.arange(0, rd, 2, dtype=torch.float64) / rd)
    ang = torch.arange(64, dtype=torch.float64)[:, None] * inv
    cos, sin = ang.cos().float(), ang.sin().float()
    kc0, vc0 = kc.clone(), vc.clone()
    out, lse = flash_attn_with_kvcache(q, kc, vc, k_new, v_new, rotary_cos=cos, rotary_sin=sin, cache_seqlens=lens,
                                       causal=True, rotary_interleaved=interleaved, return_softmax_lse=True)
    style = "interleaved" if interleaved else "half"
    for b in range(B):
        n = int(lens[b])
        k_r = reference.apply_rope(k_new[b:b + 1].double(), pos=n, theta=theta, style=style, rotary_dim=rd)
        q_r = reference.apply_rope(q[b:b + 1].double(), pos=n, theta=theta, style=style, rotary_dim=rd)
        kb = torch.cat([kc0[b, :n].double(), k_r[0]])[None]
        vb = torch.cat([vc0[b, :n].double(), v_new[b].double()])[None]
        want, want_lse = reference.attention(q_r, kb, vb, causal=True, causal_offset=n, return_lse=True)
        torch.testing.assert_close(out[b:b + 1].double(), want, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(lse[b:b + 1].double(), want_lse, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(kc[b, n].double(), k_r[0, 0], rtol=1e-5, atol=1e-6)


def _packed(lengths, H, D, gen):
    x = torch.randn(sum(lengths), H, D, generator=gen, dtype=torch.float64)
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)
    return x, cu


@pytest.mark.parametrize("kw", [dict(causal=True), dict(window_size=(3, 1)), dict(causal=True, softcap=2.0)],
                         ids=["causal", "window", "causal-softcap"])
def test_flash_attn_varlen_is_bottom_right_per_sequence(kw):
    gen = torch.Generator().manual_seed(3)
    lq, lk = [3, 9, 5], [7, 9, 2]
    q, cu_q = _packed(lq, 4, 16, gen)
    k, cu_k = _packed(lk, 2, 16, gen)
    v, _ = _packed(lk, 2, 16, gen)
    out, lse, probs = flash_attn_varlen_func(q.float(), k.float(), v.float(), cu_q, cu_k, 9, 9,
                                             return_attn_probs=True, **kw)
    assert probs is None and lse.shape == (4, sum(lq))
    window = kw.get("window_size")
    for b in range(3):
        rq, rk = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        want, want_lse = reference.attention(q[rq][None], k[rk][None], v[rk][None], causal=kw.get("causal", False),
                                             causal_offset=lk[b] - lq[b], window=window,
                                             softcap=kw.get("softcap", 0.0), return_lse=True)
        torch.testing.assert_close(out[rq].double(), want[0], rtol=1e-5, atol=1e-5)
        # flash-attn: +inf on rows that see no key (flashforge's reference: -inf)
        want_lse = torch.where(torch.isneginf(want_lse), float("inf"), want_lse)
        torch.testing.assert_close(lse[:, rq].double(), want_lse[0], rtol=1e-5, atol=1e-5)


def test_flash_attn_varlen_packed_variants_match_unpacked():
    gen = torch.Generator().manual_seed(4)
    qkv, cu = _packed([4, 11], 3 * 2, 8, gen)
    qkv = qkv.float().view(-1, 3, 2, 8)
    a = flash_attn_varlen_qkvpacked_func(qkv, cu, 11, causal=True)
    b = flash_attn_varlen_func(qkv[:, 0], qkv[:, 1], qkv[:, 2], cu, cu, 11, 11, causal=True)
    c = flash_attn_varlen_kvpacked_func(qkv[:, 0], qkv[:, 1:], cu, cu, 11, 11, causal=True)
    assert torch.equal(a, b) and torch.equal(a, c)
