"""`flashforge.attention_varlen`: attention over a packed batch of variable-length sequences."""
from __future__ import annotations

from typing import Optional, Union

import torch

from ..autograd.attention import attention_function
from .attention import build_params, check_heads_and_dims, check_qkv_rank, unit_last_stride
from .validate import check_bool, check_int, check_tensor, values_visible

__all__ = ["attention_varlen"]


def _check_cu_seqlens(name: str, cu: torch.Tensor, q: torch.Tensor, total: int,
                      check_inputs: bool) -> tuple[torch.Tensor, Optional[int]]:
    """(cu as int32, its longest sequence where its values were checked, else None)."""
    check_tensor(name, cu)
    if cu.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{name} has dtype {cu.dtype}; accepted: int32 (or int64)")
    if cu.dim() != 1 or cu.shape[0] < 2:
        raise ValueError(f"{name} has shape {tuple(cu.shape)}; accepted: [B + 1] with B >= 1 "
                         f"(cumulative sequence lengths starting at 0 and ending at {total})")
    if cu.device != q.device:
        raise ValueError(f"{name} is on {cu.device} but q is on {q.device}")
    longest = None
    if values_visible(cu, check_inputs):
        values = cu.tolist()
        if values[0] != 0:
            raise ValueError(f"{name}[0] is {values[0]}; accepted: 0 (cumulative sequence lengths start at 0)")
        for i in range(1, len(values)):
            if values[i] < values[i - 1]:
                raise ValueError(f"{name} decreases at index {i} ({values[i - 1]} -> {values[i]}); accepted: "
                                 f"non-decreasing cumulative sequence lengths")
        if values[-1] != total:
            raise ValueError(f"{name}[-1] is {values[-1]} but the packed tensor has {total} rows; accepted: "
                             f"a last entry equal to the packed row count")
        longest = max(b - a for a, b in zip(values, values[1:]))
    elif cu.dtype == torch.int64:  # unchecked: no value past int32 may wrap into range (the kernels clamp)
        cu = cu.clamp(0, total)
    return cu.to(torch.int32).contiguous(), longest


def _check_max_seqlen(name: str, value, longest: Optional[int], total: int) -> int:
    """The grid's extent: at least the longest sequence where it is known, and never past the
    packed row count (no sequence is longer: a larger value only adds idle programs)."""
    value = check_int(name, value, minimum=0)
    if longest is not None and value < longest:
        raise ValueError(f"{name} is {value} but the longest sequence has {longest} rows; accepted: >= {longest} "
                         f"(rows past it would not be computed)")
    return min(value, total)


def attention_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                     cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, *, causal: bool = False,
                     causal_offset: Union[int, str, torch.Tensor] = 0, window=None, dropout_p: float = 0.0,
                     seed: Optional[int] = None, scale: Optional[float] = None, softcap: float = 0.0,
                     alibi_slopes: Optional[torch.Tensor] = None, deterministic: bool = False,
                     return_lse: bool = False, backend: Optional[str] = None, allow_tf32: bool = False,
                     check_inputs: bool = False):
    """Attention over B sequences packed along the first dim (flash-attn's varlen layout).

    Args:
        q: ``[total_q, Hq, D]``; sequence b owns rows ``cu_seqlens_q[b]:cu_seqlens_q[b+1]``.
        k, v: ``[total_k, Hkv, D]``, ``[total_k, Hkv, Dv]``, split by ``cu_seqlens_k``.
        cu_seqlens_q, cu_seqlens_k: int32 ``[B + 1]``, cumulative lengths from 0 to the packed row
            count, non-decreasing, on q's device.
        max_seqlen_q, max_seqlen_k: Python ints, at least the longest sequence of each (they size
            the kernel grid; passing them avoids a device-to-host sync).
        check_inputs: also check the values of device ``cu_seqlens_*`` (a device sync); CPU tensors
            are always checked, and a value breaking the rules above raises ``ValueError``.
            Unchecked device values never make a kernel touch memory outside the tensors:
            sequence b is taken as rows ``clamp(cu[b], 0, total)`` to
            ``clamp(cu[b+1], start, total)``; rows that no sequence covers, rows past
            ``max_seqlen_q`` in a sequence (and the keys' gradients past ``max_seqlen_k``) are
            not computed: their contents are unspecified, as in flash-attn.
        causal_offset: per sequence, as in `flashforge.attention`: an int, an int tensor ``[B]``,
            or ``"bottom_right"`` (``Sk_b - Sq_b``, flash-attn's varlen alignment).
        Other options as in `flashforge.attention` (no ``mask``: a packed batch has no dense
        score shape to broadcast against).  The dropout mask of sequence b is that of batch
        row b of the padded dense batch.

    Returns:
        ``o [total_q, Hq, Dv]``, or ``(o, lse)`` with ``lse [Hq, total_q]`` (float32).
    """
    check_qkv_rank(q, k, v, (3,), "[total_q, Hq, D]")
    check_bool("check_inputs", check_inputs)
    cu_q, longest_q = _check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, q, q.shape[0], check_inputs)
    cu_k, longest_k = _check_cu_seqlens("cu_seqlens_k", cu_seqlens_k, q, k.shape[0], check_inputs)
    if cu_q.shape != cu_k.shape:
        raise ValueError(f"cu_seqlens_q has {cu_q.shape[0] - 1} sequences but cu_seqlens_k has {cu_k.shape[0] - 1}")
    max_seqlen_q = _check_max_seqlen("max_seqlen_q", max_seqlen_q, longest_q, q.shape[0])
    max_seqlen_k = _check_max_seqlen("max_seqlen_k", max_seqlen_k, longest_k, k.shape[0])
    B = cu_q.shape[0] - 1
    # one packed "batch" of one: [1, total, H, E]
    q4, k4, v4 = q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0)
    check_heads_and_dims(q4, k4, v4)
    params, seed_tensor, backend = build_params(
        q4, B, q.shape[0] + k.shape[0], causal=causal, causal_offset=causal_offset, window=window,
        dropout_p=dropout_p, seed=seed, scale=scale, softcap=softcap, alibi_slopes=alibi_slopes,
        deterministic=deterministic, allow_tf32=allow_tf32, backend=backend, check_inputs=check_inputs,
        cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k)
    q4, k4, v4 = unit_last_stride(q4, k4, v4)
    o, lse = attention_function(q4, k4, v4, None, params, backend, seed_tensor)
    return (o[0], lse[0]) if return_lse else o[0]
