"""PyTorch's own CPU flash-attention kernel, for the calls whose meaning it computes exactly.

``aten::_scaled_dot_product_flash_attention_for_cpu`` (what SDPA runs on the CPU) and its
backward compute ``softmax(scale * q k^T) v`` and the log-sum-exp (float32, natural log)
in fused, multithreaded C++ blocks; the chunked path of `flashforge.ops.attention_torch`
spends most of its time in the separate passes torch ops make over each tile.  This module
routes to the kernel exactly the calls it computes as SPEC section 2 defines them
(`serves`):

* CPU tensors; float32, bfloat16 or float16, computed in float32: low-precision inputs are
  upcast, O(B·S·H·D), rather than handed to the kernel's reduced-precision path, which runs
  a decoding step ~4x slower here and float16 matmuls ~2x slower.  Its bfloat16 backward is
  faster on torch 2.13 (1.24-1.67x at 1k-4k keys on 1 and 2 threads) but gives dK and dV with
  2-4x the error against float64 (up to 1.1e-2 of their largest entry, against <= 3.3e-3
  upcast: `benchmarks/profile/cpu_bf16_backward.py`), so gradients stay upcast, as our GPU
  kernels accumulate them in float32 (the same products with the GPU kernels' rounding points,
  emulated there, give 1.9e-3-3.8e-3: the upcast's accuracy, not the native kernel's).  The
  exception, short bfloat16 forward calls (`NATIVE_MAX_KEYS`), rounds P to bfloat16 before
  P·V, as flash-attn and our Triton kernels do.  float64 (gradcheck) stays on the chunked path;
* a dense call (no packed batch, KV cache or in-kernel RoPE), no mask, no dropout, no
  softcap, no ALiBi, and ``D == Dv``.  Grouped-query attention is run with the kernel's
  query and kv heads paired one to one (only recent kernels know GQA; older ones index K by
  the query head): the G query heads of a kv head become G rows per query (``_to_rows``),
  so K and V are never repeated;
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
256 (`MIN_BLOCK`), 0.75, 0.62, 0.56.  On more than one thread only triangles of at most
`MULTI_THREAD_CUT_MAX` queries are cut: there the smaller calls lose more than the skipped
work saves (measured on 2 threads at 1024 and 2048 queries).  Each call returns its part of the rows' softmax with
its own lse; the forward merges the parts by their lse, the backward runs each part's backward against the whole
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

import functools
from typing import NamedTuple, Optional

import torch
from torch import Tensor

from .params import AttnParams

__all__ = ["serves", "exact_lse", "forward", "backward", "LSE_BOUND", "KEY_CHUNK", "MIN_BLOCK",
           "MULTI_THREAD_CUT_MAX"]

# torch's Python binding of the forward where it has one: ~14 us less per call than the op overload
_FWD = getattr(torch, "_scaled_dot_product_flash_attention_for_cpu", None) \
    or torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
_BWD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

#: Largest |lse| for which the kernel's float32 lse serves the backward (see the module docstring).
LSE_BOUND = 64.0
#: Keys per kernel call for low-precision inputs, upcast one such chunk at a time (`forward`).
KEY_CHUNK = 1024
#: A bfloat16 call of one kernel call, >= 64 queries and at most this many keys, runs the kernel
#: in bfloat16: there the float32 copies (fresh pages) cost more than its bfloat16 matmuls lose
#: (S = 512: 0.86-1.08x SDPA upcast, 1.0x native), while with fewer queries they run ~4x slower.
NATIVE_MAX_KEYS = 512
#: Smallest diagonal block of the causal cut: halving stops before blocks get smaller than this.
#: Each level costs one more call and a merge over half the rows, and the kernel runs calls of
#: fewer than 192 queries in 32-row blocks, less efficiently: 128 measured no better on 1 thread.
MIN_BLOCK = 256
#: On more than one thread, triangles of more queries than this are not cut (the kernel's own
#: causal runs them): the cut's smaller calls scale worse over threads than one big call, and
#: measured 0.91-0.93x the uncut call at 1024 and 2048 queries on 2 threads (1.07x at 512, where
#: the kernel's one 512-key block computes the whole square), while on 1 thread it gains 1-26%.
MULTI_THREAD_CUT_MAX = 512


def serves(q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor], params: AttnParams) -> bool:
    """Whether this dense call is one the kernel computes exactly (module docstring)."""
    p = params
    if (q.device.type != "cpu" or q.dtype not in _DTYPES or mask is not None or p.is_varlen
            or p.seqlens_k is not None or p.q_rope is not None or p.has_dropout or p.softcap > 0
            or p.alibi_slopes is not None or p.window_left >= 0 or p.window_right > 0
            or q.shape[3] != v.shape[3]):
        return False
    return p.window_right < 0 or (p.offset_tensor is None and _causal_offset(p, q.shape[1], k.shape[1]) >= 0)


def exact_lse(lse: Tensor) -> bool:
    """Whether P recomputed from this float32 lse is exact to float32 rounding (|lse| <= LSE_BOUND).
    Reads lse on the host: this path runs there."""
    if lse.numel() == 0:
        return True
    return -LSE_BOUND <= float(lse.min()) and float(lse.max()) <= LSE_BOUND  # NaN: False


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


def _plan(Sq: int, Sk: int, c: Optional[int], key_chunk: Optional[int] = None, cut: bool = True) -> list[_Part]:
    """The kernel calls of one attention call (c: the causal offset, None when not causal); with
    ``key_chunk``, parts of one block take their keys that many at a time; ``cut=False`` leaves
    the causal triangle whole."""
    N = 0 if c is None else min(Sq, Sk - c)  # queries that do not see every key
    if N <= 0:
        parts = [_Part(_span(0, Sq), _span(0, Sk), False, True)]
    else:
        L = 0
        while cut and N % 2 ** (L + 1) == 0 and N // 2 ** (L + 1) >= MIN_BLOCK:
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


def _parts(q: Tensor, k: Tensor, params: AttnParams, key_chunk: Optional[int] = None) -> tuple[_Part, ...]:
    Sq, Sk = q.shape[1], k.shape[1]
    c = None if params.window_right < 0 else _causal_offset(params, Sq, Sk)
    cut = c is None or min(Sq, Sk - c) <= MULTI_THREAD_CUT_MAX or torch.get_num_threads() == 1
    return _cached_plan(Sq, Sk, c, key_chunk, cut, MIN_BLOCK)


@functools.lru_cache(maxsize=512)
def _cached_plan(Sq: int, Sk: int, c: Optional[int], key_chunk: Optional[int], cut: bool,
                 min_block: int) -> tuple[_Part, ...]:
    """`_plan`, kept per shape (``min_block``: the `MIN_BLOCK` it was made with)."""
    return tuple(_plan(Sq, Sk, c, key_chunk, cut))


# Grouped-query attention without repeating K/V: the G query heads of a kv head become G rows
# per query, ``[B, Sq, Hkv*G, E]`` -> ``[B, Sq*G, Hkv, E]`` (row i*G + g = query i of head
# hkv*G + g), and each kernel call sees Hkv heads.  A plain call takes those rows as they come
# (its rows are independent); a causal one needs each row's own query position, so it runs once
# per g on the rows of that g (a strided view).  G = 1 is the identity, without copies.

def _to_rows(x: Tensor, G: int) -> Tensor:
    """``[B, S, H, E]`` -> ``[B, S*G, H/G, E]`` in float32 (a copy when G > 1)."""
    if G == 1:
        return _f32(x)
    B, S, H, E = x.shape
    out = torch.empty(B, S, G, H // G, E, dtype=torch.float32, device=x.device)
    return out.copy_(x.unflatten(2, (H // G, G)).transpose(2, 3)).view(B, S * G, H // G, E)


def _from_rows(x: Tensor, G: int, dtype: torch.dtype) -> Tensor:
    """``[B, S*G, Hkv, E]`` -> a fresh contiguous ``[B, S, Hkv*G, E]`` in ``dtype``."""
    B, SG, Hkv, E = x.shape
    out = torch.empty(B, SG // G, Hkv * G, E, dtype=dtype, device=x.device)
    out.view(B, SG // G, Hkv, G, E).copy_(x.view(B, SG // G, G, Hkv, E).transpose(2, 3))
    return out


def _lse_to_rows(lse: Tensor, G: int) -> Tensor:
    """``[B, Hq, S]`` -> ``[B, Hkv, S*G]``."""
    if G == 1:
        return lse
    B, H, S = lse.shape
    return lse.view(B, H // G, G, S).transpose(2, 3).reshape(B, H // G, S * G)


def _lse_from_rows(lse: Tensor, G: int) -> Tensor:
    """``[B, Hkv, S*G]`` -> a contiguous ``[B, Hq, S]``."""
    B, Hkv, SG = lse.shape
    return lse.view(B, Hkv, SG // G, G).transpose(2, 3).reshape(B, Hkv * G, SG // G).contiguous()


def _scaled(rows: _Sel, G: int) -> _Sel:
    """Query positions -> their rows in the row layout (G rows each)."""
    return rows if G == 1 else _Sel(rows.base * G, rows.n, rows.stride * G, rows.inner * G, rows.size * G)


def _calls(part: _Part, G: int, *rows_tensors: Tensor):
    """The kernel calls of one part: (rows sel, the row-layout tensors' views) for each; the views
    are ``[B, S', Hkv, E]`` and ``[B, Hkv, S']`` (lse), the sel indexes their dim S'."""
    if G == 1 or not part.causal:
        yield _scaled(part.rows, G), rows_tensors
        return
    for g in range(G):
        yield part.rows, tuple(t.unflatten(2, (-1, G))[..., g] if t.dim() == 3 else t.unflatten(1, (-1, G))[:, :, g]
                          for t in rows_tensors)


def forward(q: Tensor, k: Tensor, v: Tensor, params: AttnParams) -> tuple[Tensor, Tensor]:
    """``o [B, Sq, Hq, D]`` in q's dtype and ``lse [B, Hq, Sq]`` (float32) of a call `serves` accepts."""
    B, Sq, Hq, D = q.shape
    G = Hq // k.shape[2]
    # Low-precision keys and values are upcast a part at a time, and plain parts take them
    # KEY_CHUNK at a time: a copy that small stays in cache for the kernel to read, where a
    # whole one would cost a decoding step (one query, all keys) more than the attention.
    key_chunk = None if k.dtype == torch.float32 else KEY_CHUNK
    parts = _parts(q, k, params, key_chunk)
    if len(parts) == 1 and G == 1 and q.dtype == torch.bfloat16 and Sq >= 64 and k.shape[1] <= NATIVE_MAX_KEYS:
        o, lse = _FWD(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), 0.0, parts[0].causal, scale=params.scale)
        return o.transpose(1, 2).contiguous(), lse.contiguous()
    qr = _to_rows(q, G)  # [B, Sq*G, Hkv, D]
    if len(parts) == 1 and (G == 1 or not parts[0].causal):  # one call: the most common, and the one
        o, lse = _FWD(qr.transpose(1, 2), _f32(k).transpose(1, 2), _f32(v).transpose(1, 2), 0.0,  # views cost most
                      parts[0].causal, scale=params.scale)
        if G == 1:  # o: a [B, Sq, H, D] tensor's transposed view
            o = o.transpose(1, 2)
            return (o if q.dtype == torch.float32 else o.to(q.dtype)).contiguous(), lse.contiguous()
        return _from_rows(o.transpose(1, 2), G, q.dtype), _lse_from_rows(lse, G)
    o = lse = None  # [B, Sq*G, Hkv, D], [B, Hkv, Sq*G]
    for part in parts:
        k_p, v_p = _f32(_batch(k, part.keys)), _f32(_batch(v, part.keys))
        if o is None and (G == 1 or not part.causal) and part.rows.n * part.rows.size == Sq:
            # the first call covers every row: its outputs become the accumulators
            o_p, lse_p = _FWD(_batch(qr, _scaled(part.rows, G)), k_p, v_p, 0.0, part.causal, scale=params.scale)
            o = o_p.transpose(1, 2).reshape(qr.shape)
            lse = _unbatch(lse_p, B).transpose(1, 2).reshape(B, qr.shape[2], qr.shape[1])
            continue
        if o is None:
            o = torch.empty(qr.shape, dtype=torch.float32, device=q.device)
            lse = torch.empty(B, qr.shape[2], qr.shape[1], dtype=torch.float32, device=q.device)
        for rows, (q_c, o_c, lse_c) in _calls(part, G, qr, o, lse):
            o_p, lse_p = _FWD(_batch(q_c, rows), k_p, v_p, 0.0, part.causal, scale=params.scale)
            o_p = _unbatch(o_p.transpose(1, 2), B)  # [B, n, size, Hkv, D]
            lse_p = _unbatch(lse_p, B).transpose(1, 2)  # [B, Hkv, n, size]
            o_at, lse_at = rows.of(o_c), rows.of(lse_c, 2)
            if part.first:
                o_at.copy_(o_p)
                lse_at.copy_(lse_p)
            else:
                # softmax over the union of two key sets: weights e^lse / (e^lse + e^lse_p), i.e.
                # sigmoid(lse_p - lse) for the new part; every row here sees a key of each, so both are finite
                w = torch.sigmoid(lse_p - lse_at)  # [B, Hkv, n, size]
                o_at.lerp_(o_p, w.permute(0, 2, 3, 1).unsqueeze(-1))
                lse_at.copy_(torch.logaddexp(lse_at, lse_p))
    if G == 1:
        return o.to(q.dtype).contiguous(), lse.contiguous()
    return _from_rows(o, G, q.dtype), _lse_from_rows(lse, G)


def backward(do: Tensor, q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor,
             params: AttnParams) -> tuple[Tensor, Tensor, Tensor]:
    """``dq, dk, dv`` (shaped and typed like q, k, v) of `forward`'s call, from its o and lse; no lse gradient."""
    G = q.shape[2] // k.shape[2]
    qr, dor, o_r, lse_r = _to_rows(q, G), _to_rows(do, G), _to_rows(o, G), _lse_to_rows(lse, G)
    k32, v32 = _f32(k), _f32(v)
    parts = _parts(q, k, params)
    if len(parts) == 1 and (G == 1 or not parts[0].causal):
        dq, dk, dv = _BWD(dor.transpose(1, 2), qr.transpose(1, 2), k32.transpose(1, 2), v32.transpose(1, 2),
                          o_r.transpose(1, 2), lse_r, 0.0, parts[0].causal, scale=params.scale)
        dq, dk, dv = dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)
    else:
        dq = dk = dv = None
        for part in parts:
            keys = part.keys
            k_p, v_p = _batch(k32, keys), _batch(v32, keys)
            if dq is None and (G == 1 or not part.causal) and part.rows.n * part.rows.size == q.shape[1] \
                    and keys.base == 0 and keys.n * keys.size == k.shape[1]:
                # the first call covers every row and key: its gradients become the accumulators
                rows = _scaled(part.rows, G)
                grads = _BWD(_batch(dor, rows), _batch(qr, rows), k_p, v_p, _batch(o_r, rows), _batch_lse(lse_r, rows),
                             0.0, part.causal, scale=params.scale)
                dq, dk, dv = (g.transpose(1, 2).reshape(x.shape) for g, x in zip(grads, (qr, k, v)))
                continue
            if dq is None:
                dq, dk, dv = (torch.zeros(x.shape, dtype=torch.float32, device=q.device) for x in (qr, k, v))
            for rows, (do_c, q_c, o_c, dq_c, lse_c) in _calls(part, G, dor, qr, o_r, dq, lse_r):
                grads = _BWD(_batch(do_c, rows), _batch(q_c, rows), k_p, v_p, _batch(o_c, rows),
                             _batch_lse(lse_c, rows), 0.0, part.causal, scale=params.scale)
                dq_p, dk_p, dv_p = (_unbatch(g.transpose(1, 2), q.shape[0]) for g in grads)
                rows.of(dq_c).add_(dq_p)
                keys.of(dk).add_(dk_p)
                keys.of(dv).add_(dv_p)
    dq = dq.to(q.dtype) if G == 1 else _from_rows(dq, G, q.dtype)
    return dq, dk.to(k.dtype), dv.to(v.dtype)
