"""The plain PyTorch meaning of every flashforge op.

These functions materialise the full ``[B, H, Sq, Sk]`` score matrix, so they
are only for tests, documentation and small inputs.  They are differentiable
through ordinary autograd; tests call them on float64 copies of the inputs.
Arguments mean exactly what they mean in `flashforge.attention`
(see SPEC.md section 2), in the 4-D BSHD layout only.
"""
from __future__ import annotations

import math
from typing import Optional, Union

import torch

from .ops.dropout import dropout_mask

__all__ = ["attention", "visible", "apply_rope", "dropout_mask"]


def visible(Sq: int, Sk: int, causal: bool, causal_offset, window, B: int = 1,
            device=None) -> torch.Tensor:
    """Bool ``[B, 1, Sq, Sk]``: key j visible from query i (causal and window rules)."""
    if isinstance(causal_offset, torch.Tensor):
        off = causal_offset.to(device=device, dtype=torch.int64).view(-1, 1, 1, 1)
    else:
        off = torch.full((1, 1, 1, 1), int(causal_offset), dtype=torch.int64, device=device)
    i = torch.arange(Sq, device=device).view(1, 1, Sq, 1) + off  # absolute query position
    j = torch.arange(Sk, device=device).view(1, 1, 1, Sk)
    vis = torch.ones(off.shape[0], 1, Sq, Sk, dtype=torch.bool, device=device)
    if window is not None:
        if isinstance(window, int):
            left = right = window - 1
        else:
            left, right = window
        if left >= 0:
            vis = vis & (j >= i - left)
        if right >= 0:
            vis = vis & (j <= i + right)
    if causal:
        vis = vis & (j <= i)
    return vis.expand(max(B, off.shape[0]), 1, Sq, Sk)


def attention(q, k, v, *, causal=False, causal_offset: Union[int, torch.Tensor] = 0,
              window=None, mask: Optional[torch.Tensor] = None, dropout_p: float = 0.0,
              seed: int = 0, scale: Optional[float] = None, softcap: float = 0.0,
              alibi_slopes: Optional[torch.Tensor] = None, return_lse: bool = False):
    """Reference attention. q ``[B, Sq, Hq, D]``, k ``[B, Sk, Hkv, D]``,
    v ``[B, Sk, Hkv, Dv]`` -> o ``[B, Sq, Hq, Dv]`` (and lse ``[B, Hq, Sq]``)."""
    B, Sq, Hq, D = q.shape
    Sk, Hkv = k.shape[1], k.shape[2]
    if isinstance(causal_offset, str):  # "bottom_right": the queries are the last Sq of Sk positions
        causal_offset = Sk - Sq
    if Sk == 0:  # nothing to attend to: o = 0, lse = -inf (kept on the autograd graph, zero gradients)
        zero = 0.0 * (q.sum() + k.sum() + v.sum())
        o = q.new_zeros(B, Sq, Hq, v.shape[-1]) + zero
        lse = torch.full((B, Hq, Sq), float("-inf"), dtype=q.dtype, device=q.device) + zero
        return (o, lse.float() if q.dtype != torch.float64 else lse) if return_lse else o
    g = Hq // Hkv
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    qh = q.transpose(1, 2)  # [B, Hq, Sq, D]
    kh = k.transpose(1, 2).repeat_interleave(g, dim=1)  # [B, Hq, Sk, D]
    vh = v.transpose(1, 2).repeat_interleave(g, dim=1)
    s = scale * (qh @ kh.transpose(-1, -2))  # [B, Hq, Sq, Sk]
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    neg_inf = torch.tensor(float("-inf"), dtype=s.dtype, device=s.device)
    if alibi_slopes is not None:
        if isinstance(causal_offset, torch.Tensor):
            off = causal_offset.to(device=q.device, dtype=s.dtype).view(-1, 1, 1, 1)
        else:
            off = float(causal_offset)
        i = torch.arange(Sq, device=q.device, dtype=s.dtype).view(1, 1, Sq, 1)
        j = torch.arange(Sk, device=q.device, dtype=s.dtype).view(1, 1, 1, Sk)
        slopes = alibi_slopes.to(s.dtype).reshape(-1, Hq, 1, 1)  # [1 or B, Hq, 1, 1]
        s = s - slopes * (i + off - j).abs()
    if mask is not None:
        if mask.dtype == torch.bool:
            s = torch.where(mask, s, neg_inf)
        else:
            s = s + mask.to(s.dtype)
    vis = visible(Sq, Sk, causal, causal_offset, window, B, device=q.device)
    s = torch.where(vis, s, neg_inf)
    m = s.amax(dim=-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m)).detach()
    e = torch.exp(s - m)
    l = e.sum(dim=-1, keepdim=True)
    l_safe = torch.where(l > 0, l, torch.ones_like(l))  # fully masked rows: p = 0, lse = -inf
    p = e / l_safe
    lse = torch.where(l > 0, m + torch.log(l_safe), neg_inf).squeeze(-1)
    if dropout_p > 0:
        keep = dropout_mask(seed, B, Hq, Sq, Sk, dropout_p, device=q.device)
        p = torch.where(keep, p / (1.0 - dropout_p), torch.zeros_like(p))
    o = (p @ vh).transpose(1, 2).to(q.dtype)
    if return_lse:
        return o, lse.float() if q.dtype != torch.float64 else lse
    return o


def apply_rope(x, pos=0, theta: float = 10000.0, style: str = "half",
               rotary_dim: Optional[int] = None, position_ids: Optional[torch.Tensor] = None):
    """Reference rotary embedding on ``[B, S, H, D]``: token s of batch b sits at
    ``pos + s`` (``pos`` int or ``[B]``) or at ``position_ids[b, s]``."""
    B, S, H, D = x.shape
    rd = D if rotary_dim is None else rotary_dim
    if position_ids is not None:
        p = position_ids.to(torch.float64).view(B, S)
    else:
        if isinstance(pos, torch.Tensor):
            base = pos.to(torch.float64).view(-1, 1)
        else:  # float64: a float32 tensor would round positions past 2**24
            base = torch.tensor([[float(pos)]], dtype=torch.float64)
        p = base.to(x.device) + torch.arange(S, dtype=torch.float64, device=x.device).view(1, S)
        p = p.expand(B, S)
    inv = theta ** (-torch.arange(0, rd, 2, dtype=torch.float64, device=x.device) / rd)  # [rd/2]
    ang = p[..., None] * inv  # [B, S, rd/2]
    cos, sin = torch.cos(ang)[:, :, None, :], torch.sin(ang)[:, :, None, :]
    xr, xp = x[..., :rd].to(torch.float64), x[..., rd:]
    if style == "half":
        x1, x2 = xr[..., : rd // 2], xr[..., rd // 2:]
        out = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    else:
        x1, x2 = xr[..., 0::2], xr[..., 1::2]
        out = torch.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).flatten(-2)
    return torch.cat([out.to(x.dtype), xp], dim=-1)
