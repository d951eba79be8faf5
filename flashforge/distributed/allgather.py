"""All-gather attention (the Llama 3 recipe): gather the full K/V on every rank, attend locally.

Each query segment of the shard makes one call against the keys it can see (all of them,
or the window's span around its global positions), so there is nothing to merge.  The
backward gathers K/V again rather than keeping the gathered copies from the forward (they
are W times the shard: the memory context parallelism is there to save) and reduce-scatters
dK/dV, summed in float32, back to the ranks that own them.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor

from ..ops.params import AttnParams
from . import block, comm, layout as lay
from .plan import Call, plan


def _calls(layout: str, rank: int, world: int, local_len: int, left: int, right: int) -> list[Call]:
    """One call per query segment, against the span of global keys [lo, hi) visible from it."""
    total = world * local_len
    calls = []
    for seg in lay.segments(layout, rank, world, local_len):
        lo = 0 if left < 0 else max(0, seg.start - left)
        hi = total if right < 0 else min(total, seg.start + seg.length + right)
        calls += plan((seg,), (lay.Segment(lo, hi - lo, lo),), left, right)
    return calls


def _gather_kv(k: Tensor, v: Tensor, layout: str, group: dist.ProcessGroup) -> tuple[Tensor, Tensor]:
    W = group.size()
    return tuple(lay.to_global(comm.all_gather(t, group), layout, W, 1) for t in (k, v))


def allgather_forward(q: Tensor, k: Tensor, v: Tensor, layout: str, params: AttnParams, backend: str,
                      group: dist.ProcessGroup) -> tuple[Tensor, Tensor]:
    """This rank's ``o [B, S, Hq, Dv]`` and ``lse [B, Hq, S]`` (float32)."""
    K, V = _gather_kv(k, v, layout, group)
    B, S, Hq, _ = q.shape
    o = torch.empty(B, S, Hq, v.shape[-1], dtype=q.dtype, device=q.device)
    lse = torch.empty(B, Hq, S, dtype=torch.float32, device=q.device)
    # every row sees at least the key at its own position, so the calls cover every row
    for call in _calls(layout, group.rank(), group.size(), S, params.window_left, params.window_right):
        o[:, call.q0:call.q1], lse[:, :, call.q0:call.q1] = block.forward(q, K, V, call, params, backend)
    return o, lse


def allgather_backward(do: Tensor, dlse: Optional[Tensor], q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor,
                       layout: str, params: AttnParams, backend: str,
                       group: dist.ProcessGroup) -> tuple[Tensor, Tensor, Tensor]:
    K, V = _gather_kv(k, v, layout, group)
    W = group.size()
    dq = torch.empty_like(q)
    dK = torch.zeros(K.shape, dtype=torch.float32, device=q.device)
    dV = torch.zeros(V.shape, dtype=torch.float32, device=q.device)
    for call in _calls(layout, group.rank(), W, q.shape[1], params.window_left, params.window_right):
        dq[:, call.q0:call.q1], dk_c, dv_c = block.backward(do, dlse, q, K, V, o, lse, call, params, backend)
        dK[:, call.k0:call.k1] += dk_c
        dV[:, call.k0:call.k1] += dv_c
    dk, dv = (comm.reduce_scatter(lay.to_rank_order(g, layout, W, 1), group) for g in (dK, dV))
    return dq, dk.to(k.dtype), dv.to(v.dtype)
