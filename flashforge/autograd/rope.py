"""Autograd for RoPE: the backward is the inverse rotation of the gradient, so
nothing but the positions is saved, and the in-place form can be differentiated
(the input is marked dirty; its old values are never needed)."""
from __future__ import annotations

import importlib
from typing import Optional

import torch

from ..ops.rope_torch import RopeParams

_BACKENDS = {"torch": "flashforge.ops.rope_torch", "triton": "flashforge.ops.triton.rope"}


def _backend(name: str):
    try:
        return importlib.import_module(_BACKENDS[name])
    except ImportError as e:  # triton missing (e.g. macOS, Windows)
        raise ValueError(f"backend={name!r} is not available here: {e}") from e


class _Rope(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, pos, position_ids, params: RopeParams, backend: str, inplace: bool):
        y = _backend(backend).rope(x, pos, position_ids, params, out=x if inplace else None)
        if inplace:
            ctx.mark_dirty(x)
        ctx.save_for_backward(pos, position_ids)
        ctx.params, ctx.backend = params, backend
        return y

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        pos, position_ids = ctx.saved_tensors
        dx = _backend(ctx.backend).rope(dy, pos, position_ids, ctx.params, inverse=True)
        return dx, None, None, None, None, None


def rope_function(x: torch.Tensor, pos: Optional[torch.Tensor], position_ids: Optional[torch.Tensor],
                  params: RopeParams, backend: str, inplace: bool = False) -> torch.Tensor:
    """Differentiable RoPE on a validated ``x [B, S, H, D]``; ``pos`` int ``[B]`` or None,
    ``position_ids`` int ``[B, S]`` or None.  With ``inplace`` x is overwritten and returned."""
    return _Rope.apply(x, pos, position_ids, params, backend, inplace)
