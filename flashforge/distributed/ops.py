"""Context-parallel attention and the sequence all-gather as `torch.library` custom ops.

Inside an op everything runs eagerly (the collectives, the ring's overlap, the per-block
kernels); from outside it is one node with a fake implementation and registered autograd, so
`torch.compile(fullgraph=True)` traces a model through it without a graph break, which
Dynamo could not do with ``batch_isend_irecv`` in the traced code.  The schema has no
ProcessGroup type: groups travel by name (``ProcessGroup.group_name``), as in PyTorch's
functional collectives.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ..api.attention import check_heads_and_dims
from ..ops.params import AttnParams
from . import comm, layout as lay
from .allgather import allgather_backward, allgather_forward
from .plan import schedule
from .ring import ring_backward, ring_forward


def _check_shapes(q: Tensor, k: Tensor, v: Tensor, layout: str) -> None:
    """The local shapes; called once every rank is known to have the same ones (so every rank
    raises alike)."""
    if not (k.shape[0] == v.shape[0] == q.shape[0]):
        raise ValueError(f"batch sizes differ: q has {q.shape[0]}, k has {k.shape[0]}, v has {v.shape[0]}")
    check_heads_and_dims(q, k, v)
    if k.shape[1] != q.shape[1]:
        raise ValueError(f"q has {q.shape[1]} rows per rank but k and v have {k.shape[1]}: context parallelism "
                         f"shards one sequence (self-attention), so every shard has the same length")
    if layout == "zigzag" and q.shape[1] % 2:
        raise ValueError(f"the shards have {q.shape[1]} rows, an odd number: layout='zigzag' holds two equal "
                         f"chunks per rank (use shard_sequence, which needs S divisible by 2W)")


def _params(scale, window_left, window_right, softcap, deterministic) -> AttnParams:
    return AttnParams(scale=scale, window_left=window_left, window_right=window_right, softcap=softcap,
                      deterministic=deterministic)


@torch.library.custom_op("flashforge::cp_attention_fwd", mutates_args=())
def cp_attention_fwd(q: Tensor, k: Tensor, v: Tensor, group_name: str, layout: str, strategy: str, scale: float,
                     window_left: int, window_right: int, softcap: float, deterministic: bool,
                     backend: str) -> tuple[Tensor, Tensor]:
    """(o, lse) of this rank's shards; every rank of the group calls it together."""
    group = comm.resolve_group(group_name)
    if group.size() > 1:
        options = (layout, strategy, scale, window_left, window_right, softcap, deterministic, backend)
        comm.check_same_call(q, k, v, options, group)
    _check_shapes(q, k, v, layout)
    params = _params(scale, window_left, window_right, softcap, deterministic)
    B, S, Hq, _ = q.shape
    if q.numel() == 0:  # every rank is empty alike: nothing to send
        return (q.new_zeros(B, S, Hq, v.shape[-1]),
                torch.full((B, Hq, S), float("-inf"), dtype=torch.float32, device=q.device))
    if strategy == "allgather":
        return allgather_forward(q, k, v, layout, params, backend, group)
    sched = schedule(layout, group.size(), S, window_left, window_right)
    return ring_forward(q, k.contiguous(), v.contiguous(), group.rank(), sched, params, backend, comm.P2P(group))


@cp_attention_fwd.register_fake
def _(q, k, v, *args):
    B, S, Hq, _ = q.shape
    return q.new_empty(B, S, Hq, v.shape[-1]), q.new_empty(B, Hq, S, dtype=torch.float32)


@torch.library.custom_op("flashforge::cp_attention_bwd", mutates_args=())
def cp_attention_bwd(do: Tensor, dlse: Optional[Tensor], q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor,
                     group_name: str, layout: str, strategy: str, scale: float, window_left: int, window_right: int,
                     softcap: float, deterministic: bool, backend: str) -> tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv) of this rank's shards."""
    if q.numel() == 0:
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    group = comm.resolve_group(group_name)
    params = _params(scale, window_left, window_right, softcap, deterministic)
    do = do.contiguous()
    if strategy == "allgather":
        return allgather_backward(do, dlse, q, k, v, o, lse, layout, params, backend, group)
    sched = schedule(layout, group.size(), q.shape[1], window_left, window_right)
    return ring_backward(do, dlse, q, k.contiguous(), v.contiguous(), o, lse, group.rank(), sched, params, backend,
                         comm.P2P(group))


@cp_attention_bwd.register_fake
def _(do, dlse, q, k, v, *args):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_attention(ctx, inputs, output):
    q, k, v = inputs[:3]
    ctx.save_for_backward(q, k, v, *output)
    ctx.scalars = inputs[3:]


def _attention_backward(ctx, do, dlse):
    q, k, v, o, lse = ctx.saved_tensors
    if do is None:
        do = torch.zeros_like(o)
    dq, dk, dv = cp_attention_bwd(do, dlse, q, k, v, o, lse, *ctx.scalars)
    return (dq, dk, dv) + (None,) * len(ctx.scalars)


cp_attention_fwd.register_autograd(_attention_backward, setup_context=_setup_attention)


@torch.library.custom_op("flashforge::cp_unshard", mutates_args=())
def cp_unshard(x: Tensor, group_name: str, world: int, layout: str, dim: int) -> Tensor:
    """The full tensor from every rank's shard ``x`` along ``dim``."""
    return lay.to_global(comm.all_gather(x, comm.resolve_group(group_name)), layout, world, dim)


@cp_unshard.register_fake
def _(x, group_name, world, layout, dim):
    shape = list(x.shape)
    shape[dim] *= world
    return x.new_empty(shape)


@torch.library.custom_op("flashforge::cp_unshard_bwd", mutates_args=())
def cp_unshard_bwd(grad: Tensor, group_name: str, world: int, layout: str, dim: int) -> Tensor:
    """The adjoint of the all-gather: every rank's gradient of the full tensor, summed, sharded."""
    full = lay.to_rank_order(grad, layout, world, dim)
    return comm.reduce_scatter(full, comm.resolve_group(group_name))


@cp_unshard_bwd.register_fake
def _(grad, group_name, world, layout, dim):
    shape = list(grad.shape)
    shape[dim] //= world
    return grad.new_empty(shape)


def _setup_unshard(ctx, inputs, output):
    ctx.scalars = inputs[1:]


def _unshard_backward(ctx, grad):
    return (cp_unshard_bwd(grad.contiguous(), *ctx.scalars),) + (None,) * len(ctx.scalars)


cp_unshard.register_autograd(_unshard_backward, setup_context=_setup_unshard)
