"""The launch cache (flashforge/ops/launch.py) keys a compiled kernel by what Triton
specializes on: two arguments with the same key must get the same specialization from
Triton's own rule (`native_specialize_impl`), or a cached kernel compiled for one would be
launched for the other.  Runs on the CPU (the rule is host code)."""
import itertools

import pytest
import torch

from flashforge.ops.launch import launch_key

triton_jit = pytest.importorskip("triton.runtime.jit")
tl = pytest.importorskip("triton.language")
from triton.backends.compiler import BaseBackend  # noqa: E402


def spec(a):
    return triton_jit.native_specialize_impl(BaseBackend, a, False, True, True)


def _values():
    ints = [0, 1, 2, 15, 16, 17, 32, 48, 1000, 1024, 2**31 - 1, 2**31 - 16, 2**31, 2**31 + 16, 2**40 + 3,
            2**63 - 16, 2**63, 2**64 - 16, -1, -16, -17, -2**31, -2**31 - 16]
    base = torch.zeros(4096, dtype=torch.bfloat16)
    tensors = [base, base[1:], base[8:], base[9:], base.float(), base.float()[4:], base.float()[1:],
               torch.zeros(3, dtype=torch.int32), torch.zeros(4, dtype=torch.uint8)[1:], torch.zeros(2, dtype=torch.bool)]
    floats = [0.0, 1.0, 0.125, -3.5]
    bools = [True, False]
    out = [ints, tensors, floats, bools]
    try:
        from triton.tools.tensor_descriptor import TensorDescriptor
        t = torch.zeros(2, 128, 4, 64, dtype=torch.bfloat16)
        out.append([TensorDescriptor(x, list(x.shape), list(x.stride()), [1, rows, 1, 64])
                    for x in (t, t[:, :100], t.float()) for rows in (64, 128)])
    except ImportError:
        pass
    try:
        from flashforge.ops.gluon import attention as gluon_attention
        if gluon_attention._kernel() is not None:
            t = torch.zeros(2, 128, 4, 64, dtype=torch.bfloat16)
            out.append([gluon_attention._descriptor(x, rows) for x in (t, t[:, :100], t.half()) for rows in (64, 32)])
    except ImportError:
        pass
    return out


@pytest.mark.parametrize("group", range(6), ids=["int", "tensor", "float", "bool", "descriptor", "gluon-descriptor"])
def test_same_key_means_same_specialization(group):
    groups = _values()
    if group >= len(groups):
        pytest.skip("this Triton has no such descriptor")
    values = groups[group]
    for a, b in itertools.combinations(values, 2):
        ka, kb = launch_key([a]), launch_key([b])
        assert ka is not None and kb is not None
        if ka == kb:
            assert spec(a) == spec(b), (a if not isinstance(a, torch.Tensor) else a.dtype, b, ka)
    # and the key separates what Triton separates within the group (no needless recompiles either)
    assert len({launch_key([v]) for v in values}) == len({str(spec(v)) for v in values})


def _kernel_with_positional_constexpr(X, n, D: "tl.constexpr", BLOCK: "tl.constexpr" = 16):
    pass


def test_positional_constexprs_are_keyed_by_value():
    """A constexpr passed by position is keyed by its value: 96 and 128 have the same integer
    properties.  (The preprocess kernel takes its head dim DV so; the cache once served its
    DV = 96 kernel to a DV = 128 call, and the backward's dq came out wrong.)"""
    import inspect
    from flashforge.ops.launch import cache_key
    from flashforge.ops.triton.attention_bwd import attn_bwd_preprocess_kernel
    fn = getattr(attn_bwd_preprocess_kernel, "fn", attn_bwd_preprocess_kernel)
    names = list(inspect.signature(fn).parameters)
    assert "constexpr" in str(inspect.signature(fn).parameters["DV"].annotation) and names.index("DV") == 17
    kernel = triton_jit.JITFunction(_kernel_with_positional_constexpr)
    t = torch.zeros(8, dtype=torch.bfloat16)

    def key(d, n=1000, **kw):
        return cache_key(kernel, 0, (t, n, d), kw)

    assert key(96) != key(128)
    assert key(128) == key(128, n=999) and key(128) != key(128, BLOCK=64)
    assert cache_key(kernel, 0, (t, object()), {}) is None


def test_unknown_argument_types_take_the_plain_launch():
    assert launch_key([object()]) is None
    assert launch_key([1, "tf32"]) is None


@pytest.mark.gpu
def test_repeat_launches_are_right(monkeypatch):
    """Calls whose arguments share a key (lengths 130, 257: neither 1 nor a multiple of 16)
    run from the cache, with their own grids and values, and match the reference.  (Training
    launch plans off: a planned call launches its kernels past the cache's lookup, so it counts
    no hit; tests/test_replay.py covers plans.)"""
    from flashforge.ops import launch, replay
    monkeypatch.setattr(launch, "ENABLED", True)
    monkeypatch.setattr(replay, "TRAINING", False)
    from helpers import Case, check_case
    for Sq in (130, 257, 130, 257):
        for causal in (False, True):
            check_case(Case(B=2, Sq=Sq, Sk=Sq + 3, Hq=4, Hkv=2, D=64, causal=causal), "triton", device="cuda",
                       dtype=torch.bfloat16)
    hits = launch.hits
    check_case(Case(B=2, Sq=257, Sk=260, Hq=4, Hkv=2, D=64), "triton", device="cuda", dtype=torch.bfloat16)
    assert launch.hits > hits


@pytest.mark.gpu
def test_served_kernels_are_tritons_choice(monkeypatch):
    """Every repeat launch in a run of varied calls -- head dims sharing every integer property
    (96, 128), layouts, masks, dropout, softcap, GQA, the Gluon kernels -- is served the kernel
    Triton itself would pick (verify mode raises otherwise), and every result is right."""
    from flashforge.ops import launch
    monkeypatch.setattr(launch, "ENABLED", True)
    monkeypatch.setattr(launch, "VERIFY", True)
    from helpers import Case, check_case
    cases = [Case(B=2, Sq=1000, Sk=1000, Hq=4, Hkv=2, D=96, layout="bhsd"),
             Case(B=1, Sq=1000, Sk=1000, Hq=4, Hkv=4, D=128, causal=True, dropout_p=0.1, seed=5),
             Case(B=1, Sq=1000, Sk=1000, Hq=4, Hkv=2, D=128, causal=True, softcap=30.0),
             Case(B=2, Sq=300, Sk=300, Hq=4, Hkv=2, D=128, causal=True),
             Case(B=2, Sq=256, Sk=256, Hq=4, Hkv=1, D=64, mask="float_grad", mask_shape="B1SqSk"),
             Case(B=2, Sq=300, Sk=300, Hq=4, Hkv=2, D=96)]
    hits = launch.hits
    for _ in range(2):
        for c in cases:
            check_case(c, None, device="cuda", dtype=torch.bfloat16)
    assert launch.hits > hits


def test_profiler_hooks_take_tritons_path():
    """Triton keeps an (empty) hook chain; only a chain with hooks in it sends launches through
    Triton's own path, which calls them."""
    from triton import knobs
    from flashforge.ops import launch
    assert not launch._hooked()
    hook = knobs.runtime.launch_enter_hook

    def probe(*args):
        pass

    hook.add(probe)
    try:
        assert launch._hooked()
    finally:
        hook.remove(probe)
    assert not launch._hooked()


def test_direct_launch_passes_what_tritons_launcher_would():
    """A repeat launch calls Triton's C launcher itself (`launch._direct`): with the same kernel
    arguments it must pass exactly what Triton 3.6's Python launcher (`CudaLauncher.__call__`,
    then the wrapper that expands descriptors) would, descriptors expanded in place."""
    driver = pytest.importorskip("triton.backends.nvidia.driver")
    from types import SimpleNamespace

    from flashforge.ops import launch
    from triton.tools.tensor_descriptor import TensorDescriptor

    calls = []

    def launch_c(*args):  # stands in for the C launcher
        calls.append(args)
    launch_c.__name__ = "launch"

    # a kernel (x_desc, y, n, z_desc, BLOCK: constexpr); descriptors lowered to pointers (no metadata)
    signature = {"x_desc": "tensordesc<bf16[1, 64, 1, 128]>", "y": "*fp32", "n": "i32",
                 "z_desc": "tensordesc<bf16[1, 32, 1, 128]>", "BLOCK": "constexpr"}
    wrapped = driver.wrap_handle_tensordesc(launch_c, signature, None)
    run = SimpleNamespace(launch=wrapped, global_scratch_size=0, profile_scratch_size=0,
                          launch_cooperative_grid=False, launch_pdl=True)
    compiled = SimpleNamespace(run=run, metadata=SimpleNamespace(tensordesc_meta=None),
                               src=SimpleNamespace(signature=signature), packed_metadata=("meta",), function=1234)
    t = torch.zeros(2, 100, 4, 128, dtype=torch.bfloat16)
    descs = [TensorDescriptor(t, list(t.shape), list(t.stride()), [1, rows, 1, 128]) for rows in (64, 32)]
    args = (descs[0], torch.zeros(3), 100, descs[1])

    ready = launch._Ready(compiled, [64], len(args))
    assert ready.raw is launch_c and [i for i, _ in ready.expand] == [3, 0]
    launch.launch_ready(ready, (5, 6), 777, args)
    # Triton's own path: CudaLauncher.__call__ passes (coop, pdl, no scratch) then its arguments
    wrapped(5, 6, 1, 777, 1234, False, True, None, None, ("meta",), None, None, None, *args, 64)
    ours, theirs = calls
    assert len(ours) == len(theirs)
    for a, b in zip(ours, theirs):
        assert a is b or a == b
