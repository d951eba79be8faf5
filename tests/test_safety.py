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
from hypothesis import HealthCheck, event, given, settings  # noqa: E402
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
    """Bool [Sq, Sk] of the visibility rule, key j visible from query i iff i + off - left <= j <=
    i + off + right (a side < 0: unbounded), exact for Python ints of any size: the bounds on j - i
    are computed in Python, and clamping them beyond |j - i| < Sq + Sk changes no comparison."""
    n = Sq + Sk + 1
    d = torch.arange(Sk).view(1, Sk) - torch.arange(Sq).view(Sq, 1)  # j - i
    vis = torch.ones(Sq, Sk, dtype=torch.bool)
    if left >= 0:
        vis &= d >= max(-n, min(n, off - left))
    if right >= 0:
        vis &= d <= max(-n, min(n, off + right))
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
    vis = visible(q.shape[0], k.shape[0], off, left, right)[None, None].to(q.device)
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
        flashforge.attention_varlen(q, k, v, cus["cu_seqlens_q"], cus["cu_seqlens_k"], 10, 10, backend=backend,
                                    check_inputs=True)


@pytest.mark.parametrize("backend", BACKENDS)
def test_varlen_rejects_a_max_seqlen_below_the_longest_sequence(backend):
    dev = backend_device(backend)
    q, k, v = _varlen_inputs(dev, 10, 10, Guards())
    cu = torch.tensor([0, 4, 10], dtype=torch.int32, device=dev)
    with pytest.raises(ValueError, match=r"max_seqlen_q is 5 but the longest sequence has 6 rows; accepted: >= 6"):
        flashforge.attention_varlen(q, k, v, cu, cu, 5, 6, backend=backend, check_inputs=True)
    with pytest.raises(ValueError, match=r"max_seqlen_k is 3 but the longest sequence has 6 rows"):
        flashforge.attention_varlen(q, k, v, cu, cu, 6, 3, backend=backend, check_inputs=True)


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
        flashforge.attention_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=lens, block_table=table, backend=backend,
                                          check_inputs=True)
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


@pytest.mark.parametrize("backend", [p for p in BACKENDS if p.values[0] == "triton"])
def test_block_table_clamp_per_key(backend, monkeypatch):
    """Key tiles wider than the pages look the block table up per key (`key_rows`): an unchecked
    entry outside the pool is clamped there too."""
    from flashforge.ops.triton import configs
    dev = backend_device(backend)
    if torch.device(dev).type == "cpu":  # the interpreter's tiles are 16 x 16: widen the keys
        monkeypatch.setattr(configs, "_INTERPRETER", configs.TileConfig(16, 32, 1, 1))
    guards = Guards()
    q, kc, vc, _, _, table = _cache(dev, guards, True, 32, [20, 30], 0, 1)
    table[0, 1], table[1, 0] = 2**31 - 1, -5
    lens = guards.place(torch.tensor([20, 30], dtype=torch.int32, device=dev))
    with unchecked(), guarded_allocations(guards):
        o = flashforge.attention_with_kvcache(q, kc, vc, cache_seqlens=lens, block_table=table, backend=backend)
    guards.check()
    rows_k, rows_v = _gather(kc, table, kc.shape[0]), _gather(vc, table, vc.shape[0])
    assert_rows_close(o, _kvcache_reference(q, rows_k, rows_v, [20, 30], True, None), "o")


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
                             backend=backend, check_inputs=True)
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


# ---------------------------------------------------------------------------------------------
# Property tests: bad and extreme values for every index-like argument.  Either a ValueError
# naming an argument that is wrong, or the right result; nothing outside the tensors touched.
# Derandomized (CI sees the same examples every run), tiny shapes.

PROPS = dict(deadline=None, derandomize=True, database=None, print_blob=True,
             suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
INT32_EDGES = [-(2**31), -(2**31) + 1, -7, -1, 1, 2**31 - 2, 2**31 - 1]
INT64_EDGES = INT32_EDGES + [-(2**62), -(2**40), 2**31, 2**32 + 3, 2**40, 2**61, 2**62, 2**63 - 1, -(2**63)]
SIDES = [-1, 0, 1, 3, 2**31 - 2, 2**31 - 1, 2**40, 10**20]
INT_OFFSETS = [0, 2, -3, 2**29, 2**29 + 1, -(2**31), 2**31 - 1, 2**40, -(10**20), 10**20]
MAX_OFFSET, SAFE_INDEX = 2**61, 2**29


@st.composite
def cumulative(draw, lengths, dtype):
    """cu_seqlens of `lengths`, maybe broken: (values, kind)."""
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    kind = draw(st.sampled_from(["valid", "valid", "valid", "start", "decrease", "last", "edge"]))
    if kind == "start":
        cu[0] = draw(st.sampled_from([1, -1, 3]))
    elif kind == "decrease" and len(cu) > 2:
        i = draw(st.integers(1, len(cu) - 2))
        cu[i] = cu[i + 1] + draw(st.integers(1, 4))
    elif kind == "last":
        cu[-1] += draw(st.sampled_from([-1, 1, 7, 1000]))
    elif kind == "edge":
        cu[draw(st.integers(0, len(cu) - 1))] = draw(st.sampled_from(INT32_EDGES if dtype == torch.int32
                                                                      else INT64_EDGES))
    return cu


def cu_valid(cu, total: int) -> bool:
    return cu[0] == 0 and all(a <= b for a, b in zip(cu, cu[1:])) and cu[-1] == total


@st.composite
def offsets(draw, B: int, alibi: bool):
    """(the causal_offset argument's description, per-sequence values before any bottom-right shift or
    None for bottom_right, whether it is valid)."""
    kind = draw(st.sampled_from(["int", "int32", "int64", "bottom_right"]))
    if kind == "bottom_right":
        return "bottom_right", None, True
    limit = SAFE_INDEX if alibi else MAX_OFFSET
    if kind == "int":
        value = draw(st.sampled_from(INT_OFFSETS))
        return value, [value] * B, not alibi or abs(value) <= SAFE_INDEX
    edges = INT32_EDGES if kind == "int32" else INT64_EDGES
    values = draw(st.lists(st.sampled_from(edges + [0, 2, -3]), min_size=B, max_size=B))
    dtype = torch.int32 if kind == "int32" else torch.int64
    return (tuple(values), dtype), values, all(-limit <= x <= limit for x in values)


def offset_argument(desc, dev):
    if isinstance(desc, tuple):
        return torch.tensor(desc[0], dtype=desc[1], device=dev)
    return desc


windows = st.one_of(st.none(), st.tuples(st.sampled_from(SIDES), st.sampled_from(SIDES)))


def _varlen_reference(q, k, v, bounds_q, bounds_k, offs, left, right, slopes, do):
    """Per sequence in float64: o [total_q, Hq, Dv] and lse [Hq, total_q] (rows of no sequence: 0, -inf)
    and, with do, the gradients of sum(o * do)."""
    q64, k64, v64 = (t.detach().double().cpu().requires_grad_() for t in (q, k, v))
    o = torch.zeros(q.shape[0], q.shape[1], v.shape[-1], dtype=torch.float64)
    lse = torch.full((q.shape[1], q.shape[0]), float("-inf"), dtype=torch.float64)
    loss = 0.0
    for b, ((q0, q1), (k0, k1)) in enumerate(zip(bounds_q, bounds_k)):
        off = (k1 - k0) - (q1 - q0) if offs is None else offs[b]
        ob, lb = reference_rows(q64[q0:q1], k64[k0:k1], v64[k0:k1], off, left, right,
                                slopes=None if slopes is None else slopes[b])
        o[q0:q1], lse[:, q0:q1] = ob.detach(), lb.detach()
        if do is not None:
            loss = loss + (ob * do[q0:q1].double().cpu()).sum()
    grads = torch.autograd.grad(loss, (q64, k64, v64), allow_unused=True) if do is not None else None
    return o, lse, grads


def _covered_once(bounds, total, limit=None):
    """Bool [total]: rows of exactly one sequence (and below `limit` rows into it)."""
    count = torch.zeros(total, dtype=torch.int64)
    keep = torch.zeros(total, dtype=torch.bool)
    for start, end in bounds:
        count[start:end] += 1
        keep[start:min(end, start + limit) if limit is not None else end] = True
    return keep & (count == 1)


@st.composite
def varlen_calls(draw):
    B = draw(st.integers(1, 3))
    lq = draw(st.lists(st.integers(0, 5), min_size=B, max_size=B))
    lk = draw(st.lists(st.integers(0, 5), min_size=B, max_size=B))
    dtype_q, dtype_k = (draw(st.sampled_from([torch.int32, torch.int64])) for _ in range(2))
    alibi = draw(st.booleans())
    off_desc, offs, off_ok = draw(offsets(B, alibi))
    if alibi and off_ok and offs is not None and any(abs(x) > 8 for x in offs):
        off_desc, offs = 0, [0] * B  # a valid ALiBi offset float32 can resolve (large ones: refused)
    return dict(B=B, lq=lq, lk=lk, cu_q=draw(cumulative(lq, dtype_q)), cu_k=draw(cumulative(lk, dtype_k)),
                dtype_q=dtype_q, dtype_k=dtype_k, dq=draw(st.sampled_from([0, 0, 1, -1, 10**9])),
                dk=draw(st.sampled_from([0, 0, 1, -1, 10**9])), causal=draw(st.booleans()), window=draw(windows),
                off_desc=off_desc, offs=offs, off_ok=off_ok, alibi=alibi,
                unchecked=draw(st.booleans()), bwd=draw(st.booleans()))


def _varlen_property(backend, c):
    dev = backend_device(backend)
    total_q, total_k = sum(c["lq"]), sum(c["lk"])
    guards = Guards()
    q, k, v = _varlen_inputs(dev, total_q, total_k, guards, seed=len(c["lq"]))
    cu_q = guards.place(torch.tensor(c["cu_q"], dtype=c["dtype_q"], device=dev))
    cu_k = guards.place(torch.tensor(c["cu_k"], dtype=c["dtype_k"], device=dev))
    max_q, max_k = max(0, max(c["lq"]) + c["dq"]), max(0, max(c["lk"]) + c["dk"])
    slopes = torch.rand(c["B"], 2, generator=torch.Generator().manual_seed(1)).to(dev) if c["alibi"] else None
    unchecked_call = c["unchecked"] and c["off_ok"]  # (beyond the documented range, unchecked offsets clamp)
    wrong = set()
    if not cu_valid(c["cu_q"], total_q):
        wrong.add("cu_seqlens_q")
    if not cu_valid(c["cu_k"], total_k):
        wrong.add("cu_seqlens_k")
    if not wrong:
        if max_q < max(c["lq"]):
            wrong.add("max_seqlen_q")
        if max_k < max(c["lk"]):
            wrong.add("max_seqlen_k")
    if not c["off_ok"]:
        wrong.add("causal_offset")
    kw = dict(causal=c["causal"], causal_offset=offset_argument(c["off_desc"], dev), window=c["window"],
              alibi_slopes=slopes, return_lse=True, backend=backend, check_inputs=not unchecked_call)
    event("refused" if wrong and not unchecked_call else "unchecked, out of range" if wrong else
          "unchecked" if unchecked_call else "valid")
    if wrong and not unchecked_call:
        with pytest.raises(ValueError) as err:
            flashforge.attention_varlen(q, k, v, cu_q, cu_k, max_q, max_k, **kw)
        assert any(str(err.value).startswith(name) for name in wrong), (str(err.value), wrong)
        guards.check()
        return
    with contextlib.ExitStack() as stack:
        if unchecked_call:
            stack.enter_context(unchecked())
        stack.enter_context(guarded_allocations(guards))
        o, lse = flashforge.attention_varlen(q, k, v, cu_q, cu_k, max_q, max_k, **kw)
        do = torch.randn(o.shape, generator=torch.Generator().manual_seed(2)).to(dev)
        grads = torch.autograd.grad((o * do).sum(), (q, k, v)) if c["bwd"] else None
    guards.check()
    bounds_q, bounds_k = clamped_bounds(c["cu_q"], total_q), clamped_bounds(c["cu_k"], total_k)
    left, right = sides(c["window"], c["causal"])
    want_o, want_lse, want_grads = _varlen_reference(q, k, v, bounds_q, bounds_k, c["offs"], left, right,
                                                     None if slopes is None else slopes.cpu(),
                                                     do if grads is not None and not wrong else None)
    rows = _covered_once(bounds_q, total_q, limit=max_q)
    assert_rows_close(o[rows.to(dev)], want_o[rows], "o")
    assert_rows_close(lse[:, rows.to(dev)], want_lse[:, rows], "lse")
    if want_grads is not None:
        for name, got, want in zip(("dq", "dk", "dv"), grads, want_grads):
            assert_rows_close(got, torch.zeros_like(got.cpu().double()) if want is None else want, name)


@pytest.mark.parametrize("backend", BACKENDS[:1])
@settings(max_examples=40, **PROPS)
@given(c=varlen_calls())
def test_varlen_index_arguments_property_torch(backend, c):
    _varlen_property(backend, c)


@pytest.mark.parametrize("backend", BACKENDS[1:])
@settings(max_examples=15, **PROPS)
@given(c=varlen_calls())
def test_varlen_index_arguments_property_triton(backend, c):
    _varlen_property(backend, c)


LEN_EDGES = [-1, -5, 2**31 - 1, -(2**31)]


@st.composite
def kvcache_calls(draw):
    paged = draw(st.booleans())
    capacity = PAGE * draw(st.integers(1, 2)) if paged else draw(st.integers(1, 20))
    s_new = draw(st.integers(0, 2))
    Sq = draw(st.integers(1, 3))
    kind = draw(st.sampled_from(["int", "int32", "int64"]))
    in_range = st.integers(0, max(0, capacity - s_new))
    if kind == "int":
        n = draw(st.one_of(in_range, in_range, st.sampled_from([capacity - s_new + 1, -1, 2**40])))
        lengths = [n] * B
    else:
        edges = LEN_EDGES + ([2**40, -(2**40), 2**63 - 1] if kind == "int64" else [])
        lengths = draw(st.lists(st.one_of(in_range, in_range, in_range,
                                          st.sampled_from(edges + [capacity - s_new + 1])), min_size=B, max_size=B))
    entries = []  # (b, j, value) corruptions of the block table
    if paged:
        for _ in range(draw(st.sampled_from([0, 0, 1, 2]))):
            entries.append((draw(st.integers(0, B - 1)), draw(st.integers(0, capacity // PAGE - 1)),
                            draw(st.sampled_from([-1, B * (capacity // PAGE) + 2, 2**31 - 1, -(2**31)]))))
    return dict(paged=paged, capacity=capacity, s_new=s_new, Sq=Sq, kind=kind, lengths=lengths, entries=entries,
                causal=draw(st.booleans()), window=draw(windows), splits=draw(st.sampled_from([1, 1, 3])),
                unchecked=kind != "int" and draw(st.sampled_from([True, True, False])))


def _kvcache_property(backend, c):
    dev = backend_device(backend)
    guards = Guards()
    capacity, s_new, lengths = c["capacity"], c["s_new"], c["lengths"]
    q, kc, vc, kn, vn, table = _cache(dev, guards, c["paged"], capacity, [min(max(n, 0), capacity) for n in lengths],
                                      s_new, c["Sq"], seed=capacity)
    for b, j, value in c["entries"]:
        table[b, j] = value
    if c["kind"] == "int":
        lens = lengths[0]
    else:
        lens = guards.place(torch.tensor(lengths, dtype=torch.int32 if c["kind"] == "int32" else torch.int64,
                                         device=dev))
    n_blocks = kc.shape[0]
    wrong = any(n < 0 or n + s_new > capacity for n in lengths)
    if table is not None and not wrong:
        for b, n in enumerate(lengths):
            used = -(-(n + s_new) // PAGE)
            wrong |= any(not 0 <= int(x) < n_blocks for x in table[b, :used].tolist())
    kw = dict(cache_seqlens=lens, block_table=table, causal=c["causal"], window=c["window"], num_splits=c["splits"],
              backend=backend, check_inputs=not c["unchecked"])
    before = _bits(kc), _bits(vc)
    event("refused" if wrong and not c["unchecked"] else "unchecked, out of range" if wrong else
          "unchecked" if c["unchecked"] else "valid")
    if wrong and not c["unchecked"]:
        with pytest.raises(ValueError, match=r"^(cache_seqlens|block_table)"):
            flashforge.attention_with_kvcache(q, kc, vc, kn, vn, **kw)
        assert torch.equal(_bits(kc), before[0]) and torch.equal(_bits(vc), before[1]), "a failed call wrote the cache"
        guards.check()
        return
    want_k, want_v, targets = _expected_append(kc, vc, kn, vn, lengths, table, capacity)
    with contextlib.ExitStack() as stack:
        if c["unchecked"]:
            stack.enter_context(unchecked())
        stack.enter_context(guarded_allocations(guards))
        o = flashforge.attention_with_kvcache(q, kc, vc, kn, vn, **kw)
    guards.check()
    for slot, writers in targets.items():
        if len(writers) > 1:
            want_k[slot], want_v[slot] = kc[slot].cpu(), vc[slot].cpu()
    assert torch.equal(_bits(kc), _bits(want_k)) and torch.equal(_bits(vc), _bits(want_v)), \
        "the append wrote other slots than its own"
    keys = [min(max(n + s_new, 0), capacity) for n in lengths]
    rows_k, rows_v = _gather(kc, table, n_blocks), _gather(vc, table, n_blocks)
    assert_rows_close(o, _kvcache_reference(q, rows_k, rows_v, keys, c["causal"], c["window"]), "o")


@pytest.mark.parametrize("backend", BACKENDS[:1])
@settings(max_examples=40, **PROPS)
@given(c=kvcache_calls())
def test_kvcache_index_arguments_property_torch(backend, c):
    _kvcache_property(backend, c)


@pytest.mark.parametrize("backend", BACKENDS[1:])
@settings(max_examples=20, **PROPS)
@given(c=kvcache_calls())
def test_kvcache_index_arguments_property_triton(backend, c):
    _kvcache_property(backend, c)


@st.composite
def dense_calls(draw):
    Bd = draw(st.integers(1, 2))
    alibi = draw(st.booleans())
    off_desc, offs, off_ok = draw(offsets(Bd, alibi))
    if alibi and off_ok and offs is not None and any(abs(x) > 8 for x in offs):
        off_desc, offs = 0, [0] * Bd
    window = draw(st.one_of(windows, st.sampled_from([1, 2, 2**31, 10**20, 0, -3])))
    dropout = draw(st.sampled_from([0.0, 0.0, 0.3]))
    seed = draw(st.sampled_from([0, 1, 2**32 - 1, 2**32, 2**63 - 1, -1, 2**63]))
    return dict(B=Bd, Sq=draw(st.integers(1, 5)), Sk=draw(st.integers(0, 6)), alibi=alibi, off_desc=off_desc,
                offs=offs, off_ok=off_ok, window=window, causal=draw(st.booleans()), dropout=dropout, seed=seed,
                unchecked=draw(st.booleans()))


def _dense_property(backend, c):
    dev = backend_device(backend)
    gen = torch.Generator().manual_seed(c["Sq"] * 7 + c["Sk"])
    guards = Guards()
    Bd, Sq, Sk = c["B"], c["Sq"], c["Sk"]
    q = guards.place(randn(gen, Bd, Sq, 2, 16, device=dev)).requires_grad_()
    k = guards.place(randn(gen, Bd, Sk, 1, 16, device=dev)).requires_grad_()
    v = guards.place(randn(gen, Bd, Sk, 1, 16, device=dev)).requires_grad_()
    slopes = torch.rand(2, generator=gen).to(dev) if c["alibi"] else None
    offset = offset_argument(c["off_desc"], dev)
    if isinstance(offset, torch.Tensor):
        offset = guards.place(offset)
    wrong = set()
    if not c["off_ok"]:
        wrong.add("causal_offset")
    if isinstance(c["window"], int) and c["window"] <= 0:
        wrong.add("window")
    if c["dropout"] > 0 and not 0 <= c["seed"] < 2**63:
        wrong.add("seed")
    unchecked_call = c["unchecked"] and not wrong
    kw = dict(causal=c["causal"], causal_offset=offset, window=c["window"], alibi_slopes=slopes,
              dropout_p=c["dropout"], seed=c["seed"] if c["dropout"] > 0 else None, return_lse=True, backend=backend,
              check_inputs=not unchecked_call)
    event("refused" if wrong else "unchecked" if unchecked_call else "valid")
    if wrong:
        with pytest.raises(ValueError) as err:
            flashforge.attention(q, k, v, **kw)
        assert any(str(err.value).startswith(name) for name in wrong), (str(err.value), wrong)
        return
    with contextlib.ExitStack() as stack:
        if unchecked_call:
            stack.enter_context(unchecked())
        stack.enter_context(guarded_allocations(guards))
        o, lse = flashforge.attention(q, k, v, **kw)
        do = torch.randn(o.shape, generator=gen).to(dev)
        grads = torch.autograd.grad((o * do).sum(), (q, k, v))
    guards.check()
    left, right = sides(c["window"], c["causal"])
    offs = [Sk - Sq] * Bd if c["offs"] is None else c["offs"]
    vis = torch.stack([visible(Sq, Sk, offs[b], left, right) for b in range(Bd)])[:, None]  # [B, 1, Sq, Sk]
    q64, k64, v64 = (t.detach().double().cpu().requires_grad_() for t in (q, k, v))
    want_o, want_lse = reference.attention(
        q64, k64, v64, mask=vis, causal_offset=torch.tensor(offs) if slopes is not None else 0,
        alibi_slopes=None if slopes is None else slopes.cpu(), dropout_p=c["dropout"], seed=max(c["seed"], 0),
        return_lse=True)
    want_grads = torch.autograd.grad((want_o * do.double().cpu()).sum(), (q64, k64, v64), allow_unused=True)
    assert_rows_close(o, want_o, "o")
    assert_rows_close(lse, want_lse, "lse")
    for name, got, want in zip(("dq", "dk", "dv"), grads, want_grads):
        assert_rows_close(got, torch.zeros_like(got.cpu().double()) if want is None else want, name)


@pytest.mark.parametrize("backend", BACKENDS[:1])
@settings(max_examples=40, **PROPS)
@given(c=dense_calls())
def test_offsets_windows_seeds_property_torch(backend, c):
    _dense_property(backend, c)


@pytest.mark.parametrize("backend", BACKENDS[1:])
@settings(max_examples=15, **PROPS)
@given(c=dense_calls())
def test_offsets_windows_seeds_property_triton(backend, c):
    _dense_property(backend, c)


# ---------------------------------------------------------------------------------------------
# GPU only: real device tensors (the lead's batched GPU run)

@pytest.mark.gpu
def test_gpu_default_path_reads_no_device_value():
    """Without check_inputs no index tensor is read on the host: a decoding step (append + attend,
    paged) and a varlen call synchronise nothing; check_inputs=True does (that is its cost)."""
    dev = "cuda"
    guards = Guards()
    q, kc, vc, kn, vn, table = _cache(dev, guards, True, 32, [5, 17], 1, 1)
    lens = torch.tensor([5, 17], dtype=torch.int32, device=dev)
    qv = torch.randn(10, 2, 16, device=dev)
    cu = torch.tensor([0, 4, 10], dtype=torch.int32, device=dev)
    for _ in range(2):  # (compiled and cached on the first pass)
        flashforge.attention_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=lens, block_table=table)
        flashforge.attention_varlen(qv, qv[:, :1], qv[:, :1], cu, cu, 6, 6, causal=True)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        flashforge.attention_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=lens, block_table=table)
        flashforge.attention_varlen(qv, qv[:, :1], qv[:, :1], cu, cu, 6, 6, causal=True)
        with pytest.raises(RuntimeError, match="synchroniz"):
            flashforge.attention_varlen(qv, qv[:, :1], qv[:, :1], cu, cu, 6, 6, check_inputs=True)
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.gpu
def test_gpu_check_inputs_refuses_device_values():
    """check_inputs=True reads device index tensors and refuses bad values before writing; without it
    the same calls run, clamped (no illegal address: the CUDA context survives)."""
    dev = "cuda"
    guards = Guards()
    q, k, v = _varlen_inputs(dev, 10, 10, guards)
    cu_bad = guards.place(torch.tensor([0, 4, 40], dtype=torch.int32, device=dev))
    with pytest.raises(ValueError, match=r"cu_seqlens_q\[-1\] is 40"):
        flashforge.attention_varlen(q, k, v, cu_bad, cu_bad, 10, 10, check_inputs=True)
    with guarded_allocations(guards):
        flashforge.attention_varlen(q, k, v, cu_bad, cu_bad, 10, 10).sum().backward()
    torch.cuda.synchronize()
    guards.check()
    qc, kc, vc, kn, vn, table = _cache(dev, guards, True, 32, [20, 31], 1, 1)
    before = _bits(kc), _bits(vc)
    lens = guards.place(torch.tensor([20, 40], dtype=torch.int32, device=dev))
    with pytest.raises(ValueError, match=r"cache_seqlens\[1\] \(40\) \+ S_new \(1\)"):
        flashforge.attention_with_kvcache(qc, kc, vc, kn, vn, cache_seqlens=lens, block_table=table,
                                          check_inputs=True)
    assert torch.equal(_bits(kc), before[0]) and torch.equal(_bits(vc), before[1])
    table[1, 0] = 10**6
    with guarded_allocations(guards):
        flashforge.attention_with_kvcache(qc, kc, vc, kn, vn, cache_seqlens=lens, block_table=table)
    torch.cuda.synchronize()
    guards.check()


@pytest.mark.gpu
def test_gpu_environment_variable_covers_the_drop_in():
    """FLASHFORGE_CHECK_INPUTS=1 makes flash-attn's drop-in (no check_inputs keyword in its
    signature) refuse bad device cu_seqlens."""
    import subprocess
    import sys
    code = ("import torch; from flashforge.flash_attn_interface import flash_attn_varlen_func as f\n"
            "q = torch.randn(10, 2, 64, device='cuda', dtype=torch.bfloat16)\n"
            "cu = torch.tensor([0, 4, 40], dtype=torch.int32, device='cuda')\n"
            "try:\n    f(q, q, q, cu, cu, 10, 10)\nexcept ValueError as e:\n    print('refused:', e)\n")
    env = dict(__import__("os").environ, FLASHFORGE_CHECK_INPUTS="1")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert "refused: cu_seqlens_q[-1] is 40" in out.stdout, out.stdout + out.stderr


@pytest.mark.gpu
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_gluon_varlen_unchecked_bounds_stay_inside(D, causal):
    """The sm_90 Gluon kernels serve packed bf16 batches with D = 64/128 and >= 64 rows: with a last
    cu_seqlens entry past the rows (unchecked), nothing outside q, k, v, o, lse or the gradients is
    touched and the sequences are those of the clamped bounds (needs the clamp in the Gluon kernels'
    `pipeline.sequence`)."""
    dev = "cuda"
    guards = Guards()
    total = 200
    gen = torch.Generator().manual_seed(8)
    q, k, v = (guards.place(randn(gen, total, 2, D, device=dev).to(torch.bfloat16)).requires_grad_()
               for _ in range(3))
    cu_bad = guards.place(torch.tensor([0, 120, 4000], dtype=torch.int32, device=dev))
    cu = torch.tensor([0, 120, 200], dtype=torch.int32, device=dev)
    with guarded_allocations(guards):
        o = flashforge.attention_varlen(q, k, v, cu_bad, cu_bad, 4000, 4000, causal=causal)
        grads = torch.autograd.grad(o.float().sum(), (q, k, v))
    torch.cuda.synchronize()
    guards.check()
    want = flashforge.attention_varlen(q, k, v, cu, cu, 120, 120, causal=causal)
    want_grads = torch.autograd.grad(want.float().sum(), (q, k, v))
    torch.testing.assert_close(o, want, rtol=0, atol=0)
    for got, ref in zip(grads, want_grads):
        torch.testing.assert_close(got, ref, rtol=2e-2, atol=2e-2)
