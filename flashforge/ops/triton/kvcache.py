"""Appending new keys and values to a KV cache (contiguous or paged), rotating the
keys with RoPE on the way: one program per (new token, kv head).  A token whose slot lies
outside the cache's capacity is not written, and a block-table entry outside the cache's
blocks is clamped into them: unchecked device values never write outside the cache."""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from .. import replay
from ..rope_torch import RopeParams
from .configs import head_dim_block
from .rope import rope_cos_sin, rope_partner, rope_rotate, rope_turns


@triton.jit
def kvcache_append_kernel(
    K_NEW, V_NEW, K_CACHE, V_CACHE, SEQLENS, BT, TURNS,
    stride_knb, stride_kns, stride_knh, stride_vnb, stride_vns, stride_vnh,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_btb,
    S_new, capacity, num_pages, D: tl.constexpr, DV: tl.constexpr,
    PAGED: tl.constexpr, PAGE: tl.constexpr, ROPE_DIM: tl.constexpr, ROPE_INTERLEAVED: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
):
    pid = tl.program_id(0)
    hk = tl.program_id(1)
    b = pid // S_new
    i = pid % S_new
    pos = tl.load(SEQLENS + b).to(tl.int64) + i  # the token's slot: its absolute position
    ok = (pos >= 0) & (pos < capacity)  # [] (scalar): the slot exists
    if PAGED:
        # stride_kb / stride_vb are the block strides of a paged cache
        blk = tl.load(BT + b.to(tl.int64) * stride_btb + pos // PAGE, mask=ok, other=0)
        blk = tl.minimum(tl.maximum(blk, 0), num_pages - 1).to(tl.int64)
        row = (pos % PAGE).to(tl.int64)
    else:
        blk = b.to(tl.int64)
        row = pos.to(tl.int64)
    o_d = tl.arange(0, BLOCK_D)
    o_dv = tl.arange(0, BLOCK_DV)
    p_k = K_NEW + b.to(tl.int64) * stride_knb + i * stride_kns + hk * stride_knh
    b_k = tl.load(p_k + o_d[None, :], mask=o_d[None, :] < D, other=0.0)  # [1, BD]
    if ROPE_DIM > 0:
        o_p = rope_partner(o_d, ROPE_DIM, ROPE_INTERLEAVED)
        b_kp = tl.load(p_k + o_p[None, :], mask=o_p[None, :] < D, other=0.0)
        b_cos, b_sin = rope_cos_sin(tl.full([1], 0, tl.int64) + pos, TURNS, o_d, ROPE_DIM, ROPE_INTERLEAVED)
        b_k = rope_rotate(b_k, b_kp, b_cos, b_sin, o_d, ROPE_DIM, ROPE_INTERLEAVED, False)
    tl.store(K_CACHE + blk * stride_kb + row * stride_ks + hk * stride_kh + o_d[None, :],
             b_k.to(K_CACHE.dtype.element_ty), mask=(o_d[None, :] < D) & ok)
    b_v = tl.load(V_NEW + b.to(tl.int64) * stride_vnb + i * stride_vns + hk * stride_vnh + o_dv, mask=o_dv < DV)
    tl.store(V_CACHE + blk * stride_vb + row * stride_vs + hk * stride_vh + o_dv,
             b_v.to(V_CACHE.dtype.element_ty), mask=(o_dv < DV) & ok)


def append(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
           cache_seqlens: torch.Tensor, block_table: Optional[torch.Tensor], rope: Optional[RopeParams]) -> None:
    """Write ``k, v [B, S_new, Hkv, *]`` at positions ``cache_seqlens[b] + i`` (k rotated first if ``rope``)."""
    if k.shape[0] * k.shape[1] == 0:
        return
    if k.device.type == "cuda" and replay.usable():  # a decoding step's append: replayed (ops/replay.py)
        key, named = replay.signature(("kvcache_append", replay.generation[0], k.device, torch.cuda.current_device(),
                                       rope), dict(k_cache=k_cache, v_cache=v_cache, k=k, v=v,
                                                   cache_seqlens=cache_seqlens, block_table=block_table))
        replay.call(key, named, lambda rec: _append(rec, k_cache, v_cache, k, v, cache_seqlens, block_table, rope))
        return
    _append(replay.DIRECT, k_cache, v_cache, k, v, cache_seqlens, block_table, rope)


def _append(rec, k_cache, v_cache, k, v, cache_seqlens, block_table, rope) -> tuple:
    B, s_new, Hkv, D = k.shape
    Dv = v.shape[-1]
    paged = block_table is not None
    bt = block_table if paged else cache_seqlens
    capacity = bt.shape[1] * k_cache.shape[1] if paged else k_cache.shape[1]
    turns = cache_seqlens if rope is None else rec.fresh(rope_turns, rope.rotary_dim, float(rope.theta), k.device)
    rec.launch(kvcache_append_kernel, (B * s_new, Hkv),
        k, v, k_cache, v_cache, cache_seqlens, bt, turns,
        k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), v_cache.stride(0), v_cache.stride(1),
        v_cache.stride(2), bt.stride(0),
        s_new, capacity, k_cache.shape[0], D, Dv, PAGED=paged, PAGE=k_cache.shape[1] if paged else 1,
        ROPE_DIM=0 if rope is None else rope.rotary_dim, ROPE_INTERLEAVED=rope is not None and rope.interleaved,
        BLOCK_D=head_dim_block(D), BLOCK_DV=head_dim_block(Dv), num_warps=1,
    )
    return ()  # nothing made: the cache is written in place
