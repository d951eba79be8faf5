"""Rotary position embedding (RoPE), the Triton twin of `flashforge.ops.rope_torch`.

Angles without float32 cancellation.  ``pos * inv_freq`` formed in float32 (as
Hugging Face does) is off by up to ~0.04 rad at position 1e6.  Here each
frequency is stored once, on the host, as a 64-bit fixed-point fraction of a
turn, ``T_k = (inv_freq_k / 2pi) * 2**64`` (`rope_turns`); in the kernel the
integer product ``pos * T_k`` wraps modulo 2**64, which is exactly the range
reduction ``angle mod 2pi``, and its top 32 bits (signed) are the angle in
``[-pi, pi)`` to ~2e-7 rad for any int64 position (`rope_angle`).

Helpers for other kernels:

* `rope_angle` + `rope_rotate_pairs`: tiles of first and second pair members
  (what `rope_kernel` uses);
* `rope_cos_sin` + `rope_partner` + `rope_rotate`: a whole-head tile ``[BM, BD]``
  whose rows carry their own position (q or k inside attention): load it at
  ``offs_d`` and again at ``rope_partner(offs_d)``.
"""
from __future__ import annotations

import functools
import math
from typing import Optional

import torch
import triton
import triton.language as tl

from ..rope_torch import RopeParams

__all__ = ["rope", "rope_turns", "rope_angle", "rope_rotate_pairs", "rope_partner", "rope_cos_sin",
           "rope_rotate", "rope_kernel"]

# 2 pi / 2**32: from the top 32 bits of a 64-bit turn fraction to radians
_RAD_PER_UNIT = tl.constexpr(2.0 * math.pi / 2.0**32)
# elements (tokens x heads x rotated and copied dims) per program
_TILE_ELEMS = 4096


@triton.jit
def rope_angle(b_pos, b_turns):
    """Angle in [-pi, pi), float32, of int positions times `rope_turns` entries (broadcast
    together, e.g. ``[BM, 1]`` and ``[1, BK]``): the int64 product wraps mod 2**64, which
    is mod one full turn."""
    b_phase = b_pos.to(tl.int64) * b_turns
    return (b_phase >> 32).to(tl.float32) * _RAD_PER_UNIT


@triton.jit
def rope_rotate_pairs(b_x1, b_x2, b_cos, b_sin, INVERSE: tl.constexpr):
    """``(a, b) -> (a cos - b sin, b cos + a sin)``, float32, on matching tiles of first and
    second pair members (by ``-angle`` if INVERSE)."""
    if INVERSE:
        b_sin = -b_sin
    b_x1 = b_x1.to(tl.float32)
    b_x2 = b_x2.to(tl.float32)
    return b_x1 * b_cos - b_x2 * b_sin, b_x2 * b_cos + b_x1 * b_sin


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
    """cos and sin, float32 ``[BM, BD]``, of the angle of each dim ``offs_d [BD]`` at the int
    positions ``b_pos [BM]``.  Past the rotary part the angle is 0."""
    HALF: tl.constexpr = ROTARY_DIM // 2
    if INTERLEAVED:
        o_k = offs_d // 2
    else:
        o_k = offs_d % HALF
    b_t = tl.load(turns_ptr + o_k, mask=offs_d < ROTARY_DIM, other=0)  # [BD] int64
    b_ang = rope_angle(b_pos[:, None], b_t[None, :])  # [BM, BD]
    return tl.cos(b_ang), tl.sin(b_ang)


@triton.jit
def rope_rotate(b_x, b_xp, b_cos, b_sin, offs_d, ROTARY_DIM: tl.constexpr, INTERLEAVED: tl.constexpr,
                INVERSE: tl.constexpr):
    """Rotated whole-head tile ``[..., BD]``, float32.  ``b_x``: dims ``offs_d``; ``b_xp``: the
    same rows loaded at ``rope_partner(offs_d)``; ``b_cos``/``b_sin`` from `rope_cos_sin`,
    broadcastable to the tile.  INVERSE turns by -angle.  Dims past the rotary part come
    back unchanged."""
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
    b_y = b_xf * b_cos + (sgn * b_sin) * b_xp.to(tl.float32)
    # explicit select, so that inf/nan in a passed-through dim stays as it is
    return tl.where(offs_d < ROTARY_DIM, b_y, b_xf)


@triton.jit
def rope_kernel(x_ptr, o_ptr, turns_ptr, pos_ptr, pos_base, S, H, D, n_s_blocks,
                stride_xb, stride_xs, stride_xh, stride_xd,
                stride_ob, stride_os, stride_oh, stride_od,
                stride_pb, stride_ps,
                ROTARY_DIM: tl.constexpr, INTERLEAVED: tl.constexpr, INVERSE: tl.constexpr,
                POS_MODE: tl.constexpr, IN_PLACE: tl.constexpr, COPY_PASS: tl.constexpr,
                BLOCK_S: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr,
                BLOCK_P: tl.constexpr):
    """One program: BLOCK_S tokens x BLOCK_H heads of one sequence.  The angles depend on the
    token only: cos/sin are computed once per (token, pair) and shared by the heads.

    POS_MODE 0: position ``pos_base + s``; 1: ``pos[b] + s``; 2: ``position_ids[b, s]``.
    COPY_PASS: also copy dims ``ROTARY_DIM..D`` (at most BLOCK_P of them) to the output.
    """
    HALF: tl.constexpr = ROTARY_DIM // 2
    pid = tl.program_id(0)
    b = (pid // n_s_blocks).to(tl.int64)
    o_s = ((pid % n_s_blocks) * BLOCK_S + tl.arange(0, BLOCK_S)).to(tl.int64)
    o_h = (tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)).to(tl.int64)
    o_k = tl.arange(0, BLOCK_K)
    m_s = o_s < S
    if POS_MODE == 2:
        b_pos = tl.load(pos_ptr + b * stride_pb + o_s * stride_ps, mask=m_s, other=0).to(tl.int64)
    elif POS_MODE == 1:
        b_pos = tl.load(pos_ptr + b * stride_pb).to(tl.int64) + o_s
    else:
        b_pos = o_s + pos_base
    b_t = tl.load(turns_ptr + o_k, mask=o_k < HALF, other=0)
    # [BLOCK_S, BLOCK_K]
    b_ang = rope_angle(b_pos[:, None], b_t[None, :])
    b_cos = tl.cos(b_ang)[:, None, :]
    b_sin = tl.sin(b_ang)[:, None, :]

    m_sh = m_s[:, None, None] & (o_h < H)[None, :, None]
    p_x = x_ptr + b * stride_xb + o_s[:, None, None] * stride_xs + o_h[None, :, None] * stride_xh
    p_o = o_ptr + b * stride_ob + o_s[:, None, None] * stride_os + o_h[None, :, None] * stride_oh
    if INTERLEAVED:
        # one contiguous load of [a0, b0, a1, b1, ...], split into the pair members in registers
        o_r = tl.arange(0, 2 * BLOCK_K)
        m_x = m_sh & (o_r < ROTARY_DIM)[None, None, :]
        # [BLOCK_S, BLOCK_H, 2 * BLOCK_K]
        b_x = tl.load(p_x + o_r[None, None, :] * stride_xd, mask=m_x, other=0.0)
        b_x1, b_x2 = tl.split(tl.reshape(b_x, (BLOCK_S, BLOCK_H, BLOCK_K, 2)))
        b_y1, b_y2 = rope_rotate_pairs(b_x1, b_x2, b_cos, b_sin, INVERSE)
        b_y = tl.reshape(tl.join(b_y1, b_y2), (BLOCK_S, BLOCK_H, 2 * BLOCK_K))
        if IN_PLACE:
            # the split may move elements between threads: every load lands before any store
            tl.debug_barrier()
        tl.store(p_o + o_r[None, None, :] * stride_od, b_y.to(o_ptr.dtype.element_ty), mask=m_x)
    else:
        m_x = m_sh & (o_k < HALF)[None, None, :]
        # [BLOCK_S, BLOCK_H, BLOCK_K]: dims k and k + HALF, each a contiguous run
        b_x1 = tl.load(p_x + o_k[None, None, :] * stride_xd, mask=m_x, other=0.0)
        b_x2 = tl.load(p_x + (o_k + HALF)[None, None, :] * stride_xd, mask=m_x, other=0.0)
        b_y1, b_y2 = rope_rotate_pairs(b_x1, b_x2, b_cos, b_sin, INVERSE)
        tl.store(p_o + o_k[None, None, :] * stride_od, b_y1.to(o_ptr.dtype.element_ty), mask=m_x)
        tl.store(p_o + (o_k + HALF)[None, None, :] * stride_od, b_y2.to(o_ptr.dtype.element_ty), mask=m_x)
    if COPY_PASS:
        o_q = ROTARY_DIM + tl.arange(0, BLOCK_P)
        m_q = m_sh & (o_q < D)[None, None, :]
        # [BLOCK_S, BLOCK_H, BLOCK_P]
        b_q = tl.load(p_x + o_q[None, None, :] * stride_xd, mask=m_q, other=0.0)
        tl.store(p_o + o_q[None, None, :] * stride_od, b_q, mask=m_q)


@functools.lru_cache(maxsize=64)
def _host_turns(rotary_dim: int, theta: float, pinned: bool) -> torch.Tensor:
    inv_freq = theta ** (-torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim)
    # inv_freq <= 1, so turns < 1/(2 pi): exact in int64 after the power-of-two scaling
    turns = (inv_freq / (2.0 * math.pi) * 2.0**64).to(torch.int64)
    return turns.pin_memory() if pinned else turns


def rope_turns(rotary_dim: int, theta: float, device: torch.device) -> torch.Tensor:
    """int64 ``[rotary_dim / 2]``: ``inv_freq_k / 2pi`` as a fraction of 2**64 (< 2**63).

    A fresh device copy per call (an asynchronous copy from a cached pinned host tensor),
    not a cached device tensor: torch.compile(mode="reduce-overhead") allocates from its
    CUDA-graph pool while it warms up, and a cache entry made there would be a live
    allocation the graph does not own ("tensor in the cudagraph pool not tracked")."""
    host = _host_turns(rotary_dim, float(theta), device.type == "cuda")
    return host.to(device, non_blocking=True)


def rope(x: torch.Tensor, pos: Optional[torch.Tensor], position_ids: Optional[torch.Tensor],
         params: RopeParams, *, inverse: bool = False, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Rotate ``x [B, S, H, D]`` (any strides) into ``out`` (new if None; may be x).

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
    block_k = triton.next_power_of_2(params.rotary_dim // 2)
    in_place = out.data_ptr() == x.data_ptr()
    copy_pass = not in_place and params.rotary_dim < D
    block_p = triton.next_power_of_2(D - params.rotary_dim) if copy_pass else 1
    width = 2 * block_k + (block_p if copy_pass else 0)
    block_h = min(triton.next_power_of_2(H), max(1, _TILE_ELEMS // width))
    block_s = min(triton.next_power_of_2(S), max(1, _TILE_ELEMS // (block_h * width)))
    n_s_blocks = triton.cdiv(S, block_s)
    rope_kernel[(B * n_s_blocks, triton.cdiv(H, block_h))](
        x, out, turns, pos_t, params.pos_base, S, H, D, n_s_blocks,
        *x.stride(), *out.stride(), spb, sps,
        ROTARY_DIM=params.rotary_dim, INTERLEAVED=params.interleaved, INVERSE=inverse,
        POS_MODE=pos_mode, IN_PLACE=in_place, COPY_PASS=copy_pass,
        BLOCK_S=block_s, BLOCK_H=block_h, BLOCK_K=block_k, BLOCK_P=block_p, num_warps=4)
    return out
