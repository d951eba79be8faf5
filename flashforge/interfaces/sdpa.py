"""`flashforge.scaled_dot_product_attention`: a drop-in for
`torch.nn.functional.scaled_dot_product_attention` that always runs flashforge's kernels.

Same signature, layout and meaning as SDPA: ``[..., H, L, E]`` tensors (batch dims
first, heads, then sequence), top-left causal alignment, bool masks with True = take
part, float masks added to the scores, PyTorch broadcasting of the leading dims and of
the mask, ``enable_gqa``.  The tensors reach the kernels as transposed views (BSHD), so
nothing is copied in the usual ``[B, H, L, E]`` case.

Where SDPA rejects an input, this raises `SDPAInputError`, which is both a
``ValueError`` (flashforge's convention) and a ``RuntimeError`` (what SDPA raises), so
``except RuntimeError`` written for SDPA keeps working.

Differences from SDPA, by design:

* float64 inputs are refused (flashforge computes in float32; use SDPA for float64);
* ``dropout_p`` must be below 1 (SDPA accepts ``1.0`` and returns zeros);
* ``is_causal=True`` together with ``attn_mask`` raises, as SDPA documents and its math
  backend does (PyTorch's CPU flash kernel instead combines the two; fold the causal
  rule into your mask to get that);
* key and value must have the same number of heads (SDPA broadcasts them separately);
* the mask may not broadcast the output to a larger shape than q, k and v give;
* the dropout mask is flashforge's counter-based one, drawn from torch's generator:
  the same ``torch.manual_seed`` gives the same result, but not SDPA's dropout pattern.
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from ..api.attention import attention
from ..api.validate import FLOAT_DTYPES, check_tensor

__all__ = ["scaled_dot_product_attention", "SDPAInputError"]


class SDPAInputError(ValueError, RuntimeError):
    """An input `torch.nn.functional.scaled_dot_product_attention` rejects as well.

    A ``ValueError`` like every flashforge input error, and a ``RuntimeError`` like SDPA's.
    """


def _check_qkv(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
    for name, t in (("query", query), ("key", key), ("value", value)):
        check_tensor(name, t)
    if min(query.dim(), key.dim(), value.dim()) < 2:
        raise SDPAInputError(
            f"query, key and value must all be at least 2-dimensional ([..., L, E]); got query.dim() = "
            f"{query.dim()}, key.dim() = {key.dim()}, value.dim() = {value.dim()}")
    if not (query.dtype == key.dtype == value.dtype):
        raise SDPAInputError(f"query, key and value must have the same dtype; got {query.dtype}, {key.dtype} "
                             f"and {value.dtype}")
    if query.dtype not in FLOAT_DTYPES:
        raise ValueError(f"query has dtype {query.dtype}; accepted: float16, bfloat16, float32 "
                         f"(flashforge accumulates in float32 and takes no float64)")
    if not (query.device == key.device == value.device):
        raise ValueError(f"query, key and value must be on one device; got {query.device}, {key.device} "
                         f"and {value.device}")
    if key.shape[-1] != query.shape[-1]:
        raise SDPAInputError(f"query and key must have the same embedding dim E; got query {tuple(query.shape)} "
                             f"and key {tuple(key.shape)}")
    if key.shape[-2] != value.shape[-2]:
        raise SDPAInputError(f"key and value must have the same sequence length S; got key {tuple(key.shape)} "
                             f"and value {tuple(value.shape)}")


def _heads(Hq: int, Hk: int, Hv: int, enable_gqa: bool) -> tuple[int, int]:
    """(output heads H, kv heads passed to the kernels); raise where SDPA would."""
    if Hk != Hv:
        raise SDPAInputError(f"key and value must have the same number of heads; got {Hk} and {Hv}")
    if Hq == Hk:
        return Hq, Hk
    if enable_gqa:
        if Hq % Hk != 0:
            raise SDPAInputError(f"with enable_gqa=True the number of query heads must be a multiple of the "
                                 f"number of key/value heads; got Hq={Hq} and Hkv={Hk}")
        return Hq, Hk
    if Hk == 1:  # SDPA broadcasts one kv head over all query heads: grouped attention with one group
        return Hq, 1
    if Hq == 1:  # one query head broadcast over the kv heads
        return Hk, Hk
    raise SDPAInputError(f"query and key/value must have the same number of heads (or one of them 1), but got "
                         f"Hq={Hq} and Hkv={Hk}; try setting enable_gqa=True")


def _flatten_batch(x: torch.Tensor, batch: tuple) -> torch.Tensor:
    """``[*b, H, S, E]`` (``b`` broadcastable to ``batch``, possibly empty) -> ``[prod(batch), H, S, E]``.

    A view (stride 0 where broadcast) unless several batch dims must be merged and their
    strides do not allow it; then `reshape` copies once.
    """
    n = len(batch)
    tail = tuple(x.shape[n:])
    B = math.prod(batch)
    if all(s == 1 for s in x.shape[:n]):
        return x.reshape(1, *tail).expand(B, *tail)
    return x.expand(*batch, *tail).reshape(B, *tail)


def _mask_4d(attn_mask: torch.Tensor, query: torch.Tensor, rank: int, batch: tuple, H: int, L: int,
             S: int) -> torch.Tensor:
    """The mask as ``[1 or B, 1 or H, 1 or L, 1 or S]``, without expanding broadcast dims."""
    check_tensor("attn_mask", attn_mask)
    if attn_mask.dtype not in (torch.bool, torch.float32, query.dtype):
        raise SDPAInputError(f"attn_mask has dtype {attn_mask.dtype}; accepted: torch.bool, torch.float32 "
                             f"or the query's dtype ({query.dtype})")
    if attn_mask.device != query.device:
        raise ValueError(f"attn_mask is on {attn_mask.device} but query is on {query.device}")
    scores = (*batch, H, L, S)
    if attn_mask.dim() > rank:
        raise SDPAInputError(f"attn_mask has shape {tuple(attn_mask.shape)}; it must have rank <= {rank} and "
                             f"broadcast to the attention scores' shape {scores}")
    m = attn_mask.reshape((1,) * (rank - attn_mask.dim()) + tuple(attn_mask.shape))
    for have, want in zip(m.shape, scores):
        if have != 1 and have != want:
            raise SDPAInputError(f"attn_mask of shape {tuple(attn_mask.shape)} is not broadcastable to the "
                                 f"attention scores' shape {scores} (each dim must be 1 or equal)")
    n = len(batch)
    if all(s == 1 for s in m.shape[:n]):  # no batch dims of its own: one plane for every batch entry
        return m.reshape(1, *m.shape[n:])
    return _flatten_batch(m, batch)


def scaled_dot_product_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                                 attn_mask: Optional[torch.Tensor] = None, dropout_p: float = 0.0,
                                 is_causal: bool = False, *, scale: Optional[float] = None,
                                 enable_gqa: bool = False) -> torch.Tensor:
    """`torch.nn.functional.scaled_dot_product_attention`, computed by flashforge.

    Args:
        query: ``[..., Hq, L, E]`` (``[B, Hq, L, E]``, unbatched ``[Hq, L, E]``, one head
            ``[L, E]``, or several leading batch dims).
        key: ``[..., Hkv, S, E]``; leading dims broadcast against query's.
        value: ``[..., Hkv, S, Ev]``.
        attn_mask: bool (True = the key takes part) or float (added to the scores) tensor of
            dtype bool, float32 or query's dtype, broadcastable to ``[..., H, L, S]``; a float
            mask that requires grad gets its gradient.
        dropout_p: dropout probability in [0, 1), applied whenever > 0 (SDPA has no training flag).
        is_causal: top-left causal mask: query i sees key j iff ``j <= i`` (also when L != S).
            Not together with ``attn_mask``.
        scale: score scale, default ``1/sqrt(E)``.
        enable_gqa: let key/value have fewer heads than query (``Hq % Hkv == 0``); query head h
            reads kv head ``h // (Hq // Hkv)``.  Grouped natively: k and v are not repeated.

    Returns:
        ``[..., H, L, Ev]`` in query's dtype (a transposed view of flashforge's BSHD output).

    Raises:
        SDPAInputError (a ValueError and a RuntimeError) where SDPA raises too; ValueError for
        float64 inputs and ``dropout_p >= 1`` (SDPA accepts those).
    """
    _check_qkv(query, key, value)
    if attn_mask is not None and is_causal:
        raise SDPAInputError("attn_mask must be None when is_causal=True (as SDPA requires); fold the causal "
                             "rule into the mask instead")
    if not isinstance(dropout_p, (int, float)) or isinstance(dropout_p, bool) or not 0.0 <= dropout_p <= 1.0:
        raise SDPAInputError(f"dropout_p must be a probability between 0 and 1, got {dropout_p!r}")

    # align ranks (leading size-1 dims, as broadcasting does); rank 3 at least: [*batch, H, L, E]
    out_rank = max(query.dim(), key.dim(), value.dim())
    rank = max(out_rank, 3)
    q, k, v = (t.reshape((1,) * (rank - t.dim()) + tuple(t.shape)) for t in (query, key, value))
    try:
        batch = tuple(torch.broadcast_shapes(q.shape[:-3], k.shape[:-3], v.shape[:-3]))
    except RuntimeError as e:
        raise SDPAInputError(f"the batch dims of query {tuple(query.shape)}, key {tuple(key.shape)} and value "
                             f"{tuple(value.shape)} do not broadcast: {e}") from None
    H, Hkv = _heads(q.shape[-3], k.shape[-3], v.shape[-3], bool(enable_gqa))
    L, S = q.shape[-2], k.shape[-2]
    q = q.expand(*q.shape[:-3], H, L, q.shape[-1])
    k, v = (t.expand(*t.shape[:-3], Hkv, S, t.shape[-1]) for t in (k, v))

    mask = None if attn_mask is None else _mask_4d(attn_mask, query, rank, batch, H, L, S)
    # [B, H, S, E] -> BSHD views: the kernels take any strides with a unit last dim
    q4, k4, v4 = (_flatten_batch(t, batch).transpose(1, 2) for t in (q, k, v))
    o = attention(q4, k4, v4, causal=bool(is_causal), mask=mask, dropout_p=float(dropout_p), scale=scale)

    o = o.transpose(1, 2).reshape(*batch, H, L, o.shape[-1])  # [B, L, H, Ev] -> [*batch, H, L, Ev], a view
    return o[0] if out_rank == 2 else o
