"""The PyTorch attention path (`flashforge.ops.attention_torch`) on its own.

tests/test_attention.py runs the public API on both backends at the default
tile sizes, where these small shapes fit in one tile.  Here the tiles are
shrunk (`small_tiles`) so that every case crosses query-block and key-chunk
boundaries, tile skipping is checked against the visibility rule, float64
inputs are checked directly and by gradcheck, and low-precision inputs go
through the same path.  `small_tiles` also turns off the route to PyTorch's own
kernel (`flashforge.ops.attention_cpu_aten`, tested in tests/test_attention_cpu_aten.py),
so the plain cases exercise the chunks too.  Extreme logits are checked on the
default route: there the kernel's float32 lse is too coarse and the chunked path
(with ``lse_lo``) serves them.
"""
import pytest
import torch

import flashforge
from flashforge import reference
from flashforge.autograd.attention import attention_function
from flashforge.ops import attention_cpu_aten, attention_torch
from flashforge.ops.params import AttnParams
from helpers import FLOOR, Case, check_case, make_inputs, run_flashforge, run_reference


@pytest.fixture
def small_tiles(monkeypatch):
    """Query blocks of 8 rows and key chunks of 5: uneven, so tiles straddle every boundary;
    every call takes the chunked path."""
    monkeypatch.setattr(attention_torch, "QUERY_BLOCK", 8)
    monkeypatch.setattr(attention_torch, "KEY_CHUNK", 5)
    monkeypatch.setattr(attention_cpu_aten, "serves", lambda *args: False)


def case(id, **kw):
    return pytest.param(Case(**kw), id=id)


CASES = [
    case("S1", B=2, Sq=1, Sk=1, D=16),
    case("S17-D40", Sq=17, Sk=17, D=40),
    case("S33-D64", B=1, Sq=33, Sk=33, D=64),
    case("Sq1-Sk97-decode", Sq=1, Sk=97, D=16),  # one query row: key chunks 8x wider, still 3 of them
    case("Sq33-Sk17-Dv40", B=1, Sq=33, Sk=17, D=16, Dv=40),
    case("gqa-4/2", B=1, Sq=17, Sk=33, Hq=4, Hkv=2, D=16),
    case("gqa-6/1", B=1, Sq=17, Sk=17, Hq=6, Hkv=1, D=40),
    case("bhsd-strides-gqa", Sq=17, Sk=33, Hq=4, Hkv=2, D=16, layout="bhsd"),
    case("strided-last-dim", Sq=9, Sk=17, D=16, Dv=8, layout="strided"),
    case("causal", Sq=33, Sk=33, causal=True),
    case("causal-offset+5", Sq=17, Sk=17, causal=True, causal_offset=5),
    case("causal-offset-7", Sq=17, Sk=33, causal=True, causal_offset=-7),
    case("causal-bottom-right", Sq=9, Sk=33, causal=True, causal_offset=24),
    case("causal-offset-tensor", B=3, Sq=17, Sk=33, Hq=4, Hkv=2, causal=True, causal_offset=(16, -3, 0)),
    case("window-int", Sq=33, Sk=33, window=4),
    case("window-tuple", Sq=17, Sk=33, window=(3, 6)),
    case("window-left-only", Sq=17, Sk=17, window=(4, -1)),
    case("window-right-only", Sq=17, Sk=17, window=(-1, 2)),
    case("window-causal", Sq=33, Sk=33, window=(6, -1), causal=True),
    case("window-int-causal-offset-tensor", Sq=17, Sk=33, window=5, causal=True, causal_offset=(16, 2)),
    case("window-offset-tensor", Sq=17, Sk=17, window=(2, 3), causal_offset=(-12, 10)),  # empty rows in b=0
    *(case(f"mask-bool-{s}", Sq=17, Sk=17, Hq=4, Hkv=2, mask="bool", mask_shape=s)
      for s in ("SqSk", "11SqSk", "B1SqSk", "BHSqSk", "B11Sk")),
    *(case(f"bias-grad-{s}", Sq=17, Sk=33, Hq=4, Hkv=2, mask="float_grad", mask_shape=s)
      for s in ("SqSk", "11SqSk", "B1SqSk", "1HSqSk", "BHSqSk", "B11Sk")),
    case("bias-no-grad-causal", Sq=17, Sk=17, causal=True, mask="float", mask_shape="B1SqSk"),
    case("dropout", B=2, Sq=17, Sk=33, Hq=4, Hkv=2, dropout_p=0.3, seed=2**40 + 7),
    case("dropout-causal-offset-tensor", Sq=17, Sk=17, causal=True, causal_offset=(0, 4), dropout_p=0.2, seed=3),
    case("softcap", Sq=17, Sk=33, softcap=2.0, input_scale=3.0),
    case("softcap-dropout-bias-grad-gqa", B=1, Sq=17, Sk=17, Hq=6, Hkv=1, softcap=1.5, dropout_p=0.25, seed=9,
         mask="float_grad", mask_shape="1HSqSk", causal=True),
    case("empty-rows-bool", Sq=17, Sk=17, mask="bool_empty_rows"),
    case("empty-rows-neg-inf-bias-grad", Sq=17, Sk=17, mask="float_neginf_rows", mask_shape="B1SqSk"),
    case("empty-rows-causal", Sq=17, Sk=17, causal=True, causal_offset=-10, dropout_p=0.3, seed=1),
    case("empty-all", Sq=9, Sk=9, causal=True, causal_offset=-9),
    case("o-only-loss", Sq=17, Sk=17, lse_grad=False),
]


@pytest.mark.parametrize("c", CASES)
def test_chunked_against_reference(c, small_tiles):
    """o, lse, dq, dk, dv, dmask against float64 (helpers.compare), inputs unchanged, no NaN."""
    check_case(c, "torch")


EXTREME = [  # (dtype, |q|, |k| scale): scores of 1e6-1e8, where one ulp of a float32 lse is 0.06-8
    pytest.param(torch.float16, 1e4, id="fp16-1e4"),
    pytest.param(torch.bfloat16, 3e3, id="bf16-3e3"),
    pytest.param(torch.float32, 1e3, id="fp32-1e3"),
    pytest.param(torch.float32, 1e4, id="fp32-1e4"),
]
ROW_SUM_RTOL = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 1e-2}


@pytest.mark.parametrize("variant", [
    pytest.param({}, id="plain"),
    pytest.param({"causal": True}, id="causal"),
    pytest.param({"Hq": 4, "Hkv": 2}, id="gqa-4/2"),
])
@pytest.mark.parametrize("shifted", [pytest.param(False, id="spread"), pytest.param(True, id="shifted")])
@pytest.mark.parametrize("dtype,mag", EXTREME)
def test_extreme_logits_gradients(dtype, mag, shifted, variant):
    """Logits of ~scale * mag**2: with dO = 1 each kv head's v.grad summed over keys is (query heads
    per kv head) x Sq, i.e. every row of the P the backward recomputes sums to 1; and where float32
    scores can be right at all ("spread"), o and the gradients match the float64 reference.

    "spread": q and k ~ mag * randn, so each row's softmax is one-hot.  "shifted": q and k are
    randn but for a first component of mag, so every score is the same huge number plus O(1): P is
    spread over many keys, lse = m + log(l) is rounded to an ulp of m, and P recomputed from a
    float32 lse alone misses by up to e**8 (the lse_lo contract, flashforge.ops.params).  The
    scores themselves carry that ulp, so there no float32 attention matches the float64 reference.

    The reference tolerance is the dtype's rounding floor relative to each result's natural size:
    the reference's dq and dk are ~0 where softmax is one-hot, and what remains of ours is float32
    rounding of dS (~1e-7) times the other operand (~mag); PyTorch's own float16 run of the
    reference overflows."""
    c = Case(B=1, Sq=16, Sk=16, D=16, input_scale=1.0 if shifted else mag, lse_grad=False, **variant)
    inputs = make_inputs(c, "cpu", dtype)
    if shifted:
        for t in (inputs.q, inputs.k):
            t.detach()[..., 0] = mag
    ours = run_flashforge(c, inputs, "torch")
    for name in ("o", "dq", "dk", "dv"):
        assert torch.isfinite(ours[name]).all(), name
    if not shifted:
        ref = run_reference(c, inputs, torch.float64)
        q, k, v, do = (t.detach().double().abs().max().item() for t in (inputs.q, inputs.k, inputs.v, inputs.do))
        scale = c.D ** -0.5
        natural = {"o": v, "dq": scale * k * v * do, "dk": scale * q * v * do, "dv": 0.0}
        for name, size in natural.items():
            err = (ours[name].double() - ref[name]).abs().max().item()
            tol = FLOOR[dtype] * max(1.0, size, ref[name].abs().max().item())
            assert err <= tol, f"{name}: max error {err:.3e} > {tol:.3e}"

    o = flashforge.attention(inputs.q, inputs.k, inputs.v, causal=c.causal, backend="torch")
    (dv,) = torch.autograd.grad(o, inputs.v, torch.ones_like(o))
    want = torch.full_like(dv[:, 0].float(), c.Sq * c.Hq // c.Hkv)
    torch.testing.assert_close(dv.float().sum(dim=1), want, rtol=ROW_SUM_RTOL[dtype], atol=0)


@pytest.mark.parametrize("tiles", [(1, 1), (3, 7), (16, 2), (256, 256)])
def test_any_tiling_same_meaning(tiles, monkeypatch):
    monkeypatch.setattr(attention_torch, "QUERY_BLOCK", tiles[0])
    monkeypatch.setattr(attention_torch, "KEY_CHUNK", tiles[1])
    check_case(Case(B=2, Sq=13, Sk=21, Hq=4, Hkv=2, causal=True, causal_offset=(8, -2), window=(6, -1),
                    mask="float_grad", mask_shape="B11Sk", dropout_p=0.2, seed=5, softcap=4.0), "torch")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_inputs(dtype, small_tiles):
    """float16/bfloat16 inputs accumulate in float32: o and grads in the input dtype, lse float32."""
    c = Case(B=1, Sq=17, Sk=33, Hq=4, Hkv=2, D=40, causal=True, causal_offset=16, mask="float_grad",
             mask_shape="B11Sk", dropout_p=0.1, seed=2, softcap=5.0)
    ours = check_case(c, "torch", dtype=dtype)
    assert ours["o"].dtype == ours["dq"].dtype == ours["dk"].dtype == ours["dv"].dtype == dtype


def _params(**kw) -> AttnParams:
    return AttnParams(**{"scale": 0.4, **kw})


def _visible(params: AttnParams, B: int, Sq: int, Sk: int) -> torch.Tensor:
    """Bool [B, Sq, Sk] straight from the rule in AttnParams' docstring."""
    off = params.offset_tensor.view(-1, 1, 1) if params.offset_tensor is not None else torch.tensor(params.offset)
    i = torch.arange(Sq).view(1, Sq, 1) + off
    j = torch.arange(Sk).view(1, 1, Sk)
    vis = torch.ones(B, Sq, Sk, dtype=torch.bool)
    if params.window_left >= 0:
        vis &= j >= i - params.window_left
    if params.window_right >= 0:
        vis &= j <= i + params.window_right
    return vis


@pytest.mark.parametrize("window,offset", [
    ((-1, 0), 0), ((-1, 0), 9), ((-1, 0), -5), ((3, 0), (0, 11, -4)), ((2, 5), -3), ((0, 0), (7, 7, 30)),
    ((4, -1), 2), ((-1, 1), (-40, 0, 3)),
])
def test_tiles_cover_exactly_the_visible_keys(window, offset, monkeypatch):
    """Every visible (i, j) lies in a visited tile, every visited tile has a visible entry, and a
    tile is unmasked only where the whole of it is visible."""
    monkeypatch.setattr(attention_torch, "QUERY_BLOCK", 4)
    monkeypatch.setattr(attention_torch, "KEY_CHUNK", 3)
    B, Sq, Sk = 3, 19, 23
    if isinstance(offset, tuple):
        params = _params(window_left=window[0], window_right=window[1], offset_tensor=torch.tensor(offset).int())
    else:
        params = _params(window_left=window[0], window_right=window[1], offset=offset)
    vis = _visible(params, B, Sq, Sk)
    q, k = torch.zeros(B, Sq, 1, 4), torch.zeros(B, Sk, 1, 4)
    tiles = attention_torch._Tiles(q, k, k, None, params)
    covered = torch.zeros(Sq, Sk, dtype=torch.bool)
    for r0, r1 in tiles.row_blocks():
        chunks = list(tiles.key_chunks(r0, r1))
        for (c0, c1), (d0, _) in zip(chunks, chunks[1:]):
            assert c1 <= d0, "key chunks of a block must be ascending and disjoint"
        for c0, c1 in chunks:
            assert c1 - c0 <= attention_torch.KEY_CHUNK * max(1, attention_torch.QUERY_BLOCK // (r1 - r0))
            tile = vis[:, r0:r1, c0:c1]
            assert tile.any(), f"tile rows [{r0}, {r1}) keys [{c0}, {c1}) has nothing visible"
            covered[r0:r1, c0:c1] = True
            invisible = tiles._invisible(r0, r1, c0, c1)
            if invisible is None:
                assert tile.all()
            else:
                assert torch.equal(~invisible.view(-1, r1 - r0, c1 - c0).expand_as(tile), tile)
    assert not (vis.any(0) & ~covered).any(), "a visible key was skipped"


def test_causal_skips_the_upper_triangle(monkeypatch):
    monkeypatch.setattr(attention_torch, "QUERY_BLOCK", 16)
    monkeypatch.setattr(attention_torch, "KEY_CHUNK", 16)
    q = torch.zeros(1, 64, 1, 4)
    tiles = attention_torch._Tiles(q, q, q, None, _params(window_right=0))
    visited = sum(1 for r0, r1 in tiles.row_blocks() for _ in tiles.key_chunks(r0, r1))
    assert visited == 4 + 3 + 2 + 1


def _float64_inputs(B=2, Sq=11, Sk=13, Hq=4, Hkv=2, D=8, Dv=6, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Hq, Sq, D, generator=gen, dtype=torch.float64).transpose(1, 2)
    k = torch.randn(B, Sk, Hkv, D, generator=gen, dtype=torch.float64)
    v = torch.randn(B, Sk, Hkv, Dv, generator=gen, dtype=torch.float64)
    mask = torch.randn(B, 1, Sq, Sk, generator=gen, dtype=torch.float64)
    return q, k, v, mask


def test_direct_call_float64(small_tiles):
    """attention_forward/backward called directly on float64 match the reference to float64 rounding."""
    q, k, v, mask = _float64_inputs()
    offset = torch.tensor([2, 4], dtype=torch.int32)
    params = _params(window_left=5, window_right=0, offset_tensor=offset, softcap=3.0, dropout_p=0.3, seed=17)
    before = [t.clone() for t in (q, k, v, mask, offset)]
    o, lse = attention_torch.attention_forward(q, k, v, mask, params)
    assert o.dtype == lse.dtype == torch.float64 and o.shape == (2, 11, 4, 6) and lse.shape == (2, 4, 11)

    gen = torch.Generator().manual_seed(1)
    do = torch.randn(2, 4, 11, 6, generator=gen, dtype=torch.float64).transpose(1, 2)  # non-contiguous
    dlse = torch.randn(2, 4, 11, generator=gen, dtype=torch.float64)
    dq, dk, dv, dmask = attention_torch.attention_backward(do, dlse, q, k, v, mask, o, lse, params, True)
    for a, b in zip((q, k, v, mask, offset), before):
        assert torch.equal(a, b), "an input was modified"

    leaves = [t.clone().requires_grad_() for t in (q, k, v, mask)]
    ro, rlse = reference.attention(*leaves[:3], mask=leaves[3], causal=True, causal_offset=offset, window=(5, -1),
                                   dropout_p=0.3, seed=17, scale=0.4, softcap=3.0, return_lse=True)
    grads = torch.autograd.grad((ro, rlse), leaves, (do, dlse))
    names = ("o", "lse", "dq", "dk", "dv", "dmask")
    for name, ours, ref in zip(names, (o, lse, dq, dk, dv, dmask), (ro, rlse, *grads)):
        assert ours.shape == ref.shape, name
        torch.testing.assert_close(ours, ref, rtol=1e-10, atol=1e-12, msg=name)


def test_direct_call_no_dmask_no_dlse():
    q, k, v, mask = _float64_inputs(Sq=5, Sk=5)
    params = _params()
    o, lse = attention_torch.attention_forward(q, k, v, mask > 0, params)
    do = torch.ones_like(o)
    *grads, dmask = attention_torch.attention_backward(do, None, q, k, v, mask > 0, o, lse, params, False)
    assert dmask is None
    assert [g.shape for g in grads] == [q.shape, k.shape, v.shape]
    assert all(g.dtype == torch.float64 and torch.isfinite(g).all() for g in grads)


def test_gradcheck_float64(small_tiles):
    """Analytic gradients (o and lse outputs; q, k, v and the float mask) against finite differences,
    with GQA, a per-batch causal offset, a window, softcap, dropout and a broadcast bias."""
    q, k, v, mask = _float64_inputs(B=2, Sq=6, Sk=9, Hq=4, Hkv=2, D=3, Dv=2)
    mask = mask[:, :, :1]  # [B, 1, 1, Sk]: gradient summed over heads and query rows
    params = _params(window_left=4, window_right=0, offset_tensor=torch.tensor([3, 1], dtype=torch.int32),
                     softcap=1.5, dropout_p=0.25, seed=123)
    inputs = [t.detach().clone().requires_grad_() for t in (q, k, v, mask)]
    assert torch.autograd.gradcheck(lambda *x: attention_function(*x, params, "torch"), inputs)


@pytest.mark.gpu
def test_runs_on_cuda_tensors():
    """backend="torch" is device-agnostic: CUDA tensors give the CPU path's results."""
    c = Case(B=2, Sq=33, Sk=65, Hq=4, Hkv=2, D=40, causal=True, causal_offset=(32, 5), window=(20, -1),
             mask="float_grad", mask_shape="B11Sk", dropout_p=0.2, seed=9, softcap=4.0)
    cpu = run_flashforge(c, make_inputs(c, "cpu"), "torch")
    gpu = run_flashforge(c, make_inputs(c, "cuda"), "torch", allow_tf32=False)
    for name in ("o", "lse", "dq", "dk", "dv", "dmask"):
        torch.testing.assert_close(gpu[name].cpu(), cpu[name], rtol=1e-4, atol=1e-5, msg=name)

