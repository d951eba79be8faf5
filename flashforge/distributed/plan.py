"""Which attention calls one ring step makes, and how far each K/V block travels.

A rank's queries and a K/V block are each a few `Segment`s (one for the contiguous layout,
two for zigzag).  Query i of segment Q sits at global position ``Q.start + i``, key j of
segment K at ``K.start + j``; the call rule of `AttnParams` (key j visible iff
``i + offset - left <= j <= i + offset + right``) gives global causality and windows when
``offset = Q.start - K.start``.  Every (Q, K) pair is thus one call, but calls are merged
where that keeps the meaning: one call over adjacent segments is exact when, for every pair
it covers, its rule selects the same (i, j) as the pair's global rule.  Zigzag's causal
steps become one call each that way (the diagonal step one causal call, the others one
unmasked call), as in ring-flash-attn.

The visible (i, j) of a pair are the ``j - i`` in an interval: ``[off - left, off + right]``
(a side unbounded when -1) clipped to ``[-(Lq - 1), Lk - 1]``, the values ``j - i`` takes on
the pair.  Two rules select the same entries iff their clipped intervals are equal.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Optional

from .layout import Segment, segments


@dataclass(frozen=True)
class Call:
    """One attention call: query rows [q0, q1) of the shard against rows [k0, k1) of the block."""
    q0: int
    q1: int
    k0: int
    k1: int
    offset: int  # AttnParams.offset of the call
    masked: bool  # False: every entry is visible, the call runs without causal mask or window


def _clip(off: int, lq: int, lk: int, left: int, right: int) -> Optional[tuple[int, int]]:
    """The visible ``j - i`` of an lq x lk pair under offset ``off``, or None if there are none."""
    lo, hi = -(lq - 1), lk - 1
    if left >= 0:
        lo = max(lo, off - left)
    if right >= 0:
        hi = min(hi, off + right)
    return (lo, hi) if lo <= hi else None


def _box_call(qs: tuple[Segment, ...], ks: tuple[Segment, ...], left: int, right: int) -> Optional[Call]:
    """One call over adjacent query segments ``qs`` x adjacent key segments ``ks``, or None if no
    single offset reproduces every pair's global visibility."""
    q0, k0 = qs[0].local, ks[0].local
    pairs = [(q, k, _clip(q.start - k.start, q.length, k.length, left, right)) for q in qs for k in ks]
    call = Call(q0, qs[-1].local + qs[-1].length, k0, ks[-1].local + ks[-1].length, 0, False)
    if all(want == (-(q.length - 1), k.length - 1) for q, k, want in pairs):
        return call  # everything visible
    for q, k, want in pairs:
        if want is None:
            continue
        # the call offset that gives this pair its global offset (its rows shifted by the box corner)
        off = q.start - k.start - (q.local - q0) + (k.local - k0)
        if all(_clip(off + (qq.local - q0) - (kk.local - k0), qq.length, kk.length, left, right) == w
               for qq, kk, w in pairs):
            return Call(call.q0, call.q1, call.k0, call.k1, off, True)
    return None


def plan(q_segs: tuple[Segment, ...], k_segs: tuple[Segment, ...], left: int, right: int) -> tuple[Call, ...]:
    """The calls of queries ``q_segs`` against a block ``k_segs``: one over the bounding box of the
    visible pairs if exact, else one per query segment, else one per visible pair."""
    seen = [(a, b) for a, q in enumerate(q_segs) for b, k in enumerate(k_segs)
            if _clip(q.start - k.start, q.length, k.length, left, right) is not None]
    if not seen:
        return ()
    a0, a1 = min(a for a, _ in seen), max(a for a, _ in seen) + 1
    b0, b1 = min(b for _, b in seen), max(b for _, b in seen) + 1
    whole = _box_call(q_segs[a0:a1], k_segs[b0:b1], left, right)
    if whole is not None:
        return (whole,)
    calls = []
    for a in range(a0, a1):
        bs = [b for aa, b in seen if aa == a]
        if not bs:
            continue
        row = _box_call(q_segs[a:a + 1], k_segs[min(bs):max(bs) + 1], left, right)
        if row is not None:
            calls.append(row)
        else:  # a single pair is always exact with its own offset
            calls.extend(_box_call(q_segs[a:a + 1], k_segs[b:b + 1], left, right) for b in bs)
    return tuple(calls)


@dataclass(frozen=True)
class Schedule:
    """The ring of one call: every rank's calls against every block, and each block's route.

    Block b starts on rank b and moves one rank forward per step; ``last[b]`` is the step at
    which the last rank that needs it (rank ``b + last[b]``) holds it.  It is not sent further,
    so a window or the contiguous causal layout stops blocks early; a step whose block a rank
    does not need computes nothing there.
    """
    world: int
    calls: tuple[tuple[tuple[Call, ...], ...], ...]  # calls[r][b]: rank r's queries against block b
    last: tuple[int, ...]

    def holds(self, rank: int, step: int) -> bool:
        """Whether ``rank`` has block ``rank - step`` at ``step``."""
        return step <= self.last[(rank - step) % self.world]


@lru_cache(maxsize=256)
def schedule(layout: str, world: int, local_len: int, left: int, right: int) -> Schedule:
    segs = [segments(layout, r, world, local_len) for r in range(world)]
    calls = tuple(tuple(plan(segs[r], segs[b], left, right) for b in range(world)) for r in range(world))
    last = tuple(max(t for t in range(world) if t == 0 or calls[(b + t) % world][b]) for b in range(world))
    return Schedule(world, calls, last)
