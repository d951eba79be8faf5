"""Appending new keys and values to a KV cache, in PyTorch (the Triton twin is
`flashforge.ops.triton.kvcache`)."""
from __future__ import annotations

from typing import Optional

import torch

from .rope_torch import RopeParams, rope


def append(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
           cache_seqlens: torch.Tensor, block_table: Optional[torch.Tensor], rope_params: Optional[RopeParams]) -> None:
    """Write ``k, v [B, S_new, Hkv, *]`` at positions ``cache_seqlens[b] + i`` (k rotated first if asked).

    As in the Triton kernel, a token whose slot lies outside ``[0, capacity)`` is not written and a
    block-table entry outside ``[0, num_blocks)`` is clamped into it: the public layer checks every
    value it can see, so only unchecked device values get here out of range."""
    B, s_new = k.shape[:2]
    if rope_params is not None:
        k = rope(k, cache_seqlens, None, rope_params)
    pos = cache_seqlens.long().view(B, 1) + torch.arange(s_new, device=k.device).view(1, s_new)  # [B, S_new]
    capacity = k_cache.shape[1] if block_table is None else block_table.shape[1] * k_cache.shape[1]
    if capacity == 0:
        return
    ok = (pos >= 0) & (pos < capacity)  # [B, S_new]
    if block_table is None:
        rows = torch.arange(B, device=k.device).view(B, 1).expand(B, s_new)
        slots = (rows[ok], pos[ok])
    else:
        size = k_cache.shape[1]
        blocks = block_table.long().gather(1, pos.clamp(0, capacity - 1) // size).clamp(0, k_cache.shape[0] - 1)
        slots = (blocks[ok], (pos % size)[ok])
    k_cache[slots] = k[ok].to(k_cache.dtype)
    v_cache[slots] = v[ok].to(v_cache.dtype)
