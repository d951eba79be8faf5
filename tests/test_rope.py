"""`flashforge.apply_rope` on both backends against the float64 reference
(`flashforge.reference.apply_rope`), and against a Hugging Face style
(Llama) rotate-half written out by hand."""
import os

import torch

if not torch.cuda.is_available():
    # tests/conftest.py does the same; kept so that this file also runs on its own
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from helpers import FLOOR, HAS_TRITON, assert_close, assert_no_nan, backend_device, backend_params  # noqa: E402

import flashforge  # noqa: E402
from flashforge import apply_rope, reference  # noqa: E402
from flashforge.autograd.rope import rope_function  # noqa: E402
from flashforge.ops.rope_torch import RopeParams  # noqa: E402

BACKENDS = backend_params()
STYLES = ("half", "interleaved")
F64 = torch.float64


def randn(*shape, seed=0, dtype=torch.float32, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=gen).to(device=device, dtype=dtype)


def ref4(x4, **kw):
    """The float64 reference on a [B, S, H, D] tensor (any dtype): (exact, rounded to x's dtype)."""
    r64 = reference.apply_rope(x4.detach().to(F64), **kw)
    return r64, reference.apply_rope(x4.detach(), **kw)


def check(name, y, x4_view_of_y, r64, r_lowp, dtype):
    assert y.dtype == dtype, f"{name}: dtype {y.dtype}, expected {dtype}"
    assert_no_nan(name, y)
    assert_close(name, x4_view_of_y, r64, r_lowp, dtype)


def ref_kwargs(style, rotary_dim, theta=10000.0):
    return dict(theta=theta, style=style, rotary_dim=rotary_dim)


# ---------------------------------------------------------------- forward, [B, S, H, D]

@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("style", STYLES)
@pytest.mark.parametrize("D, rotary_dim", [(40, None), (96, 32), (8, 2), (6, 4)])
def test_forward_bshd(backend, style, D, rotary_dim):
    dev = backend_device(backend)
    x = randn(2, 5, 3, D, device=dev)
    before = x.clone()
    y = apply_rope(x, 3, style=style, rotary_dim=rotary_dim, backend=backend)
    assert torch.equal(x, before), "x was modified with inplace=False"
    r64, rl = ref4(x, pos=3, **ref_kwargs(style, rotary_dim))
    check("y", y, y, r64, rl, torch.float32)
    rd = D if rotary_dim is None else rotary_dim
    assert torch.equal(y[..., rd:], x[..., rd:]), "dims past rotary_dim must pass through bit for bit"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("style", STYLES)
def test_forward_low_precision(backend, dtype, style):
    dev = backend_device(backend)
    x = randn(2, 9, 2, 64, seed=1, dtype=dtype, device=dev)
    y = apply_rope(x, 1000, theta=500000.0, style=style, rotary_dim=48, backend=backend)
    r64, rl = ref4(x, pos=1000, **ref_kwargs(style, 48, 500000.0))
    check("y", y, y, r64, rl, dtype)


# ---------------------------------------------------------------- positions

def _positions(kind, B, S, device):
    """(pos argument, position_ids argument, reference kwargs)."""
    if kind == "int0":
        return 0, None, dict(pos=0)
    if kind == "int":
        return 11, None, dict(pos=11)
    if kind == "negative":
        return -4, None, dict(pos=-4)
    if kind == "tensor_i32":
        p = torch.tensor([5, 70000], dtype=torch.int32, device=device)[:B]
        return p, None, dict(pos=p)
    if kind == "tensor_i64_0dim":
        p = torch.tensor(123, dtype=torch.int64, device=device)
        return p, None, dict(pos=p.expand(B))
    if kind == "position_ids":
        gen = torch.Generator().manual_seed(3)
        ids = torch.randint(0, 1_000_000, (B, S), generator=gen).to(device)
        return 0, ids, dict(position_ids=ids)
    if kind == "position_ids_strided":  # a transposed [S, B] buffer
        gen = torch.Generator().manual_seed(4)
        ids = torch.randint(0, 5000, (S, B), generator=gen, dtype=torch.int64).to(device).t()
        return 0, ids, dict(position_ids=ids)
    raise ValueError(kind)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", ["int0", "int", "negative", "tensor_i32", "tensor_i64_0dim", "position_ids",
                                  "position_ids_strided"])
def test_positions(backend, kind):
    dev = backend_device(backend)
    x = randn(2, 6, 2, 16, seed=2, device=dev)
    pos, ids, rkw = _positions(kind, 2, 6, dev)
    for style in STYLES:
        y = apply_rope(x, pos, style=style, position_ids=ids, backend=backend)
        r64, rl = ref4(x, style=style, **rkw)
        check(f"y ({style})", y, y, r64, rl, torch.float32)


@pytest.mark.parametrize("backend", BACKENDS)
def test_large_positions_keep_float32_accuracy(backend):
    """Angles are reduced exactly: at positions ~1e6..2**31 the error stays at float32
    rounding (a float32 ``pos * inv_freq`` is off by ~0.04 here)."""
    dev = backend_device(backend)
    x = randn(1, 4, 2, 128, seed=5, device=dev)
    for pos in (1_000_000, 2**31 - 4):
        y = apply_rope(x, pos, theta=10000.0, backend=backend)
        r64 = reference.apply_rope(x.to(F64), pos=pos)
        err = (y.to(F64) - r64).abs().max().item()
        assert err < 4e-6, f"pos={pos}: max error {err:.2e}"


# ---------------------------------------------------------------- layouts

@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("style", STYLES)
def test_layouts(backend, style):
    dev = backend_device(backend)
    S, H, D = 7, 3, 10
    # [S, D]: one head
    x = randn(S, D, seed=6, device=dev)
    y = apply_rope(x, 2, style=style, backend=backend)
    assert y.shape == x.shape
    r64, rl = ref4(x[None, :, None], pos=2, style=style)
    check("[S, D]", y, y[None, :, None], r64, rl, torch.float32)
    # [S, H*D] with head_dim: rotated per head
    x = randn(S, H * D, seed=7, device=dev)
    ids = torch.arange(S, device=dev) * 3 + 1
    y = apply_rope(x, style=style, rotary_dim=6, head_dim=D, position_ids=ids, backend=backend)
    x4 = x.view(1, S, H, D)
    r64, rl = ref4(x4, position_ids=ids.view(1, S), style=style, rotary_dim=6)
    check("[S, H*D]", y, y.view(1, S, H, D), r64, rl, torch.float32)
    # [D]: a single token at position pos
    x = randn(D, seed=8, device=dev)
    y = apply_rope(x, 1234, style=style, backend=backend)
    r64, rl = ref4(x.view(1, 1, 1, D), pos=1234, style=style)
    check("[D]", y, y.view(1, 1, 1, D), r64, rl, torch.float32)
    # [H*D] with head_dim, the position as a 0-dim tensor
    x = randn(H * D, seed=9, device=dev)
    y = apply_rope(x, torch.tensor(99, device=dev), style=style, head_dim=D, backend=backend)
    r64, rl = ref4(x.view(1, 1, H, D), pos=99, style=style)
    check("[H*D]", y, y.view(1, 1, H, D), r64, rl, torch.float32)


@pytest.mark.parametrize("backend", BACKENDS)
def test_strided_inputs(backend):
    """No copy is needed: [B, H, S, D] transposed, and a last dim of stride 2."""
    dev = backend_device(backend)
    base = randn(2, 3, 5, 24, seed=10, device=dev)
    for name, x in (("bhsd", base.transpose(1, 2)), ("last-stride-2", base.transpose(1, 2)[..., ::2])):
        y = apply_rope(x, 4, style="interleaved", backend=backend)
        r64, rl = ref4(x, pos=4, style="interleaved")
        check(name, y, y, r64, rl, torch.float32)


@pytest.mark.parametrize("backend", BACKENDS)
def test_empty(backend):
    dev = backend_device(backend)
    x = randn(2, 0, 3, 8, device=dev).requires_grad_()
    y = apply_rope(x, 5, backend=backend)
    assert y.shape == x.shape
    y.sum().backward()
    assert x.grad.shape == x.shape


# ---------------------------------------------------------------- gradients

@pytest.mark.parametrize("style", STYLES)
@pytest.mark.parametrize("positions", ["int", "tensor", "ids"])
def test_gradcheck_torch_float64(style, positions):
    """The autograd layer in float64 (the public layer takes float16/bfloat16/float32 only)."""
    x = randn(2, 3, 2, 10, seed=11, dtype=F64).requires_grad_()
    pos = torch.tensor([3, -2]) if positions == "tensor" else None
    ids = torch.tensor([[0, 7, 100000], [5, 4, 3]]) if positions == "ids" else None
    params = RopeParams(theta=100.0, rotary_dim=6, interleaved=style == "interleaved",
                        pos_base=17 if positions == "int" else 0)
    assert torch.autograd.gradcheck(lambda t: rope_function(t, pos, ids, params, "torch"), (x,))
    assert torch.autograd.gradgradcheck(lambda t: rope_function(t, pos, ids, params, "torch"), (x,))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("style", STYLES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grad_vs_reference(backend, style, dtype):
    dev = backend_device(backend)
    x = randn(2, 5, 2, 40, seed=12, dtype=dtype, device=dev).requires_grad_()
    pos = torch.tensor([0, 1000], device=dev)
    # a non-contiguous upstream gradient
    dy = randn(2, 2, 5, 40, seed=13, dtype=dtype, device=dev).transpose(1, 2)
    y = apply_rope(x, pos, style=style, rotary_dim=24, backend=backend)
    (dx,) = torch.autograd.grad(y, x, dy)
    grads = []
    for dt in (F64, dtype):
        xr = x.detach().to(dt).requires_grad_()
        yr = reference.apply_rope(xr, pos=pos, style=style, rotary_dim=24)
        grads.append(torch.autograd.grad(yr, xr, dy.to(dt))[0])
    assert dx.dtype == dtype
    assert_no_nan("dx", dx)
    assert_close("dx", dx, grads[0], grads[1], dtype)


@pytest.mark.parametrize("backend", BACKENDS)
def test_grad_through_layouts(backend):
    dev = backend_device(backend)
    x = randn(6, 4 * 8, seed=14, device=dev).requires_grad_()
    w = randn(6, 4 * 8, seed=15, device=dev)
    (apply_rope(x, 9, style="interleaved", head_dim=8, backend=backend) * w).sum().backward()
    x64 = x.detach().to(F64).requires_grad_()
    y64 = reference.apply_rope(x64.view(1, 6, 4, 8), pos=9, style="interleaved").view(6, 32)
    (y64 * w.to(F64)).sum().backward()
    assert_close("dx", x.grad, x64.grad, x64.grad.float(), torch.float32)


# ---------------------------------------------------------------- in place

@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("style", STYLES)
def test_inplace(backend, style):
    dev = backend_device(backend)
    x = randn(2, 4, 3, 20, seed=16, device=dev)
    r64, rl = ref4(x, pos=7, style=style, rotary_dim=12)
    ptr, version = x.data_ptr(), x._version
    y = apply_rope(x, 7, style=style, rotary_dim=12, inplace=True, backend=backend)
    assert y is x and x.data_ptr() == ptr
    assert x._version > version, "an in-place write must bump x's version counter"
    check("x", x, x, r64, rl, torch.float32)


@pytest.mark.parametrize("backend", BACKENDS)
def test_inplace_on_a_view_of_fused_qkv(backend):
    """Rotating q inside a fused [B, S, 3, H, D] buffer touches q only."""
    dev = backend_device(backend)
    qkv = randn(2, 5, 3, 2, 16, seed=17, device=dev)
    before = qkv.clone()
    q = qkv[:, :, 0]
    apply_rope(q, torch.tensor([1, 2], device=dev), inplace=True, backend=backend)
    r64, rl = ref4(before[:, :, 0], pos=torch.tensor([1, 2]))
    check("q", qkv[:, :, 0], qkv[:, :, 0], r64, rl, torch.float32)
    assert torch.equal(qkv[:, :, 1:], before[:, :, 1:]), "k and v must be untouched"


@pytest.mark.parametrize("backend", BACKENDS)
def test_inplace_autograd(backend):
    """A non-leaf may be rotated in place under autograd (the backward needs no old values)."""
    dev = backend_device(backend)
    a = randn(5, 3 * 8, seed=18, device=dev).requires_grad_()
    w = randn(5, 3 * 8, seed=19, device=dev)
    h = a * 2.0
    y = apply_rope(h, 3, inplace=True, head_dim=8, backend=backend)
    assert y is h
    (y * w).sum().backward()
    a64 = a.detach().to(F64).requires_grad_()
    y64 = reference.apply_rope((a64 * 2.0).view(1, 5, 3, 8), pos=3).view(5, 24)
    (y64 * w.to(F64)).sum().backward()
    assert_close("da", a.grad, a64.grad, a64.grad.float(), torch.float32)


@pytest.mark.parametrize("backend", BACKENDS)
def test_inplace_leaf_under_no_grad(backend):
    dev = backend_device(backend)
    x = randn(3, 8, seed=20, device=dev).requires_grad_()
    r64, rl = ref4(x.view(1, 3, 1, 8), pos=1)
    with torch.no_grad():
        apply_rope(x, 1, inplace=True, backend=backend)
    check("x", x.detach(), x.detach().view(1, 3, 1, 8), r64, rl, torch.float32)


# ---------------------------------------------------------------- poisoned allocations

@pytest.mark.parametrize("backend", BACKENDS)
def test_every_output_element_written(backend, monkeypatch):
    """torch.empty filled with NaN (as conftest does): forward and backward write everything,
    pass-through dims, padded head dims (D = 40 -> 64) and both styles included."""
    empty = torch.empty

    def nan_empty(*a, **kw):
        t = empty(*a, **kw)
        if t.dtype.is_floating_point:
            t.fill_(float("nan"))
        return t

    monkeypatch.setattr(torch, "empty", nan_empty)
    dev = backend_device(backend)
    for style in STYLES:
        x = randn(2, 3, 5, 40, seed=21, device=dev).requires_grad_()
        y = apply_rope(x, torch.tensor([2, 3], device=dev), style=style, rotary_dim=30, backend=backend)
        assert_no_nan("y", y)
        (dx,) = torch.autograd.grad(y, x, torch.ones_like(y))
        assert_no_nan("dx", dx)


# ---------------------------------------------------------------- helpers for fused kernels

if HAS_TRITON:
    import triton
    import triton.language as tl

    from flashforge.ops.triton.rope import rope_cos_sin, rope_partner, rope_rotate, rope_turns

    @triton.jit
    def _whole_tile_kernel(x_ptr, o_ptr, turns_ptr, pos_ptr, S, D, ROTARY_DIM: tl.constexpr,
                           INTERLEAVED: tl.constexpr, INVERSE: tl.constexpr, BLOCK_S: tl.constexpr,
                           BLOCK_D: tl.constexpr):
        """What an attention kernel does with a q tile: all dims at once, rows at own positions."""
        o_s = tl.arange(0, BLOCK_S)
        o_d = tl.arange(0, BLOCK_D)
        m = (o_s < S)[:, None] & (o_d < D)[None, :]
        b_pos = tl.load(pos_ptr + o_s, mask=o_s < S, other=0)
        o_p = rope_partner(o_d, ROTARY_DIM, INTERLEAVED)
        b_x = tl.load(x_ptr + o_s[:, None] * D + o_d[None, :], mask=m, other=0.0)
        b_xp = tl.load(x_ptr + o_s[:, None] * D + o_p[None, :], mask=m, other=0.0)
        b_cos, b_sin = rope_cos_sin(b_pos, turns_ptr, o_d, ROTARY_DIM, INTERLEAVED)
        b_y = rope_rotate(b_x, b_xp, b_cos, b_sin, o_d, ROTARY_DIM, INTERLEAVED, INVERSE)
        tl.store(o_ptr + o_s[:, None] * D + o_d[None, :], b_y, mask=m)


@pytest.mark.parametrize("backend", [p for p in BACKENDS if p.values[0] == "triton"])
@pytest.mark.parametrize("style", STYLES)
def test_whole_tile_helpers(backend, style):
    """rope_partner / rope_cos_sin / rope_rotate on a [S, D] tile match the reference; inverse undoes."""
    dev = backend_device(backend)
    S, D, rd = 5, 40, 24
    x = randn(S, D, seed=23, device=dev)
    ids = torch.tensor([0, 3, 999_999, 7, 2**31 - 1], device=dev)
    turns = rope_turns(rd, 10000.0, torch.device(dev))
    y, back = torch.empty_like(x), torch.empty_like(x)
    for src, dst, inverse in ((x, y, False), (y, back, True)):
        _whole_tile_kernel[(1,)](src, dst, turns, ids, S, D, ROTARY_DIM=rd, INTERLEAVED=style == "interleaved",
                                 INVERSE=inverse, BLOCK_S=8, BLOCK_D=64)
    r64, rl = ref4(x[None, :, None], position_ids=ids.view(1, S), style=style, rotary_dim=rd)
    check("y", y, y[None, :, None], r64, rl, torch.float32)
    torch.testing.assert_close(back, x, atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------- Hugging Face meaning

def _llama_rotary(q, position_ids, theta):
    """transformers' LlamaRotaryEmbedding + apply_rotary_pos_emb, q in [B, H, S, D]."""
    D = q.shape[-1]
    inv_freq = 1.0 / (theta ** (torch.arange(0, D, 2, dtype=torch.int64).float() / D))
    freqs = (inv_freq[None, :, None] @ position_ids[:, None, :].float()).transpose(1, 2)  # [B, S, D/2]
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos()[:, None], emb.sin()[:, None]  # [B, 1, S, D]

    def rotate_half(t):
        return torch.cat((-t[..., D // 2:], t[..., : D // 2]), dim=-1)

    return q * cos + rotate_half(q) * sin


@pytest.mark.parametrize("backend", BACKENDS)
def test_matches_hugging_face_llama(backend):
    """theta is a config's rope_theta (Llama 3: 500000.0), style "half" is Llama's rotate_half."""
    dev = backend_device(backend)
    B, H, S, D = 2, 3, 12, 64
    q = randn(B, H, S, D, seed=22)
    position_ids = torch.arange(S).expand(B, S) + torch.tensor([[0], [20]])
    hf = _llama_rotary(q, position_ids, 500000.0)
    ours = apply_rope(q.transpose(1, 2).to(dev), position_ids=position_ids.to(dev), theta=500000.0,
                      style="half", backend=backend).transpose(1, 2).cpu()
    torch.testing.assert_close(ours, hf, atol=FLOOR[torch.float32], rtol=1e-5)


# ---------------------------------------------------------------- errors

X4 = torch.zeros(2, 3, 2, 8)


@pytest.mark.parametrize("call, exc, match", [
    (lambda: apply_rope([1.0, 2.0]), TypeError, "x must be a torch.Tensor"),
    (lambda: apply_rope(X4.long()), ValueError, "x has dtype torch.int64"),
    (lambda: apply_rope(X4.double()), ValueError, "x has dtype torch.float64"),
    (lambda: apply_rope(torch.zeros(3, 2, 8)), ValueError, "x has rank 3"),
    (lambda: apply_rope(torch.zeros(1, 2, 3, 2, 8)), ValueError, "x has rank 5"),
    (lambda: apply_rope(torch.zeros(3, 20), head_dim=8), ValueError, r"last dim \(20\).*head_dim \(8\)"),
    (lambda: apply_rope(X4, head_dim=4), ValueError, r"head_dim \(4\)"),
    (lambda: apply_rope(torch.zeros(3, 8), head_dim=0), ValueError, "head_dim must be >= 1"),
    (lambda: apply_rope(torch.zeros(3, 8), head_dim=2.0), TypeError, "head_dim must be an int"),
    (lambda: apply_rope(torch.zeros(3, 512)), ValueError, r"head dim 512.*pass head_dim"),
    (lambda: apply_rope(torch.zeros(3, 9)), ValueError, r"rotary_dim defaults to the head dim 9"),
    (lambda: apply_rope(X4, rotary_dim=5), ValueError, r"rotary_dim is 5.*even"),
    (lambda: apply_rope(X4, rotary_dim=10), ValueError, r"rotary_dim is 10.*head dim 8"),
    (lambda: apply_rope(X4, rotary_dim=0), ValueError, "rotary_dim is 0"),
    (lambda: apply_rope(X4, rotary_dim=4.0), TypeError, "rotary_dim must be an int"),
    (lambda: apply_rope(X4, style="neox"), ValueError, r"style is 'neox'"),
    (lambda: apply_rope(X4, style=None), TypeError, "style must be a str"),
    (lambda: apply_rope(X4, theta=0.0), ValueError, r"theta must be > 0.*0\.0"),
    (lambda: apply_rope(X4, theta=-1e4), ValueError, "theta must be > 0"),
    (lambda: apply_rope(X4, theta=float("inf")), ValueError, "theta must be finite"),
    (lambda: apply_rope(X4, theta="1e4"), TypeError, "theta must be a float"),
    (lambda: apply_rope(X4, 1.5), TypeError, r"pos must be an int.*float"),
    (lambda: apply_rope(X4, True), TypeError, "pos must be an int"),
    (lambda: apply_rope(X4, 2**31 - 2), ValueError, r"must fit in int32"),
    (lambda: apply_rope(X4, torch.tensor([1, 2, 3])), ValueError, r"pos has shape \(3,\).*\[B\] = \[2\]"),
    (lambda: apply_rope(X4, torch.tensor([1.0, 2.0])), ValueError, "pos tensor has dtype torch.float32"),
    (lambda: apply_rope(X4, torch.tensor([1, 2], device="meta")), ValueError, "pos is on meta"),
    (lambda: apply_rope(X4, position_ids=torch.zeros(2, 4, dtype=torch.long)), ValueError,
     r"position_ids has shape \(2, 4\).*\[2, 3\]"),
    (lambda: apply_rope(X4, position_ids=torch.zeros(2, 3)), ValueError, "position_ids tensor has dtype"),
    (lambda: apply_rope(X4, position_ids=[[0, 1, 2]] * 2), TypeError, "position_ids must be a torch.Tensor"),
    (lambda: apply_rope(X4, 3, position_ids=torch.zeros(2, 3, dtype=torch.long)), ValueError,
     "either pos or position_ids"),
    (lambda: apply_rope(torch.zeros(3, 8), position_ids=torch.zeros(2, 3, dtype=torch.long)), ValueError,
     r"position_ids has shape \(2, 3\).*\[S\] = \[3\]"),
    (lambda: apply_rope(X4, inplace=1), TypeError, "inplace must be a bool"),
    (lambda: apply_rope(X4.clone().requires_grad_(), inplace=True), ValueError, "leaf tensor"),
    (lambda: apply_rope(X4.clone().requires_grad_()[0:1], inplace=True), ValueError, "leaf tensor"),
    (lambda: apply_rope(torch.zeros(1, 3, 1, 8).expand(2, 3, 2, 8), inplace=True), ValueError, "expanded"),
    (lambda: apply_rope(X4, backend="cuda"), ValueError, "backend must be"),
])
def test_errors(call, exc, match):
    with pytest.raises(exc, match=match):
        call()


def test_default_backend_on_cpu_is_torch(monkeypatch):
    """backend=None runs the PyTorch path for CPU tensors (Triton is for CUDA tensors)."""
    import flashforge.ops.rope_torch as rope_torch

    calls = []
    real = rope_torch.rope
    monkeypatch.setattr(rope_torch, "rope", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    x = randn(1, 2, 1, 4)
    torch.testing.assert_close(flashforge.apply_rope(x, 1), apply_rope(x, 1, backend="torch"))
    assert calls
