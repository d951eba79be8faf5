"""PyTorch's own CPU flash-attention kernel, for the calls whose meaning it computes exactly.

``aten::_scaled_dot_product_flash_attention_for_cpu`` (what SDPA runs on the CPU) and its
backward compute ``softmax(scale * q k^T) v`` and the log-sum-exp (float32, natural log)
in fused, multithreaded C++ blocks; the chunked path of `flashforge.ops.attention_torch`
spends most of its time in the separate passes torch ops make over each tile.  This module
routes to the kernel exactly the calls it computes as SPEC section 2 defines them
(`serves`):

* CPU tensors; float32, bfloat16 or float16, always computed in float32 (our accumulation
  rule: low-precision inputs are upcast once, O(B·S·H·D), rather than handed to the
  kernel's reduced-precision path, which rounds P to the input dtype before its matmuls);
  float64 (gradcheck) stays on the chunked path;
* a dense call (no packed batch, KV cache or in-kernel RoPE), no mask, no dropout, no
  softcap, no ALiBi, ``Hq == Hkv`` (the kernel pairs query head h with kv head h) and
  ``D == Dv``;
* no window, or causal (``window = (-1, 0)``) with one int offset ``c >= 0`` (every query
  sees key 0, so no row is fully masked: the kernel would give such a row lse 0, not -inf).

The kernel's causal rule is top-left (key j visible from query i iff j <= i).  With an
offset c, query i sees keys ``[0, min(i + c + 1, Sk))``: keys ``[0, c)`` are visible to every
query (one plain call), and the N = min(Sq, Sk - c) queries that do not see every key face
keys ``[c, c + N)`` in a top-left triangle; the other queries see all keys (one plain call).
The triangle is cut in halves, ``L`` times over: the diagonal blocks (one causal call,
the blocks stacked as a batch: views, no copies) and at each level the rectangles below
the diagonal (one plain call per level).  The kernel itself skips whole 512-key blocks only:
of a square of 512, 1024, 2048 queries it computes 1.0, 0.75, 0.62; cut down to blocks of
256 (`MIN_BLOCK`), 0.75, 0.62, 0.56.  Each call returns its part of the rows' softmax with its own lse; the forward
merges the parts by their lse, the backward runs each part's backward against the whole
rows' o and lse (which is all the FA2 backward needs) and sums the parts' gradients.

The log-sum-exp for the backward (`flashforge.ops.params`): the kernel returns lse rounded
to float32 and its backward recomputes P from it.  Where ``|lse| <= LSE_BOUND`` that
rounding moves P by less than 5e-6 relative (half an ulp of lse, plus the one of
``lse * log2(e)``), under float32 attention's own error, and `lse_lo` is written as 0;
beyond it (logits of a diverging run) the caller runs the chunked path instead
(`exact_lse`).  The kernel has no lse gradient, so a backward with ``dlse`` is chunked too.

No atomics and a fixed order of calls and merges: results are bitwise reproducible.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch
from torch import Tensor

from .params import AttnParams

__all__ = ["serves", "exact_lse", "forward", "backward", "LSE_BOUND", "KEY_CHUNK", "MIN_BLOCK"]

_FWD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
_BWD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

#: Largest |lse| for which the kernel's float32 lse serves the backward (see the module docstring).
LSE_BOUND = 64.0
#: Keys per kernel call for low-precision inputs, upcast one such chunk at a time (`forward`).
KEY_CHUNK = 1024
#: Smallest diagonal block of the causal cut: halving stops before blocks get smaller than this.
#: Each level costs one more call and a merge over half the rows, and the kernel runs calls of
#: fewer than 192 queries in 32-row blocks, less efficiently: 128 measured no better on 1 thread.
MIN_BLOCK = 256


def serves(q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor], params: AttnParams) -> bool:
    """Whether this dense call is one the kernel computes exactly (module docstring)."""
    p = params
    if (q.device.type != "cpu" or q.dtype not in _DTYPES or mask is not None or p.is_varlen
            or p.seqlens_k is not None or p.q_rope is not None or p.has_dropout or p.softcap > 0
            or p.alibi_slopes is not None or p.window_left >= 0 or p.window_right > 0
            or q.shape[2] != k.shape[2] or q.shape[3] != v.shape[3]):
        return False
    return p.window_right < 0 or (p.offset_tensor is None and _causal_offset(p, q.shape[1], k.shape[1]) >= 0)


def exact_lse(lse: Tensor) -> bool:
    """Whether P recomputed from this float32 lse is exact to float32 rounding (|lse| <= LSE_BOUND).
    Reads lse on the host: this path runs there."""
    return lse.numel() == 0 or bool(lse.abs().amax() <= LSE_BOUND)


def _causal_offset(p: AttnParams, Sq: int, Sk: int) -> int:
    return p.offset + (Sk - Sq if p.offset_bottom_right else 0)


class _Sel(NamedTuple):
    """Positions ``base + m * stride + inner + t`` (m < n, t < size) along the sequence dim:
    n equal blocks, one batch entry each when handed to the kernel."""
    base: int
    n: int
    stride: int
    inner: int
    size: int

    def of(self, x: Tensor, dim: int = 1) -> Tensor:
        """The view of ``x`` at these positions, the sequence dim split in (n, size)."""
        if self.n == 1:
            return self.run(x, dim).unsqueeze(dim)
        x = x.narrow(dim, self.base, self.n * self.stride)
        x = x.view(x.shape[:dim] + (self.n, self.stride) + x.shape[dim + 1:])
        return x.narrow(dim + 1, self.inner, self.size)

    def run(self, x: Tensor, dim: int = 1) -> Tensor:
        """The one block of positions (``n == 1``) as a view of ``x``."""
        return x if self.size == x.shape[dim] else x.narrow(dim, self.base + self.inner, self.size)


def _span(start: int, size: int) -> _Sel:
    """One block of ``size`` positions from ``start``."""
    return _Sel(start, 1, size, 0, size)


class _Part(NamedTuple):
    rows: _Sel
    keys: _Sel
    causal: bool
    first: bool  # the first part of its rows: written, not merged


def _plan(Sq: int, Sk: int, c: Optional[int], key_chunk: Optional[int] = None) -> list[_Part]:
    """The kernel calls of one attention call (c: the causal offset, None when not causal); with
    ``key_chunk``, parts of one block take their keys that many at a time."""
    N = 0 if c is None else min(Sq, Sk - c)  # queries that do not see every key
    if N <= 0:
        parts = [_Part(_span(0, Sq), _span(0, Sk), False, True)]
    else:
        L = 0
        while N % 2 ** (L + 1) == 0 and N // 2 ** (L + 1) >= MIN_BLOCK:
            L += 1
        b = N >> L
        parts = [_Part(_Sel(0, 2 ** L, b, 0, b), _Sel(c, 2 ** L, b, 0, b), True, True)]
        for level in range(1, L + 1):  # rows in the lower half of each block of 2s, keys in its upper half
            s, n = N >> level, 2 ** (level - 1)
            parts.append(_Part(_Sel(0, n, 2 * s, s, s), _Sel(c, n, 2 * s, 0, s), False, False))
        if c > 0:
            parts.append(_Part(_span(0, N), _span(0, c), False, False))
        if N < Sq:
            parts.append(_Part(_span(N, Sq - N), _span(0, Sk), False, True))
    if key_chunk is None:
        return parts
    split = []
    for part in parts:
        keys = part.keys
        if part.causal or keys.n > 1 or keys.size <= key_chunk:
            split.append(part)
            continue
        for c0 in range(0, keys.size, key_chunk):
            split.append(_Part(part.rows, _span(keys.base + c0, min(key_chunk, keys.size - c0)), False,
                               part.first and c0 == 0))
    return split


def _batch(x: Tensor, sel: _Sel) -> Tensor:
    """``[B, S, H, E]`` -> the kernel's ``[B*n, H, size, E]`` at ``sel`` (a view where strides allow)."""
    if sel.n == 1:
        return sel.run(x).transpose(1, 2)
    return sel.of(x).flatten(0, 1).transpose(1, 2)


def _unbatch(x: Tensor, B: int) -> Tensor:
    """The kernel's ``[B*n, ...]`` -> ``[B, n, ...]``."""
    return x.view((B, x.shape[0] // B) + x.shape[1:])


def _batch_lse(lse: Tensor, sel: _Sel) -> Tensor:
    """``[B, H, S]`` -> ``[B*n, H, size]`` at ``sel``."""
    return sel.of(lse, 2).transpose(1, 2).flatten(0, 1)


def _f32(x: Tensor) -> Tensor:
    return x if x.dtype == torch.float32 else x.float()


def _parts(q: Tensor, k: Tensor, params: AttnParams, key_chunk: Optional[int] = None) -> list[_Part]:
    Sq, Sk = q.shape[1], k.shape[1]
    return _plan(Sq, Sk, None if params.window_right < 0 else _causal_offset(params, Sq, Sk), key_chunk)


def forward(q: Tensor, k: Tensor, v: Tensor, params: AttnParams) -> tuple[Tensor, Tensor]:
    """``o [B, Sq, H, D]`` in q's dtype and ``lse [B, H, Sq]`` (float32) of a call `serves` accepts."""
    B, Sq, H, D = q.shape
    q32 = _f32(q)
    # Low-precision keys and values are upcast a part at a time, and plain parts take them
    # KEY_CHUNK at a time: a copy that small stays in cache for the kernel to read, where a
    # whole one would cost a decoding step (one query, all keys) more than the attention.
    key_chunk = None if k.dtype == torch.float32 else KEY_CHUNK
    parts = _parts(q, k, params, key_chunk)
    if len(parts) == 1:  # one call over every row and key: the most common, and the one the views cost most
        o, lse = _FWD(q32.transpose(1, 2), _f32(k).transpose(1, 2), _f32(v).transpose(1, 2), 0.0, parts[0].causal,
                      scale=params.scale)
        return o.transpose(1, 2).to(dtype=q.dtype, memory_format=torch.contiguous_format), lse.contiguous()
    o = lse = None
    for part in parts:
        o_p, lse_p = _FWD(_batch(q32, part.rows), _f32(_batch(k, part.keys)), _f32(_batch(v, part.keys)), 0.0,
                          part.causal, scale=params.scale)
        o_p = _unbatch(o_p.transpose(1, 2), B)  # [B, n, size, H, D]
        lse_p = _unbatch(lse_p, B).transpose(1, 2)  # [B, H, n, size]
        if o is None:
            if part.rows.n * part.rows.size == Sq:  # it covers every row: its outputs are ours
                o, lse = o_p.reshape(B, Sq, H, D), lse_p.reshape(B, H, Sq)
                continue
            o = torch.empty(B, Sq, H, D, dtype=torch.float32, device=q.device)
            lse = torch.empty(B, H, Sq, dtype=torch.float32, device=q.device)
        o_at, lse_at = part.rows.of(o), part.rows.of(lse, 2)
        if part.first:
            o_at.copy_(o_p)
            lse_at.copy_(lse_p)
        else:
            # softmax over the union of two key sets: weights e^lse / (e^lse + e^lse_p), i.e.
            # sigmoid(lse_p - lse) for the new part; every row here sees a key of each, so both lse are finite
            w = torch.sigmoid(lse_p - lse_at)  # [B, H, n, size]
            o_at.lerp_(o_p, w.permute(0, 2, 3, 1).unsqueeze(-1))
            lse_at.copy_(torch.logaddexp(lse_at, lse_p))
    return o.to(dtype=q.dtype, memory_format=torch.contiguous_format), lse.contiguous()


def backward(do: Tensor, q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor,
             params: AttnParams) -> tuple[Tensor, Tensor, Tensor]:
    """``dq, dk, dv`` (shaped and typed like q, k, v) of `forward`'s call, from its o and lse; no lse gradient."""
    B, Sq, H, D = q.shape
    Sk = k.shape[1]
    q32, k32, v32, do32, o32 = _f32(q), _f32(k), _f32(v), _f32(do), _f32(o)
    parts = _parts(q, k, params)
    if len(parts) == 1:
        grads = _BWD(do32.transpose(1, 2), q32.transpose(1, 2), k32.transpose(1, 2), v32.transpose(1, 2),
                     o32.transpose(1, 2), lse, 0.0, parts[0].causal, scale=params.scale)
        return tuple(g.transpose(1, 2).to(x.dtype) for g, x in zip(grads, (q, k, v)))
    dq = dk = dv = None
    for part in parts:
        rows, keys = part.rows, part.keys
        grads = _BWD(_batch(do32, rows), _batch(q32, rows), _batch(k32, keys), _batch(v32, keys), _batch(o32, rows),
                     _batch_lse(lse, rows), 0.0, part.causal, scale=params.scale)
        dq_p, dk_p, dv_p = (_unbatch(g.transpose(1, 2), B) for g in grads)
        if dq is None:
            if rows.n * rows.size == Sq and keys.base == 0 and keys.n * keys.size == Sk:
                dq, dk, dv = dq_p.reshape(q.shape), dk_p.reshape(k.shape), dv_p.reshape(v.shape)
                continue
            dq, dk, dv = (torch.zeros(x.shape, dtype=torch.float32, device=q.device) for x in (q, k, v))
        rows.of(dq).add_(dq_p)
        keys.of(dk).add_(dk_p)
        keys.of(dv).add_(dv_p)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)
