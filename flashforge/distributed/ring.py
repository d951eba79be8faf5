"""Ring attention: K/V blocks travel around the group, one rank per step.

At step s rank r holds block r - s (block b: rank b's K/V shard).  Each step starts the
exchange for step s + 1 (send the block on, receive the next one: one ``batch_isend_irecv``),
computes its own block's calls (`plan.Schedule`) behind it and only then waits, so the
transfer overlaps the attention.  A block is sent only as far as some rank needs it, and a
rank computes nothing for a block it does not need (causal, window).

Forward: every call's partial (o, lse) is merged into float32 running ones (`block.merge`).
Backward: the same route; each rank adds its dQ, and the block's dK/dV accumulators
(float32) follow the block one step behind it (sent at the start of the next step, so that
transfer overlaps that step's attention too); the last rank on a block's route sends them
home to its owner.  Sums are taken in route order, fixed by the schedule: with
``deterministic`` kernels the gradients are bitwise reproducible.

The transport (``start(sends, recvs) -> pending``, ``pending.wait()``) is `comm.P2P` over a
process group; the benchmarks substitute emulated ones on one GPU.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ..ops.params import AttnParams
from . import block
from .plan import Schedule


def _exchange_kv(kv, like, rank: int, step: int, sched: Schedule):
    """(next block or None, sends, receives) that pass the block held at ``step`` (``kv``, or None)
    on and bring rank ``rank`` its block of ``step + 1`` (shaped like ``like``, its own)."""
    W = sched.world
    if step + 1 >= W:
        return None, [], []
    nxt, prv = (rank + 1) % W, (rank - 1) % W
    sends = [(kv[0], nxt), (kv[1], nxt)] if sched.holds(nxt, step + 1) else []
    if not sched.holds(rank, step + 1):
        return None, sends, []
    new = (torch.empty_like(like[0]), torch.empty_like(like[1]))
    return new, sends, [(new[0], prv), (new[1], prv)]


def ring_forward(q: Tensor, k: Tensor, v: Tensor, rank: int, sched: Schedule, params: AttnParams, backend: str,
                 transport) -> tuple[Tensor, Tensor]:
    """This rank's ``o [B, S, Hq, Dv]`` (q's dtype) and ``lse [B, Hq, S]`` (float32);
    ``k``, ``v`` contiguous (they are sent as they are)."""
    W = sched.world
    B, S, Hq, _ = q.shape
    o = torch.zeros(B, S, Hq, v.shape[-1], dtype=torch.float32, device=q.device)
    lse = torch.full((B, Hq, S), float("-inf"), dtype=torch.float32, device=q.device)
    kv = (k, v)
    for step in range(W):
        new, sends, recvs = _exchange_kv(kv, (k, v), rank, step, sched)
        pending = transport.start(sends, recvs)
        for call in sched.calls[rank][(rank - step) % W]:
            o_c, lse_c = block.forward(q, kv[0], kv[1], call, params, backend)
            rows = slice(call.q0, call.q1)
            block.merge(o[:, rows], lse[:, :, rows], o_c, lse_c, backend)
        pending.wait()
        kv = new
    return o.to(q.dtype), lse


def ring_backward(do: Tensor, dlse: Optional[Tensor], q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor,
                  rank: int, sched: Schedule, params: AttnParams, backend: str,
                  transport) -> tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv) of this rank's shards, given the forward's merged ``o`` and ``lse``; ``do``, ``k``,
    ``v`` contiguous."""
    W = sched.world
    nxt, prv = (rank + 1) % W, (rank - 1) % W
    f32 = dict(dtype=torch.float32, device=q.device)
    dq = torch.zeros(q.shape, **f32)
    kv = (k, v)
    carry = None  # float32 (dK, dV) of the block computed at the previous step
    own = None  # (dK, dV) of this rank's own block, once complete
    for step in range(W + 1):  # the last round only sends the final dK/dV home
        new, sends, recvs = _exchange_kv(kv, (k, v), rank, step, sched) if step < W else (None, [], [])
        if carry is not None:
            c = (rank - step + 1) % W
            if sched.holds(nxt, step):  # the block goes on: its gradients follow it
                sends += [(carry[0], nxt), (carry[1], nxt)]
            elif c != rank:  # this rank was the last to need it
                sends += [(carry[0], c), (carry[1], c)]
            else:
                own = carry
        incoming = None
        if 0 < step < W and sched.holds(rank, step):
            incoming = (torch.empty(k.shape, **f32), torch.empty(v.shape, **f32))
            recvs += [(incoming[0], prv), (incoming[1], prv)]
        last = sched.last[rank]
        if last > 0 and step == last + 1:
            own = (torch.empty(k.shape, **f32), torch.empty(v.shape, **f32))
            recvs += [(own[0], (rank + last) % W), (own[1], (rank + last) % W)]
        pending = transport.start(sends, recvs)
        parts = []
        for call in (sched.calls[rank][(rank - step) % W] if step < W else ()):
            dq_c, dk_c, dv_c = block.backward(do, dlse, q, kv[0], kv[1], o, lse, call, params, backend)
            dq[:, call.q0:call.q1] += dq_c
            parts.append((call, dk_c, dv_c))
        pending.wait()
        carry = None
        if step < W and sched.holds(rank, step):
            carry = incoming if incoming is not None else (torch.zeros(k.shape, **f32), torch.zeros(v.shape, **f32))
            for call, dk_c, dv_c in parts:
                carry[0][:, call.k0:call.k1] += dk_c
                carry[1][:, call.k0:call.k1] += dv_c
        kv = new
    return dq.to(q.dtype), own[0].to(k.dtype), own[1].to(v.dtype)
