"""`flashforge.attention` against the float64 reference, on both backends.

Each case checks o, lse, dq, dk, dv and (float masks that require grad) dmask
with the tolerance policy of `helpers.compare`, that no output is NaN (fresh
allocations are NaN-poisoned by conftest), that fully masked rows are exactly 0
with lse -inf, and that the inputs are left unchanged.  The Triton backend runs
on CUDA when there is one, else on CPU tensors in the Triton interpreter, so the
shapes stay small.  float32 throughout; tests/test_gpu.py covers fp16/bf16.
"""
import pytest
import torch

import flashforge
from helpers import Case, backend_device, backend_params, check_case, make_inputs, run_flashforge, with_

BACKENDS = backend_params()


def case(id, **kw):
    return pytest.param(Case(**kw), id=id)


SHAPES = [
    case("S1", B=2, Sq=1, Sk=1, D=16),
    case("S17-D40", Sq=17, Sk=17, D=40),
    case("S33-D64", B=1, Sq=33, Sk=33, D=64),
    case("Sq1-Sk33-decode", Sq=1, Sk=33, D=16),
    case("Sq33-Sk17", B=1, Sq=33, Sk=17, D=16),
    case("Sq17-Sk40", B=1, Sq=17, Sk=40, D=64),
    case("D40-Dv16", Sq=17, Sk=17, D=40, Dv=16),
    case("D16-Dv64", B=1, Sq=17, Sk=33, D=16, Dv=64),
    case("D1-Dv3", Sq=9, Sk=9, D=1, Dv=3),
    case("gqa-4/2", B=1, Sq=17, Sk=17, Hq=4, Hkv=2, D=16),
    case("gqa-6/1", B=1, Sq=17, Sk=33, Hq=6, Hkv=1, D=40),
    case("scale", Sq=17, Sk=17, D=16, scale=0.7),
    case("sharp-softmax", Sq=17, Sk=17, D=16, input_scale=4.0),
    case("bhsd-strides", Sq=17, Sk=33, Hq=4, Hkv=2, D=16, layout="bhsd"),
    case("bhsd-S1", B=2, Sq=1, Sk=17, D=16, layout="bhsd"),
    case("strided-last-dim", Sq=9, Sk=17, D=16, Dv=8, layout="strided"),
    case("o-only-loss", Sq=17, Sk=17, D=16, lse_grad=False),
]

CAUSAL = [
    case("causal", Sq=17, Sk=17, causal=True),
    case("causal-S33-D64", B=1, Sq=33, Sk=33, D=64, causal=True),
    case("causal-bottom-right", Sq=9, Sk=33, causal=True, causal_offset=24),
    case("causal-offset+5", Sq=17, Sk=17, causal=True, causal_offset=5),
    case("causal-offset-4", Sq=17, Sk=17, causal=True, causal_offset=-4),  # rows 0..3 see nothing
    case("causal-Sq>Sk", Sq=33, Sk=17, causal=True, causal_offset=-16, Hq=4, Hkv=2),
    case("causal-offset-tensor-i32", Sq=9, Sk=33, causal=True, causal_offset=(24, 3), offset_dtype=torch.int32),
    case("causal-offset-tensor-i64", Sq=17, Sk=17, causal=True, causal_offset=(-3, 20), offset_dtype=torch.int64),
    case("causal-gqa-bhsd", B=1, Sq=17, Sk=17, Hq=6, Hkv=1, causal=True, layout="bhsd"),
]

WINDOWS = [
    case("window-int-5", Sq=17, Sk=17, window=5),
    case("window-(3,2)", Sq=17, Sk=33, window=(3, 2)),
    case("window-(4,-1)", Sq=17, Sk=17, window=(4, -1)),
    case("window-(-1,3)", Sq=17, Sk=17, window=(-1, 3)),
    case("window-(0,0)", Sq=17, Sk=17, window=(0, 0)),
    case("window-(6,-1)-causal", Sq=17, Sk=17, window=(6, -1), causal=True),
    case("window-int-3-causal", B=1, Sq=33, Sk=33, D=64, window=3, causal=True),
    case("window-(2,5)-causal-offset", Sq=9, Sk=33, window=(2, 5), causal=True, causal_offset=24),
    case("window-offset-tensor", Sq=9, Sk=17, window=(3, 1), causal_offset=(2, 7)),
    case("window-empty-rows", Sq=17, Sk=8, window=(1, 0)),  # rows i >= 9 see nothing
    case("window-gqa", B=1, Sq=17, Sk=17, Hq=4, Hkv=2, window=(5, 5)),
]

MASKS = [
    *(case(f"mask-bool-{s}", Sq=17, Sk=17, mask="bool", mask_shape=s)
      for s in ("SqSk", "11SqSk", "B1SqSk", "1HSqSk", "BHSqSk", "B11Sk")),
    *(case(f"bias-grad-{s}", Sq=9, Sk=17, mask="float_grad", mask_shape=s)
      for s in ("SqSk", "11SqSk", "B1SqSk", "1HSqSk", "BHSqSk", "B11Sk")),
    case("bias-no-grad", Sq=17, Sk=17, mask="float", mask_shape="B1SqSk"),
    case("bias-grad-gqa", B=1, Sq=17, Sk=17, Hq=4, Hkv=2, mask="float_grad", mask_shape="1HSqSk"),
    case("bias-grad-causal-window", Sq=17, Sk=17, causal=True, window=(5, -1), mask="float_grad"),
    case("mask-bool-causal-offset", Sq=9, Sk=17, causal=True, causal_offset=8, mask="bool", mask_shape="B11Sk"),
    case("bias-grad-S33-D64", B=1, Sq=33, Sk=33, D=64, mask="float_grad", mask_shape="BHSqSk"),
    case("bias-grad-Sq1-B11Sk", Sq=1, Sk=33, mask="float_grad", mask_shape="B11Sk"),
    case("bias-grad-B1-H1-11SqSk", B=1, Hq=1, Hkv=1, Sq=17, Sk=9, mask="float_grad", mask_shape="11SqSk"),
]

DROPOUT_SOFTCAP = [
    case("dropout-0.1", Sq=17, Sk=17, dropout_p=0.1, seed=1),
    case("dropout-0.5-S33-D64", B=1, Sq=33, Sk=33, D=64, dropout_p=0.5, seed=2**40 + 3),
    case("dropout-causal-gqa", B=1, Sq=17, Sk=33, Hq=4, Hkv=2, causal=True, causal_offset=16, dropout_p=0.3,
         seed=7),
    case("dropout-bias-grad", Sq=17, Sk=17, dropout_p=0.2, seed=11, mask="float_grad", mask_shape="1HSqSk"),
    case("dropout-window-Sq1", Sq=1, Sk=33, window=(4, 4), causal_offset=20, dropout_p=0.25, seed=5),
    case("softcap-1", Sq=17, Sk=17, softcap=1.0),
    case("softcap-30-sharp", Sq=17, Sk=33, softcap=30.0, input_scale=4.0),
    case("softcap-causal-bias-grad", Sq=17, Sk=17, softcap=2.0, causal=True, mask="float_grad"),
    case("softcap-dropout-window", Sq=17, Sk=17, softcap=5.0, dropout_p=0.1, seed=3, window=(3, 3)),
    case("causal-bottom-right-Sq<Sk", Sq=17, Sk=33, causal=True, causal_offset="bottom_right"),
    # few queries x a GQA group fit one tile: the forward packs the group's heads into its rows
    case("gqa-packed-decode-bias-grad-alibi", Sq=2, Sk=33, Hq=6, Hkv=2, mask="float_grad", mask_shape="BHSqSk",
         alibi="BH", causal=True, causal_offset="bottom_right"),
    case("gqa-packed-dropout-softcap-window", Sq=3, Sk=40, Hq=4, Hkv=1, dropout_p=0.2, seed=9, softcap=3.0,
         window=(7, 0), causal_offset=(30, 5)),
    case("window-bottom-right-Sq>Sk", Sq=33, Sk=17, window=(4, 2), causal_offset="bottom_right"),
    # ALiBi: -slope * |i + offset - j| after softcap, slopes [Hq] or [B, Hq]
    case("alibi-H", Sq=17, Sk=33, Hq=4, Hkv=2, alibi="H"),
    case("alibi-BH-causal-offset-tensor", Sq=17, Sk=33, Hq=4, Hkv=1, alibi="BH", causal=True,
         causal_offset=(16, 3)),
    case("alibi-softcap-bias-grad-window", Sq=17, Sk=17, alibi="H", softcap=2.0, mask="float_grad",
         mask_shape="B1SqSk", window=(5, 2)),
]

FULLY_MASKED = [
    case("empty-rows-bool-mask", Sq=17, Sk=17, mask="bool_empty_rows"),
    case("empty-rows-bool-key-padding", Sq=17, Sk=17, mask="bool_empty_rows", mask_shape="B11Sk"),
    case("empty-rows-neg-inf-bias", Sq=17, Sk=17, mask="float_neginf_rows", mask_shape="B1SqSk"),
    case("empty-rows-causal-negative-offset", Sq=17, Sk=17, causal=True, causal_offset=-10),
    case("empty-all-causal", Sq=9, Sk=9, causal=True, causal_offset=-9),
    case("empty-rows-window-offset", Sq=17, Sk=17, window=(2, 2), causal_offset=(-12, 10)),
    case("empty-rows-dropout-gqa", B=1, Sq=17, Sk=17, Hq=4, Hkv=2, mask="bool_empty_rows", mask_shape="1HSqSk",
         dropout_p=0.3, seed=9),
]

CONVENIENCE = [
    case("SD", Sq=17, Sk=33, D=16, rank=2),
    case("SD-causal-mask", Sq=17, Sk=17, D=40, rank=2, causal=True, mask="bool", mask_shape="SqSk"),
    case("SD-bias-grad-bhsd", Sq=9, Sk=17, D=16, rank=2, mask="float_grad", mask_shape="SqSk", layout="bhsd"),
    case("NSD", B=3, Sq=17, Sk=17, D=16, rank=3),
    case("NSD-causal-offsets", B=3, Sq=9, Sk=17, D=16, rank=3, causal=True, causal_offset=(8, 0, -2)),
    case("NSD-bias-grad", B=3, Sq=17, Sk=17, D=16, rank=3, mask="float_grad", mask_shape="NSqSk"),
    case("NSD-mask-1SqSk-bhsd", B=2, Sq=17, Sk=17, D=16, rank=3, mask="bool", mask_shape="1SqSk", layout="bhsd"),
    case("NSD-mask-SqSk-dropout", B=2, Sq=9, Sk=17, D=16, rank=3, mask="float_grad", mask_shape="SqSk",
         dropout_p=0.2, seed=4),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("c", SHAPES + CAUSAL + WINDOWS + MASKS + DROPOUT_SOFTCAP + FULLY_MASKED + CONVENIENCE)
def test_against_reference(c, backend):
    check_case(c, backend)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("c", [
    case("Sq0", Sq=0, Sk=17),
    case("Sk0", Sq=17, Sk=0),
    case("Sk0-causal-bias-grad", Sq=9, Sk=0, causal=True, mask="float_grad", mask_shape="B1SqSk"),
    case("Sq0-Sk0", Sq=0, Sk=0),
    case("Sk0-SD", Sq=5, Sk=0, rank=2),
    case("Sq0-NSD-dropout", B=3, Sq=0, Sk=9, rank=3, dropout_p=0.5, seed=1),
])
def test_empty_sequences(c, backend):
    """Sq = 0: empty output; Sk = 0: o = 0, lse = -inf; all gradients 0 (the reference cannot run these)."""
    x = make_inputs(c, backend_device(backend))
    ours = run_flashforge(c, x, backend)
    B, Hq = {2: (1, 1), 3: (c.B, 1), 4: (c.B, c.Hq)}[c.rank]
    assert ours["o"].shape == (B, c.Sq, Hq, c.dv) and ours["o"].dtype == x.q.dtype
    assert ours["lse"].shape == (B, Hq, c.Sq) and ours["lse"].dtype == torch.float32
    assert (ours["o"] == 0).all() and (ours["lse"] == float("-inf")).all()
    for name, like in (("dq", x.q), ("dk", x.k), ("dv", x.v), ("dmask", x.mask)):
        if like is None or not like.requires_grad:
            continue
        g = ours[name]  # 4-D form for dq/dk/dv, the mask's own shape for dmask
        assert g is not None and g.numel() == like.numel() and (g == 0).all(), name


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("c", [
    case("gqa-bias-dropout", B=1, Sq=17, Sk=33, Hq=4, Hkv=2, causal=True, causal_offset=16, mask="float_grad",
         mask_shape="B11Sk", dropout_p=0.2, seed=5),
    case("S33-D64-window", B=1, Sq=33, Sk=33, Hq=6, Hkv=1, D=64, window=(8, 8)),
])
def test_deterministic_is_bitwise_reproducible(c, backend):
    """deterministic=True: two runs give bitwise-identical outputs and gradients."""
    device = backend_device(backend)
    runs = [run_flashforge(c, make_inputs(c, device), backend, deterministic=True) for _ in range(2)]
    for name in ("o", "lse", "dq", "dk", "dv", "dmask"):
        a, b = runs[0][name], runs[1][name]
        assert (a is None) == (b is None), name
        if a is not None:
            assert torch.equal(a, b), f"{name} differs between two deterministic runs"
    check_case(c, backend, deterministic=True)


@pytest.mark.parametrize("backend", BACKENDS)
def test_dropout_same_seed_same_result(backend):
    c = Case(B=1, Sq=17, Sk=17, Hq=4, Hkv=2, dropout_p=0.4, seed=123, causal=True)
    device = backend_device(backend)
    a, b = (run_flashforge(c, make_inputs(c, device), backend) for _ in range(2))
    for name in ("o", "lse"):
        assert torch.equal(a[name], b[name]), name
    for name in ("dq", "dk", "dv"):
        torch.testing.assert_close(a[name], b[name], rtol=0, atol=1e-6)
    other = run_flashforge(with_(c, seed=124), make_inputs(c, device), backend)
    assert not torch.equal(a["o"], other["o"]), "another seed must give another dropout mask"


@pytest.mark.parametrize("backend", BACKENDS)
def test_gradient_through_lse_only(backend):
    """A loss of lse alone (o unused) still differentiates: dq, dk from lse, dv = 0."""
    device = backend_device(backend)
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 9, 2, 16, generator=gen).to(device).requires_grad_() for _ in range(3))
    _, lse = flashforge.attention(q, k, v, causal=True, return_lse=True, backend=backend)
    dq, dk, dv = torch.autograd.grad(lse.sum(), (q, k, v), allow_unused=True)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    _, lse64 = flashforge.reference.attention(q64, k64, v64, causal=True, return_lse=True)
    rq, rk = torch.autograd.grad(lse64.sum(), (q64, k64))
    torch.testing.assert_close(dq.double(), rq, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(dk.double(), rk, rtol=1e-4, atol=1e-5)
    assert dv is None or (dv == 0).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_default_scale_and_output_dtype(backend):
    c = Case(B=1, Sq=9, Sk=9, D=40)
    device = backend_device(backend)
    x = make_inputs(c, device)
    o = flashforge.attention(x.q, x.k, x.v, backend=backend)
    assert o.dtype == x.q.dtype and o.shape == (1, 9, 2, 40) and o.device == x.q.device
    o2 = flashforge.attention(x.q, x.k, x.v, scale=40 ** -0.5, backend=backend)
    assert torch.equal(o, o2)


def test_allocations_are_poisoned():
    """conftest's fixture: fresh allocations are NaN (floats) or a sentinel (ints), so unwritten
    output elements cannot pass for results."""
    assert torch.empty(3).isnan().all() and torch.empty_like(torch.ones(2)).isnan().all()
    assert torch.ones(1).new_empty(4).isnan().all()
    assert (torch.empty(2, dtype=torch.int32) == -7777).all()


def test_default_backend_on_cpu_is_torch():
    c = Case(Sq=9, Sk=9, causal=True, dropout_p=0.3, seed=3)
    x = make_inputs(c, "cpu")
    a = flashforge.attention(x.q, x.k, x.v, causal=True, dropout_p=0.3, seed=3)
    b = flashforge.attention(x.q, x.k, x.v, causal=True, dropout_p=0.3, seed=3, backend="torch")
    assert torch.equal(a, b)


@pytest.mark.parametrize("backend", BACKENDS[1:])
def test_backends_agree(backend):
    """Triton against the CPU path (both are checked against the reference elsewhere)."""
    c = Case(B=1, Sq=17, Sk=33, Hq=4, Hkv=2, D=40, causal=True, causal_offset=16, mask="float_grad",
             mask_shape="1HSqSk", dropout_p=0.2, seed=77, softcap=3.0)
    ours = run_flashforge(c, make_inputs(c, backend_device("triton")), "triton")
    cpu = run_flashforge(c, make_inputs(c, "cpu"), "torch")
    for name in ("o", "lse", "dq", "dk", "dv", "dmask"):
        torch.testing.assert_close(ours[name].cpu(), cpu[name], rtol=1e-4, atol=1e-5, msg=name)
