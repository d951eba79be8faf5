"""The PyTorch attention path (CPU, or any device with ``backend="torch"``).

Dense CPU calls without mask, dropout, softcap, ALiBi or GQA (plain or causal) go to
PyTorch's own fused CPU flash kernel (`flashforge.ops.attention_cpu_aten`, which says
exactly which calls and why); everything else, and those calls at logits too large
for the kernel's float32 lse, runs the chunked path below.

Exact attention, flash style: queries in blocks of `QUERY_BLOCK` rows, keys in
chunks of `KEY_CHUNK` (wider for short query blocks), an online softmax
(running max ``m``, sum ``l``, accumulator) across the chunks, and a backward
that recomputes P from ``lse`` (SPEC sections 2 and 3).  Nothing of size
Sq x Sk is allocated: beyond accumulation-dtype copies of the inputs
(O(B·H·S·D)), one step holds a few tiles of ``B·Hq·QUERY_BLOCK·KEY_CHUNK``
elements.  Key chunks that no query of the block can see (causal, window,
per-batch offsets) are never computed, and the visibility mask is only built
for tiles that straddle its boundary.

Grouped-query attention without repeating K/V: q is regrouped as
``[B*Hkv, Sq*G, D]`` with row ``i*G + g`` holding query i of head
``hkv*G + g``, so one bmm against a key chunk ``[B*Hkv, c, D]`` scores every
query head of a kv head, and a query block is one contiguous row range.  The
same tiles viewed as ``[B, Hkv, n, G, c]`` broadcast against the mask,
visibility and dropout index tensors.

Scores are kept in log2 units (q is scaled by ``scale * log2(e)`` once), so the
softmax runs on ``exp2``: on x86 CPUs torch's exp2 is about 3x faster than exp.
Keys are also kept transposed (``[B*Hkv, D, Sk]``, contiguous) when enough query
rows share them: the score bmm reads that about 1.6x faster than a transposed view.

Accumulation is float32 for float16/bfloat16/float32 inputs and float64 for
float64 inputs (gradcheck).  Matmuls follow torch's own precision settings.
The loop order is fixed and there are no atomics, so results are bitwise
reproducible: ``params.deterministic`` needs nothing more.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Iterator, Optional

import torch
from torch import Tensor

from . import attention_cpu_aten as aten
from . import attention_cpu_decode as decode
from .dropout import keep_block
from .params import AttnParams
from .rope_torch import rope

__all__ = ["attention_forward", "attention_backward", "QUERY_BLOCK", "KEY_CHUNK"]

# Tile sizes, read at call time (tests shrink them to exercise the chunking).
QUERY_BLOCK = 256
KEY_CHUNK = 256

_NEG_INF = float("-inf")
_LOG2E = 1.4426950408889634
_LN2 = 0.6931471805599453


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _group_rows(x: Tensor, Hkv: int, dtype: torch.dtype) -> Tensor:
    """``[B, S, H, E]`` -> a fresh ``[B*Hkv, S*G, E]`` in ``dtype`` (row ``i*G + g`` = head ``hkv*G + g``)."""
    B, S, H, E = x.shape
    G = H // Hkv
    out = torch.empty(B, Hkv, S, G, E, dtype=dtype, device=x.device)
    out.copy_(x.unflatten(2, (Hkv, G)).transpose(1, 2))
    return out.view(B * Hkv, S * G, E)


def _ungroup_rows(x: Tensor, out: Tensor) -> Tensor:
    """Write grouped ``x [B*Hkv, S*G, E]`` into ``out [B, S, H, E]`` (any strides, any dtype)."""
    B, S, H, E = out.shape
    Hkv = x.shape[0] // B
    G = H // Hkv
    out.unflatten(2, (Hkv, G)).copy_(x.view(B, Hkv, S, G, E).transpose(1, 2))
    return out


def _group_stats(x: Tensor, Hkv: int, dtype: torch.dtype) -> Tensor:
    """Per-row statistics ``[B, Hq, S]`` -> ``[B*Hkv, S*G]`` (possibly a view of ``x``: do not write)."""
    B, H, S = x.shape
    G = H // Hkv
    return x.unflatten(1, (Hkv, G)).transpose(2, 3).reshape(B * Hkv, S * G).to(dtype)


def _ungroup_stats(x: Tensor, B: int, Hq: int, dtype: torch.dtype) -> Tensor:
    """``[B*Hkv, S*G]`` -> ``[B, Hq, S]``."""
    Hkv = x.shape[0] // B
    G = Hq // Hkv
    S = x.shape[1] // G
    return x.view(B, Hkv, S, G).transpose(2, 3).reshape(B, Hq, S).to(dtype)


def _heads_first(x: Tensor, dtype: torch.dtype) -> Tensor:
    """``[B, S, H, E]`` -> ``[B*H, S, E]`` in ``dtype``; may alias ``x`` (read only)."""
    B, S, H, E = x.shape
    return x.transpose(1, 2).reshape(B * H, S, E).to(dtype)


def _heads_last(x: Tensor, like: Tensor) -> Tensor:
    """``[B*H, S, E]`` -> a tensor shaped, typed and strided like ``like [B, S, H, E]``."""
    B, S, H, E = like.shape
    return torch.empty_like(like).copy_(x.view(B, H, S, E).transpose(1, 2))


def _mask5(m: Tensor, Hkv: int, G: int) -> Tensor:
    """View a mask ``[Bm, Hm, Sqm, Skm]`` as ``[Bm, Hkv or 1, Sqm, G or 1, Skm]``, the grouped tile layout."""
    if m.shape[1] == 1:
        return m.unsqueeze(3)
    return m.unflatten(1, (Hkv, G)).transpose(2, 3)


def _tile(m5: Tensor, r0: int, r1: int, c0: int, c1: int) -> Tensor:
    """The part of a 5-D mask view that covers query rows [r0, r1) and keys [c0, c1) (broadcast dims stay 1)."""
    rows = slice(r0, r1) if m5.shape[2] > 1 else slice(None)
    cols = slice(c0, c1) if m5.shape[4] > 1 else slice(None)
    return m5[:, :, rows, :, cols]


class _Tiles:
    """One call's shared set-up: grouped operands, the mask view, the visible tiles and their scores."""

    def __init__(self, q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor], params: AttnParams):
        B, Sq, Hq, _ = q.shape
        Sk, Hkv = k.shape[1], k.shape[2]
        self.B, self.Hq, self.Hkv, self.G, self.Sq, self.Sk = B, Hq, Hkv, Hq // Hkv, Sq, Sk
        self.params = params
        self.acc = _acc_dtype(q.dtype)
        dev = q.device
        # scale * log2(e) folded into q once: scores come out in log2 units, and
        # dK = ln2 * dS^T (scaled q) costs one multiply at the end
        self.q = _group_rows(q, Hkv, self.acc).mul_(params.scale * _LOG2E)  # [B*Hkv, Sq*G, D]
        self.k = _heads_first(k, self.acc)  # [B*Hkv, Sk, D]
        # [B*Hkv, D, Sk]: the score bmm runs ~1.6x faster on it than on a transposed view, but
        # the transposing copy costs ~3.5 ns an element here (~200 query rows' worth of
        # savings): only for calls with enough query rows (never when decoding)
        self.kt = self.k.transpose(1, 2)
        if Sq * self.G >= 256:
            self.kt = self.kt.contiguous()
        self.v = _heads_first(v, self.acc)  # [B*Hkv, Sk, Dv]
        self.mask = None if mask is None else _mask5(mask, Hkv, self.G)
        # ALiBi slopes [B, Hq] -> [B, Hkv, 1, G, 1], the grouped tile layout
        slopes = params.alibi_slopes
        self.slopes = None if slopes is None else (slopes.to(self.acc) * _LOG2E).reshape(B, Hkv, 1, self.G, 1)
        self.rows = torch.arange(Sq, device=dev).view(1, 1, Sq, 1, 1)
        self.cols = torch.arange(Sk, device=dev).view(1, 1, 1, 1, Sk)
        shift = Sk - Sq if params.offset_bottom_right else 0
        if params.offset_tensor is None:
            self.offset = params.offset + shift
            self.offsets = [self.offset]
        else:
            self.offset = params.offset_tensor.to(torch.int64).view(B, 1, 1, 1, 1) + shift
            # The only host sync of the call: tile bounds are Python ints.
            self.offsets = sorted(set(o + shift for o in params.offset_tensor.tolist()))
        self.off_min, self.off_max = self.offsets[0], self.offsets[-1]
        if params.has_dropout:
            # an unseeded call's seed tensor is read once here (on the host: this path runs there)
            self.seed = params.seed if params.seed_tensor is None else int(params.seed_tensor.item())
            base = params.dropout_batch_base * Hq
            self.bh = torch.arange(base, base + B * Hq, device=dev).view(B, Hkv, 1, self.G, 1)  # b*Hq + h

    def row_blocks(self) -> Iterator[tuple[int, int]]:
        for r0 in range(0, self.Sq, QUERY_BLOCK):
            yield r0, min(r0 + QUERY_BLOCK, self.Sq)

    def key_chunks(self, r0: int, r1: int) -> Iterator[tuple[int, int]]:
        """Key chunks [c0, c1) covering exactly the keys visible from some query in [r0, r1) of some batch.

        Per offset the visible keys form one interval; per-batch offsets (KV-cache lengths) can leave gaps
        between those intervals, and chunks are never spent on a gap.  A short query block (decoding)
        takes proportionally wider chunks: the same tile size in fewer Python-level steps.
        """
        step = KEY_CHUNK * max(1, QUERY_BLOCK // (r1 - r0))
        left, right = self.params.window_left, self.params.window_right
        spans: list[list[int]] = []
        for off in self.offsets:  # ascending, so the intervals come sorted by start
            lo = 0 if left < 0 else max(0, r0 + off - left)
            hi = self.Sk if right < 0 else min(self.Sk, r1 + off + right)
            if lo >= hi:
                continue
            if spans and lo <= spans[-1][1]:
                spans[-1][1] = max(spans[-1][1], hi)
            else:
                spans.append([lo, hi])
        for lo, hi in spans:
            for c0 in range(lo, hi, step):
                yield c0, min(c0 + step, hi)

    def _invisible(self, r0: int, r1: int, c0: int, c1: int) -> Optional[Tensor]:
        """Bool ``[1 or B, 1, n, 1, c]``, True where key j is invisible from query i; None if all are visible."""
        left, right = self.params.window_left, self.params.window_right
        left_ok = left < 0 or c0 >= r1 - 1 + self.off_max - left
        right_ok = right < 0 or c1 - 1 <= r0 + self.off_min + right
        if left_ok and right_ok:
            return None
        d = self.cols[..., c0:c1] - (self.rows[:, :, r0:r1] + self.offset)  # key minus absolute query position
        if left_ok:
            return d > right
        if right_ok:
            return d < -left
        return (d < -left) | (d > right)

    def scores(self, r0: int, r1: int, c0: int, c1: int, softcap_grad: bool = False):
        """Masked scores ``[B*Hkv, n*G, c]`` of query rows [r0, r1) against keys [c0, c1), in log2
        units, and, if asked and softcap is on, d(capped)/d(raw) = 1 - tanh^2 of the same shape (else None)."""
        G = self.G
        s = torch.bmm(self.q[:, r0 * G:r1 * G], self.kt[:, :, c0:c1])  # [B*Hkv, n*G, c]
        dcap = None
        cap = self.params.softcap * _LOG2E  # the cap in log2 units: tanh sees the same argument
        if cap > 0:
            t = s.div_(cap).tanh_()
            if softcap_grad:
                dcap = 1.0 - t * t
            s = t.mul_(cap)
        s5 = s.view(self.B, self.Hkv, r1 - r0, G, c1 - c0)
        if self.mask is not None:
            m = _tile(self.mask, r0, r1, c0, c1)
            if m.dtype == torch.bool:
                s5.masked_fill_(~m, _NEG_INF)
            else:
                s5.add_(m, alpha=_LOG2E)
        if self.slopes is not None:
            dist = (self.cols[..., c0:c1] - (self.rows[:, :, r0:r1] + self.offset)).abs()  # [1 or B, 1, n, 1, c]
            s5.sub_(self.slopes * dist)
        invisible = self._invisible(r0, r1, c0, c1)
        if invisible is not None:
            s5.masked_fill_(invisible, _NEG_INF)
        return s, dcap

    def keep(self, r0: int, r1: int, c0: int, c1: int) -> Tensor:
        """Dropout keep-mask of the tile, bool ``[B*Hkv, n*G, c]`` (SPEC: a pure function of (seed, b, h, i, j))."""
        p = self.params
        keep = keep_block(self.seed, p.dropout_p, self.bh[..., 0], self.rows[:, :, r0:r1, :, 0], c0, c1)
        return keep.view(self.B * self.Hkv, (r1 - r0) * self.G, c1 - c0)


def _sequences(params: AttnParams, total_q: int, total_k: int) -> Iterator[tuple[int, slice, slice, AttnParams]]:
    """A packed batch, one dense call per sequence: (b, its q rows, its k rows, its params).
    Bounds are clamped into the packed tensors as the kernels clamp them (`seq_bounds`), so
    unchecked device values never index outside (the public layer checks every value it can see)."""
    cu_q = params.cu_seqlens_q.tolist()  # host sync: this path loops over sequences in Python
    cu_k = params.cu_seqlens_k.tolist()
    offsets = params.offset_tensor.tolist() if params.offset_tensor is not None else None
    for b in range(len(cu_q) - 1):
        one = replace(params, cu_seqlens_q=None, cu_seqlens_k=None, offset_tensor=None,
                      offset=params.offset if offsets is None else offsets[b],
                      alibi_slopes=None if params.alibi_slopes is None else params.alibi_slopes[b:b + 1],
                      dropout_batch_base=b)
        q0, k0 = min(max(cu_q[b], 0), total_q), min(max(cu_k[b], 0), total_k)
        rows_q = slice(q0, min(max(cu_q[b + 1], q0), total_q))
        yield b, rows_q, slice(k0, min(max(cu_k[b + 1], k0), total_k)), one


def _varlen_forward(q: Tensor, k: Tensor, v: Tensor, params: AttnParams,
                    lse_lo: Optional[Tensor]) -> tuple[Tensor, Tensor]:
    o = torch.zeros(*q.shape[:3], v.shape[-1], dtype=q.dtype, device=q.device)
    lse = torch.full((1, q.shape[2], q.shape[1]), _NEG_INF, dtype=_acc_dtype(q.dtype), device=q.device)
    if lse_lo is not None:
        lse_lo.zero_()  # rows of no sequence (past the last cu_seqlens_q entry) included
    for _, rq, rk, one in _sequences(params, q.shape[1], k.shape[1]):
        if rq.stop > rq.start and rk.stop > rk.start:
            o[:, rq], lse[:, :, rq] = attention_forward(q[:, rq], k[:, rk], v[:, rk], None, one,
                                                        lse_lo=None if lse_lo is None else lse_lo[:, :, rq])
    return o, lse


def _varlen_backward(do, dlse, q, k, v, o, lse, lse_lo, params: AttnParams) -> tuple[Tensor, Tensor, Tensor]:
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for _, rq, rk, one in _sequences(params, q.shape[1], k.shape[1]):
        if rq.stop > rq.start and rk.stop > rk.start:
            dq[:, rq], dk[:, rk], dv[:, rk], _ = attention_backward(
                do[:, rq], None if dlse is None else dlse[:, :, rq], q[:, rq], k[:, rk], v[:, rk], None,
                o[:, rq], lse[:, :, rq], one, False, lse_lo=None if lse_lo is None else lse_lo[:, :, rq])
    return dq, dk, dv


def _kvcache_forward(q: Tensor, k: Tensor, v: Tensor, params: AttnParams) -> tuple[Tensor, Tensor]:
    """A KV cache, as a dense call: gather the pages into rows, hide keys past each row's length.

    Only the keys below the longest row's length are gathered, and value rows past each row's own
    length are zeroed: an unused slot may hold anything (NaN from ``torch.empty``), and a weight of
    0 times NaN is NaN.  Unchecked device values are clamped as the kernels clamp them: lengths to
    [0, capacity], block-table entries to [0, num_blocks)."""
    B, Sq, Hq, _ = q.shape
    paged = params.block_table is not None
    capacity = params.block_table.shape[1] * k.shape[1] if paged else k.shape[1]
    add = params.seqlens_k_add  # (clamped before adding: a count near the int64 range must not wrap)
    lengths = (params.seqlens_k.to(torch.int64).clamp(-add, capacity) + add).clamp(max=capacity)  # [B]
    longest = int(lengths.max()) if B else 0  # host sync: this path runs on the host
    if longest == 0:  # no row sees a key
        return (torch.zeros(B, Sq, Hq, v.shape[-1], dtype=q.dtype, device=q.device),
                torch.full((B, Hq, Sq), _NEG_INF, dtype=_acc_dtype(q.dtype), device=q.device))
    if paged:
        table = params.block_table[:, :-(-longest // k.shape[1])].long().clamp(0, k.shape[0] - 1)
        k = k[table].flatten(1, 2)[:, :longest]  # [B, longest, Hkv, D]
        v = v[table].flatten(1, 2)[:, :longest]
    else:
        k, v = k[:B, :longest], v[:B, :longest]
    keep = torch.arange(longest, device=q.device) < lengths.view(B, 1)  # [B, longest]
    v = v.masked_fill(~keep.view(B, longest, 1, 1), 0.0)
    return attention_forward(q, k, v, keep.view(B, 1, 1, longest),
                             replace(params, seqlens_k=None, seqlens_k_add=0, block_table=None, num_splits=1))


def attention_forward(q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor],
                      params: AttnParams, lse_lo: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    """Attention on validated BSHD tensors.

    Args:
        q: ``[B, Sq, Hq, D]``; k: ``[B, Sk, Hkv, D]``; v: ``[B, Sk, Hkv, Dv]``; last-dim stride 1,
            ``Hq % Hkv == 0``, ``Sq, Sk >= 1``.
        mask: None, or ``[Bm, Hm, Sqm, Skm]`` with each dim 1 or full; bool (True = keep) or float (additive).
        params: the normalised call (`AttnParams`).
        lse_lo: None, or a tensor shaped and typed like lse that receives the part of the
            log-sum-exp lse cannot hold, for the backward (`flashforge.ops.params`).

    Returns:
        ``o [B, Sq, Hq, Dv]`` in q's dtype and ``lse [B, Hq, Sq]`` (float32; float64 for float64
        inputs), -inf on fully masked rows, where o is 0.  A packed batch (``params.is_varlen``)
        runs one sequence at a time.
    """
    if params.q_rope is not None:  # q at its absolute positions i + offset (explicit offsets only)
        q = rope(q, params.offset_tensor, None, replace(params.q_rope, pos_base=params.offset))
        params = replace(params, q_rope=None)
    if params.is_varlen:
        return _varlen_forward(q, k, v, params, lse_lo)
    if params.seqlens_k is not None:
        return _kvcache_forward(q, k, v, params)
    route = decode if decode.serves(q, k, v, mask, params) else aten if aten.serves(q, k, v, mask, params) else None
    if route is not None:
        o, lse = route.forward(q, k, v, params)
        # a backward will follow (lse_lo asked for): past the bound only the chunked forward
        # writes the lse_lo it needs, so the kernel's result is dropped (rare: diverging logits)
        if lse_lo is None or aten.exact_lse(lse):
            if lse_lo is not None:
                lse_lo.zero_()
            return o, lse
    t = _Tiles(q, k, v, mask, params)
    B, Hq, G, Sq = t.B, t.Hq, t.G, t.Sq
    BH, Dv = B * t.Hkv, v.shape[-1]
    o = torch.zeros(BH, Sq * G, Dv, dtype=t.acc, device=q.device)
    lse = torch.empty(BH, Sq * G, dtype=t.acc, device=q.device)
    lo = None if lse_lo is None else torch.empty(BH, Sq * G, dtype=t.acc, device=q.device)
    for r0, r1 in t.row_blocks():
        rows = slice(r0 * G, r1 * G)
        acc = o[:, rows]  # [BH, n*G, Dv], accumulated in place
        m = torch.full((BH, (r1 - r0) * G), _NEG_INF, dtype=t.acc, device=q.device)  # [BH, n*G]
        l = torch.zeros_like(m)
        for c0, c1 in t.key_chunks(r0, r1):
            s, _ = t.scores(r0, r1, c0, c1)  # [BH, n*G, c]
            m_new = torch.maximum(m, s.amax(dim=-1))
            # A row with nothing visible yet keeps m = -inf; subtracting 0 instead leaves its exp at 0, not NaN.
            m_ref = m_new.masked_fill(m_new == _NEG_INF, 0.0)
            alpha = (m - m_ref).exp2_()
            p = s.sub_(m_ref.unsqueeze(-1)).exp2_()
            l.mul_(alpha).add_(p.sum(dim=-1))
            if params.has_dropout:
                p.mul_(t.keep(r0, r1, c0, c1))
            acc.mul_(alpha.unsqueeze(-1)).baddbmm_(p, t.v[:, c0:c1])
            m = m_new
        # Fully masked rows: l = 0, so o = 0 and lse = -inf + log 0 = -inf.
        norm = l.masked_fill(l == 0, 1.0)
        if params.has_dropout:
            norm.mul_(1.0 - params.dropout_p)
        acc.div_(norm.unsqueeze(-1))
        lse_b = lse[:, rows]
        torch.mul(m + l.log2(), _LN2, out=lse_b)
        if lo is not None:
            # what the backward's lse * LOG2E (the same float op) misses of m + log2(l); float64,
            # so that neither term is rounded at a large m
            hi = lse_b * _LOG2E
            lo[:, rows] = ((m.double() - hi.double()) + l.double().log2()).masked_fill_(l == 0, 0.0)
    out = _ungroup_rows(o, torch.empty(B, Sq, Hq, Dv, dtype=q.dtype, device=q.device))
    lse_dtype = torch.float64 if t.acc == torch.float64 else torch.float32
    if lse_lo is not None:
        lse_lo.copy_(_ungroup_stats(lo, B, Hq, lse_lo.dtype))
    return out, _ungroup_stats(lse, B, Hq, lse_dtype)


def attention_backward(do: Tensor, dlse: Optional[Tensor], q: Tensor, k: Tensor, v: Tensor,
                       mask: Optional[Tensor], o: Tensor, lse: Tensor, params: AttnParams,
                       need_dmask: bool, lse_lo: Optional[Tensor] = None
                       ) -> tuple[Tensor, Tensor, Tensor, Optional[Tensor]]:
    """Gradients of `attention_forward` (FA2 style: P recomputed from ``lse``, never stored).

    Args:
        do: ``[B, Sq, Hq, Dv]``, the gradient of o; dlse: None or ``[B, Hq, Sq]``, the gradient of lse.
        q, k, v, mask, params: as given to `attention_forward`; o, lse: what it returned, and
            lse_lo what it wrote there (None: taken as 0).
        need_dmask: also return the mask's gradient.

    Returns:
        ``dq, dk, dv`` shaped and typed like q, k, v, and ``dmask``: None unless ``need_dmask``, else the
        gradient of the score (after softcap, before visibility) summed over the mask's broadcast dims,
        shaped like the mask, float32 (float64 for float64 inputs).
    """
    if params.is_varlen:
        return (*_varlen_backward(do, dlse, q, k, v, o, lse, lse_lo, params), None)
    if dlse is None and aten.serves(q, k, v, mask, params) and aten.exact_lse(lse):
        return (*aten.backward(do, q, k, v, o, lse, params), None)
    t = _Tiles(q, k, v, mask, params)
    G = t.G
    do_g = _group_rows(do, t.Hkv, t.acc)  # [BH, Sq*G, Dv]
    # delta_i = rowsum(o_i * do_i); the lse gradient adds dlse_i * P_ij to dS_ij, i.e. delta - dlse.
    delta = _group_rows(o, t.Hkv, t.acc).mul_(do_g).sum(dim=-1)  # [BH, Sq*G]
    if dlse is not None:
        delta.sub_(_group_stats(dlse, t.Hkv, t.acc))
    # Fully masked rows have every score -inf, so any finite lse gives P = 0 there.
    lse_g = _group_stats(lse, t.Hkv, t.acc)
    lse_g = lse_g.masked_fill(lse_g == _NEG_INF, 0.0).mul_(_LOG2E)  # [BH, Sq*G], log2 units like the scores
    lo_g = None if lse_lo is None else _group_stats(lse_lo, t.Hkv, t.acc)
    dq = torch.zeros_like(t.q)  # [BH, Sq*G, D]
    dk = torch.zeros_like(t.k)  # [BH, Sk, D]
    dv = torch.zeros_like(t.v)  # [BH, Sk, Dv]
    dmask = torch.zeros(mask.shape, dtype=t.acc, device=q.device) if need_dmask else None
    dmask5 = _mask5(dmask, t.Hkv, G) if need_dmask else None
    inv_keep = 1.0 / (1.0 - params.dropout_p)
    for r0, r1 in t.row_blocks():
        rows = slice(r0 * G, r1 * G)
        q_b, do_b, dq_b = t.q[:, rows], do_g[:, rows], dq[:, rows]  # [BH, n*G, D | Dv | D]
        lse_b, delta_b = lse_g[:, rows, None], delta[:, rows, None]  # [BH, n*G, 1]
        lo_b = None if lo_g is None else lo_g[:, rows, None]
        for c0, c1 in t.key_chunks(r0, r1):
            s, dcap = t.scores(r0, r1, c0, c1, softcap_grad=True)
            s.sub_(lse_b)  # exact near the row's maximum, where P is not negligible
            if lo_b is not None:
                s.sub_(lo_b)
            p = s.exp2_()  # [BH, n*G, c]
            dp = torch.bmm(do_b, t.v[:, c0:c1].transpose(1, 2))  # [BH, n*G, c]
            if params.has_dropout:
                keep = t.keep(r0, r1, c0, c1)
                dv[:, c0:c1].baddbmm_(torch.mul(p, keep).transpose(1, 2), do_b, alpha=inv_keep)
                dp.mul_(keep).mul_(inv_keep)
            else:
                dv[:, c0:c1].baddbmm_(p.transpose(1, 2), do_b)
            ds = dp.sub_(delta_b).mul_(p)  # gradient of the (capped, masked) score
            if dmask5 is not None:
                target = _tile(dmask5, r0, r1, c0, c1)
                ds5 = ds.view(t.B, t.Hkv, r1 - r0, G, c1 - c0)
                dims = [d for d in range(5) if target.shape[d] == 1 and ds5.shape[d] > 1]
                target.add_(ds5.sum(dim=dims, keepdim=True) if dims else ds5)
            if dcap is not None:
                ds.mul_(dcap)
            dq_b.baddbmm_(ds, t.k[:, c0:c1])
            dk[:, c0:c1].baddbmm_(ds.transpose(1, 2), q_b)
    dq.mul_(params.scale)
    dk.mul_(_LN2)  # q was scaled by scale * log2(e); dK wants scale alone
    dq_out = _ungroup_rows(dq, torch.empty_like(q))
    return dq_out, _heads_last(dk, k), _heads_last(dv, v), dmask
