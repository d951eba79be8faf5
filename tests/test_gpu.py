"""The Triton kernels on a CUDA GPU at realistic sizes, in float16, bfloat16 and
float32, against the float64 reference computed on the GPU (tolerance policy of
`helpers.compare`: a multiple of PyTorch's own error in the same dtype).

Every test here is marked `gpu`; conftest skips them, with the reason, when
CUDA is not available.  Kernel compilation dominates the run time, so feature
cases are spread over the dtypes rather than crossed with all of them.
"""
import pytest
import torch

import flashforge
from helpers import Case, attention_keep_mask, check_case, make_inputs, run_flashforge

pytestmark = pytest.mark.gpu

F16, BF16, F32 = torch.float16, torch.bfloat16, torch.float32


def case(id, dtype, **kw):
    return pytest.param(Case(**kw), dtype, id=f"{id}-{str(dtype)[6:]}")


# shapes in two dtypes, or one for float32 (its kernels compile slowest: ~15 s a case)
GRID = [
    case("S1-D64", F16, B=2, Sq=1, Sk=1, Hq=4, Hkv=4, D=64),
    case("S17-D40", BF16, B=2, Sq=17, Sk=17, Hq=2, Hkv=2, D=40),
    case("S128-D128-causal", F16, B=2, Sq=128, Sk=128, Hq=4, Hkv=4, D=128, causal=True),
    case("S128-D128-causal-bias-grad", F32, B=2, Sq=128, Sk=128, Hq=4, Hkv=4, D=128, causal=True,
         mask="float_grad", mask_shape="B11Sk"),
    case("S1000-D64", BF16, B=1, Sq=1000, Sk=1000, Hq=4, Hkv=4, D=64),
    case("S2048-D128-causal-gqa8/2", F16, B=1, Sq=2048, Sk=2048, Hq=8, Hkv=2, D=128, causal=True),
    case("S2048-D128-causal-gqa8/2", BF16, B=1, Sq=2048, Sk=2048, Hq=8, Hkv=2, D=128, causal=True),
    case("S300-D256", F16, B=1, Sq=300, Sk=300, Hq=2, Hkv=1, D=256),
    case("S300-D256", BF16, B=1, Sq=300, Sk=300, Hq=2, Hkv=1, D=256),
]

# each feature in one dtype
GRID += [
    # Sq != Sk, head dims, strides
    case("decode-Sq1-Sk2048-gqa8/1", BF16, B=2, Sq=1, Sk=2048, Hq=8, Hkv=1, D=128),
    case("Sq1000-Sk128-bottom-right", F16, B=1, Sq=1000, Sk=128, Hq=4, Hkv=2, D=64, causal=True,
         causal_offset=128 - 1000),
    case("D40-Dv200", BF16, B=1, Sq=300, Sk=300, Hq=2, Hkv=2, D=40, Dv=200),
    case("D96-bhsd", BF16, B=2, Sq=1000, Sk=1000, Hq=4, Hkv=2, D=96, layout="bhsd"),
    # causal offsets and windows
    case("causal-offset-tensor", BF16, B=3, Sq=512, Sk=2048, Hq=4, Hkv=1, D=128, causal=True,
         causal_offset=(1536, 0, 700), offset_dtype=torch.int64),
    case("window-(256,-1)-causal", BF16, B=1, Sq=2048, Sk=2048, Hq=4, Hkv=2, D=64, causal=True, window=(256, -1)),
    case("window-(64,32)-offset", F16, B=2, Sq=500, Sk=1000, Hq=2, Hkv=1, D=64, window=(64, 32), causal_offset=500),
    # masks and bias gradients
    case("bias-grad-1HSqSk", BF16, B=2, Sq=512, Sk=512, Hq=4, Hkv=4, D=128, mask="float_grad",
         mask_shape="1HSqSk"),
    case("bias-grad-SqSk-causal", F16, B=2, Sq=1000, Sk=1000, Hq=2, Hkv=1, D=64, mask="float_grad",
         mask_shape="SqSk", causal=True),
    case("bias-grad-B11Sk-decode", BF16, B=2, Sq=1, Sk=1000, Hq=4, Hkv=1, D=128, mask="float_grad",
         mask_shape="B11Sk"),
    # dropout, softcap
    case("dropout-0.1-causal", BF16, B=1, Sq=1000, Sk=1000, Hq=4, Hkv=4, D=128, causal=True, dropout_p=0.1,
         seed=2**40 + 1),
    case("dropout-0.3-gqa-bias-grad", F16, B=2, Sq=512, Sk=512, Hq=4, Hkv=2, D=64, dropout_p=0.3, seed=7,
         mask="float_grad", mask_shape="B1SqSk"),
    case("alibi-BH-causal-bottom-right", F16, B=2, Sq=500, Sk=1000, Hq=4, Hkv=2, D=64, causal=True,
         causal_offset=500, alibi="BH"),
    case("softcap-30-causal", BF16, B=1, Sq=1000, Sk=1000, Hq=4, Hkv=2, D=128, causal=True, softcap=30.0,
         input_scale=3.0),
    # fully masked rows
    case("empty-rows-bool", F16, B=2, Sq=1000, Sk=1000, Hq=2, Hkv=2, D=64, mask="bool_empty_rows"),
    case("empty-rows-causal-offset", BF16, B=1, Sq=512, Sk=512, Hq=4, Hkv=2, D=128, causal=True,
         causal_offset=-300),
    case("empty-rows-neg-inf-bias", F16, B=2, Sq=128, Sk=128, Hq=2, Hkv=2, D=64, mask="float_neginf_rows",
         mask_shape="B1SqSk"),
]


@pytest.mark.parametrize("c, dtype", GRID)
def test_against_reference(c, dtype):
    check_case(c, None, device="cuda", dtype=dtype)


def test_fp32_allow_tf32():
    """allow_tf32=True trades float32 accuracy for speed: judged with a TF32-sized floor."""
    c = Case(B=2, Sq=512, Sk=512, Hq=4, Hkv=2, D=64, causal=True)
    check_case(c, None, device="cuda", dtype=F32, floor=5e-3, allow_tf32=True)


@pytest.mark.parametrize("c", [
    pytest.param(Case(Sq=0, Sk=100, D=64), id="Sq0"),
    pytest.param(Case(Sq=100, Sk=0, D=64, mask="float_grad", mask_shape="B1SqSk"), id="Sk0"),
])
def test_empty_sequences(c):
    x = make_inputs(c, "cuda", F16)
    ours = run_flashforge(c, x, None)
    assert ours["o"].shape == (c.B, c.Sq, c.Hq, c.dv)
    assert (ours["o"] == 0).all() and (ours["lse"] == float("-inf")).all()
    for name in ("dq", "dk", "dv", "dmask"):
        if ours[name] is not None:
            assert (ours[name] == 0).all(), name


@pytest.mark.parametrize("seed, B, Hq, Hkv, Sq, Sk, p", [
    pytest.param(5, 2, 3, 3, 300, 64, 0.5, id="300x64"),
    pytest.param(2**62 + 9, 1, 4, 1, 1000, 64, 0.75, id="seed>2**32-gqa"),
])
def test_dropout_mask_equals_dropout_mask(seed, B, Hq, Hkv, Sq, Sk, p):
    # bfloat16 is exact here: every kept weight is 1 / (Sk (1 - p)), a power of two
    keep = attention_keep_mask(None, "cuda", seed, B, Hq, Hkv, Sq, Sk, p, dtype=BF16)
    assert torch.equal(keep, flashforge.dropout_mask(seed, B, Hq, Sq, Sk, p))
    assert torch.equal(keep, flashforge.dropout_mask(seed, B, Hq, Sq, Sk, p, device="cuda").cpu())


def test_deterministic_is_bitwise_reproducible():
    c = Case(B=2, Sq=512, Sk=512, Hq=8, Hkv=2, D=128, causal=True, mask="float_grad", mask_shape="1HSqSk",
             dropout_p=0.1, seed=11)
    runs = [run_flashforge(c, make_inputs(c, "cuda", BF16), None, deterministic=True) for _ in range(2)]
    for name in ("o", "lse", "dq", "dk", "dv", "dmask"):
        assert torch.equal(runs[0][name], runs[1][name]), f"{name} differs between two deterministic runs"


def test_memory_is_linear_in_sequence_length():
    """Nothing of size Sq x Sk: at S = 16384 one fp32 score matrix per head would be 1 GiB."""
    B, S, H, D = 1, 16384, 2, 64
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(B, S, H, D, device="cuda", dtype=BF16, generator=gen).requires_grad_() for _ in range(3))
    do = torch.randn(B, S, H, D, device="cuda", dtype=BF16, generator=gen)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    o = flashforge.attention(q, k, v, causal=True)
    torch.autograd.grad(o, (q, k, v), do)
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    inputs = 4 * q.numel() * q.element_size()
    assert extra < 16 * inputs, f"peak extra memory {extra / 2**20:.0f} MiB for inputs of {inputs / 2**20:.0f} MiB"


def test_unseeded_dropout_in_cuda_graphs_draws_a_new_mask_per_replay():
    """The seed of an unseeded call is drawn on the device by PyTorch's graph-safe
    generator and read by the kernels: every replay of a captured graph drops a
    different set of weights; a seeded call replays identically."""
    B, S, H, D = 1, 256, 2, 64
    q, k = (torch.zeros(B, S, H, D, device="cuda", dtype=BF16) for _ in range(2))
    v = torch.randn(B, S, H, D, device="cuda", dtype=BF16)
    static = {}

    def step():
        static["free"] = flashforge.attention(q, k, v, dropout_p=0.5)
        static["seeded"] = flashforge.attention(q, k, v, dropout_p=0.5, seed=3)

    step()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    outs = []
    for _ in range(2):
        graph.replay()
        torch.cuda.synchronize()
        outs.append({k_: t.clone() for k_, t in static.items()})
    assert not torch.equal(outs[0]["free"], outs[1]["free"]), "replays reused one dropout seed"
    assert torch.equal(outs[0]["seeded"], outs[1]["seeded"])
    eager = flashforge.attention(q, k, v, dropout_p=0.5, seed=3)
    assert torch.equal(outs[0]["seeded"], eager)
