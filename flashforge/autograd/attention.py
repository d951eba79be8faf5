"""Attention as `torch.library` custom ops with registered autograd.

`flashforge::attention_fwd` returns (o, lse); its backward is the op
`flashforge::attention_bwd`, which recomputes P from lse (SPEC section 3).
Both have fake (meta) implementations, so `torch.compile(fullgraph=True)`
traces them without graph breaks and with symbolic sequence lengths.  The
ops take only tensors and scalars: `AttnParams` is flattened into the
schema here and rebuilt inside.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Optional

import torch

from ..ops.backends import backend_module
from ..ops.params import AttnParams
from .dispatch import eager

def _lse_dtype(q: torch.Tensor) -> torch.dtype:
    return torch.float64 if q.dtype == torch.float64 else torch.float32


def _params(offset_tensor, alibi_slopes, seed_tensor, cu_seqlens_q, cu_seqlens_k, scale, window_left,
            window_right, offset, offset_bottom_right, softcap, dropout_p, seed, deterministic, allow_tf32,
            max_seqlen_q, max_seqlen_k) -> AttnParams:
    return AttnParams(scale=scale, window_left=window_left, window_right=window_right, offset=offset,
                      offset_tensor=offset_tensor, offset_bottom_right=offset_bottom_right, softcap=softcap,
                      alibi_slopes=alibi_slopes, dropout_p=dropout_p, seed=seed, seed_tensor=seed_tensor,
                      deterministic=deterministic,
                      allow_tf32=allow_tf32, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                      max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k)


def _forward_params(q, k, v, mask, params: AttnParams, backend: str, need_lo: bool = True):
    """(o, lse, lse_lo).  lse_lo (only with ``need_lo``, else None) is the part of the
    log-sum-exp that float32 lse cannot hold, which the backward adds back (see
    `flashforge.ops.params` "Log-sum-exp for the backward"); the backends write every element."""
    B, Sq, Hq, _ = q.shape
    lse_lo = torch.empty(B, Hq, Sq, dtype=_lse_dtype(q), device=q.device) if need_lo else None
    if q.numel() == 0 or k.shape[1] == 0:
        o = torch.zeros(B, Sq, Hq, v.shape[-1], dtype=q.dtype, device=q.device)
        if lse_lo is not None:
            lse_lo.zero_()
        return o, torch.full((B, Hq, Sq), float("-inf"), dtype=_lse_dtype(q), device=q.device), lse_lo
    o, lse = backend_module("attention", backend).attention_forward(q, k, v, mask, params, lse_lo=lse_lo)
    return o, lse, lse_lo


def _forward_impl(q, k, v, mask, offset_tensor, alibi_slopes, seed_tensor, cu_seqlens_q, cu_seqlens_k, scale,
                  window_left, window_right, offset, offset_bottom_right, softcap, dropout_p, seed, deterministic,
                  allow_tf32, max_seqlen_q, max_seqlen_k, backend):
    params = _params(offset_tensor, alibi_slopes, seed_tensor, cu_seqlens_q, cu_seqlens_k, scale, window_left,
                     window_right, offset, offset_bottom_right, softcap, dropout_p, seed, deterministic,
                     allow_tf32, max_seqlen_q, max_seqlen_k)
    return _forward_params(q, k, v, mask, params, backend)


@torch.library.custom_op("flashforge::attention_fwd", mutates_args=())
def attention_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor],
                  offset_tensor: Optional[torch.Tensor], alibi_slopes: Optional[torch.Tensor],
                  seed_tensor: Optional[torch.Tensor], cu_seqlens_q: Optional[torch.Tensor],
                  cu_seqlens_k: Optional[torch.Tensor], scale: float, window_left: int, window_right: int,
                  offset: int, offset_bottom_right: bool, softcap: float, dropout_p: float, seed: int,
                  deterministic: bool, allow_tf32: bool, max_seqlen_q: int, max_seqlen_k: int,
                  backend: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(o, lse, lse_lo); lse_lo is not differentiable (it only serves the backward)."""
    return _forward_impl(q, k, v, mask, offset_tensor, alibi_slopes, seed_tensor, cu_seqlens_q, cu_seqlens_k, scale,
                         window_left, window_right, offset, offset_bottom_right, softcap, dropout_p, seed,
                         deterministic, allow_tf32, max_seqlen_q, max_seqlen_k, backend)


@attention_fwd.register_fake
def _(q, k, v, mask, *args):
    B, Sq, Hq, _ = q.shape
    o = q.new_empty(B, Sq, Hq, v.shape[-1])
    return o, q.new_empty(B, Hq, Sq, dtype=_lse_dtype(q)), q.new_empty(B, Hq, Sq, dtype=_lse_dtype(q))


def _backward_params(do, dlse, q, k, v, mask, o, lse, lse_lo, params: AttnParams, backend: str,
                     need_dmask: bool):
    """(dq, dk, dv, dmask); dmask is float32 of the mask's shape, or empty when not asked for."""
    if q.numel() == 0 or k.shape[1] == 0:
        dmask = torch.zeros(mask.shape, dtype=torch.float32, device=q.device) if need_dmask else q.new_empty(0)
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v), dmask
    if do.stride(-1) != 1:
        do = do.contiguous()
    dq, dk, dv, dmask = backend_module("attention", backend).attention_backward(
        do, dlse, q, k, v, mask, o, lse, params, need_dmask, lse_lo=lse_lo)
    # outputs of a custom op may not alias its inputs or each other
    return dq, dk, dv, (dmask.float() if dmask is not None else q.new_empty(0))


def _backward_impl(do, dlse, q, k, v, mask, o, lse, lse_lo, offset_tensor, alibi_slopes, seed_tensor, cu_seqlens_q,
                   cu_seqlens_k, scale, window_left, window_right, offset, offset_bottom_right, softcap, dropout_p,
                   seed, deterministic, allow_tf32, max_seqlen_q, max_seqlen_k, backend, need_dmask):
    params = _params(offset_tensor, alibi_slopes, seed_tensor, cu_seqlens_q, cu_seqlens_k, scale, window_left,
                     window_right, offset, offset_bottom_right, softcap, dropout_p, seed, deterministic,
                     allow_tf32, max_seqlen_q, max_seqlen_k)
    return _backward_params(do, dlse, q, k, v, mask, o, lse, lse_lo, params, backend, need_dmask)


@torch.library.custom_op("flashforge::attention_bwd", mutates_args=())
def attention_bwd(do: torch.Tensor, dlse: Optional[torch.Tensor], q: torch.Tensor, k: torch.Tensor,
                  v: torch.Tensor, mask: Optional[torch.Tensor], o: torch.Tensor, lse: torch.Tensor,
                  lse_lo: torch.Tensor, offset_tensor: Optional[torch.Tensor],
                  alibi_slopes: Optional[torch.Tensor],
                  seed_tensor: Optional[torch.Tensor], cu_seqlens_q: Optional[torch.Tensor],
                  cu_seqlens_k: Optional[torch.Tensor], scale: float, window_left: int, window_right: int,
                  offset: int, offset_bottom_right: bool, softcap: float, dropout_p: float, seed: int,
                  deterministic: bool, allow_tf32: bool, max_seqlen_q: int, max_seqlen_k: int, backend: str,
                  need_dmask: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv, dmask); dmask is float32 of the mask's shape, or empty when not asked for."""
    return _backward_impl(do, dlse, q, k, v, mask, o, lse, lse_lo, offset_tensor, alibi_slopes, seed_tensor,
                          cu_seqlens_q, cu_seqlens_k, scale, window_left, window_right, offset, offset_bottom_right, softcap,
                          dropout_p, seed, deterministic, allow_tf32, max_seqlen_q, max_seqlen_k, backend,
                          need_dmask)


@attention_bwd.register_fake
def _(do, dlse, q, k, v, mask, o, lse, lse_lo, *args):
    need_dmask = args[-1]
    dmask = q.new_empty(mask.shape, dtype=torch.float32) if need_dmask else q.new_empty(0)
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), dmask


_N_TENSORS = 9  # q, k, v, mask, offset_tensor, alibi_slopes, seed_tensor, cu_seqlens_q, cu_seqlens_k


def _setup_context(ctx, inputs, output):
    o, lse, lse_lo = output
    ctx.save_for_backward(*inputs[:4], o, lse, lse_lo, *inputs[4:_N_TENSORS])
    ctx.scalars = inputs[_N_TENSORS:]


def _grad_inputs(o, lse, do, dlse):
    """The incoming gradients as the backward takes them: a zero dO where o was unused, dlse
    in lse's dtype and contiguous."""
    if do is None:
        do = torch.zeros_like(o)
    if dlse is not None:
        dlse = dlse.to(lse.dtype).contiguous()
    return do, dlse


def _backward(ctx, do, dlse, _dlse_lo):
    q, k, v, mask, o, lse, lse_lo, *aux = ctx.saved_tensors
    need_dmask = mask is not None and ctx.needs_input_grad[3]
    do, dlse = _grad_inputs(o, lse, do, dlse)
    dq, dk, dv, dmask = attention_bwd(do, dlse, q, k, v, mask, o, lse, lse_lo, *aux, *ctx.scalars, need_dmask)
    return (dq, dk, dv, dmask.to(mask.dtype) if need_dmask else None) + (None,) * (
        _N_TENSORS - 4 + len(ctx.scalars))


attention_fwd.register_autograd(_backward, setup_context=_setup_context)


class _EagerAttention(torch.autograd.Function):
    """The same forward and backward as the ops, without their dispatch (see `dispatch.eager`).
    It takes the AttnParams object whole rather than the ops' 22 flattened arguments: each
    argument of `Function.apply` and each returned gradient costs host time, which the grid's
    short training steps (S = 1k) spend instead of GPU time.  The params' tensors (offsets,
    slopes, cu_seqlens, seed) are not differentiable and ride along on ctx."""

    @staticmethod
    def forward(ctx, q, k, v, mask, params, backend):
        # an unused output (lse, mostly) arrives as None rather than as a zero tensor: no
        # allocation, fill and read of a dlse that changes nothing
        ctx.set_materialize_grads(False)
        o, lse, lse_lo = _forward_params(q, k, v, mask, params, backend)
        ctx.save_for_backward(q, k, v, mask, o, lse, lse_lo)
        ctx.params, ctx.backend = params, backend
        return o, lse

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, do, dlse):
        q, k, v, mask, o, lse, lse_lo = ctx.saved_tensors
        need_dmask = mask is not None and ctx.needs_input_grad[3]
        do, dlse = _grad_inputs(o, lse, do, dlse)
        dq, dk, dv, dmask = _backward_params(do, dlse, q, k, v, mask, o, lse, lse_lo, ctx.params, ctx.backend,
                                             need_dmask)
        return dq, dk, dv, dmask.to(mask.dtype) if need_dmask else None, None, None


def attention_function(q, k, v, mask, params: AttnParams, backend: str, seed_tensor: Optional[torch.Tensor] = None):
    """Differentiable attention on validated BSHD tensors; returns (o, lse).

    ``seed_tensor`` (an int64 scalar on q's device) replaces ``params.seed`` when
    given: the public layer draws unseeded dropout seeds as a tensor so that no
    value is read on the host (tracing, CUDA graphs).
    """
    p = params
    args = (q, k, v, mask, p.offset_tensor, p.alibi_slopes, seed_tensor, p.cu_seqlens_q, p.cu_seqlens_k, p.scale,
            p.window_left, p.window_right, p.offset, p.offset_bottom_right, p.softcap, p.dropout_p, p.seed,
            p.deterministic, p.allow_tf32, p.max_seqlen_q, p.max_seqlen_k, backend)
    if not eager(*args[:_N_TENSORS]):
        o, lse, _ = torch.ops.flashforge.attention_fwd(*args)
        return o, lse
    if seed_tensor is not None or p.seed_tensor is not None:  # as the ops' flattened arguments carry it
        p = replace(p, seed_tensor=seed_tensor)
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad
                                    or (mask is not None and mask.requires_grad)):
        return _EagerAttention.apply(q, k, v, mask, p, backend)
    return _forward_params(q, k, v, mask, p, backend, need_lo=False)[:2]
