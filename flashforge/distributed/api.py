"""The public functions of `flashforge.distributed`: validation, then the ops."""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from ..api.attention import build_params, check_qkv_rank, unit_last_stride
from ..api.validate import check_int, check_tensor
from . import layout as lay
from . import ops

__all__ = ["context_parallel_attention", "shard_sequence", "unshard_sequence"]

STRATEGIES = ("ring", "allgather")


def _group(group) -> dist.ProcessGroup:
    if group is None:
        if not dist.is_initialized():
            raise ValueError("group=None means the default process group, but torch.distributed is not "
                             "initialized: call torch.distributed.init_process_group() first (torchrun sets "
                             "its environment), or pass group=")
        return dist.group.WORLD
    if isinstance(group, dist.ProcessGroup):
        return group
    if group is dist.GroupMember.NON_GROUP_MEMBER:
        raise ValueError("this process is not a member of the group it passed (torch.distributed.new_group "
                         "returns a placeholder on the ranks it leaves out)")
    raise TypeError(f"group must be None or a torch.distributed.ProcessGroup, got {type(group).__name__}")


def _dim(x: torch.Tensor, dim) -> int:
    check_int("dim", dim)
    if not -x.dim() <= dim < x.dim():
        raise ValueError(f"dim is {dim} but the tensor has {x.dim()} dims (shape {tuple(x.shape)})")
    return dim % x.dim()


def shard_sequence(x: torch.Tensor, group: Optional[dist.ProcessGroup] = None, layout: str = "zigzag",
                   dim: int = 1) -> torch.Tensor:
    """This rank's shard of the full tensor ``x`` (the same on every rank) along ``dim``; no communication.

    Args:
        x: any tensor, e.g. ``[B, S, H, D]`` or token ids ``[B, S]``; ``x.shape[dim] = S``.
        group: the ranks sharing the sequence; None is the default group.
        layout: ``"zigzag"``: of 2W equal chunks, rank r holds chunks r and 2W-1-r, in that order
            (causal load balance); ``"contiguous"``: of W equal chunks, rank r holds chunk r.
        dim: the sequence dim.

    Returns:
        ``S / W`` rows along ``dim``: a view of ``x`` (contiguous) or a new tensor (zigzag), in
        either case differentiable.  Global positions (for RoPE) are ``shard_sequence(torch.arange(S), group,
        layout, dim=0)``.

    Raises:
        ValueError: S not divisible by W (contiguous) or 2W (zigzag).
    """
    check_tensor("x", x)
    group = _group(group)
    lay.check_layout(layout)
    dim = _dim(x, dim)
    lay.check_divisible(f"x (dim {dim})", x.shape[dim], layout, group.size())
    return lay.shard(x, layout, group.rank(), group.size(), dim)


def unshard_sequence(x_local: torch.Tensor, group: Optional[dist.ProcessGroup] = None, layout: str = "zigzag",
                     dim: int = 1) -> torch.Tensor:
    """The inverse of `shard_sequence`: the full tensor, on every rank, from every rank's shard (an all-gather).

    Every rank of ``group`` calls it together with shards of one shape.  Differentiable: the
    gradient of a shard is the sum over the ranks of their gradients for its rows (a
    reduce-scatter, the adjoint of the all-gather), so a loss that every rank computes alike on
    the full tensor counts W times; divide it by W, or take the gradient of each rank's own rows.
    """
    check_tensor("x_local", x_local)
    group = _group(group)
    lay.check_layout(layout)
    dim = _dim(x_local, dim)
    if layout == "zigzag" and x_local.shape[dim] % 2:
        raise ValueError(f"x_local has {x_local.shape[dim]} rows along dim {dim}, an odd number: layout='zigzag' "
                         f"shards hold two equal chunks")
    return ops.cp_unshard(x_local, group.group_name, group.size(), layout, dim)


def context_parallel_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                               group: Optional[dist.ProcessGroup] = None, layout: str = "zigzag",
                               strategy: str = "ring", causal: bool = False, window=None, softcap: float = 0.0,
                               scale: Optional[float] = None, return_lse: bool = False, deterministic: bool = False):
    """Attention over a sequence sharded across the ranks of ``group``: this rank's shard of
    ``flashforge.attention`` of the full tensors.

    Every rank of the group calls it together, with its shards in ``layout`` (as `shard_sequence`
    cuts them).  The result, its lse and the gradients of q, k and v are this rank's shards of
    the single-process ones.

    Args:
        q: ``[B, S_local, Hq, D]``; k: ``[B, S_local, Hkv, D]``; v: ``[B, S_local, Hkv, Dv]``: this rank's
            rows of one sequence (self-attention; the same S_local on every rank), any strides (copied
            once if the last dim's is not 1). ``Hq % Hkv == 0`` (grouped-query attention).
        group: the ranks sharing the sequence; None is the default group.  A group of one is plain
            attention (no communication).
        layout: ``"zigzag"`` or ``"contiguous"`` (see `shard_sequence`); tells each chunk its global offset.
        strategy: ``"ring"``: K/V blocks travel around the ring with ``batch_isend_irecv``, each step's
            transfer overlapped with the previous block's attention, partial outputs merged through the
            lse, dK/dV sent around behind the blocks in the backward; blocks nobody needs are neither
            computed nor sent (causal, windows).  ``"allgather"``: all-gather K/V, attend locally,
            reduce-scatter dK/dV (float32) in the backward.
        causal: over global positions: global query i sees global keys j <= i.
        window: as in `flashforge.attention`, over global positions: None, int w (``|i - j| < w``) or
            ``(left, right)`` with -1 unbounded; with ``causal`` the right side is 0.
        softcap, scale: as in `flashforge.attention` (scale defaults to ``1/sqrt(D)``).
        return_lse: also return this rank's ``lse [B, Hq, S_local]`` (float32), differentiable.
        deterministic: deterministic per-block kernels; the ring sums in a fixed order, so its
            gradients are then bitwise reproducible.  ``"allgather"`` sums dK/dV in the reduce-scatter,
            in the order of the collective's implementation (fixed by NCCL for one topology and size).

    Returns:
        ``o [B, S_local, Hq, Dv]`` in q's dtype, or ``(o, lse)``.

    With more than one rank the call first checks, with one small all-gather read on the host (a
    device sync on CUDA), that every rank passed shards of one shape and dtype and the same
    options, and raises the same ValueError on every rank otherwise (mismatched rings would hang).
    """
    check_qkv_rank(q, k, v, (4,), "[B, S_local, H, D]")
    group = _group(group)
    lay.check_layout(layout)
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be 'ring' or 'allgather', got {strategy!r}")
    if not isinstance(return_lse, bool):
        raise TypeError(f"return_lse must be a bool, got {type(return_lse).__name__}")
    # the window is over global positions: W * S_local queries and as many keys
    params, _, backend = build_params(
        q, q.shape[0], 2 * group.size() * q.shape[1], causal=causal, causal_offset=0, window=window, dropout_p=0.0,
        seed=None, scale=scale,
        softcap=softcap, alibi_slopes=None, deterministic=deterministic, allow_tf32=False, backend=None)
    q, k, v = unit_last_stride(q, k, v)
    o, lse = ops.cp_attention_fwd(
        q, k, v, group.group_name, layout, strategy, params.scale, params.window_left, params.window_right,
        params.softcap, params.deterministic, backend)
    return (o, lse) if return_lse else o
