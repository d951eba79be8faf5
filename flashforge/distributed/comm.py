"""The collectives, all through torch.distributed (NCCL on GPUs, gloo on CPUs).

On CUDA, ProcessGroupNCCL runs every collective on its own stream, after the work already
queued on the current stream (an event wait, so the inputs are ready), and a returned work's
``wait()`` makes the current stream wait for it, without blocking the host.  The ring
relies on exactly that: it starts a step's exchange, queues the step's attention behind it
on the current stream, then waits, so transfer and compute overlap.
"""
from __future__ import annotations

import zlib
from typing import Sequence

import torch
import torch.distributed as dist
from torch import Tensor

# torch 2.13 renamed the tensor collectives (the old names warn); 2.11 has only the old ones
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def resolve_group(group_name: str) -> dist.ProcessGroup:
    """The group registered under ``group_name`` (the ops take groups by name: their schema has no
    ProcessGroup type)."""
    return dist.distributed_c10d._resolve_process_group(group_name)


def all_gather(x: Tensor, group: dist.ProcessGroup) -> Tensor:
    """``[W, *x.shape]``: every rank's ``x``, in rank order."""
    # the output is the shards concatenated along dim 0 (gloo checks that shape exactly)
    out = x.new_empty(group.size() * x.shape[0], *x.shape[1:])
    _all_gather(out, x.contiguous(), group=group)
    return out.view(group.size(), *x.shape)


def reduce_scatter(x: Tensor, group: dist.ProcessGroup) -> Tensor:
    """``x [W, *shape]`` summed over the ranks; this rank gets its ``[*shape]`` row."""
    out = x.new_empty(x.shape[1:])
    _reduce_scatter(out, x.flatten(0, 1).contiguous(), group=group)
    return out


class Pending:
    def __init__(self, works: Sequence):
        self._works = works

    def wait(self) -> None:
        for w in self._works:
            w.wait()


class P2P:
    """The ring's transport: each `start` is one ``batch_isend_irecv`` of its sends and receives
    (``(tensor, group rank)`` pairs; sends and receives between two ranks pair up in order)."""

    def __init__(self, group: dist.ProcessGroup):
        self.group = group
        self._global = [dist.get_global_rank(group, r) for r in range(group.size())]

    def start(self, sends: Sequence[tuple[Tensor, int]], recvs: Sequence[tuple[Tensor, int]]) -> Pending:
        ops = [dist.P2POp(dist.isend, t, self._global[p], self.group) for t, p in sends]
        ops += [dist.P2POp(dist.irecv, t, self._global[p], self.group) for t, p in recvs]
        return Pending(dist.batch_isend_irecv(ops) if ops else ())


_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def check_same_call(q: Tensor, k: Tensor, v: Tensor, options: tuple, group: dist.ProcessGroup) -> None:
    """Raise the same ValueError on every rank unless all ranks pass shards of one shape and
    dtype and the same options: otherwise their rings would not pair up (a hang or garbage).

    One all-gather of a few integers, read on the host (a device sync on CUDA)."""
    crc = zlib.crc32(repr(options).encode())
    mine = [*q.shape, *k.shape, *v.shape, _DTYPES.index(q.dtype), crc]
    table = all_gather(torch.tensor(mine, dtype=torch.int64, device=q.device), group).tolist()
    if all(row == table[0] for row in table):
        return

    def describe(row):
        dtype = _DTYPES[row[12]]
        return f"q {row[0:4]}, k {row[4:8]}, v {row[8:12]} {str(dtype).replace('torch.', '')}"

    if any(row[:13] != table[0][:13] for row in table):
        ranks = "; ".join(f"rank {r}: {describe(row)}" for r, row in enumerate(table))
        raise ValueError(f"context_parallel_attention: the ranks of the group passed shards of different shapes "
                         f"or dtypes ({ranks}); every rank must pass its shard [B, S_local, H, D] of the same "
                         f"full tensors")
    differ = [r for r, row in enumerate(table) if row[13] != table[0][13]]
    raise ValueError(f"context_parallel_attention: ranks {differ} were called with other options than rank 0 "
                     f"(causal, window, softcap, scale, layout, strategy, deterministic must be the same on "
                     f"every rank); this rank has {options}")
