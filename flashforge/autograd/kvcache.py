"""KV-cache attention as a `torch.library` custom op (forward only: inference).

The caches are read, never written, by the op (the public layer appends the new
keys and values before calling it), so it declares no mutation and
`torch.compile(fullgraph=True)` traces decoding steps through its fake impl.
"""
from __future__ import annotations

from typing import Optional

import torch

from ..ops.backends import backend_module
from ..ops.params import AttnParams


@torch.library.custom_op("flashforge::attention_kvcache", mutates_args=())
def attention_kvcache(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, seqlens_k: torch.Tensor,
                      q_pos: torch.Tensor, block_table: Optional[torch.Tensor],
                      alibi_slopes: Optional[torch.Tensor], scale: float, window_left: int, window_right: int,
                      softcap: float, num_splits: int, backend: str) -> tuple[torch.Tensor, torch.Tensor]:
    params = AttnParams(scale=scale, window_left=window_left, window_right=window_right, offset_tensor=q_pos,
                        softcap=softcap, alibi_slopes=alibi_slopes, seqlens_k=seqlens_k, block_table=block_table,
                        num_splits=num_splits)
    return backend_module("attention", backend).attention_forward(q, k_cache, v_cache, None, params)


@attention_kvcache.register_fake
def _(q, k_cache, v_cache, *args):
    B, Sq, Hq, _ = q.shape
    return q.new_empty(B, Sq, Hq, v_cache.shape[-1]), q.new_empty(B, Hq, Sq, dtype=torch.float32)


def attention_kvcache_function(q, k_cache, v_cache, params: AttnParams, backend: str):
    """(o, lse) of validated inputs; ``params`` carries seqlens_k, the query offsets and paging."""
    p = params
    return torch.ops.flashforge.attention_kvcache(q, k_cache, v_cache, p.seqlens_k, p.offset_tensor, p.block_table,
                                                  p.alibi_slopes, p.scale, p.window_left, p.window_right, p.softcap,
                                                  p.num_splits, backend)
