"""`flashforge.attention_with_kvcache`: attention for inference against a KV cache
(contiguous or paged), appending the new keys and values in place first."""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Optional, Union

import torch

from ..autograd.kvcache import attention_kvcache_function, kvcache_append_function
from ..ops.rope_torch import RopeParams
from ..ops.params import AttnParams
from .attention import _normalise_slopes, check_heads_and_dims, check_qkv_rank
from .rope import STYLES
from .validate import (canonical_visibility, check_backend, check_bool, check_float, check_int, check_tensor,
                       check_window, values_visible)

__all__ = ["Rope", "attention_with_kvcache"]

@dataclass(frozen=True)
class Rope:
    """Rotary embedding applied by `attention_with_kvcache` to q and the new k, at their
    absolute positions (the arguments of `flashforge.apply_rope`)."""
    theta: float = 10000.0
    style: str = "half"  # "half" (Llama, NeoX) or "interleaved" (GPT-J)
    rotary_dim: Optional[int] = None


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def auto_splits(Sq: int, B: int, Hq: int, Hkv: int, capacity: int, sms: int, block_m: int = 128) -> int:
    """Split-KV factor: split the keys when the forward's programs cannot fill ``sms``
    multiprocessors.  Mirrors the launcher's grid: a GQA group whose rows fit one tile is
    one program (packed), else one program per (query block, head)."""
    group = Hq // Hkv
    if group > 1 and Sq * group <= block_m:
        programs = B * Hkv
    else:
        programs = -(-Sq // block_m) * B * Hq
    if programs >= sms:
        return 1
    # as many programs as are resident at once, each with >= 256 keys: one per SM for
    # 64-row tiles (H200, B = 1-4, GQA 32/8: one full wave beat two, and beat a wave and a
    # bit), two for the 16-row decoding tiles ("fwd_decode": ~100 KB of shared memory; B = 4,
    # 4k / 32k keys: 8 splits 2373 / 3956 GB/s in CUDA graphs against 4 splits' 2322 / 3899)
    per_sm = 2 if Sq * group <= 16 else 1
    return max(1, min(per_sm * sms // programs, capacity // 256, 64))


def _check_cache_seqlens(cache_seqlens: torch.Tensor, s_new: int, capacity: int) -> list:
    """The lengths as a list, each checked: 0 <= n and n + S_new <= capacity."""
    lengths = cache_seqlens.tolist()
    for b, n in enumerate(lengths):
        if n < 0:
            raise ValueError(f"cache_seqlens[{b}] is {n}; accepted: >= 0")
        if n + s_new > capacity:
            raise ValueError(f"cache_seqlens[{b}] ({n}) + S_new ({s_new}) is {n + s_new}; accepted: at most the "
                             f"cache's capacity {capacity}")
    return lengths


def _check_block_table(block_table: torch.Tensor, lengths: list, s_new: int, block_size: int,
                       num_blocks: int) -> None:
    """The entries each row uses (those of its keys below lengths[b] + S_new) name blocks of the cache."""
    table = block_table.tolist()
    for b, n in enumerate(lengths):
        used = -(-(n + s_new) // block_size)
        for j, blk in enumerate(table[b][:used]):
            if not 0 <= blk < num_blocks:
                raise ValueError(f"block_table[{b}, {j}] is {blk}; accepted: a block index in [0, {num_blocks}) "
                                 f"(row {b} uses its first {used} entries)")


def attention_with_kvcache(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           k: Optional[torch.Tensor] = None, v: Optional[torch.Tensor] = None, *,
                           cache_seqlens: Union[int, torch.Tensor], block_table: Optional[torch.Tensor] = None,
                           rope: Optional[Rope] = None, causal: bool = True, window=None, softcap: float = 0.0,
                           scale: Optional[float] = None, alibi_slopes: Optional[torch.Tensor] = None,
                           return_lse: bool = False, num_splits: Optional[int] = None,
                           backend: Optional[str] = None, check_inputs: bool = False):
    """Attention of new queries against a KV cache (inference: no gradients).

    Args:
        q: ``[B, Sq, Hq, D]``.
        k_cache, v_cache: ``[B_cache, S_cache, Hkv, D]`` (``B_cache >= B``, row b is sequence b),
            or paged ``[num_blocks, block_size, Hkv, D]`` with ``block_table``.
        k, v: None, or the new keys and values ``[B, S_new, Hkv, D]``: they are written into the
            cache in place at positions ``cache_seqlens[b] + i`` (after RoPE, if asked) before
            attending.
        cache_seqlens: int or int32/int64 tensor ``[B]``: tokens already in each cache row, with
            ``0 <= cache_seqlens[b]`` and ``cache_seqlens[b] + S_new <= capacity`` (``S_cache``, or
            ``max_blocks * block_size`` when paged).
        block_table: int32 ``[B, max_blocks]``: key j of sequence b is row ``j % block_size`` of
            block ``block_table[b, j // block_size]``; ``block_size`` a power of two >= 16.  The
            entries a row uses (its first ``ceil(L_b / block_size)``) must lie in ``[0, num_blocks)``;
            the others are never read.
        rope: a `Rope`: rotate q and the new k at their absolute positions, as `apply_rope` would.
        causal, window, softcap, scale, alibi_slopes: as in `flashforge.attention`, with the
            queries aligned to the end of the keys: sequence b has ``L_b = cache_seqlens[b] + S_new``
            keys and query i sits at position ``L_b - Sq + i`` (``cache_seqlens[b] + i`` when
            ``Sq == S_new``).
        num_splits: split-KV factor; None picks one from the batch, heads and cache size.
        check_inputs: also check the values of device ``cache_seqlens`` and ``block_table`` (a device
            sync); CPU tensors and ints are always checked, and a value breaking the rules above
            raises ``ValueError`` before anything is written.  Unchecked device values never make
            a kernel touch memory outside the tensors: row b holds ``clamp(cache_seqlens[b] + S_new,
            0, capacity)`` keys (the queries aligned to their end), a new key whose slot falls outside
            ``[0, capacity)`` is not written, and a block-table entry outside ``[0, num_blocks)``
            reads (and its slots are written in) block ``clamp(entry, 0, num_blocks - 1)``.

    Returns:
        ``o [B, Sq, Hq, D]``, or ``(o, lse [B, Hq, Sq])``.
    """
    check_qkv_rank(q, k_cache, v_cache, (4,), "[B, Sq, Hq, D] with caches [B_cache, S_cache, Hkv, D]")
    B, Sq, Hq, D = q.shape
    check_heads_and_dims(q, k_cache, v_cache)
    dev = q.device
    if block_table is not None:
        check_tensor("block_table", block_table)
        if block_table.dtype != torch.int32 or block_table.dim() != 2 or block_table.shape[0] != B:
            raise ValueError(f"block_table must be an int32 tensor [B, max_blocks] = [{B}, *], got "
                             f"{block_table.dtype} {tuple(block_table.shape)}")
        if block_table.device != dev:
            raise ValueError(f"block_table is on {block_table.device} but q is on {dev}")
        block_size = k_cache.shape[1]
        if block_size < 16 or block_size & (block_size - 1):
            raise ValueError(f"paged k_cache has block_size {block_size}; accepted: a power of two >= 16")
        if k_cache.shape[0] == 0:
            raise ValueError("paged k_cache has 0 blocks; accepted: at least one (the block table's entries "
                             "index them)")
        capacity = block_table.shape[1] * block_size
    else:
        if k_cache.shape[0] < B:
            raise ValueError(f"k_cache has {k_cache.shape[0]} rows but q has batch {B}; B_cache >= B needed")
        capacity = k_cache.shape[1]

    if isinstance(cache_seqlens, torch.Tensor):
        if cache_seqlens.dtype not in (torch.int32, torch.int64) or cache_seqlens.shape != (B,):
            raise ValueError(f"cache_seqlens must be an int or an int32/int64 tensor [B] = [{B}], got "
                             f"{cache_seqlens.dtype} {tuple(cache_seqlens.shape)}")
        if cache_seqlens.device != dev:
            raise ValueError(f"cache_seqlens is on {cache_seqlens.device} but q is on {dev}")
    else:
        check_int("cache_seqlens", cache_seqlens, minimum=0)

    if (k is None) != (v is None):
        raise ValueError("k and v must be given together (the new keys and values) or both be None")
    s_new = 0
    if k is not None:
        check_qkv_rank(q, k, v, (4,), "[B, S_new, Hkv, D]")
        if k.shape[0] != B or k.shape[2:] != k_cache.shape[2:] or v.shape[:3] != k.shape[:3] \
                or v.shape[3] != v_cache.shape[3]:
            raise ValueError(f"new k {tuple(k.shape)} / v {tuple(v.shape)} must be [B, S_new, Hkv, D] matching "
                             f"q's batch {B} and the caches' heads and head dims")
        s_new = k.shape[1]
    check_bool("check_inputs", check_inputs)
    # every value checked before anything is written (the append comes first)
    if isinstance(cache_seqlens, int):
        if cache_seqlens + s_new > capacity:
            raise ValueError(f"cache_seqlens ({cache_seqlens}) + S_new ({s_new}) is {cache_seqlens + s_new}; "
                             f"accepted: at most the cache's capacity {capacity}")
        if block_table is not None and values_visible(block_table, check_inputs):
            _check_block_table(block_table, [cache_seqlens] * B, s_new, k_cache.shape[1], k_cache.shape[0])
        cache_seqlens = torch.full((B,), cache_seqlens, dtype=torch.int32, device=dev)
    elif values_visible(cache_seqlens, check_inputs):
        lengths = _check_cache_seqlens(cache_seqlens, s_new, capacity)
        if block_table is not None:
            _check_block_table(block_table, lengths, s_new, k_cache.shape[1], k_cache.shape[0])
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    left, right = check_window(window)
    if causal:
        right = 0
    # the queries sit at offset L_b - Sq of keys L_b <= capacity (aligned in the kernels)
    _, left, right = canonical_visibility(0, left, right, Sq + capacity, False)
    softcap = check_float("softcap", softcap, minimum=0.0)
    scale = check_float("scale", scale, allow_none=True)
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    if rope is not None and not isinstance(rope, Rope):
        raise TypeError(f"rope must be a flashforge.Rope or None, got {type(rope).__name__}")
    backend = check_backend(backend)
    if backend is None:
        backend = "triton" if dev.type == "cuda" else "torch"
    if num_splits is None:  # split-KV only pays on a GPU
        sms = _sm_count(dev.index if dev.index is not None else torch.cuda.current_device()) \
            if dev.type == "cuda" else 0
        num_splits = auto_splits(Sq, B, Hq, k_cache.shape[2], capacity, sms) if sms else 1
    num_splits = check_int("num_splits", num_splits, minimum=1)

    rope_params = None
    if rope is not None:
        rotary_dim = D if rope.rotary_dim is None else check_int("rope.rotary_dim", rope.rotary_dim)
        if rotary_dim % 2 or not 2 <= rotary_dim <= D:
            raise ValueError(f"rope.rotary_dim is {rotary_dim}; accepted: an even int from 2 to the head dim {D}")
        if rope.style not in STYLES:
            raise ValueError(f"rope.style is {rope.style!r}; accepted: 'half' or 'interleaved'")
        theta = check_float("rope.theta", rope.theta)
        if theta <= 0.0:
            raise ValueError(f"rope.theta must be > 0, got {theta}")
        rope_params = RopeParams(theta=theta, rotary_dim=rotary_dim, interleaved=rope.style == "interleaved")

    # row b has cache_seqlens[b] + s_new keys (the kernels add s_new themselves) and its query 0
    # sits at that count - Sq: the Triton kernel aligns its queries bottom-right against each
    # row's key count itself (no extra kernel in a decoding step); the PyTorch path takes the
    # positions as a tensor (of the clamped key counts, as the kernels clamp unchecked values)
    q_pos = None if backend == "triton" else \
        (cache_seqlens.to(torch.int64).clamp(-s_new, capacity) + s_new).clamp(max=capacity) - Sq
    with torch.no_grad():
        if k is not None:  # rotated (if asked) on the way into the cache
            kvcache_append_function(k_cache, v_cache, k, v, cache_seqlens, block_table, rope_params, backend)
        params = AttnParams(scale=scale, window_left=left, window_right=right, offset_tensor=q_pos,
                            offset_bottom_right=q_pos is None,
                            softcap=softcap, alibi_slopes=_normalise_slopes(alibi_slopes, q, B, Hq),
                            seqlens_k=cache_seqlens, seqlens_k_add=s_new, block_table=block_table,
                            num_splits=num_splits,
                            q_rope=rope_params)  # q is rotated inside the attention kernel
        qc = q if q.stride(-1) == 1 else q.contiguous()
        o, lse = attention_kvcache_function(qc, k_cache, v_cache, params, backend)
    return (o, lse) if return_lse else o
