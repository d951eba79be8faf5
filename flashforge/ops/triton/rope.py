"""Rotary position embedding (RoPE), the Triton twin of `flashforge.ops.rope_torch`.

Angles without float32 cancellation.  ``pos * inv_freq`` formed in float32 (as
Hugging Face does) is off by up to ~0.06 rad at position 1e6.  Here each
frequency is stored once, on the host, as a 64-bit fixed-point fraction of a
turn, ``T_k = (inv_freq_k / 2pi) * 2**64`` (`rope_turns`); in the kernel the
integer product ``pos * T_k`` wraps modulo 2**64, which is exactly the range
reduction ``angle mod 2pi``, and its top 32 bits (signed) are the angle in
``[-pi, pi)`` to ~2e-7 rad for any int64 position.

The jitted helpers (`rope_turn_index`, `rope_partner`, `rope_cos_sin`,
`rope_rotate`) work on any ``[BM, BD]`` tile whose rows carry their own
position, so an attention kernel can rotate q/k tiles in place of a separate
pass: load the tile at ``offs_d`` and again at ``rope_partner(offs_d)``.
"""
from __future__ import annotations

import functools
import math
from typing import Optional

import torch
import triton
import triton.language as tl

from ..rope_torch import RopeParams

__all__ = ["rope", "rope_turns", "rope_cos_sin", "rope_partner", "rope_rotate", "rope_kernel"]

# 2 pi / 2**32: from the top 32 bits of a 64-bit turn fraction to radians
_RAD_PER_UNIT = tl.constexpr(2.0 * math.pi / 2.0**32)
# rows x padded head dim per program
_TILE_ELEMS = 4096


@triton.jit
def rope_partner(offs_d, ROTARY_DIM: tl.constexpr, INTERLEAVED: tl.constexpr):
    """The dim paired with each dim in ``offs_d [BD]`` (itself past the rotary part)."""
    HALF: tl.constexpr = ROTARY_DIM // 2
    if INTERLEAVED:
        o_p = offs_d ^ 1
    else:
        o_p = tl.where(offs_d < HALF, offs_d + HALF, offs_d - HALF)
    return tl.where(offs_d < ROTARY_DIM, o_p, offs_d)


@triton.jit
def rope_cos_sin(b_pos, turns_ptr, offs_d, ROTARY_DIM: tl.constexpr, INTERLEAVED: tl.constexpr):
    """cos and sin, float32 ``[BM, BD]``, of the angle of dims ``offs_d [BD]`` at the
    int positions ``b_pos [BM]``; ``turns_ptr`` is `rope_turns`' int64 table.
    Past the rotary part the angle is 0."""
    HALF: tl.constexpr = ROTARY_DIM // 2
    if INTERLEAVED:
        o_k = offs_d // 2
    else:
        o_k = offs_d % HALF
    b_t = tl.load(turns_ptr + o_k, mask=offs_d < ROTARY_DIM, other=0)  # [BD] int64
    # [BM, BD] pos * T mod 2**64: the wrap-around is the reduction mod one turn
    b_phase = b_pos.to(tl.int64)[:, None] * b_t[None, :]
    b_ang = (b_phase >> 32).to(tl.float32) * _RAD_PER_UNIT
    return tl.cos(b_ang), tl.sin(b_ang)


@triton.jit
def rope_rotate(b_x, b_xp, b_cos, b_sin, offs_d, ROTARY_DIM: tl.constexpr, INTERLEAVED: tl.constexpr,
                INVERSE: tl.constexpr):
    """Rotated tile, float32 ``[BM, BD]``.  ``b_x``: dims ``offs_d``; ``b_xp``: the same rows
    at ``rope_partner(offs_d)``; ``b_cos``/``b_sin`` from `rope_cos_sin`.  INVERSE turns
    by -angle (the backward).  Dims past the rotary part come back unchanged."""
    HALF: tl.constexpr = ROTARY_DIM // 2
    if INTERLEAVED:
        m_first = (offs_d % 2) == 0
    else:
        m_first = offs_d < HALF
    # first of a pair: a cos - b sin; second: b cos + a sin
    sgn = tl.where(m_first, -1.0, 1.0)
    if INVERSE:
        sgn = -sgn
    b_xf = b_x.to(tl.float32)
    # [BM, BD]
    b_y = b_xf * b_cos + (sgn[None, :] * b_sin) * b_xp.to(tl.float32)
    # explicit select, so that inf/nan in a passed-through dim stays as it is
    return tl.where((offs_d < ROTARY_DIM)[None, :], b_y, b_xf)


@triton.jit
def rope_kernel(x_ptr, o_ptr, turns_ptr, pos_ptr, pos_base, S, H, D, n_row_blocks,
                stride_xb, stride_xs, stride_xh, stride_xd,
                stride_ob, stride_os, stride_oh, stride_od,
                stride_pb, stride_ps,
                ROTARY_DIM: tl.constexpr, INTERLEAVED: tl.constexpr, INVERSE: tl.constexpr,
                POS_MODE: tl.constexpr, IN_PLACE: tl.constexpr,
                BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    """One program: BLOCK_R consecutive (token, head) rows of one sequence, all D dims.

    POS_MODE 0: position ``pos_base + s``; 1: ``pos[b] + s``; 2: ``position_ids[b, s]``.
    """
    pid = tl.program_id(0)
    b = (pid // n_row_blocks).to(tl.int64)
    o_r = (pid % n_row_blocks) * BLOCK_R + tl.arange(0, BLOCK_R)
    m_r = o_r < S * H
    o_s = (o_r // H).to(tl.int64)
    o_h = (o_r % H).to(tl.int64)
    if POS_MODE == 2:
        b_pos = tl.load(pos_ptr + b * stride_pb + o_s * stride_ps, mask=m_r, other=0).to(tl.int64)
    elif POS_MODE == 1:
        b_pos = tl.load(pos_ptr + b * stride_pb).to(tl.int64) + o_s
    else:
        b_pos = o_s + pos_base
    o_d = tl.arange(0, BLOCK_D)
    o_p = rope_partner(o_d, ROTARY_DIM, INTERLEAVED)
    m_x = m_r[:, None] & (o_d < D)[None, :]
    p_row = x_ptr + b * stride_xb + o_s[:, None] * stride_xs + o_h[:, None] * stride_xh
    # [BLOCK_R, BLOCK_D]
    b_x = tl.load(p_row + o_d[None, :] * stride_xd, mask=m_x, other=0.0)
    b_xp = tl.load(p_row + o_p[None, :] * stride_xd, mask=m_x, other=0.0)
    b_cos, b_sin = rope_cos_sin(b_pos, turns_ptr, o_d, ROTARY_DIM, INTERLEAVED)
    b_y = rope_rotate(b_x, b_xp, b_cos, b_sin, o_d, ROTARY_DIM, INTERLEAVED, INVERSE)
    if IN_PLACE:
        # another thread's partner load may read what this thread is about to overwrite
        tl.debug_barrier()
    p_out = o_ptr + b * stride_ob + o_s[:, None] * stride_os + o_h[:, None] * stride_oh + o_d[None, :] * stride_od
    tl.store(p_out, b_y.to(o_ptr.dtype.element_ty), mask=m_x)


@functools.lru_cache(maxsize=64)
def rope_turns(rotary_dim: int, theta: float, device: torch.device) -> torch.Tensor:
    """int64 ``[rotary_dim / 2]``: ``inv_freq_k / 2pi`` as a fraction of 2**64 (< 2**63)."""
    inv_freq = theta ** (-torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim)
    # inv_freq <= 1, so turns < 1/(2 pi): exact in int64 after the power-of-two scaling
    turns = (inv_freq / (2.0 * math.pi) * 2.0**64).to(torch.int64)
    return turns.to(device)


def rope(x: torch.Tensor, pos: Optional[torch.Tensor], position_ids: Optional[torch.Tensor],
         params: RopeParams, *, inverse: bool = False, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Rotate ``x [B, S, H, D]`` (any strides, D <= 256) into ``out`` (new if None; may be x).

    ``pos``: None or int tensor ``[B]``; ``position_ids``: None or int tensor ``[B, S]``.
    """
    B, S, H, D = x.shape
    if out is None:
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if x.numel() == 0:
        return out
    turns = rope_turns(params.rotary_dim, float(params.theta), x.device)
    if position_ids is not None:
        pos_mode, pos_t, spb, sps = 2, position_ids, position_ids.stride(0), position_ids.stride(1)
    elif pos is not None:
        pos_mode, pos_t, spb, sps = 1, pos, pos.stride(0), 0
    else:
        pos_mode, pos_t, spb, sps = 0, turns, 0, 0  # pos_ptr never read
    block_d = triton.next_power_of_2(D)
    block_r = min(triton.next_power_of_2(S * H), max(1, _TILE_ELEMS // block_d))
    n_row_blocks = triton.cdiv(S * H, block_r)
    rope_kernel[(B * n_row_blocks,)](
        x, out, turns, pos_t, params.pos_base, S, H, D, n_row_blocks,
        *x.stride(), *out.stride(), spb, sps,
        ROTARY_DIM=params.rotary_dim, INTERLEAVED=params.interleaved, INVERSE=inverse,
        POS_MODE=pos_mode, IN_PLACE=out.data_ptr() == x.data_ptr(),
        BLOCK_R=block_r, BLOCK_D=block_d, num_warps=4)
    return out
