"""Memory safety and validation of the index-like arguments: cu_seqlens, max_seqlen, cache_seqlens
(+ S_new), block_table, causal_offset, window sides and seed.

The contract (README, API section): a bad value that can be seen without a device sync (an int, a
shape, a CPU tensor; a device tensor with ``check_inputs=True``) raises ``ValueError`` naming the
argument and the value before anything is written; an unchecked device value never makes a kernel
touch memory outside the tensors it was given (bounds clamped, appends past the capacity dropped),
and offsets and window sides of any size keep their meaning.

Tensors sit in the middle of larger buffers whose margins hold a poison value (NaN, or a sentinel
for ints): a stray read shows up as NaN in an output, a stray write as a changed margin.  Every
``torch.empty*`` allocation of a call (outputs, scratch) is guarded the same way.  Device tensors
are simulated on the CPU by switching the public layer's value checks off (`unchecked`), which is
what it does for a CUDA tensor without ``check_inputs``.  Without a GPU the Triton kernels run in
the interpreter, where an out-of-bounds access corrupts the process's heap (SIGSEGV).
"""
from __future__ import annotations

import contextlib
import math
from typing import Optional
from unittest import mock

import pytest
import torch

import flashforge
import flashforge.api.attention as api_attention
import flashforge.api.kvcache as api_kvcache
import flashforge.api.varlen as api_varlen
from flashforge import reference
from helpers import backend_device, backend_params

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

BACKENDS = backend_params()
INT_POISON = -7777
PAD = 256  # elements of margin on each side of a guarded tensor
TOL = dict(rtol=1e-4, atol=1e-5)


def _poison(dtype: torch.dtype):
    return float("nan") if dtype.is_floating_point else INT_POISON


class Guards:
    """Tensors placed in the middle of poisoned buffers, and a check that the margins are intact."""

    def __init__(self):
        self.regions = []  # (base, pad, n)

    def buffer(self, shape, dtype, device, alloc=torch.empty) -> torch.Tensor:
        n = math.prod(shape)
        base = alloc((n + 2 * PAD,), dtype=dtype, device=device)
        base.fill_(_poison(dtype))
        self.regions.append((base, n))
        return base[PAD:PAD + n].view(shape)

    def place(self, t: torch.Tensor) -> torch.Tensor:
        """A copy of t inside a guarded buffer (a leaf: requires_grad may be set on it)."""
        view = self.buffer(tuple(t.shape), t.dtype, t.device)
        view.copy_(t.detach())
        return view

    def check(self) -> None:
        for base, n in self.regions:
            for side in (base[:PAD], base[PAD + n:]):
                intact = side.isnan().all() if side.is_floating_point() else (side == INT_POISON).all()
                assert intact, f"a write outside a tensor of {n} elements ({base.dtype})"


@contextlib.contextmanager
def guarded_allocations(guards: Guards):
    """Every ``torch.empty``/``empty_like``/``new_empty`` in the block returns a guarded tensor."""
    empty, empty_like, new_empty = torch.empty, torch.empty_like, torch.Tensor.new_empty

    def make(shape, dtype, device, fallback):
        if dtype == torch.bool:
            return fallback()
        return guards.buffer(tuple(shape), dtype, device, empty)

    def g_empty(*size, dtype=None, device=None, **kw):
        shape = tuple(size[0]) if len(size) == 1 and not isinstance(size[0], int) else size
        if kw.get("requires_grad") or kw.get("out") is not None:
            return empty(*size, dtype=dtype, device=device, **kw)
        return make(shape, dtype or torch.get_default_dtype(), device,
                    lambda: empty(*size, dtype=dtype, device=device, **kw))

    def g_empty_like(t, dtype=None, device=None, **kw):
        if kw.get("requires_grad"):
            return empty_like(t, dtype=dtype, device=device, **kw)
        return make(t.shape, dtype or t.dtype, device or t.device,
                    lambda: empty_like(t, dtype=dtype, device=device, **kw))

    def g_new_empty(self, *size, dtype=None, device=None, **kw):
        shape = tuple(size[0]) if len(size) == 1 and not isinstance(size[0], int) else size
        return make(shape, dtype or self.dtype, device or self.device,
                    lambda: new_empty(self, *size, dtype=dtype, device=device, **kw))

    with mock.patch.object(torch, "empty", g_empty), mock.patch.object(torch, "empty_like", g_empty_like), \
            mock.patch.object(torch.Tensor, "new_empty", g_new_empty):
        yield


@contextlib.contextmanager
def unchecked():
    """The public layer as it treats device tensors without check_inputs: no value is read."""
    never = lambda t, check_inputs: False  # noqa: E731
    with mock.patch.object(api_attention, "values_visible", never, create=True), \
            mock.patch.object(api_varlen, "values_visible", never, create=True), \
            mock.patch.object(api_kvcache, "values_visible", never, create=True):
        yield


def visible(Sq: int, Sk: int, off: int, left: int, right: int) -> torch.Tensor:
    """Bool [Sq, Sk] of the visibility rule with Python ints (exact for any size)."""
    vis = torch.ones(Sq, Sk, dtype=torch.bool)
    for i in range(Sq):
        for j in range(Sk):
            d = j - (i + off)
            vis[i, j] = (left < 0 or d >= -left) and (right < 0 or d <= right)
    return vis


def sides(window, causal: bool) -> tuple[int, int]:
    if window is None:
        left, right = -1, -1
    elif isinstance(window, int):
        left = right = window - 1
    else:
        left, right = window
    return left, 0 if causal else right


def reference_rows(q, k, v, off: int, left: int, right: int, slopes=None, **kw):
    """float64 reference of one sequence ``q [Sq, Hq, D]`` against ``k, v [Sk, Hkv, *]``: (o, lse [Hq, Sq])."""
    vis = visible(q.shape[0], k.shape[0], off, left, right)[None, None]
    o, lse = reference.attention(q[None].double(), k[None].double(), v[None].double(), mask=vis,
                                 causal_offset=off if slopes is not None else 0, alibi_slopes=slopes,
                                 return_lse=True, **kw)
    return o[0], lse[0]


def assert_rows_close(got, want, what: str) -> None:
    got, want = got.detach().double().cpu(), want.detach().double().cpu()
    assert torch.equal(torch.isinf(got), torch.isinf(want)), f"{what}: -inf entries differ"
    finite = torch.isfinite(want)
    assert torch.isfinite(got[finite]).all(), f"{what}: NaN where the reference is finite"
    torch.testing.assert_close(got[finite], want[finite], **TOL, msg=lambda m: f"{what}: {m}")


def randn(gen, *shape, device="cpu"):
    return torch.randn(*shape, generator=gen).to(device)


# ---------------------------------------------------------------------------------------------
# attention_varlen: cu_seqlens and max_seqlen

def clamped_bounds(cu, total: int) -> list[tuple[int, int]]:
    """Each sequence's rows as the kernels take unchecked cu_seqlens: [start, end) clamped into [0, total]."""
    out = []
    for b in range(len(cu) - 1):
        start = min(max(cu[b], 0), total)
        out.append((start, min(max(cu[b + 1], start), total)))
    return out


def _varlen_inputs(dev, total_q, total_k, guards: Guards, Hq=2, Hkv=1, D=16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return tuple(guards.place(randn(gen, n, h, D, device=dev)).requires_grad_()
                 for n, h in ((total_q, Hq), (total_k, Hkv), (total_k, Hkv)))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name, cu, match", [
    pytest.param("cu_seqlens_q", [1, 4, 10], r"cu_seqlens_q\[0\] is 1; accepted: 0", id="start-not-0"),
    pytest.param("cu_seqlens_q", [0, 6, 4, 10], r"cu_seqlens_q decreases at index 2 \(6 -> 4\)", id="decreasing"),
    pytest.param("cu_seqlens_q", [0, 4, 8], r"cu_seqlens_q\[-1\] is 8 but the packed tensor has 10 rows",
                 id="last-short"),
    pytest.param("cu_seqlens_k", [0, 4, 40], r"cu_seqlens_k\[-1\] is 40 but the packed tensor has 10 rows",
                 id="last-past-the-rows"),
    pytest.param("cu_seqlens_k", [0, 4, 2**32 + 10], r"cu_seqlens_k\[-1\] is 4294967306", id="int64-wraps-to-10"),
])
def test_varlen_rejects_bad_cu_seqlens_values(backend, name, cu, match):
    dev = backend_device(backend)
    guards = Guards()
    q, k, v = _varlen_inputs(dev, 10, 10, guards)
    good = torch.tensor([0, 4, 10], dtype=torch.int32, device=dev)
    bad = torch.tensor(cu, dtype=torch.int64 if max(cu) >= 2**31 else torch.int32, device=dev)
    cus = {"cu_seqlens_q": good, "cu_seqlens_k": good, name: bad}
    with pytest.raises(ValueError, match=match):
        flashforge.attention_varlen(q, k, v, cus["cu_seqlens_q"], cus["cu_seqlens_k"], 10, 10, backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_varlen_rejects_a_max_seqlen_below_the_longest_sequence(backend):
    dev = backend_device(backend)
    q, k, v = _varlen_inputs(dev, 10, 10, Guards())
    cu = torch.tensor([0, 4, 10], dtype=torch.int32, device=dev)
    with pytest.raises(ValueError, match=r"max_seqlen_q is 5 but the longest sequence has 6 rows; accepted: >= 6"):
        flashforge.attention_varlen(q, k, v, cu, cu, 5, 6, backend=backend)
    with pytest.raises(ValueError, match=r"max_seqlen_k is 3 but the longest sequence has 6 rows"):
        flashforge.attention_varlen(q, k, v, cu, cu, 6, 3, backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("cu_q, cu_k", [
    pytest.param([0, 4, 40], [0, 4, 10], id="q-last-past-the-rows"),
    pytest.param([0, 4, 10], [0, 3, 2**31 - 1], id="k-last-int32-max"),
    pytest.param([-5, 4, 10], [0, 6, 10], id="negative-start"),
    pytest.param([0, 4, 10], [0, 2**40, 10], id="int64-huge-middle"),
])
def test_varlen_unchecked_bounds_are_clamped_into_the_tensors(backend, cu_q, cu_k):
    """Device values nobody checked: sequence b is rows [clamp(cu[b], 0, total), clamp(cu[b+1], start,
    total)); nothing outside q, k, v, o, lse or the gradients is read or written, and the result
    is that of the clamped bounds (before the fix: SIGSEGV / heap corruption in the interpreter)."""
    dev = backend_device(backend)
    guards = Guards()
    q, k, v = _varlen_inputs(dev, 10, 10, guards)
    dt = lambda c: torch.int64 if max(map(abs, c)) >= 2**31 else torch.int32  # noqa: E731
    tq = guards.place(torch.tensor(cu_q, dtype=dt(cu_q), device=dev))
    tk = guards.place(torch.tensor(cu_k, dtype=dt(cu_k), device=dev))
    with unchecked(), guarded_allocations(guards):
        o, lse = flashforge.attention_varlen(q, k, v, tq, tk, 10, 10, causal=True, causal_offset="bottom_right",
                                             return_lse=True, backend=backend)
        o.backward(torch.ones_like(o))
    guards.check()
    for b, ((q0, q1), (k0, k1)) in enumerate(zip(clamped_bounds(cu_q, 10), clamped_bounds(cu_k, 10))):
        want_o, want_lse = reference_rows(q[q0:q1].detach(), k[k0:k1].detach(), v[k0:k1].detach(),
                                          (k1 - k0) - (q1 - q0), -1, 0)
        assert_rows_close(o[q0:q1], want_o, f"o of sequence {b}")
        assert_rows_close(lse[:, q0:q1], want_lse, f"lse of sequence {b}")


# ---------------------------------------------------------------------------------------------
# attention_with_kvcache: cache_seqlens (+ S_new), block_table, unused slots

B, HQ, HKV, D, PAGE = 2, 2, 1, 16, 16


def _cache(dev, guards: Guards, paged: bool, capacity: int, lengths, s_new: int, Sq: int, seed=0,
           extra_blocks: int = 2):
    """q, caches (slots past each row's length hold NaN), new k/v, the block table and the
    contiguous view of the caches' rows (for the reference), all guarded."""
    gen = torch.Generator().manual_seed(seed)
    q = guards.place(randn(gen, B, Sq, HQ, D, device=dev))
    kn = guards.place(randn(gen, B, s_new, HKV, D, device=dev)) if s_new else None
    vn = guards.place(randn(gen, B, s_new, HKV, D, device=dev)) if s_new else None
    rows_k, rows_v = randn(gen, B, capacity, HKV, D), randn(gen, B, capacity, HKV, D)
    for b, n in enumerate(lengths):  # what torch.empty leaves in a fresh cache (conftest: NaN)
        rows_k[b, max(n, 0):] = float("nan")
        rows_v[b, max(n, 0):] = float("nan")
    if not paged:
        return q, guards.place(rows_k.to(dev)), guards.place(rows_v.to(dev)), kn, vn, None
    per_row = capacity // PAGE
    n_blocks = B * per_row + extra_blocks
    table = torch.randperm(n_blocks, generator=gen)[:B * per_row].view(B, per_row).int()
    kp = torch.full((n_blocks, PAGE, HKV, D), float("nan"))
    vp = torch.full((n_blocks, PAGE, HKV, D), float("nan"))
    kp[table.long()] = rows_k.view(B, per_row, PAGE, HKV, D)
    vp[table.long()] = rows_v.view(B, per_row, PAGE, HKV, D)
    return q, guards.place(kp.to(dev)), guards.place(vp.to(dev)), kn, vn, guards.place(table.to(dev))


def _gather(cache, table, n_blocks):
    """[B, keys, Hkv, D] rows of a cache (a paged one through its table, entries clamped as the kernels do)."""
    if table is None:
        return cache[:B]
    return cache[table.long().clamp(0, n_blocks - 1)].flatten(1, 2)


def _kvcache_reference(q, rows_k, rows_v, keys, causal, window):
    """Per row b: the first keys[b] of rows_k / rows_v, queries aligned to their end."""
    left, right = sides(window, causal)
    o = torch.zeros(q.shape, dtype=torch.float64)
    for b, n in enumerate(keys):
        o[b] = reference_rows(q[b].cpu(), rows_k[b, :n].cpu(), rows_v[b, :n].cpu(), n - q.shape[1],
                              left, right)[0]
    return o


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().cpu().view(torch.int32).clone()  # NaN-safe equality


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("what, match", [
    pytest.param("past-capacity", r"cache_seqlens\[1\] \(32\) \+ S_new \(1\) is 33; accepted: at most the cache's "
                 r"capacity 32", id="past-capacity"),
    pytest.param("negative", r"cache_seqlens\[0\] is -3; accepted: >= 0", id="negative"),
    pytest.param("int-past-capacity", r"cache_seqlens \(32\) \+ S_new \(1\) is 33", id="int-past-capacity"),
    pytest.param("int64-wraps", r"cache_seqlens\[1\] \(4294967300\) \+ S_new", id="int64-wraps-to-4"),
    pytest.param("block-too-big", r"block_table\[1, 0\] is 6; accepted: a block index in \[0, 6\)",
                 id="block-past-the-pool"),
    pytest.param("block-negative", r"block_table\[0, 1\] is -1; accepted: a block index in \[0, 6\)",
                 id="block-negative"),
])
def test_kvcache_rejects_bad_index_values_before_writing(backend, paged, what, match):
    """Before the fix: IndexError from deep inside the CPU path (after k_cache was written), and
    writes outside the cache on the Triton path."""
    if what.startswith("block") and not paged:
        pytest.skip("no block table")
    dev = backend_device(backend)
    guards = Guards()
    q, kc, vc, kn, vn, table = _cache(dev, guards, paged, 32, [20, 31], 1, 1, extra_blocks=2)
    lens = torch.tensor([20, 31], dtype=torch.int32, device=dev)
    if what == "past-capacity":
        lens[1] = 32
    elif what == "negative":
        lens[0] = -3
    elif what == "int-past-capacity":
        lens = 32
    elif what == "int64-wraps":
        lens = torch.tensor([20, 2**32 + 4], device=dev)
    elif what == "block-too-big":
        table[1, 0] = 6
    else:
        table[0, 1] = -1
    before = _bits(kc), _bits(vc)
    with pytest.raises(ValueError, match=match):
        flashforge.attention_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=lens, block_table=table, backend=backend)
    assert torch.equal(_bits(kc), before[0]) and torch.equal(_bits(vc), before[1]), "a failed call wrote the cache"
    guards.check()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("Sq, s_new, splits", [(1, 0, 1), (2, 2, 1), (1, 1, 3)])
def test_unused_cache_slots_never_reach_the_output(backend, paged, causal, Sq, s_new, splits):
    """Slots past cache_seqlens[b] + S_new hold NaN (as torch.empty leaves them): the output is that
    of the row's own keys (before the fix: NaN on the CPU path, contiguous and paged, non-causal)."""
    dev = backend_device(backend)
    guards = Guards()
    lengths = [5, 17]
    q, kc, vc, kn, vn, table = _cache(dev, guards, paged, 32, lengths, s_new, Sq)
    lens = guards.place(torch.tensor(lengths, dtype=torch.int32, device=dev))
    with guarded_allocations(guards):
        o = flashforge.attention_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=lens, block_table=table, causal=causal,
                                             num_splits=splits, backend=backend)
    guards.check()
    rows_k, rows_v = _gather(kc, table, kc.shape[0]), _gather(vc, table, vc.shape[0])
    assert_rows_close(o, _kvcache_reference(q, rows_k, rows_v, [n + s_new for n in lengths], causal, None), "o")


@pytest.mark.parametrize("backend", BACKENDS)
def test_unused_block_table_entries_may_hold_anything(backend):
    """Only the entries a row uses (keys below cache_seqlens[b] + S_new) must name a block: padding
    such as -1 or a huge value in the others is accepted and never read."""
    dev = backend_device(backend)
    guards = Guards()
    q, kc, vc, kn, vn, table = _cache(dev, guards, True, 48, [5, 17], 1, 1)
    table[0, 1:] = -1  # row 0 uses 1 entry of 3, row 1 uses 2
    table[1, 2] = 2**31 - 1
    with guarded_allocations(guards):
        o = flashforge.attention_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=torch.tensor([5, 17], device=dev),
                                             block_table=table, backend=backend)
    guards.check()
    new_k, new_v = _gather(kc, table, kc.shape[0]), _gather(vc, table, vc.shape[0])  # after the append
    assert_rows_close(o, _kvcache_reference(q, new_k, new_v, [6, 18], True, None), "o")


def _expected_append(kc, vc, kn, vn, lengths, table, capacity):
    """The caches after an append with clamped semantics, and the slots written exactly once."""
    kc, vc = kc.detach().cpu().clone(), vc.detach().cpu().clone()
    targets = {}
    for b, n in enumerate(lengths):
        for i in range(0 if kn is None else kn.shape[1]):
            pos = n + i
            if not 0 <= pos < capacity:
                continue
            if table is None:
                slot = (b, pos)
            else:
                slot = (min(max(int(table[b, pos // PAGE]), 0), kc.shape[0] - 1), pos % PAGE)
            targets.setdefault(slot, []).append((b, i))
    for slot, writers in targets.items():
        b, i = writers[-1]
        kc[slot], vc[slot] = kn[b, i].cpu(), vn[b, i].cpu()
    return kc, vc, targets


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("lengths, entry", [
    pytest.param([31, 40], None, id="past-capacity"),
    pytest.param([-3, 2**31 - 1], None, id="negative-and-int32-max"),
    pytest.param([2**40, -2**40], None, id="int64-huge"),
    pytest.param([20, 30], 7, id="block-past-the-pool"),
    pytest.param([20, 30], -2**31, id="block-int32-min"),
])
def test_kvcache_unchecked_values_stay_inside_the_cache(backend, paged, lengths, entry):
    """Device values nobody checked: row b holds clamp(cache_seqlens[b] + S_new, 0, capacity) keys,
    appends outside [0, capacity) are dropped, block-table entries are clamped into the pool; no
    byte outside the tensors is read or written (before the fix: writes outside the cache)."""
    if entry is not None and not paged:
        pytest.skip("no block table")
    dev = backend_device(backend)
    guards = Guards()
    capacity, s_new, Sq = 32, 2, 2
    q, kc, vc, kn, vn, table = _cache(dev, guards, paged, capacity, [min(max(n, 0), capacity) for n in lengths],
                                      s_new, Sq)
    if entry is not None:
        table[1, 1] = entry
    lens = guards.place(torch.tensor(lengths, dtype=torch.int64 if max(map(abs, lengths)) >= 2**31 else torch.int32,
                                     device=dev))
    want_k, want_v, targets = _expected_append(kc, vc, kn, vn, lengths, table, capacity)
    with unchecked(), guarded_allocations(guards):
        o = flashforge.attention_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=lens, block_table=table,
                                             backend=backend)
    guards.check()
    for slot, writers in targets.items():
        if len(writers) > 1:  # several tokens clamped onto one slot: any of them
            want_k[slot], want_v[slot] = kc[slot].cpu(), vc[slot].cpu()
    assert torch.equal(_bits(kc), _bits(want_k)) and torch.equal(_bits(vc), _bits(want_v)), \
        "the append wrote other slots than the clamped ones"
    keys = [min(max(n + s_new, 0), capacity) for n in lengths]
    rows_k, rows_v = _gather(kc, table, kc.shape[0]), _gather(vc, table, vc.shape[0])
    assert_rows_close(o, _kvcache_reference(q, rows_k, rows_v, keys, True, None), "o")


# ---------------------------------------------------------------------------------------------
# causal_offset and window sides of any size

@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("offsets, dtype, window, causal", [
    pytest.param([2**32 - 1, 2**31 + 5], torch.int64, None, True, id="int64-past-int32"),
    pytest.param([-(2**33), 3], torch.int64, (2, -1), False, id="int64-far-negative-window"),
    pytest.param([2**40, -2], torch.int64, (2**40 - 3, -1), False, id="int64-offset-with-an-equal-window"),
    pytest.param([2**31 - 1, -(2**31)], torch.int32, (5, 2), False, id="int32-extremes"),
])
def test_per_batch_offsets_keep_their_value(backend, offsets, dtype, window, causal):
    """An int64 causal_offset tensor is not truncated to int32 (before the fix: values >= 2**31
    wrapped), and int32 extremes do not overflow inside the kernels."""
    dev = backend_device(backend)
    gen = torch.Generator().manual_seed(3)
    q, k, v = (randn(gen, 2, 4, 2, 16, device=dev) for _ in range(3))
    off = torch.tensor(offsets, dtype=dtype, device=dev)
    o, lse = flashforge.attention(q, k, v, causal=causal, causal_offset=off, window=window, return_lse=True,
                                  backend=backend)
    left, right = sides(window, causal)
    for b in range(2):
        want_o, want_lse = reference_rows(q[b].cpu(), k[b].cpu(), v[b].cpu(), offsets[b], left, right)
        assert_rows_close(o[b], want_o, f"o[{b}]")
        assert_rows_close(lse[b], want_lse, f"lse[{b}]")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("offset, window, causal", [
    pytest.param(2**31 - 3, None, True, id="offset-near-int32-max"),
    pytest.param(0, (-1, 2**31 - 1), False, id="right-int32-max"),
    pytest.param(0, (2**31 - 1, 0), False, id="left-int32-max"),
    pytest.param(-(2**31), (2**31 + 2, -1), False, id="offset-and-window-cancel"),
    pytest.param(10**30, (10**30 - 2, -1), False, id="beyond-int64"),
    pytest.param(-(10**30), None, True, id="nothing-visible"),
])
def test_huge_int_offsets_and_windows_keep_their_meaning(backend, offset, window, causal):
    """Python ints of any size (before the fix: int32 overflow in the kernels for values near 2**31)."""
    dev = backend_device(backend)
    gen = torch.Generator().manual_seed(4)
    q, k, v = (randn(gen, 1, 5, 2, 16, device=dev) for _ in range(3))
    o, lse = flashforge.attention(q, k, v, causal=causal, causal_offset=offset, window=window, return_lse=True,
                                  backend=backend)
    want_o, want_lse = reference_rows(q[0].cpu(), k[0].cpu(), v[0].cpu(), offset, *sides(window, causal))
    assert_rows_close(o[0], want_o, "o")
    assert_rows_close(lse[0], want_lse, "lse")


@pytest.mark.parametrize("backend", BACKENDS)
def test_alibi_offsets_beyond_the_exact_range(backend):
    """ALiBi's distance term uses the offset itself: beyond +-2**29 a visible offset is refused,
    and an unchecked per-batch one acts as +-2**29 (documented clamp; visibility stays exact)."""
    dev = backend_device(backend)
    gen = torch.Generator().manual_seed(5)
    q, k, v = (randn(gen, 2, 3, 2, 16, device=dev) for _ in range(3))
    slopes = torch.tensor([1e-8, 2e-8], device=dev)  # a bias of slope * 2**29 that float32 can still add to
    with pytest.raises(ValueError, match=r"causal_offset is 536870913; accepted with alibi_slopes"):
        flashforge.attention(q, k, v, causal_offset=2**29 + 1, alibi_slopes=slopes, backend=backend)
    with pytest.raises(ValueError, match=r"causal_offset\[1\] is -1073741824; accepted with alibi_slopes"):
        flashforge.attention(q, k, v, causal_offset=torch.tensor([0, -2**30], device=dev), alibi_slopes=slopes,
                             backend=backend)
    off = torch.tensor([2**29, -2**29], device=dev)
    o = flashforge.attention(q, k, v, causal=True, causal_offset=off, alibi_slopes=slopes, backend=backend)
    for b in range(2):
        want = reference_rows(q[b].cpu(), k[b].cpu(), v[b].cpu(), int(off[b]), -1, 0, slopes=slopes.cpu())[0]
        assert_rows_close(o[b], want, f"o[{b}]")
    if backend == "triton":
        with unchecked():
            far = flashforge.attention(q, k, v, causal=True, causal_offset=off * 4, alibi_slopes=slopes,
                                       backend=backend)
        torch.testing.assert_close(far, o, **TOL)


@pytest.mark.parametrize("backend", BACKENDS)
def test_check_inputs_reads_device_tensors(backend, monkeypatch):
    """check_inputs=True checks tensors whose values are not otherwise read (device tensors);
    the keyword reaches every entry point that takes index tensors and must be a bool."""
    dev = backend_device(backend)
    seen = []
    real = api_varlen.values_visible

    def spy(t, check_inputs):
        seen.append(check_inputs)
        return real(t, check_inputs)
    monkeypatch.setattr(api_varlen, "values_visible", spy)
    monkeypatch.setattr(api_kvcache, "values_visible", spy)
    monkeypatch.setattr(api_attention, "values_visible", spy)
    q = torch.randn(6, 2, 16, device=dev)
    cu = torch.tensor([0, 6], dtype=torch.int32, device=dev)
    flashforge.attention_varlen(q, q, q, cu, cu, 6, 6, check_inputs=True, backend=backend)
    kc = torch.randn(1, 16, 2, 16, device=dev)
    flashforge.attention_with_kvcache(q[None, :1], kc, kc, cache_seqlens=torch.tensor([3], device=dev),
                                      check_inputs=True, backend=backend)
    flashforge.attention(q[None], q[None], q[None], causal_offset=torch.tensor([1], device=dev), check_inputs=True,
                         backend=backend)
    assert seen and all(seen)
    with pytest.raises(TypeError, match=r"check_inputs must be a bool, got str"):
        flashforge.attention_varlen(q, q, q, cu, cu, 6, 6, check_inputs="yes", backend=backend)


def test_check_inputs_environment_variable(monkeypatch):
    """$FLASHFORGE_CHECK_INPUTS=1, read at import, checks device tensors as check_inputs=True does, so
    the drop-in interfaces (flash-attn's exact signatures, no keyword to add) get the check too."""
    import importlib

    from flashforge.api import validate
    try:
        monkeypatch.setenv("FLASHFORGE_CHECK_INPUTS", "1")
        assert importlib.reload(validate).CHECK_INPUTS
        monkeypatch.setenv("FLASHFORGE_CHECK_INPUTS", "0")
        assert not importlib.reload(validate).CHECK_INPUTS
    finally:
        monkeypatch.delenv("FLASHFORGE_CHECK_INPUTS")
        importlib.reload(validate)
    assert not validate.values_visible(torch.zeros(2, device="meta"), True)  # no values to read
    monkeypatch.setattr(validate, "CHECK_INPUTS", True)
    assert validate.values_visible(torch.zeros(2), False)


def test_canonical_visibility_is_exact():
    """The host folding of int offsets and window sides: same visible keys for every (i, j) of
    sequences with Sq_b + Sk_b <= extent, values bounded by SAFE_INDEX or 2 * extent."""
    from flashforge.api.validate import SAFE_INDEX, canonical_visibility
    extent = 7
    values = [-(10**20), -(2**40), -SAFE_INDEX - 1, -9, -3, 0, 2, 5, 8, SAFE_INDEX + 1, 2**40, 10**20]
    for off in values:
        for left in [-1, 0, 3, 2**31, 10**21]:
            for right in [-1, 0, 4, 2**31, 10**21]:
                o2, l2, r2 = canonical_visibility(off, left, right, extent, False)
                assert max(abs(o2), l2, r2) <= max(SAFE_INDEX, 2 * extent)
                assert (l2 < 0) == (left < 0) and (r2 < 0) == (right < 0)
                for Sq in range(0, extent + 1):
                    for Sk in range(0, extent - Sq + 1):
                        for br in (0, Sk - Sq):
                            assert torch.equal(visible(Sq, Sk, off + br, left, right),
                                               visible(Sq, Sk, o2 + br, l2, r2)), (off, left, right, Sq, Sk, br)
