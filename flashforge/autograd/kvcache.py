"""KV-cache attention as `torch.library` custom ops (forward only: inference).

`flashforge::kvcache_append` writes the new keys (rotated) and values into the
caches and declares that mutation; `flashforge::attention_kvcache` only reads the
caches.  Both have fake impls, so `torch.compile(fullgraph=True)` traces a
decoding step.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch.autograd.graph import increment_version

from ..ops.backends import backend_module
from ..ops.params import AttnParams
from ..ops.rope_torch import RopeParams
from .dispatch import eager


def _rope(theta: float, rotary_dim: int, interleaved: bool) -> Optional[RopeParams]:
    return RopeParams(theta=theta, rotary_dim=rotary_dim, interleaved=interleaved) if rotary_dim > 0 else None


@torch.library.custom_op("flashforge::kvcache_append", mutates_args=("k_cache", "v_cache"))
def kvcache_append(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   cache_seqlens: torch.Tensor, block_table: Optional[torch.Tensor], rope_theta: float,
                   rope_dim: int, rope_interleaved: bool, backend: str) -> None:
    """Write k, v at positions cache_seqlens[b] + i of each cache row (k rotated if rope_dim > 0)."""
    backend_module("kvcache", backend).append(k_cache, v_cache, k, v, cache_seqlens, block_table,
                                              _rope(rope_theta, rope_dim, rope_interleaved))


@kvcache_append.register_fake
def _(k_cache, v_cache, k, v, cache_seqlens, block_table, rope_theta, rope_dim, rope_interleaved, backend):
    return None


@torch.library.custom_op("flashforge::attention_kvcache", mutates_args=())
def attention_kvcache(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, seqlens_k: torch.Tensor,
                      q_pos: Optional[torch.Tensor], block_table: Optional[torch.Tensor],
                      alibi_slopes: Optional[torch.Tensor], scale: float, window_left: int, window_right: int,
                      softcap: float, num_splits: int, seqlens_k_add: int, rope_theta: float, rope_dim: int,
                      rope_interleaved: bool, backend: str) -> tuple[torch.Tensor, torch.Tensor]:
    # q_pos None: queries aligned bottom-right against each row's key count (seqlens_k + seqlens_k_add)
    params = AttnParams(scale=scale, window_left=window_left, window_right=window_right, offset_tensor=q_pos,
                        offset_bottom_right=q_pos is None,
                        softcap=softcap, alibi_slopes=alibi_slopes, seqlens_k=seqlens_k, block_table=block_table,
                        num_splits=num_splits, seqlens_k_add=seqlens_k_add,
                        q_rope=_rope(rope_theta, rope_dim, rope_interleaved))
    return backend_module("attention", backend).attention_forward(q, k_cache, v_cache, None, params)


@attention_kvcache.register_fake
def _(q, k_cache, v_cache, *args):
    B, Sq, Hq, _ = q.shape
    return q.new_empty(B, Sq, Hq, v_cache.shape[-1]), q.new_empty(B, Hq, Sq, dtype=torch.float32)


def _rope_args(rope: Optional[RopeParams]) -> tuple:
    return (float(rope.theta), rope.rotary_dim, rope.interleaved) if rope is not None else (0.0, 0, False)


def attention_kvcache_function(q, k_cache, v_cache, params: AttnParams, backend: str):
    """(o, lse) of validated inputs; ``params`` carries seqlens_k, the query offsets, paging
    and the RoPE of q (rotated inside the kernel)."""
    p = params
    if eager(q, k_cache, v_cache, p.seqlens_k, p.offset_tensor, p.block_table, p.alibi_slopes):
        return backend_module("attention", backend).attention_forward(q, k_cache, v_cache, None, params)
    return torch.ops.flashforge.attention_kvcache(q, k_cache, v_cache, p.seqlens_k, p.offset_tensor, p.block_table,
                                                  p.alibi_slopes, p.scale, p.window_left, p.window_right, p.softcap,
                                                  p.num_splits, p.seqlens_k_add, *_rope_args(p.q_rope), backend)


def kvcache_append_function(k_cache, v_cache, k, v, cache_seqlens, block_table, rope: Optional[RopeParams],
                            backend: str) -> None:
    if eager(k_cache, v_cache, k, v, cache_seqlens, block_table):
        backend_module("kvcache", backend).append(k_cache, v_cache, k, v, cache_seqlens, block_table, rope)
        increment_version(k_cache)  # as the op's declared mutation would
        increment_version(v_cache)
        return
    torch.ops.flashforge.kvcache_append(k_cache, v_cache, k, v, cache_seqlens, block_table, *_rope_args(rope),
                                        backend)
