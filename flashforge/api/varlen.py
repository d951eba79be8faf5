"""`flashforge.attention_varlen`: attention over a packed batch of variable-length sequences."""
from __future__ import annotations

from typing import Optional, Union

import torch

from ..autograd.attention import attention_function
from .attention import build_params, check_heads_and_dims, check_qkv_rank, unit_last_stride
from .validate import check_int, check_tensor

__all__ = ["attention_varlen"]


def _check_cu_seqlens(name: str, cu: torch.Tensor, q: torch.Tensor, total: int) -> torch.Tensor:
    check_tensor(name, cu)
    if cu.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{name} has dtype {cu.dtype}; accepted: int32 (or int64)")
    if cu.dim() != 1 or cu.shape[0] < 2:
        raise ValueError(f"{name} has shape {tuple(cu.shape)}; accepted: [B + 1] with B >= 1 "
                         f"(cumulative sequence lengths starting at 0 and ending at {total})")
    if cu.device != q.device:
        raise ValueError(f"{name} is on {cu.device} but q is on {q.device}")
    return cu.to(torch.int32).contiguous()


def attention_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                     cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, *, causal: bool = False,
                     causal_offset: Union[int, str, torch.Tensor] = 0, window=None, dropout_p: float = 0.0,
                     seed: Optional[int] = None, scale: Optional[float] = None, softcap: float = 0.0,
                     alibi_slopes: Optional[torch.Tensor] = None, deterministic: bool = False,
                     return_lse: bool = False, backend: Optional[str] = None, allow_tf32: bool = False):
    """Attention over B sequences packed along the first dim (flash-attn's varlen layout).

    Args:
        q: ``[total_q, Hq, D]``; sequence b owns rows ``cu_seqlens_q[b]:cu_seqlens_q[b+1]``.
        k, v: ``[total_k, Hkv, D]``, ``[total_k, Hkv, Dv]``, split by ``cu_seqlens_k``.
        cu_seqlens_q, cu_seqlens_k: int32 ``[B + 1]``, cumulative lengths from 0, on q's device.
        max_seqlen_q, max_seqlen_k: Python ints, the longest sequence of each (they size the
            kernel grid; passing them avoids a device-to-host sync).  A value smaller than the
            true maximum leaves rows uncomputed: pass the real maxima.
        causal_offset: per sequence, as in `flashforge.attention`: an int, an int tensor ``[B]``,
            or ``"bottom_right"`` (``Sk_b - Sq_b``, flash-attn's varlen alignment).
        Other options as in `flashforge.attention` (no ``mask``: a packed batch has no dense
        score shape to broadcast against).  The dropout mask of sequence b is that of batch
        row b of the padded dense batch.

    Returns:
        ``o [total_q, Hq, Dv]``, or ``(o, lse)`` with ``lse [Hq, total_q]`` (float32).
    """
    check_qkv_rank(q, k, v, (3,), "[total_q, Hq, D]")
    cu_q = _check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, q, q.shape[0])
    cu_k = _check_cu_seqlens("cu_seqlens_k", cu_seqlens_k, q, k.shape[0])
    if cu_q.shape != cu_k.shape:
        raise ValueError(f"cu_seqlens_q has {cu_q.shape[0] - 1} sequences but cu_seqlens_k has {cu_k.shape[0] - 1}")
    max_seqlen_q = check_int("max_seqlen_q", max_seqlen_q, minimum=0)
    max_seqlen_k = check_int("max_seqlen_k", max_seqlen_k, minimum=0)
    B = cu_q.shape[0] - 1
    # one packed "batch" of one: [1, total, H, E]
    q4, k4, v4 = q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0)
    check_heads_and_dims(q4, k4, v4)
    params, seed_tensor, backend = build_params(
        q4, B, causal=causal, causal_offset=causal_offset, window=window, dropout_p=dropout_p, seed=seed,
        scale=scale, softcap=softcap, alibi_slopes=alibi_slopes, deterministic=deterministic,
        allow_tf32=allow_tf32, backend=backend, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
        max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k)
    q4, k4, v4 = unit_last_stride(q4, k4, v4)
    o, lse = attention_function(q4, k4, v4, None, params, backend, seed_tensor)
    return (o[0], lse[0]) if return_lse else o[0]
