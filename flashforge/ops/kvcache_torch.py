"""Appending new keys and values to a KV cache, in PyTorch (the Triton twin is
`flashforge.ops.triton.kvcache`)."""
from __future__ import annotations

from typing import Optional

import torch

from .rope_torch import RopeParams, rope


def append(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
           cache_seqlens: torch.Tensor, block_table: Optional[torch.Tensor], rope_params: Optional[RopeParams]) -> None:
    """Write ``k, v [B, S_new, Hkv, *]`` at positions ``cache_seqlens[b] + i`` (k rotated first if asked)."""
    B, s_new = k.shape[:2]
    if rope_params is not None:
        k = rope(k, cache_seqlens, None, rope_params)
    pos = cache_seqlens.long().view(B, 1) + torch.arange(s_new, device=k.device).view(1, s_new)  # [B, S_new]
    if block_table is None:
        rows = torch.arange(B, device=k.device).view(B, 1).expand(B, s_new)
        k_cache[rows, pos] = k.to(k_cache.dtype)
        v_cache[rows, pos] = v.to(v_cache.dtype)
    else:
        size = k_cache.shape[1]
        blocks = block_table.long().gather(1, pos // size)  # [B, S_new]
        k_cache[blocks, pos % size] = k.to(k_cache.dtype)
        v_cache[blocks, pos % size] = v.to(v_cache.dtype)
