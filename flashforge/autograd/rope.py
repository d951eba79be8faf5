"""RoPE as `torch.library` custom ops.

`flashforge::rope` is functional; its gradient is the same op with the inverse
rotation, so nothing but the positions is saved.  `flashforge::rope_` rotates
in place and has no autograd: in-place calls that need a gradient run the
functional op and copy the result back (autograd differentiates the copy).
Both have fake implementations, so `torch.compile(fullgraph=True)` traces them.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch.autograd.graph import increment_version

from ..ops.backends import backend_module
from ..ops.rope_torch import RopeParams
from .dispatch import eager

def _rope_impl(x, pos, position_ids, theta, rotary_dim, interleaved, pos_base, inverse, backend, out=None):
    """The backend's rotation (into ``out`` when given: the in-place form, never inverse)."""
    params = RopeParams(theta=theta, rotary_dim=rotary_dim, interleaved=interleaved, pos_base=pos_base)
    if out is not None:
        return backend_module("rope", backend).rope(x, pos, position_ids, params, out=out)
    return backend_module("rope", backend).rope(x, pos, position_ids, params, inverse=inverse)


@torch.library.custom_op("flashforge::rope", mutates_args=())
def rope(x: torch.Tensor, pos: Optional[torch.Tensor], position_ids: Optional[torch.Tensor], theta: float,
         rotary_dim: int, interleaved: bool, pos_base: int, inverse: bool, backend: str) -> torch.Tensor:
    return _rope_impl(x, pos, position_ids, theta, rotary_dim, interleaved, pos_base, inverse, backend)


@rope.register_fake
def _(x, pos, position_ids, theta, rotary_dim, interleaved, pos_base, inverse, backend):
    return torch.empty_like(x)


@torch.library.custom_op("flashforge::rope_", mutates_args=("x",))
def rope_(x: torch.Tensor, pos: Optional[torch.Tensor], position_ids: Optional[torch.Tensor], theta: float,
          rotary_dim: int, interleaved: bool, pos_base: int, backend: str) -> None:
    _rope_impl(x, pos, position_ids, theta, rotary_dim, interleaved, pos_base, False, backend, out=x)


@rope_.register_fake
def _(x, pos, position_ids, theta, rotary_dim, interleaved, pos_base, backend):
    return None


def _setup_context(ctx, inputs, output):
    x, pos, position_ids = inputs[:3]
    ctx.save_for_backward(pos, position_ids)
    ctx.scalars = inputs[3:]


def _backward_with(rotate, ctx, dy):
    pos, position_ids = ctx.saved_tensors
    theta, rotary_dim, interleaved, pos_base, inverse, backend = ctx.scalars
    dx = rotate(dy.contiguous() if dy.stride(-1) != 1 else dy, pos, position_ids, theta, rotary_dim, interleaved,
                pos_base, not inverse, backend)
    return dx, None, None, None, None, None, None, None, None


def _backward(ctx, dy):
    return _backward_with(rope, ctx, dy)


rope.register_autograd(_backward, setup_context=_setup_context)


class _EagerRope(torch.autograd.Function):
    """The op's forward and backward without its dispatch (see `dispatch.eager`)."""

    @staticmethod
    def forward(ctx, x, pos, position_ids, *scalars):
        _setup_context(ctx, (x, pos, position_ids) + scalars, None)
        return _rope_impl(x, pos, position_ids, *scalars)

    @staticmethod
    def backward(ctx, dy):
        # the inverse rotation is linear in dy: differentiable again through this Function
        return _backward_with(_EagerRope.apply, ctx, dy)


def _eager_rope_(x, pos, position_ids, theta, rotary_dim, interleaved, pos_base, backend) -> None:
    _rope_impl(x, pos, position_ids, theta, rotary_dim, interleaved, pos_base, False, backend, out=x)
    increment_version(x)  # as the op's declared mutation would (a kernel write does not)


def rope_function(x: torch.Tensor, pos: Optional[torch.Tensor], position_ids: Optional[torch.Tensor],
                  params: RopeParams, backend: str, inplace: bool = False) -> torch.Tensor:
    """Differentiable RoPE on a validated ``x [B, S, H, D]``; ``pos`` int ``[B]`` or None,
    ``position_ids`` int ``[B, S]`` or None.  With ``inplace`` x is overwritten and returned."""
    args = (pos, position_ids, params.theta, params.rotary_dim, params.interleaved, params.pos_base)
    if eager(x, pos, position_ids):
        rotate, rotate_ = _EagerRope.apply, _eager_rope_
    else:
        rotate, rotate_ = torch.ops.flashforge.rope, torch.ops.flashforge.rope_
    if not inplace:
        return rotate(x, *args, False, backend)
    if torch.is_grad_enabled() and x.requires_grad:
        return x.copy_(rotate(x, *args, False, backend))
    rotate_(x, *args, backend)
    return x
