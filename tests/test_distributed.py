"""flashforge.distributed: context-parallel attention gives this rank's shard of
`flashforge.attention` of the full tensors (o, lse, dq, dk, dv).

Most checks here run in this process: the block plans against a brute-force count of the
visible pairs, the blocks' routes, the layouts, the lse merge, and, on a gloo group of one
process, argument errors, the custom ops' registration and the group of size 1.

`test_groups_of_4_2_and_1_match_attention` spawns 4 processes once (gloo on localhost) and
runs every case on three kinds of group at once: the 4 ranks, two groups of 2 (ranks {0, 1}
and {2, 3}: group ranks differ from global ranks there) and four groups of 1.  Each case is
layout x strategy x causal or not x GQA or not x window or not, float32, compared with
`flashforge.attention` on the unsharded tensors and with the float64 reference; allocations
in the workers are NaN-poisoned as in conftest.  The groups of 2 also check the errors that
need several ranks (mismatched shapes or options: every rank raises the same ValueError, and
the group works afterwards), `unshard_sequence` and its gradient, and torch.compile.
"""
from __future__ import annotations

import dataclasses
import itertools
import json
import math
import os
import socket
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import flashforge
from flashforge import reference
from flashforge.distributed import context_parallel_attention, shard_sequence, unshard_sequence
from flashforge.distributed import block, layout as lay
from flashforge.distributed.plan import schedule
from flashforge.ops.params import AttnParams

from helpers import backend_device, backend_params

LAYOUTS = ("zigzag", "contiguous")
STRATEGIES = ("ring", "allgather")


# ---------------------------------------------------------------- plans, routes, layouts, merge


def _visible(d: int, left: int, right: int) -> bool:
    """Key minus query position ``d`` under a window (-1: unbounded side)."""
    return (left < 0 or d >= -left) and (right < 0 or d <= right)


WINDOWS = [(-1, -1), (-1, 0), (0, 0), (1, 0), (3, 2), (-1, 3), (5, -1), (2, -1), (7, 0), (0, 7)]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_plans_cover_every_visible_pair_exactly_once(layout):
    """For every rank, block, length and window: the calls' rules select exactly the globally
    visible (query, key) pairs, none twice (a pair in two calls would be merged twice)."""
    counts = {}
    for W, n, (left, right) in itertools.product((1, 2, 3, 4), (2, 4, 6), WINDOWS):
        sched = schedule(layout, W, n, left, right)
        for r, b in itertools.product(range(W), range(W)):
            gq = {s.local + i: s.start + i for s in lay.segments(layout, r, W, n) for i in range(s.length)}
            gk = {s.local + i: s.start + i for s in lay.segments(layout, b, W, n) for i in range(s.length)}
            covered = []
            for c in sched.calls[r][b]:
                covered += [(i, j) for i in range(c.q0, c.q1) for j in range(c.k0, c.k1)
                            if not c.masked or _visible((j - c.k0) - (i - c.q0) - c.offset, left, right)]
            want = {(i, j) for i in gq for j in gk if _visible(gk[j] - gq[i], left, right)}
            assert len(covered) == len(set(covered)), (layout, W, n, left, right, r, b)
            assert set(covered) == want, (layout, W, n, left, right, r, b)
            counts[len(sched.calls[r][b])] = counts.get(len(sched.calls[r][b]), 0) + 1
    assert counts.get(0, 0) > 0  # some steps are skipped outright


def test_zigzag_causal_steps_are_one_call_each_and_balanced():
    """ring-flash-attn's zigzag: the diagonal step one causal call over the whole shard; every other
    step one unmasked call of the same size (all queries x the first half, or the second half x all keys)."""
    W, n = 4, 8
    sched = schedule("zigzag", W, n, -1, 0)
    for r, b in itertools.product(range(W), range(W)):
        (c,) = sched.calls[r][b]
        if b == r:
            assert (c.q0, c.q1, c.k0, c.k1, c.masked) == (0, n, 0, n, True)
        else:
            assert not c.masked and (c.q1 - c.q0) * (c.k1 - c.k0) == n * n // 2
            assert (c.q0, c.q1, c.k0, c.k1) == ((0, n, 0, n // 2) if b < r else (n // 2, n, 0, n))
    assert sched.last == (W - 1,) * W


def test_routes_stop_where_no_rank_needs_the_block():
    W, n = 4, 8
    # contiguous causal: block b is needed by ranks b..W-1 only
    assert schedule("contiguous", W, n, -1, 0).last == (3, 2, 1, 0)
    # a window shorter than a shard: only the next rank needs a block
    sched = schedule("contiguous", W, n, 3, 0)
    assert sched.last == (1, 1, 1, 0)
    assert [[len(c) for c in row] for row in sched.calls] == [[1, 0, 0, 0], [1, 1, 0, 0], [0, 1, 1, 0], [0, 0, 1, 1]]
    assert schedule("zigzag", W, n, -1, -1).last == (W - 1,) * W


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dim", [0, 1, 2])
def test_layout_shards_and_their_permutations_invert(layout, dim):
    W = 3
    x = torch.randn(12, 12, 12)
    shards = [lay.shard(x, layout, r, W, dim) for r in range(W)]
    assert all(s.shape[dim] == 12 // W for s in shards)
    stacked = torch.stack(shards)
    assert torch.equal(lay.to_global(stacked, layout, W, dim), x)
    assert torch.equal(lay.to_rank_order(x, layout, W, dim), stacked)
    if layout == "zigzag":  # rank 1 of 3: chunks 1 and 4 of 6 (2 rows each)
        assert torch.equal(shards[1], x.index_select(dim, torch.tensor([2, 3, 8, 9])))


def test_merge_of_key_halves_equals_attention_and_keeps_empty_rows_zero():
    """Two partial results (keys [0, 8) and [8, 16)) merge into the attention over all keys; rows
    that one part cannot see, or neither (the window), give no NaN."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 16, 2, 8) for _ in range(3))
    # a causal window of 0: row i sees key i only, so each half sees nothing for half of the rows
    p = AttnParams(scale=8 ** -0.5, window_left=0, window_right=0)
    want_o, want_lse = flashforge.attention(q, k, v, window=(0, 0), return_lse=True)
    o = torch.zeros(2, 16, 2, 8)
    lse = torch.full((2, 2, 16), float("-inf"))
    mod = flashforge.ops.backends.backend_module("attention", "torch")
    for k0 in (0, 8):
        # queries against keys [k0, k0 + 8): a key block at offset -k0
        out = mod.attention_forward(q, k[:, k0:k0 + 8], v[:, k0:k0 + 8], None, dataclasses.replace(p, offset=-k0))
        block.merge(o, lse, out[0], out[1])
    torch.testing.assert_close(o, want_o, rtol=0, atol=1e-6)
    torch.testing.assert_close(lse, want_lse, rtol=0, atol=1e-6)
    o2 = torch.zeros(1, 4, 1, 2)
    lse2 = torch.full((1, 1, 4), float("-inf"))
    block.merge(o2, lse2, torch.zeros(1, 4, 1, 2), torch.full((1, 1, 4), float("-inf")))
    assert torch.equal(o2, torch.zeros_like(o2)) and torch.isneginf(lse2).all()


@pytest.mark.parametrize("backend", backend_params())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_merge_kernel_matches_float64_on_views_and_touches_nothing_else(backend, dtype):
    """`block.merge` on both backends (the Triton kernel on "triton"): odd row and head-dim counts,
    the running tensors as row views of bigger ones (as the ring merges a call's rows), rows where
    either part or both see no key (-inf), lse far apart and large (no exp overflow); rows outside the
    view, and lse entries outside it, hold NaN and must stay NaN."""
    gen = torch.Generator().manual_seed(7)
    B, N, H, Dv, r0, r1 = 2, 45, 3, 40, 5, 38
    o_big = torch.randn(B, N, H, Dv, generator=gen)
    lse_big = torch.randn(B, H, N, generator=gen) * 30 + 1e4
    o_big[:, :r0], o_big[:, r1:] = float("nan"), float("nan")
    lse_big[:, :, :r0], lse_big[:, :, r1:] = float("nan"), float("nan")
    n = r1 - r0
    o = torch.randn(B, n, H, Dv, generator=gen).to(dtype)
    lse = torch.randn(B, H, n, generator=gen) * 30 + 1e4
    lse_big[:, 0, r0:r0 + 4] = float("-inf")  # the running part saw no key yet
    o_big[:, r0:r0 + 4, 0] = 0.0
    lse[:, 0, 2:6] = float("-inf")  # the new part sees none (rows 2, 3: neither does)
    lse[:, 1, 9] = lse_big[:, 1, r0 + 9] + 200.0  # weights e^-200 apart: one side underflows to 0
    lse_acc64, o_acc64 = lse_big[:, :, r0:r1].double(), o_big[:, r0:r1].double()
    new64 = torch.logaddexp(lse_acc64, lse.double())
    ref = new64.masked_fill(torch.isneginf(new64), 0.0)
    want_o = (o_acc64 * (lse_acc64 - ref).exp().transpose(1, 2)[..., None]
              + o.double() * (lse.double() - ref).exp().transpose(1, 2)[..., None])
    dev = backend_device(backend)  # CPU tensors on "triton" without a GPU: the interpreter
    o_big, lse_big, o, lse = (t.to(dev) for t in (o_big, lse_big, o, lse))
    o_before, lse_before = o.clone(), lse.clone()
    block.merge(o_big[:, r0:r1], lse_big[:, :, r0:r1], o, lse, backend)
    o_big, lse_big, o, lse, o_before, lse_before = (t.cpu() for t in (o_big, lse_big, o, lse, o_before, lse_before))
    torch.testing.assert_close(o_big[:, r0:r1].double(), want_o, rtol=2e-6, atol=2e-6)
    torch.testing.assert_close(lse_big[:, :, r0:r1].double(), new64, rtol=0, atol=2e-3)  # float32 ulp at 1e4
    assert torch.isneginf(lse_big[:, 0, r0 + 2:r0 + 4]).all() and (o_big[:, r0 + 2:r0 + 4, 0] == 0).all()
    assert o_big[:, :r0].isnan().all() and o_big[:, r1:].isnan().all()
    assert lse_big[:, :, :r0].isnan().all() and lse_big[:, :, r1:].isnan().all()
    assert torch.equal(o, o_before) and torch.equal(lse, lse_before)


# ---------------------------------------------------------------- a gloo group of one, in this process


def test_group_none_needs_an_initialized_process_group():
    if dist.is_initialized():
        pytest.skip("a default process group exists in this process")
    x = torch.randn(1, 4, 1, 8)
    with pytest.raises(ValueError, match="not initialized"):
        context_parallel_attention(x, x, x)
    with pytest.raises(ValueError, match="not initialized"):
        shard_sequence(x)


@pytest.fixture
def one():
    """A gloo group of this process alone (an in-memory store: no network)."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def _qkv(B=1, S=8, Hq=2, Hkv=2, D=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, S, Hq, D, generator=g), torch.randn(B, S, Hkv, D, generator=g),
            torch.randn(B, S, Hkv, D, generator=g))


ERRORS = [
    (TypeError, "group must be None or a torch.distributed.ProcessGroup", dict(group="world")),
    (ValueError, "layout must be 'zigzag' or 'contiguous'", dict(layout="striped")),
    (ValueError, "strategy must be 'ring' or 'allgather'", dict(strategy="tree")),
    (TypeError, "return_lse must be a bool", dict(return_lse=1)),
    (TypeError, "causal must be a bool", dict(causal=None)),
    (ValueError, "window must be a positive int", dict(window=0)),
    (ValueError, "softcap must be >= 0", dict(softcap=-1.0)),
]


@pytest.mark.parametrize("exc, match, kwargs", ERRORS)
def test_options_are_checked(one, exc, match, kwargs):
    q, k, v = _qkv()
    with pytest.raises(exc, match=match):
        context_parallel_attention(q, k, v, **kwargs)


@pytest.mark.parametrize("exc, match, shapes", [
    (ValueError, "q has rank 3", dict(q=(8, 2, 8))),
    (ValueError, "an odd number: layout='zigzag'", dict(q=(1, 7, 2, 8), k=(1, 7, 2, 8), v=(1, 7, 2, 8))),
    (ValueError, "q has 8 rows per rank but k and v have 6", dict(k=(1, 6, 2, 8), v=(1, 6, 2, 8))),
    (ValueError, r"num_heads \(3\) must be a multiple of num_kv_heads \(2\)", dict(q=(1, 8, 3, 8))),
    (ValueError, "batch sizes differ", dict(q=(2, 8, 2, 8))),
    (ValueError, r"head_dim of q \(8\) and k \(4\) must match", dict(k=(1, 8, 2, 4))),
])
def test_shapes_are_checked(one, exc, match, shapes):
    t = {n: torch.randn(shapes.get(n, (1, 8, 2, 8))) for n in "qkv"}
    with pytest.raises(exc, match=match):
        context_parallel_attention(t["q"], t["k"], t["v"])


def test_shard_sequence_checks_divisibility_and_dim(one):
    with pytest.raises(ValueError, match=r"7 rows, not divisible by 2 \(2W chunks for layout='zigzag' with W=1"):
        shard_sequence(torch.randn(1, 7, 2), layout="zigzag")
    assert shard_sequence(torch.randn(1, 7, 2), layout="contiguous").shape == (1, 7, 2)
    with pytest.raises(ValueError, match="dim is 3 but the tensor has 3 dims"):
        shard_sequence(torch.randn(2, 4, 2), dim=3)
    with pytest.raises(TypeError, match="dim must be an int"):
        shard_sequence(torch.randn(2, 4, 2), dim=1.0)
    with pytest.raises(ValueError, match="an odd number"):
        unshard_sequence(torch.randn(2, 3), dim=-1)


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_group_of_one_is_attention(one, layout, strategy):
    """W = 1: no communication; the result and gradients are those of `flashforge.attention`
    (the ring's forward even bitwise: merging into an empty accumulator is exact; its backward
    to rounding, as it recomputes P from lse without the forward's low part, `lse_lo`)."""
    q, k, v = (t.requires_grad_() for t in _qkv(B=2, S=12, Hq=4, Hkv=2))
    kw = dict(causal=True, window=(5, -1), softcap=3.0)
    o, lse = context_parallel_attention(q, k, v, layout=layout, strategy=strategy, return_lse=True, **kw)
    want_o, want_lse = flashforge.attention(q, k, v, return_lse=True, **kw)
    g = torch.autograd.grad((o.square().sum() + lse.sum()), (q, k, v))
    want_g = torch.autograd.grad((want_o.square().sum() + want_lse.sum()), (q, k, v))
    for i, (a, b) in enumerate(zip((o, lse, *g), (want_o, want_lse, *want_g))):
        if strategy == "ring" and i < 2:
            assert torch.equal(a, b)
        else:
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert torch.equal(unshard_sequence(shard_sequence(q, layout=layout), layout=layout), q)


def test_empty_batch_gives_empty_results_and_zero_gradients(one):
    q, k, v = (t.requires_grad_() for t in _qkv(B=0, S=4))
    o, lse = context_parallel_attention(q, k, v, causal=True, return_lse=True)
    assert o.shape == (0, 4, 2, 8) and lse.shape == (0, 2, 4)
    (o.sum() + lse.sum()).backward()
    assert q.grad.shape == q.shape and k.grad.shape == k.shape


def test_ops_are_registered_with_fake_impls_and_autograd(one):
    q, k, v = _qkv(S=8)
    name = dist.group.WORLD.group_name
    rest = (name, "zigzag", "ring", 8 ** -0.5, -1, 0, 0.0, False, "torch")
    torch.library.opcheck(torch.ops.flashforge.cp_attention_fwd, (q.requires_grad_(), k.requires_grad_(), v, *rest))
    torch.library.opcheck(torch.ops.flashforge.cp_unshard, (torch.randn(2, 4, 3), name, 1, "zigzag", 1))


@pytest.mark.gpu
@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_group_of_one_on_cuda_with_nccl(layout, strategy):
    """The Triton kernels and NCCL's collectives (the shape check; all-gather and reduce-scatter for
    "allgather") on a group of one GPU: the results and gradients of `flashforge.attention`."""
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)
    try:
        q, k, v = (t.cuda().bfloat16().requires_grad_() for t in _qkv(B=2, S=256, Hq=8, Hkv=2, D=64))
        o, lse = context_parallel_attention(q, k, v, layout=layout, strategy=strategy, causal=True, return_lse=True)
        want_o, want_lse = flashforge.attention(q, k, v, causal=True, return_lse=True)
        g = torch.autograd.grad((o.float().square().sum() + lse.sum()), (q, k, v))
        want_g = torch.autograd.grad((want_o.float().square().sum() + want_lse.sum()), (q, k, v))
        for a, b in zip((o, lse, *g), (want_o, want_lse, *want_g)):
            torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=2e-2)
    finally:
        dist.destroy_process_group()


# ---------------------------------------------------------------- spawned groups of 4, 2 and 1


def _poison_allocations():
    """The workers' torch.empty* return NaN-filled tensors, as conftest's fixture does in this process."""
    import conftest

    empty, empty_like, new_empty = torch.empty, torch.empty_like, torch.Tensor.new_empty
    torch.empty = lambda *a, **kw: conftest._poisoned(empty(*a, **kw))
    torch.empty_like = lambda *a, **kw: conftest._poisoned(empty_like(*a, **kw))
    torch.Tensor.new_empty = lambda self, *a, **kw: conftest._poisoned(new_empty(self, *a, **kw))


def _full(fn, q, k, v, do, dlse, kw):
    """(o, lse, dq, dk, dv) of ``fn`` (flashforge.attention or the reference) on the full tensors."""
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    o, lse = fn(*leaves, return_lse=True, **kw)
    grads = torch.autograd.grad((o, lse), leaves, (do.to(o.dtype), dlse.to(lse.dtype)))
    return (o.detach(), lse.detach(), *grads)


def _case(group, seed, *, layout, strategy, causal=False, heads=(2, 2), window=None, softcap=0.0, chunk=3,
          transposed=False) -> list[str]:
    """One case on ``group``: this rank's results against its shards of the single-process ones.
    Returns the failures (empty: passed)."""
    W = group.size()
    B, D, S = 2, 8, 2 * W * chunk  # divisible by 2W: both layouts cut it
    Hq, Hkv = heads
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, S, h, D, generator=g) for h in (Hq, Hkv, Hkv))
    do, dlse = torch.randn(B, S, Hq, D, generator=g), torch.randn(B, Hq, S, generator=g)
    kw = dict(causal=causal, window=window, softcap=softcap)
    want = _full(flashforge.attention, q, k, v, do, dlse, kw)
    ref = _full(reference.attention, q.double(), k.double(), v.double(), do, dlse, kw)

    def cut(x, dim=1):
        return shard_sequence(x, group, layout, dim)

    if transposed:  # shards as [B, H, S_local, D] tensors viewed BSHD: the sequence dim is not outer
        leaves = [cut(t).transpose(1, 2).contiguous().transpose(1, 2).requires_grad_() for t in (q, k, v)]
    else:
        leaves = [cut(t).detach().requires_grad_() for t in (q, k, v)]
    before = [t.detach().clone() for t in leaves]
    o, lse = context_parallel_attention(*leaves, group=group, layout=layout, strategy=strategy, return_lse=True,
                                        **kw)
    got = (o, lse, *torch.autograd.grad((o, lse), leaves, (cut(do), cut(dlse, 2))))
    name = f"W={W} {layout} {strategy} causal={causal} heads={Hq}/{Hkv} window={window} softcap={softcap}"
    if transposed:
        name += " transposed"
    failures = []
    if not all(torch.equal(a, b) for a, b in zip(leaves, before)):
        failures.append(f"{name}: an input was modified")
    for what, a, w, r in zip(("o", "lse", "dq", "dk", "dv"), got, want, ref):
        dim = 2 if what == "lse" else 1
        w_mine, r_mine = cut(w, dim), cut(r, dim)
        size = max(1.0, r.abs().max().item())
        err = (a - w_mine).abs().max().item()
        # against the float64 reference: within 3x of what flashforge.attention itself makes, plus a floor
        err64, own64 = (a.double() - r_mine).abs().max().item(), (w.double() - r).abs().max().item()
        if not (err <= 1e-5 * size and err64 <= 3 * own64 + 1e-5 * size) or not math.isfinite(err):
            failures.append(f"{name}: {what} differs by {err:.2e} from flashforge.attention and {err64:.2e} from "
                            f"the float64 reference (attention's own error: {own64:.2e})")
    return failures


def _cases(group, seed, full: bool) -> tuple[int, list[str]]:
    """Every layout x strategy x causal x GQA x window case (``full``), or one per layout x strategy."""
    failures, n = [], 0
    grid = itertools.product(LAYOUTS, STRATEGIES, (False, True), ((2, 2), (4, 2)), (None, (4, 2)))
    for i, (layout, strategy, causal, heads, window) in enumerate(grid):
        if full or (causal and heads == (4, 2) and window is None):
            failures += _case(group, seed + i, layout=layout, strategy=strategy, causal=causal, heads=heads,
                              window=window)
            n += 1
    if full:  # softcap with an int window; inputs with the sequence dim inner
        for layout, strategy in zip(LAYOUTS, STRATEGIES):
            failures += _case(group, seed + 50, layout=layout, strategy=strategy, causal=True, window=7,
                              softcap=2.0, heads=(4, 1))
        for layout, strategy in zip(LAYOUTS, reversed(STRATEGIES)):
            failures += _case(group, seed + 60, layout=layout, strategy=strategy, heads=(4, 2), transposed=True)
        n += 4
    return n, failures


def _expect_error(fn, match: str) -> list[str]:
    try:
        fn()
    except ValueError as e:
        return [] if match in str(e) else [f"ValueError without {match!r}: {e}"]
    return [f"no ValueError ({match!r})"]


def _multi_rank_errors(group, other) -> tuple[int, list[str]]:
    """Errors only several ranks can see; every rank must raise, and the group keep working.
    ``other``: a group this rank is not in."""
    me = group.rank()
    q, k, v = _qkv(S=8 if me == 0 else 6)
    failures = _expect_error(lambda: context_parallel_attention(q, k, v, group=group), "different shapes")
    q, k, v = _qkv(S=8)
    failures += _expect_error(lambda: context_parallel_attention(q, k, v, group=group, causal=me == 1),
                              "other options than rank 0")
    failures += _expect_error(lambda: shard_sequence(torch.randn(1, 6, 2), group, "zigzag"), "not divisible by 4")
    failures += _expect_error(lambda: shard_sequence(torch.randn(1, 5, 2), group, "contiguous"),
                              "not divisible by 2")
    failures += _expect_error(lambda: context_parallel_attention(q, k, v, group=other), "not a member of the group")
    # afterwards the group still pairs up
    failures += _case(group, 99, layout="zigzag", strategy="ring", causal=True)
    return 6, failures


def _unshard(group) -> tuple[int, list[str]]:
    """unshard_sequence inverts shard_sequence; its gradient is the reduce-scatter (sum over ranks)."""
    W, failures = group.size(), []
    x = torch.arange(2 * 4 * W * 3, dtype=torch.float32).view(2, 4 * W, 3)
    for layout in LAYOUTS:
        mine = shard_sequence(x, group, layout).clone().requires_grad_()
        full = unshard_sequence(mine, group, layout)
        if not torch.equal(full, x):
            failures.append(f"unshard_sequence({layout}) is not the full tensor")
        # each rank weighs the full tensor by its own weights: a shard's gradient sums all of them
        weights = [torch.randn(x.shape, generator=torch.Generator().manual_seed(r)) for r in range(W)]
        (full * weights[group.rank()]).sum().backward()
        if not torch.allclose(mine.grad, shard_sequence(sum(weights), group, layout), atol=1e-5):
            failures.append(f"unshard_sequence({layout}): the gradient is not the sum of the ranks' gradients")
    return 2, failures


def _compiled(group) -> tuple[int, list[str]]:
    """torch.compile(fullgraph=True) traces shard -> attention -> unshard (no graph break) and
    gives eager's values and gradients."""
    def f(x, wq, wk, wv):
        q, k, v = (shard_sequence(x @ w, group, "zigzag").unflatten(-1, (-1, 8)) for w in (wq, wk, wv))
        o = context_parallel_attention(q, k, v, group=group, causal=True, window=(5, -1))
        return unshard_sequence(o.flatten(-2), group, "zigzag")

    g = torch.Generator().manual_seed(7)
    x = torch.randn(1, 4 * group.size(), 16, generator=g)
    ws = [torch.randn(16, n, generator=g, requires_grad=True) for n in (32, 16, 16)]
    torch._dynamo.reset()
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    outs = []
    for fn in (f, compiled):
        y = fn(x, *ws)
        outs.append((y.detach(), *torch.autograd.grad(y.square().sum(), ws)))
    bad = [i for i, (a, b) in enumerate(zip(*outs)) if not torch.allclose(a, b, rtol=1e-5, atol=1e-6)]
    return 1, [f"torch.compile: outputs {bad} differ from eager"] if bad else []


def _worker(rank: int, world: int, port: int, out_dir: str) -> None:
    _poison_allocations()
    torch.set_num_threads(1)  # four processes share the machine's cores
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank creates every group, in one order
    singles = [dist.new_group([r]) for r in range(world)]
    pair = pairs[rank // 2]
    report = {}
    for name, (n, failures) in (("W=4", _cases(dist.group.WORLD, 0, True)),
                                ("W=2", _cases(pair, 1000 * (1 + rank // 2), True)),
                                ("W=1", _cases(singles[rank], 5000, False)),
                                ("errors", _multi_rank_errors(pair, singles[(rank + 1) % world])),
                                ("unshard", _unshard(pair)),
                                # one pair only: tracing costs more than all the other cases together
                                ("compile", _compiled(pair) if rank < 2 else (0, []))):
        report[name] = dict(checked=n, failures=failures)
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(report, f)
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_groups_of_4_2_and_1_match_attention(tmp_path):
    mp.spawn(_worker, args=(4, _free_port(), str(tmp_path)), nprocs=4)
    full = 2 * 2 * 2 * 2 * 2 + 4
    expected = {"W=4": full, "W=2": full, "W=1": 4, "errors": 6, "unshard": 2}
    failures = []
    for rank in range(4):
        report = json.loads((tmp_path / f"rank{rank}.json").read_text())
        for name, n in {**expected, "compile": int(rank < 2)}.items():
            assert report[name]["checked"] == n, (rank, name, report[name]["checked"])
            failures += [f"rank {rank}: {f}" for f in report[name]["failures"]]
    assert not failures, "\n".join(failures)
