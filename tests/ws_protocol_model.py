"""A model of the warp-specialized forward's synchronization (ops/gluon/attention_fwd_ws_sm90.py
`consume_tile` / `load_tile`, run once a program or, persistent, over several items), for finding
deadlocks and barrier-phase errors on the CPU.

Why: a Gluon kernel runs only on the GPU, where a protocol error is a hang that takes the device call
with it (2026-12-07: the persistent ping-pong kernel hung on every item with a consumer whose rows are
past the sequence's end).  This replays each partition's barrier operations in the kernel's order --
the loader's fills, the consumers' waits, arrivals and ping-pong turns, with the kernel's tile counts
(Python twins of `pipeline.key_tiles` / `key_window` and `ws_pipeline.consumer_tiles`) -- under a
random interleaving, with mbarrier semantics: a wait on parity p passes once the barrier's completed
phase count has parity != p.  It reports a deadlock (no partition can move) and a wait that passed on
a phase other than the one the code meant (a waiter two phases behind).  Products, copies and stores
land at once: they wait for nothing else, so they cannot cause or hide a deadlock.  It checks the
protocol as written here; the kernel must be kept in step with it (the test names the functions)."""
from __future__ import annotations

import random
from dataclasses import dataclass, field

HALF = 64


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def key_tiles(m0, Sq, Sk, offset, BM, BN, causal):
    n_end = min(Sk, m0 + BM + offset) if causal else Sk
    n_tiles = max(cdiv(n_end, BN), 0)
    return 0 if m0 >= Sq else n_tiles


def key_window(m0, Sq, Sk, offset, span, BM, BN, causal, has_wl):
    """(n_lo, n_tiles) as `pipeline.key_window`."""
    n_tiles = key_tiles(m0, Sq, Sk, offset, BM, BN, causal)
    n_lo = 0
    if has_wl:
        n_lo = min(max(m0 + offset - span, 0) // BN, n_tiles)
        n_tiles -= n_lo
    return n_lo, n_tiles


@dataclass
class Item:
    """One work item's tile counts, as its partitions compute them."""
    u_lo: int
    u_tiles: int
    lo: list = field(default_factory=list)  # per consumer: first key tile (absolute), count
    tiles: list = field(default_factory=list)


def item(m0, Sq, Sk, offset, span, BN, causal, has_wl, nc=2) -> Item:
    u_lo, u_tiles = key_window(m0, Sq, Sk, offset, span, nc * HALF, BN, causal, has_wl)
    it = Item(u_lo, max(u_tiles, 0))
    for c in range(nc):
        lo, n = key_window(m0 + c * HALF, Sq, Sk, offset, span, HALF, BN, causal, has_wl)
        if n <= 0:  # `consumer_tiles`: nothing to compute; its first tile is past the union
            n, lo = 0, it.u_lo + it.u_tiles
        it.lo.append(lo)
        it.tiles.append(n)
    return it


class Barrier:
    def __init__(self, name, count):
        self.name, self.count, self.pending, self.done = name, count, 0, 0

    def arrive(self):
        self.pending += 1
        if self.pending == self.count:
            self.pending, self.done = 0, self.done + 1


class ProtocolError(AssertionError):
    pass


def wait(bar, parity, meant):
    """A partition's wait: passes once bar.done % 2 != parity; `meant` is the completion (1-based
    count) the code waits for, checked when it passes."""
    return ("wait", bar, parity, meant)


def ring_wait(ready, r, S):
    return wait(ready[r % S], (r // S) & 1, r // S + 1)


class Program:
    """The barriers of one program (`ws_pipeline.ws_rings` plus the persistent kernel's q_empty)."""

    def __init__(self, S, VS, nc, pingpong):
        self.S, self.VS, self.nc = S, VS, nc
        self.q = [Barrier(f"q{i}", 1) for i in range(nc)]
        self.q_empty = [Barrier(f"q_empty{i}", 1) for i in range(nc)]
        self.turn = [Barrier(f"turn{i}", 1) for i in range(2)]
        self.k_ready = [Barrier(f"k_ready{i}", 1) for i in range(S)]
        self.k_empty = [Barrier(f"k_empty{i}", nc) for i in range(S)]
        self.v_ready = [Barrier(f"v_ready{i}", 1) for i in range(VS)]
        self.v_empty = [Barrier(f"v_empty{i}", nc) for i in range(VS)]
        if pingpong:
            self.turn[0].arrive()  # consumer 0 issues first


def loader(P: Program, items, persistent):
    """`load_tile` for each item in turn."""
    base = 0
    for n, it in enumerate(items):
        for i in range(P.nc):
            if persistent:
                yield wait(P.q_empty[i], (n & 1) ^ 1, n)
            P.q[i].arrive()
        for r in range(it.u_tiles + 1):
            if r < it.u_tiles:
                x = base + r
                yield wait(P.k_empty[x % P.S], ((x // P.S) & 1) ^ 1, x // P.S)
                P.k_ready[x % P.S].arrive()
            if r > 0:
                x = base + r - 1
                yield wait(P.v_empty[x % P.VS], ((x // P.VS) & 1) ^ 1, x // P.VS)
                P.v_ready[x % P.VS].arrive()
        base += it.u_tiles


def _release(P, r):
    """`ws_pipeline.release` of ring index r in both rings."""
    yield ring_wait(P.k_ready, r, P.S)
    P.k_empty[r % P.S].arrive()
    yield ring_wait(P.v_ready, r, P.VS)
    P.v_empty[r % P.VS].arrive()


def consumer(P: Program, me, items, persistent, pingpong, old_tail=False):
    """`consume_tile` for each item in turn.  old_tail: the first persistent version's order (its
    trailing releases, then its spare turns) -- kept so the test shows the model finds that hang."""
    base = t0 = 0
    pp = pingpong and me < 2
    for n, it in enumerate(items):
        n_tiles = it.tiles[me]
        first = base + it.lo[me] - it.u_lo
        end = base + it.u_tiles
        n_own = n_tiles + 1 if n_tiles > 0 else 0
        other = 1 - me
        n_other = it.tiles[other] + 1 if (pp and it.tiles[other] > 0) else 0
        o_first = base + it.lo[other] - it.u_lo
        n_turns = max(n_own, n_other) if persistent else n_own
        lim_other = n_turns + t0 if persistent else n_other

        def turn(i):  # `turn_wait` then `turn_pass` (persistent: every turn of the item waits)
            if not pp:
                return
            ok = i <= lim_other if me == 0 else i < lim_other
            if ok:
                yield wait(P.turn[me], i & 1, i + 1)
            P.turn[1 - me].arrive()

        lead_end = first
        if persistent and pp and not old_tail and n_tiles == 0:
            lead_end = base  # no tiles: its releases go with its spare turns, below
        for r in range(base, lead_end):
            yield from _release(P, r)
        yield wait(P.q[me], n & 1, n + 1)
        if n_tiles > 0:
            yield ring_wait(P.k_ready, first, P.S)
            yield from turn(t0)
            P.k_empty[first % P.S].arrive()
            for j in range(1, n_tiles):
                r = first + j
                yield ring_wait(P.k_ready, r, P.S)
                yield ring_wait(P.v_ready, r - 1, P.VS)
                yield from turn(t0 + j)
                P.k_empty[r % P.S].arrive()
                P.v_empty[(r - 1) % P.VS].arrive()
            if persistent:
                P.q_empty[me].arrive()
            last = first + n_tiles - 1
            yield ring_wait(P.v_ready, last, P.VS)
            yield from turn(t0 + n_tiles)
            P.v_empty[last % P.VS].arrive()
        elif persistent:
            P.q_empty[me].arrive()
        r = lead_end + n_tiles  # the next of the union's tiles it has not released
        if persistent and pp and not old_tail:
            # `consume_tile`'s spare turns: before the other's turn i, hand back the tiles the loader
            # must refill for it (the other reads K at ring index o_first + i)
            for i in range(n_own, n_turns):
                while r < min(o_first + i + 2 - P.S, o_first + i + 2 - P.VS, end):
                    yield from _release(P, r)
                    r += 1
                yield from turn(t0 + i)
        while r < end:
            yield from _release(P, r)
            r += 1
        if persistent and pp and old_tail:
            for i in range(n_own, n_turns):
                yield from turn(t0 + i)
        base += it.u_tiles
        t0 += n_turns


def run(items, S, VS, pingpong, persistent, nc=2, seed=0, old_tail=False):
    """Interleave the partitions at random until all finish; raises ProtocolError on a deadlock or
    a wait that passed on the wrong phase."""
    P = Program(S, VS, nc, pingpong)
    parts = {"loader": loader(P, items, persistent)}
    for c in range(nc):
        parts[f"consumer{c}"] = consumer(P, c, items, persistent, pingpong, old_tail)
    pending = {name: next(g, None) for name, g in parts.items()}
    rng = random.Random(seed)
    while any(v is not None for v in pending.values()):
        ready = [name for name, w in pending.items() if w is not None and w[1].done % 2 != w[2]]
        if not ready:
            stuck = {name: f"{w[1].name} parity {w[2]} (done {w[1].done})" for name, w in pending.items() if w}
            raise ProtocolError(f"deadlock: {stuck}")
        name = rng.choice(ready)
        _, bar, parity, meant = pending[name]
        if bar.done != meant:
            raise ProtocolError(f"{name}: a wait on {bar.name} meant completion {meant}, passed at {bar.done}")
        pending[name] = next(parts[name], None)
