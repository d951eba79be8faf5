"""A model of the half-dQ kernel's lockstep hand-offs on named barriers
(ops/gluon/attention_bwd_dkdv_halfdq_sm90.py, not DEFER: `_half_consumer`, `_part_writer`,
`_reduce_part`), for finding deadlocks, barriers completed by the wrong parties and shared-memory
races on the CPU (a protocol error on the GPU is a hang or a wrong dQ).

The consumers: c stores tile t's dS^T into its slot t % 2 and arrives on its barrier of that
slot; after issuing dV's and dK's products it syncs on the other's, then reads both slots.

Named barriers (PTX `bar`) have no phases: a barrier completes when `count` threads have arrived
(`bar.arrive`) or synced (`bar.sync`), releases its syncers and starts over.  So a party that
arrives twice before its peer came once completes a use with the wrong members; the model records
each completed use's members and what each came for, and checks they belong to one use.  Parties
are warps (each warp of a warpgroup runs the same sequence, at its own pace); counts are in warps.
Data: a dS^T slot is read by both consumers' dQ products and must hold the tile they read; a dQ
part's buffer is read by the writer's reduce and must hold that tile's part."""
from __future__ import annotations

import random

DS_STAGES = 2
WG = 4  # warps a consumer warpgroup


class ProtocolError(AssertionError):
    pass


class Barriers:
    def __init__(self):
        self.arrived = {}  # id -> list of (party, tag)
        self.done = {}  # id -> completed uses so far
        self.count = {}

    def come(self, bid, count, party, tag):
        self.count.setdefault(bid, count)
        if self.count[bid] != count:
            raise ProtocolError(f"barrier {bid} used with counts {self.count[bid]} and {count}")
        use = self.done.get(bid, 0)  # the use this arrival counts toward
        members = self.arrived.setdefault(bid, [])
        members.append((party, tag))
        if len(members) == count:
            tags = {t for _, t in members}
            if len(tags) != 1:
                raise ProtocolError(f"barrier {bid} completed by {sorted(members, key=repr)}")
            self.arrived[bid] = []
            self.done[bid] = use + 1
        return use


def consumer_warp(B, state, me, w, T, ids, fault=""):
    """Yields until runnable; `_half_consumer`'s hand-offs in its order."""
    party = (me, w)
    for t in range(T):
        s = t % DS_STAGES
        # the slot's previous tile (t - 2) must have been read by every warp of both consumers
        prev = state["ds"].get((me, s, w))
        if prev is not None and state["ds_reads"].get((me, s, prev), 0) < 2 * WG:
            raise ProtocolError(f"consumer {me} warp {w} overwrote dS^T slot {s} (tile {prev}) before it was read")
        state["ds"][(me, s, w)] = t
        B.come(ids["ready"][me][s], 2 * WG, party, ("ready", me, t))
        yield  # (dV's and dK's products are issued)
        yield from sync(B, ids["ready"][1 - me][s], 2 * WG, party, ("ready", 1 - me, t))
        yield  # (the dQ product is issued, then read: other warps may run meanwhile)
        for c in (0, 1):  # the dQ product reads both consumers' slot s, every warp's rows
            for ww in range(WG):
                if state["ds"].get((c, s, ww)) != t:
                    raise ProtocolError(f"consumer {me} read consumer {c}'s slot {s} warp {ww} rows before tile {t}")
            state["ds_reads"][(c, s, t)] = state["ds_reads"].get((c, s, t), 0) + 1
        state["dq_done"][(me, t)] = state["dq_done"].get((me, t), 0) + 1  # (it read the other's K too)
        yield
        if t > 0 or fault == "wait_before_first_part":
            yield from sync(B, ids["empty"][me], WG + 1, party, ("empty", me, t))
        if state["dq_read"].get(me, -1) < t - 1:
            raise ProtocolError(f"consumer {me} overwrote its dQ part {t - 1} before the writer read it")
        state["dq"][(me, w)] = t
        B.come(ids["full"][me], WG + 1, party, ("full", me, t))
        yield
    if T > 0 and fault != "no_final_meet":
        s = T % DS_STAGES
        B.come(ids["ready"][me][s], 2 * WG, party, ("ready", me, T))
        yield from sync(B, ids["ready"][1 - me][s], 2 * WG, party, ("ready", 1 - me, T))
    if T > 0:
        # K's buffer takes dK: the other consumer's dQ products (which read it) are done
        for t in range(T):
            if state["dq_done"].get((1 - me, t), 0) < WG:
                raise ProtocolError(f"consumer {me} overwrote K while tile {t}'s dQ could read it")


def writer(B, state, T, ids, fault=""):
    party = ("writer", 0)
    for t in range(T):
        for c in (0, 1):
            yield from sync(B, ids["full"][c], WG + 1, party, ("full", c, t))
            for ww in range(WG):
                if state["dq"].get((c, ww)) != t:
                    raise ProtocolError(f"writer read consumer {c}'s part {t} with warp {ww}'s rows not stored")
            state["dq_read"][c] = t
            yield
            if t < T - 1 or fault == "writer_arrives_after_last":
                B.come(ids["empty"][c], WG + 1, party, ("empty", c, t + 1))


SPIN = "spin"
# the kernel's ids: DS_READY + 2 c + s, DQ_FULL + c, DQ_EMPTY + c
IDS = {"ready": ((8, 9), (10, 11)), "full": (12, 13), "empty": (14, 15)}


def sync(B, bid, count, party, tag):
    use = B.come(bid, count, party, tag)
    while B.done.get(bid, 0) <= use:  # released once this use completes
        yield SPIN


def run(T: int, seed: int = 0, ids=None, fault: str = "") -> None:
    """Replays one program of T query tiles under a random interleaving; raises ProtocolError on a
    race or a misused barrier, and on a deadlock (no party can move).  fault: a deliberate
    error ("no_final_meet", "writer_arrives_after_last", "wait_before_first_part"), for the test that the model sees it."""
    ids = ids or IDS
    B = Barriers()
    state = {"ds": {}, "ds_reads": {}, "dq": {}, "dq_read": {}, "dq_done": {}}
    parties = [consumer_warp(B, state, me, w, T, ids, fault) for me in (0, 1) for w in range(WG)]
    parties.append(writer(B, state, T, ids, fault))
    rng = random.Random(seed)
    live = list(parties)
    spun = set()  # the parties that only waited since anything last moved
    while live:
        p = rng.choice(live)
        try:
            if next(p) == SPIN:
                spun.add(id(p))
            else:
                spun.clear()
        except StopIteration:
            live.remove(p)
            spun.clear()
        if live and len(spun) == len(live):  # every party waits and nothing moved: none ever will
            raise ProtocolError(f"deadlock: pending arrivals {B.arrived}")
    left = {bid: m for bid, m in B.arrived.items() if m}
    if left:
        raise ProtocolError(f"arrivals left over at the end: {left}")
