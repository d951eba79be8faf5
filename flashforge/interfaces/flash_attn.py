"""flash-attn 2 compatible functions (``flash_attn.flash_attn_interface``), computed by flashforge.

Change the import and keep the calls::

    from flashforge.flash_attn_interface import flash_attn_func

Same signatures, ``[B, S, H, D]`` layout and meaning as flash-attn 2.x:

* causal is aligned to the bottom-right corner: query i sits at position
  ``i + Sk - Sq`` and sees key j iff ``j <= i + Sk - Sq`` (rows with nothing to see
  give 0);
* ``window_size=(left, right)``: query i sees keys
  ``[i + Sk - Sq - left, i + Sk - Sq + right]``, a negative side being unbounded;
  ``causal`` makes ``right = 0``;
* ``alibi_slopes`` (``[H]`` or ``[B, H]``) adds ``-slope * |i + Sk - Sq - j|`` to the
  score; ``softcap > 0`` caps the scaled score at ``softcap * tanh(score / softcap)``
  before that;
* grouped-query attention: ``Hq % Hkv == 0``, query head h reads kv head ``h // (Hq // Hkv)``.

Beyond flash-attn: float32 inputs, any head dim from 1 to 256, ``Dv != D``, CPU tensors.

Differences, by design:

* ``return_attn_probs=True`` returns ``(out, softmax_lse, None)``: flashforge never forms
  the attention probabilities (flash-attn documents its ``S_dmask`` as a testing aid
  that may be wrongly scaled, and gives an empty tensor without dropout).
  ``softmax_lse`` is ``[B, H, Sq]`` float32 and differentiable;
* a query row that sees no key has ``softmax_lse = +inf``, as flash-attn writes it
  (flashforge's own functions give ``-inf``, the log of an empty sum);
* with ``causal=True`` and ALiBi, flash-attn's kernel adds ``slope * j`` instead of the
  documented ``-slope * |i + Sk - Sq - j|``: the output is the same (the two differ by a
  constant per row), its ``softmax_lse`` differs by ``slope * (i + Sk - Sq)``;
  flashforge follows the documented formula;
* dropout draws its seed from torch's default generator (flash-attn: the CUDA
  generator), so ``torch.manual_seed(s)`` makes it reproducible on every device; the
  dropout pattern is flashforge's counter-based one, not flash-attn's.

The varlen functions take packed ``[total, H, D]`` tensors with ``cu_seqlens``; their
``softmax_lse`` is ``[H, total_q]``, as flash-attn's (``block_table``: k, v from a paged
cache, gathered first).  ``flash_attn_with_kvcache`` runs on `flashforge.attention_with_kvcache`;
its rotary tables are applied in PyTorch before the call (not fused yet) at flash-attn's
positions, ``cache_leftpad`` takes the dense kernel with a key mask, and ``cache_batch_idx``
gathers the selected caches (a copy) and writes the appended rows back.
"""
from __future__ import annotations

import operator
from typing import Optional

import torch

from ..api.attention import attention
from ..api.kvcache import attention_with_kvcache
from ..api.varlen import attention_varlen
from ..api.validate import check_float, check_tensor, values_visible

__all__ = ["flash_attn_func", "flash_attn_kvpacked_func", "flash_attn_qkvpacked_func", "flash_attn_varlen_func",
           "flash_attn_varlen_kvpacked_func", "flash_attn_varlen_qkvpacked_func", "flash_attn_with_kvcache"]


def _check_rank(name: str, x, rank: int, layout: str) -> None:
    check_tensor(name, x)
    if x.dim() != rank:
        raise ValueError(f"{name} has shape {tuple(x.shape)}; accepted: {layout}")


class FlashAttnInputError(ValueError, RuntimeError):
    """An input flash-attn rejects as well: a ``ValueError`` like every flashforge input error,
    and a ``RuntimeError`` like flash-attn's (its C++ checks raise RuntimeError)."""


def _empty_rows_inf(lse: torch.Tensor) -> torch.Tensor:
    """flash-attn's lse of a row that sees no key, +inf (its kernels: a zero sum gives INFINITY),
    from flashforge's -inf; out of place, so the lse the backward saved stays as it is."""
    return torch.where(lse == float("-inf"), float("inf"), lse)


def _gather_caches(k_cache, v_cache, cache_batch_idx, block_table):
    """flash-attn's ``cache_batch_idx``: query batch b reads cache ``cache_batch_idx[b]``.
    Returns the gathered copies (or the caches themselves without an index).  Out-of-range
    indices: ValueError where their values are visible (CPU, check_inputs), else clamped, so
    no index reaches outside the caches."""
    if cache_batch_idx is None:
        return k_cache, v_cache, None
    if block_table is not None:
        raise FlashAttnInputError("flash_attn_with_kvcache: cache_batch_idx with a paged cache (block_table) is not "
                                  "supported, as in flash-attn")
    idx = check_tensor("cache_batch_idx", cache_batch_idx)
    if idx.dim() != 1 or idx.dtype not in (torch.int32, torch.int64) or idx.device != k_cache.device:
        raise FlashAttnInputError(f"cache_batch_idx must be a 1-D int32/int64 tensor on {k_cache.device}, got "
                                  f"shape {tuple(idx.shape)}, {idx.dtype} on {idx.device}")
    n = k_cache.shape[0]
    if values_visible(idx, None):
        bad = (idx < 0) | (idx >= n)
        if bool(bad.any()):
            raise FlashAttnInputError(f"cache_batch_idx: entries must be in [0, {n}) (the caches' batch), got "
                                      f"{idx[bad][:4].tolist()}")
    idx = idx.long().clamp(0, n - 1)
    return k_cache.index_select(0, idx), v_cache.index_select(0, idx), idx


def _window_sides(window_size) -> tuple[int, int]:
    """flash-attn's ``window_size``: any pair whose items are integers (ints, numpy or 0-d torch
    integers: its tests pass ``torch.randint(0, n, (2,))``), a negative side meaning unbounded."""
    try:
        pair = tuple(window_size)
    except TypeError:
        pair = ()
    if len(pair) != 2:
        raise TypeError(f"window_size must be a (left, right) pair of ints, got {window_size!r}")
    sides = []
    for i, w in enumerate(pair):
        try:
            sides.append(max(operator.index(w), -1))
        except TypeError:
            raise TypeError(f"window_size[{i}] must be an int, got {type(w).__name__} ({w!r})") from None
    return sides[0], sides[1]


def _window(window_size, causal: bool) -> Optional[tuple]:
    left, right = _window_sides(window_size)
    if causal:
        right = 0
    return None if (left, right) == (-1, -1) else (left, right)


def _flash_attn(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                return_attn_probs):
    """flash-attn's meaning on validated 4-D q ``[B, Sq, Hq, D]``, k, v ``[B, Sk, Hkv, D]``."""
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    window = _window(window_size, causal)
    softcap = max(check_float("softcap", softcap), 0.0)  # flash-attn: anything <= 0 turns it off
    out = attention(q, k, v, causal=causal, causal_offset=k.shape[1] - q.shape[1], window=window,
                    dropout_p=dropout_p, scale=softmax_scale, softcap=softcap, alibi_slopes=alibi_slopes,
                    deterministic=deterministic, return_lse=bool(return_attn_probs))
    if return_attn_probs:
        o, lse = out
        return o, _empty_rows_inf(lse), None
    return out


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                    alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """flash-attn 2's ``flash_attn_func``: bottom-right causal attention in the BSHD layout.

    Args:
        q: ``[B, Sq, Hq, D]``.
        k: ``[B, Sk, Hkv, D]``; ``Hq % Hkv == 0``.
        v: ``[B, Sk, Hkv, Dv]``.
        dropout_p: dropout probability in [0, 1), applied whenever > 0 (pass 0.0 in evaluation).
        softmax_scale: score scale, default ``1/sqrt(D)``.
        causal: query i sees key j iff ``j <= i + Sk - Sq`` (bottom-right aligned).
        window_size: ``(left, right)``: keys ``[i + Sk - Sq - left, i + Sk - Sq + right]``; -1 = unbounded.
        softcap: if > 0, ``score = softcap * tanh(score / softcap)``.
        alibi_slopes: float32 ``[Hq]`` or ``[B, Hq]``: adds ``-slope * |i + Sk - Sq - j|`` to the score.
        deterministic: bitwise-reproducible backward.
        return_attn_probs: also return ``softmax_lse`` and, in place of the probabilities, None.

    Returns:
        ``out [B, Sq, Hq, Dv]``, or ``(out, softmax_lse [B, Hq, Sq] float32, None)``.
    """
    for name, t in (("q", q), ("k", k), ("v", v)):
        _check_rank(name, t, 4, "[batch, seqlen, nheads, headdim]")
    return _flash_attn(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                       deterministic, return_attn_probs)


def flash_attn_qkvpacked_func(qkv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                              softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """flash-attn 2's ``flash_attn_qkvpacked_func``: q, k, v packed in ``qkv [B, S, 3, H, D]``.

    Same arguments and returns as `flash_attn_func` (here Sq = Sk, so causal is the usual
    lower triangle).  The gradient is one ``[B, S, 3, H, D]`` tensor, like qkv.
    """
    _check_rank("qkv", qkv, 5, "[batch, seqlen, 3, nheads, headdim]")
    if qkv.shape[2] != 3:
        raise ValueError(f"qkv has shape {tuple(qkv.shape)}; dim 2 must be 3 (q, k, v): "
                         f"[batch, seqlen, 3, nheads, headdim]")
    q, k, v = qkv.unbind(2)  # views: the last dim keeps stride 1
    return _flash_attn(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                       deterministic, return_attn_probs)


def flash_attn_kvpacked_func(q, kv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                             softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """flash-attn 2's ``flash_attn_kvpacked_func``: q ``[B, Sq, Hq, D]``, k and v packed in
    ``kv [B, Sk, 2, Hkv, D]`` (``Hq % Hkv == 0``).

    Same arguments and returns as `flash_attn_func`.  The gradient of kv is one
    ``[B, Sk, 2, Hkv, D]`` tensor, like kv.
    """
    _check_rank("q", q, 4, "[batch, seqlen, nheads, headdim]")
    _check_rank("kv", kv, 5, "[batch, seqlen, 2, nheads_k, headdim]")
    if kv.shape[2] != 2:
        raise ValueError(f"kv has shape {tuple(kv.shape)}; dim 2 must be 2 (k, v): "
                         f"[batch, seqlen, 2, nheads_k, headdim]")
    k, v = kv.unbind(2)
    return _flash_attn(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                       deterministic, return_attn_probs)


def _flash_attn_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale,
                       causal, window_size, softcap, alibi_slopes, deterministic, return_attn_probs):
    """flash-attn's varlen meaning: bottom-right alignment within each sequence."""
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    window = _window(window_size, causal)
    softcap = max(check_float("softcap", softcap), 0.0)
    out = attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=causal,
                           causal_offset="bottom_right", window=window, dropout_p=dropout_p, scale=softmax_scale,
                           softcap=softcap, alibi_slopes=alibi_slopes, deterministic=deterministic,
                           return_lse=bool(return_attn_probs))
    if return_attn_probs:
        o, lse = out
        return o, _empty_rows_inf(lse), None
    return out


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                           softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                           deterministic=False, return_attn_probs=False, block_table=None):
    """flash-attn 2's ``flash_attn_varlen_func``: sequences packed along dim 0.

    Args:
        q: ``[total_q, Hq, D]``; k, v: ``[total_k, Hkv, D]``.
        cu_seqlens_q, cu_seqlens_k: int32 ``[B + 1]`` cumulative lengths.
        max_seqlen_q, max_seqlen_k: ints, the longest sequences.
        Other arguments as `flash_attn_func`; causal and windows are bottom-right aligned
        within each sequence.
        block_table: int32 ``[B, max_blocks]``: k and v are then paged caches
            ``[num_blocks, page, Hkv, D]`` and key j of sequence b is row ``j % page`` of block
            ``block_table[b, j // page]`` (its keys are gathered first: a copy, and a host sync).

    Returns:
        ``out [total_q, Hq, Dv]``, or ``(out, softmax_lse [Hq, total_q] float32, None)``.
    """
    if block_table is not None:
        k, v = _gather_pages(k, v, block_table, cu_seqlens_k)
    return _flash_attn_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                              softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                              return_attn_probs)


def flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, dropout_p=0.0, softmax_scale=None, causal=False,
                                     window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
                                     return_attn_probs=False):
    """flash-attn 2's ``flash_attn_varlen_qkvpacked_func``: ``qkv [total, 3, H, D]``, one
    ``cu_seqlens`` for queries and keys.  Same returns as `flash_attn_varlen_func`."""
    _check_rank("qkv", qkv, 4, "[total, 3, nheads, headdim]")
    if qkv.shape[1] != 3:
        raise ValueError(f"qkv has shape {tuple(qkv.shape)}; dim 1 must be 3 (q, k, v): [total, 3, nheads, headdim]")
    q, k, v = qkv.unbind(1)
    return _flash_attn_varlen(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, dropout_p, softmax_scale,
                              causal, window_size, softcap, alibi_slopes, deterministic, return_attn_probs)


def flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                                    softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                                    alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """flash-attn 2's ``flash_attn_varlen_kvpacked_func``: q ``[total_q, Hq, D]``, ``kv [total_k, 2, Hkv, D]``.
    Same returns as `flash_attn_varlen_func`."""
    _check_rank("kv", kv, 4, "[total_k, 2, nheads_k, headdim]")
    if kv.shape[1] != 2:
        raise ValueError(f"kv has shape {tuple(kv.shape)}; dim 1 must be 2 (k, v): [total_k, 2, nheads_k, headdim]")
    k, v = kv.unbind(1)
    return _flash_attn_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                              softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                              return_attn_probs)


def _gather_pages(k_cache, v_cache, block_table, cu_seqlens_k):
    """Packed ``k, v [total_k, Hkv, D]`` of a paged cache, sequence b's keys from its row of the
    block table (differentiable: the gradients reach the pages)."""
    check_tensor("block_table", block_table)
    for name, t in (("k", k_cache), ("v", v_cache)):
        _check_rank(name, t, 4, "[num_blocks, page_block_size, nheads_k, headdim] with block_table")
    if block_table.dtype != torch.int32 or block_table.dim() != 2 \
            or block_table.shape[0] != cu_seqlens_k.shape[0] - 1:
        raise FlashAttnInputError(f"block_table must be an int32 tensor [batch, max_num_blocks_per_seq] with "
                                  f"batch = {cu_seqlens_k.shape[0] - 1}; got {block_table.dtype} "
                                  f"{tuple(block_table.shape)}")
    num_blocks, page = k_cache.shape[:2]
    cu = cu_seqlens_k.long()
    lens = cu[1:] - cu[:-1]
    total = int(cu[-1])  # host sync: the packed size
    longest = int(lens.max()) if lens.numel() else 0
    if longest > block_table.shape[1] * page:
        raise FlashAttnInputError(f"a sequence of {longest} keys exceeds the capacity addressable by block_table "
                                  f"({block_table.shape[1]} blocks x {page} = {block_table.shape[1] * page})")
    seq = torch.repeat_interleave(torch.arange(lens.numel(), device=cu.device), lens, output_size=total)
    j = torch.arange(total, device=cu.device) - cu[seq]
    blocks = block_table.long()[seq, j // page]
    if total and not 0 <= int(blocks.min()) <= int(blocks.max()) < num_blocks:
        raise FlashAttnInputError(f"block_table has entries outside [0, {num_blocks}) for the keys in use")
    return k_cache[blocks, j % page], v_cache[blocks, j % page]


def _rotate_with_tables(x, cos, sin, pos, interleaved: bool):
    """flash-attn's rotary with precomputed tables: x ``[B, S, H, D]`` at positions ``pos [B, S]``,
    ``cos``/``sin`` ``[seqlen_ro, rotary_dim / 2]``; the first rotary_dim dims rotate."""
    half, rows = cos.shape[-1], cos.shape[0]
    if pos.device.type == "cpu" and pos.numel() and int(pos.max()) >= rows:
        raise ValueError(f"rotary_cos has {rows} rows but position {int(pos.max())} is needed (cache_seqlens + "
                         f"S_new must stay within the rotary tables)")
    pos = pos.clamp(0, rows - 1)  # unchecked device positions must not index outside the tables
    c = cos[pos][:, :, None, :].float()  # [B, S, 1, rd/2]
    s_ = sin[pos][:, :, None, :].float()
    xr, xp = x[..., :2 * half].float(), x[..., 2 * half:]
    if interleaved:
        x1, x2 = xr[..., 0::2], xr[..., 1::2]
        out = torch.stack([x1 * c - x2 * s_, x2 * c + x1 * s_], dim=-1).flatten(-2)
    else:
        x1, x2 = xr[..., :half], xr[..., half:]
        out = torch.cat([x1 * c - x2 * s_, x2 * c + x1 * s_], dim=-1)
    return torch.cat([out.to(x.dtype), xp], dim=-1)


def _kvcache_window(window_size, causal: bool, Sq: int, capacity: int, has_alibi: bool):
    """(window for flashforge, whether flash-attn counts the call causal or local): its
    mha_fwd_kvcache drops causal for one query without ALiBi and takes a side at or past the
    cache's capacity as unbounded; the second part decides where it rotates the queries."""
    left, right = _window_sides(window_size)
    if causal and not (Sq == 1 and not has_alibi):
        right = 0
    left = -1 if left >= capacity else left
    right = -1 if right >= capacity else right
    return (None if (left, right) == (-1, -1) else (left, right)), (left >= 0 or right >= 0)


def _check_cache_rows(cache_seqlens, s_new: int, capacity: int, block_table) -> None:
    """flash-attn checks a paged cache's lengths on the host (a sync) and raises; so does this."""
    if block_table is None:
        return
    if isinstance(cache_seqlens, int):
        longest = cache_seqlens + s_new
    else:
        longest = int(cache_seqlens.max()) + s_new if cache_seqlens.numel() else 0
    if longest > capacity:
        raise FlashAttnInputError(f"paged KV cache: max(cache_seqlens){' + seqlen_knew' if s_new else ''} "
                                  f"(= {longest}) exceeds the capacity addressable by block_table "
                                  f"(max_num_blocks_per_seq * page_block_size = {capacity})")


def _attention_leftpad(q, k_cache, v_cache, k, v, cache_seqlens, cache_leftpad, causal, window, softcap,
                       softmax_scale, alibi_slopes, return_lse):
    """flash-attn's ``cache_leftpad``: row b's keys are [leftpad_b, cache_seqlens_b + S_new); the
    positions (causal alignment, ALiBi, rotary) stay those of the whole row.  Appends, then runs
    the dense kernel over the cache with a key mask ``[B, 1, 1, S_cache]`` (no split-KV)."""
    from ..autograd.kvcache import kvcache_append_function  # the append alone, as attention_with_kvcache does

    B, Sq = q.shape[:2]
    check_tensor("cache_leftpad", cache_leftpad)
    if cache_leftpad.dtype != torch.int32 or cache_leftpad.shape != (B,) or cache_leftpad.device != q.device:
        raise FlashAttnInputError(f"cache_leftpad must be an int32 tensor [batch] = [{B}] on {q.device}; got "
                                  f"{cache_leftpad.dtype} {tuple(cache_leftpad.shape)} on {cache_leftpad.device}")
    s_new = 0 if k is None else k.shape[1]
    kc, vc = k_cache[:B], v_cache[:B]
    if k is not None:
        if k.shape != (B, s_new, *k_cache.shape[2:]) or v.shape != (B, s_new, *v_cache.shape[2:]):
            raise FlashAttnInputError(f"new k {tuple(k.shape)} / v {tuple(v.shape)} must be [batch, seqlen_new, "
                                      f"nheads_k, headdim] matching q's batch {B} and the caches")
        if k.dtype != k_cache.dtype or v.dtype != v_cache.dtype:
            raise FlashAttnInputError(f"new k, v ({k.dtype}, {v.dtype}) must have the caches' dtype {k_cache.dtype}")
        kvcache_append_function(k_cache, v_cache, k, v, cache_seqlens, None, None,
                                "triton" if q.device.type == "cuda" else "torch")
    ends = cache_seqlens.long() + s_new
    j = torch.arange(kc.shape[1], device=q.device)
    keep = (j >= cache_leftpad.long()[:, None]) & (j < ends[:, None])  # [B, S_cache]
    return attention(q, kc, vc, causal=causal, causal_offset=ends - Sq, window=window, mask=keep[:, None, None],
                     scale=softmax_scale, softcap=softcap, alibi_slopes=alibi_slopes, return_lse=return_lse)


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None,
                            cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None, block_table=None,
                            softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                            rotary_interleaved=True, alibi_slopes=None, num_splits=0, return_softmax_lse=False):
    """flash-attn 2's ``flash_attn_with_kvcache``, on `flashforge.attention_with_kvcache`.

    q ``[B, Sq, Hq, D]``; caches ``[B, S_cache, Hkv, D]`` or paged ``[num_blocks, block_size, Hkv, D]``
    with ``block_table``; new ``k``, ``v`` are appended in place at ``cache_seqlens``
    (None: the caches are full).  Queries are aligned to the end of the keys, as flash-attn.
    ``rotary_cos``/``rotary_sin`` (``[seqlen_ro, rotary_dim / 2]``, ``rotary_interleaved``: GPT-J
    pairs) rotate, when new keys are appended, key i at ``cache_seqlens + i`` and query i at
    ``cache_seqlens + i`` if the call is causal or local, else every query at ``cache_seqlens``
    (flash-attn's rule, what its kernel does: without new keys it rotates nothing).  A paged
    cache's lengths are checked on the host, as flash-attn does (a sync).  ``cache_leftpad``
    [B]: row b's keys start at ``cache_leftpad[b]`` (contiguous caches; the dense kernel with a
    key mask).  ``num_splits=0`` picks split-KV automatically.  ``cache_batch_idx`` [B]: query
    batch b uses cache ``cache_batch_idx[b]`` (contiguous caches): the selected caches are
    gathered (a copy) and, when ``k``/``v`` are given, the appended rows written back; with
    repeated indices the rows written back come from one of the repeats, as in flash-attn.
    Rows that see no key get ``softmax_lse = +inf``, as in flash-attn.

    Returns ``out [B, Sq, Hq, D]``, or ``(out, softmax_lse [B, Hq, Sq])``.
    """
    if cache_leftpad is not None and block_table is not None:
        raise FlashAttnInputError("flash_attn_with_kvcache: cache_leftpad with a paged cache (block_table) is not "
                                  "supported, as in flash-attn")
    if (rotary_cos is None) != (rotary_sin is None):
        raise ValueError("rotary_cos and rotary_sin must be given together")
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        _check_rank(name, t, 4, "[batch, seqlen, nheads, headdim]")
    softcap = max(check_float("softcap", softcap), 0.0)
    caches = k_cache, v_cache
    k_cache, v_cache, idx = _gather_caches(k_cache, v_cache, cache_batch_idx, block_table)
    B, Sq = q.shape[0], q.shape[1]
    s_new = 0 if k is None else k.shape[1]
    capacity = block_table.shape[1] * k_cache.shape[1] if block_table is not None else k_cache.shape[1]
    window, local = _kvcache_window(window_size, causal, Sq, capacity, alibi_slopes is not None)
    if cache_seqlens is None:  # full caches
        cache_seqlens = capacity - s_new
    if not isinstance(cache_seqlens, torch.Tensor):  # an int goes on as it is: checked against the capacity there
        cache_seqlens = operator.index(cache_seqlens)
    _check_cache_rows(cache_seqlens, s_new, capacity, block_table)
    lens = cache_seqlens if isinstance(cache_seqlens, torch.Tensor) else torch.full(
        (B,), cache_seqlens, dtype=torch.int32, device=q.device)
    if rotary_cos is not None and k is not None:
        ar = lambda n: torch.arange(n, device=q.device).view(1, n)  # noqa: E731
        start = lens.long().view(B, 1)
        q = _rotate_with_tables(q, rotary_cos, rotary_sin, start + ar(Sq) if local else start.expand(B, Sq),
                                rotary_interleaved)
        k = _rotate_with_tables(k, rotary_cos, rotary_sin, start + ar(s_new), rotary_interleaved)
    if cache_leftpad is not None:
        out = _attention_leftpad(q, k_cache, v_cache, k, v, lens, cache_leftpad, causal, window, softcap,
                                 softmax_scale, alibi_slopes, bool(return_softmax_lse))
    else:
        out = attention_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=cache_seqlens, block_table=block_table,
                                     causal=causal, window=window, softcap=softcap, scale=softmax_scale,
                                     alibi_slopes=alibi_slopes, return_lse=bool(return_softmax_lse),
                                     num_splits=None if not num_splits else num_splits)
    if idx is not None and k is not None:  # the gathered copies took the new rows: write them back
        caches[0].index_copy_(0, idx, k_cache)
        caches[1].index_copy_(0, idx, v_cache)
    if return_softmax_lse:
        o, lse = out
        return o, _empty_rows_inf(lse)
    return out
