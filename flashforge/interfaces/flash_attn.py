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
* a query row that sees no key has ``softmax_lse = -inf`` (flash-attn writes ``+inf``);
* with ``causal=True`` and ALiBi, flash-attn's kernel adds ``slope * j`` instead of the
  documented ``-slope * |i + Sk - Sq - j|``: the output is the same (the two differ by a
  constant per row), its ``softmax_lse`` differs by ``slope * (i + Sk - Sq)``;
  flashforge follows the documented formula;
* dropout draws its seed from torch's default generator (flash-attn: the CUDA
  generator), so ``torch.manual_seed(s)`` makes it reproducible on every device; the
  dropout pattern is flashforge's counter-based one, not flash-attn's.

The varlen functions take packed ``[total, H, D]`` tensors with ``cu_seqlens``; their
``softmax_lse`` is ``[H, total_q]``, as flash-attn's (``block_table`` is not supported
there).  ``flash_attn_with_kvcache`` runs on `flashforge.attention_with_kvcache`; its
rotary tables are applied in PyTorch before the call (not fused yet), and
``cache_batch_idx`` / ``cache_leftpad`` are not supported.
"""
from __future__ import annotations

from typing import Optional

import torch

from ..api.attention import attention
from ..api.kvcache import attention_with_kvcache
from ..api.varlen import attention_varlen
from ..api.validate import check_float, check_int, check_tensor

__all__ = ["flash_attn_func", "flash_attn_kvpacked_func", "flash_attn_qkvpacked_func", "flash_attn_varlen_func",
           "flash_attn_varlen_kvpacked_func", "flash_attn_varlen_qkvpacked_func", "flash_attn_with_kvcache"]


def _check_rank(name: str, x, rank: int, layout: str) -> None:
    check_tensor(name, x)
    if x.dim() != rank:
        raise ValueError(f"{name} has shape {tuple(x.shape)}; accepted: {layout}")


def _window(window_size, causal: bool) -> Optional[tuple]:
    if not isinstance(window_size, (tuple, list)) or len(window_size) != 2:
        raise TypeError(f"window_size must be a (left, right) pair of ints, got {window_size!r}")
    # flash-attn treats any negative side as unbounded
    left, right = (max(check_int(f"window_size[{i}]", w), -1) for i, w in enumerate(window_size))
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
        return o, lse, None
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
        return o, lse, None
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
        within each sequence.  ``block_table`` (a paged cache) is not supported here.

    Returns:
        ``out [total_q, Hq, Dv]``, or ``(out, softmax_lse [Hq, total_q] float32, None)``.
    """
    if block_table is not None:
        raise NotImplementedError("flash_attn_varlen_func: block_table (paged K/V) is not supported by "
                                  "flashforge's varlen path yet; pass contiguous packed k, v")
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


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None,
                            cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None, block_table=None,
                            softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                            rotary_interleaved=True, alibi_slopes=None, num_splits=0, return_softmax_lse=False):
    """flash-attn 2's ``flash_attn_with_kvcache``, on `flashforge.attention_with_kvcache`.

    q ``[B, Sq, Hq, D]``; caches ``[B, S_cache, Hkv, D]`` or paged ``[num_blocks, block_size, Hkv, D]``
    with ``block_table``; new ``k``, ``v`` are appended in place at ``cache_seqlens``
    (None: the caches are full).  ``rotary_cos``/``rotary_sin`` (``[seqlen_ro, rotary_dim / 2]``)
    rotate q and the new k at their absolute positions (``rotary_interleaved``: GPT-J pairs).
    Queries are aligned to the end of the keys, as flash-attn.  ``num_splits=0`` picks
    split-KV automatically.  ``cache_batch_idx`` and ``cache_leftpad`` are not supported.

    Returns ``out [B, Sq, Hq, D]``, or ``(out, softmax_lse [B, Hq, Sq])``.
    """
    if cache_batch_idx is not None or cache_leftpad is not None:
        raise NotImplementedError("flash_attn_with_kvcache: cache_batch_idx and cache_leftpad are not supported "
                                  "by flashforge; index the caches yourself")
    if (rotary_cos is None) != (rotary_sin is None):
        raise ValueError("rotary_cos and rotary_sin must be given together")
    window = _window(window_size, causal)
    softcap = max(check_float("softcap", softcap), 0.0)
    B, Sq = q.shape[0], q.shape[1]
    if cache_seqlens is None:  # full caches
        cache_seqlens = (block_table.shape[1] * k_cache.shape[1]) if block_table is not None else k_cache.shape[1]
        cache_seqlens -= 0 if k is None else k.shape[1]
    if rotary_cos is not None:
        s_new = 0 if k is None else k.shape[1]
        ar = lambda n: torch.arange(n, device=q.device).view(1, n)  # noqa: E731
        if isinstance(cache_seqlens, int):  # (an int goes on as it is: checked against the capacity there)
            start = torch.full((B, 1), cache_seqlens, dtype=torch.int64, device=q.device)
        else:
            start = cache_seqlens.long().view(B, 1)
        q = _rotate_with_tables(q, rotary_cos, rotary_sin, start + s_new - Sq + ar(Sq), rotary_interleaved)
        if k is not None:
            k = _rotate_with_tables(k, rotary_cos, rotary_sin, start + ar(s_new), rotary_interleaved)
    return attention_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=cache_seqlens, block_table=block_table,
                                  causal=causal, window=window, softcap=softcap, scale=softmax_scale,
                                  alibi_slopes=alibi_slopes, return_lse=bool(return_softmax_lse),
                                  num_splits=None if not num_splits else num_splits)
