"""Rotary position embedding (RoPE), the PyTorch path.

On ``x [B, S, H, D]`` the first ``rotary_dim`` dims of every head are rotated in
pairs; pair k turns by ``position * theta ** (-2k / rotary_dim)``:

* ``interleaved=False`` ("half", rotate-half, Llama/NeoX): pairs ``(k, k + rotary_dim/2)``;
* ``interleaved=True`` (GPT-J): pairs ``(2k, 2k + 1)``.

``(a, b) -> (a cos - b sin, b cos + a sin)``; the inverse (the backward) turns by
``-angle``.  Dims ``rotary_dim..D`` pass through unchanged.

Angles are formed in float64 (positions up to 2**31 keep ~1e-7 rad), the
rotation itself in float32 (float64 for float64 inputs), and the result is
rounded once to x's dtype.  `flashforge.ops.triton.rope` is the Triton twin.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

__all__ = ["RopeParams", "positions", "rope"]


@dataclass(frozen=True)
class RopeParams:
    """One validated RoPE call.  Positions are ``pos_base + s`` unless the caller passes
    a per-batch ``pos`` tensor ``[B]`` (then ``pos[b] + s``) or ``position_ids [B, S]``."""
    theta: float
    rotary_dim: int  # even, 2 <= rotary_dim <= D
    interleaved: bool = False
    pos_base: int = 0


def positions(B: int, S: int, params: RopeParams, pos: Optional[torch.Tensor],
              position_ids: Optional[torch.Tensor], device) -> torch.Tensor:
    """int64 ``[B, S]`` (or ``[1, S]``, broadcasting over the batch) absolute positions."""
    if position_ids is not None:
        return position_ids.to(torch.int64)
    s = torch.arange(S, dtype=torch.int64, device=device)
    if pos is not None:
        return pos.to(torch.int64).view(B, 1) + s
    return (s + params.pos_base).view(1, S)


def rope(x: torch.Tensor, pos: Optional[torch.Tensor], position_ids: Optional[torch.Tensor],
         params: RopeParams, *, inverse: bool = False, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Rotate ``x [B, S, H, D]`` (any strides) into ``out`` (a new tensor if None; may be x).

    ``pos``: None or int tensor ``[B]``; ``position_ids``: None or int tensor ``[B, S]``.
    """
    B, S, H, D = x.shape
    if out is None:
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if x.numel() == 0:
        return out
    rd, half = params.rotary_dim, params.rotary_dim // 2
    cdt = torch.float64 if x.dtype == torch.float64 else torch.float32
    p = positions(B, S, params, pos, position_ids, x.device)  # [B|1, S]
    inv_freq = params.theta ** (-torch.arange(0, rd, 2, dtype=torch.float64, device=x.device) / rd)
    ang = p.to(torch.float64)[..., None] * inv_freq  # [B|1, S, rd/2]
    cos = torch.cos(ang).to(cdt)[:, :, None, :]  # [B|1, S, 1, rd/2]
    sin = torch.sin(ang).to(cdt)[:, :, None, :]
    if inverse:
        sin = -sin
    first = (slice(None),) * 3 + ((slice(0, rd, 2),) if params.interleaved else (slice(0, half),))
    second = (slice(None),) * 3 + ((slice(1, rd, 2),) if params.interleaved else (slice(half, rd),))
    x1, x2 = x[first].to(cdt), x[second].to(cdt)
    # both halves are computed before either is written: out may be x
    y1 = x1 * cos - x2 * sin
    y2 = x2 * cos + x1 * sin
    out[first].copy_(y1)
    out[second].copy_(y2)
    if out is not x and rd < D:
        out[..., rd:].copy_(x[..., rd:])
    return out
