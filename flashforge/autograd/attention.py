"""Autograd for attention: forward saves (q, k, v, mask, o, lse); backward
recomputes P from lse (SPEC section 3) in the chosen backend."""
from __future__ import annotations

import importlib
from typing import Optional

import torch

from ..ops.params import AttnParams

_BACKENDS = {"torch": "flashforge.ops.attention_torch", "triton": "flashforge.ops.triton.attention"}


def _backend(name: str):
    try:
        return importlib.import_module(_BACKENDS[name])
    except ImportError as e:  # triton missing (e.g. macOS, Windows)
        raise ValueError(f"backend={name!r} is not available here: {e}") from e


def _empty_result(q, v, params: AttnParams):
    B, Sq, Hq, _ = q.shape
    o = torch.zeros(B, Sq, Hq, v.shape[-1], dtype=q.dtype, device=q.device)
    lse_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32  # as the backends give it
    lse = torch.full((B, Hq, Sq), float("-inf"), dtype=lse_dtype, device=q.device)
    return o, lse


class _Attention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, mask, params: AttnParams, backend: str):
        if q.numel() == 0 or k.shape[1] == 0:
            o, lse = _empty_result(q, v, params)
        else:
            o, lse = _backend(backend).attention_forward(q, k, v, mask, params)
        ctx.save_for_backward(q, k, v, mask, o, lse)
        ctx.params, ctx.backend = params, backend
        ctx.set_materialize_grads(False)
        return o, lse

    @staticmethod
    def backward(ctx, do: Optional[torch.Tensor], dlse: Optional[torch.Tensor]):
        q, k, v, mask, o, lse = ctx.saved_tensors
        need_dmask = mask is not None and ctx.needs_input_grad[3]
        if (do is None and dlse is None) or q.numel() == 0 or k.shape[1] == 0:
            dmask = torch.zeros_like(mask) if need_dmask else None
            return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v), dmask, None, None
        if do is None:
            do = torch.zeros_like(o)
        elif do.stride(-1) != 1:
            do = do.contiguous()
        if dlse is not None:
            dlse = dlse.to(lse.dtype).contiguous()
        dq, dk, dv, dmask = _backend(ctx.backend).attention_backward(
            do, dlse, q, k, v, mask, o, lse, ctx.params, need_dmask)
        if dmask is not None:
            dmask = dmask.to(mask.dtype)
        return dq, dk, dv, dmask, None, None


def attention_function(q, k, v, mask, params: AttnParams, backend: str):
    """Differentiable attention on validated BSHD tensors; returns (o, lse)."""
    return _Attention.apply(q, k, v, mask, params, backend)
