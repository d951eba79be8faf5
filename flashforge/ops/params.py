"""The normalised description of one attention call, shared by every backend.

The public layer (`flashforge.api`) validates user input and folds the
user-facing options into this one record, so the kernels see a single rule:
key j is visible from query i iff

    (left  < 0 or j >= i + offset - left) and
    (right < 0 or j <= i + offset + right)

Causal attention is simply ``right = 0``; the seed's integer window ``w`` is
``(w - 1, w - 1)``.  ``offset`` is either a Python int (``offset``) or a
per-batch int32/int64 tensor ``[B]`` on the inputs' device (``offset_tensor``).

Index safety.  The public layer checks every index value it can see (shapes, ints, CPU
tensors; device tensors with ``check_inputs``) and folds an int offset with the window sides
into int32-safe values with the same visible keys (`flashforge.api.validate.canonical_visibility`).
Whatever values reach a kernel, it clamps them into the tensors it was given: a packed
sequence's bounds to the packed rows, a KV-cache row's key count to the capacity, a
block-table entry to the blocks, an append's slot to the cache (a token past it is not
written), and per-batch offsets are folded with the window sides per sequence.
ALiBi adds ``-alibi_slopes[b, h] * |i + offset - j|`` to the score (after softcap,
like a mask).

Log-sum-exp for the backward.  Every backend's ``attention_forward(q, k, v, mask, params,
lse_lo=None)`` returns ``(o, lse)``, lse in float32 natural log, and, when given a float32
tensor ``lse_lo`` shaped like lse, writes into every element of it the part of the
log-sum-exp that lse cannot hold, in log2 units::

    lse_lo = (m + log2(l)) - fl32(lse * LOG2E)

with ``m`` the row's largest score and ``l`` its sum of ``exp2(score - m)`` (scores in log2
units); 0 on rows that see no key.  ``attention_backward(..., lse_lo=None)`` recomputes
``P = exp2((s - fl32(lse * LOG2E)) - lse_lo)``.  Where scores reach 1e6-1e8 (a diverging
run), one ulp of a float32 lse is 0.06-8 and P from lse alone is off by up to a factor of
e**8 per row; with lse_lo each row of P sums to 1 to float32 rounding.  The first
subtraction is exact near the row's maximum (the two terms are close), the second one
adds a small number to a small number.  ``lse_lo=None`` in the backward means 0.  Where
|lse| <= 64 the term is below 5e-6 and a backend may write 0 (PyTorch's CPU kernel, which
has no such output: `flashforge.ops.attention_cpu_aten`).  Likewise a backward may leave
lse_lo out where every row it reads has |lse * log2(e)| below 256 (16-bit inputs: P moves by
at most 4e-5 of itself): the sm_90 Gluon kernels check their rows once per program and run a
loop without the subtraction there (`ops.triton.common.LO_FROM`; the dK/dV kernel
as two launches, the second for the GQA groups with a far row).
How ``s - shift`` is rounded, the same in every kernel for the same inputs, is
`ops.triton.common.fused_score`'s rule (one fused multiply-add for bfloat16, the product rounded
first for float16 and float32).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


@dataclass(frozen=True)
class AttnParams:
    scale: float
    window_left: int = -1  # -1: unbounded on that side
    window_right: int = -1  # -1: unbounded; causal is right = 0
    offset: int = 0  # used when offset_tensor is None
    offset_tensor: Optional[torch.Tensor] = None  # int32 or int64 [B], same device as q
    offset_bottom_right: bool = False  # add Sk_b - Sq_b to each sequence's offset (flash-attn's alignment)
    softcap: float = 0.0  # 0: off
    alibi_slopes: Optional[torch.Tensor] = None  # float32 [B, Hq] (stride 0 where broadcast), same device as q
    dropout_p: float = 0.0
    seed: int = 0  # 0 <= seed < 2**63; only read when dropout_p > 0
    # an int64 scalar tensor on the inputs' device that replaces `seed` when set: the
    # kernels read it on the device, so an unseeded call needs no host sync and a
    # CUDA-graph replay draws a fresh seed (PyTorch's graph-safe generator)
    seed_tensor: Optional[torch.Tensor] = None
    deterministic: bool = False
    allow_tf32: bool = False  # float32 inputs: full IEEE products unless opted in
    # Packed variable-length batch: q [1, total_q, Hq, D], k/v [1, total_k, Hkv, *];
    # sequence b owns rows cu_seqlens_q[b]:cu_seqlens_q[b+1] (int32 [B+1], same device);
    # lse is [1, Hq, total_q].  max_seqlen_* size the grids (no host sync).
    cu_seqlens_q: Optional[torch.Tensor] = None
    cu_seqlens_k: Optional[torch.Tensor] = None
    max_seqlen_q: int = 0
    max_seqlen_k: int = 0
    # KV cache (forward only): batch row b sees keys [0, seqlens_k[b]) (int32 or int64 [B]); with
    # block_table (int32 [B, max_blocks]) k/v are paged [num_blocks, block_size, Hkv, *]
    # and key j of row b is row j % block_size of block block_table[b, j // block_size].
    seqlens_k: Optional[torch.Tensor] = None
    # keys appended by this call, counted on top of seqlens_k (row b sees seqlens_k[b] + this):
    # the Triton kernel adds it itself, so a decoding step with new keys launches no add
    seqlens_k_add: int = 0
    block_table: Optional[torch.Tensor] = None
    num_splits: int = 1  # split-KV: keys divided among this many programs, merged by lse
    # RoPE applied to q inside the forward, at each query's absolute position i + offset
    # (a `flashforge.ops.rope_torch.RopeParams`; its pos_base is unused)
    q_rope: Optional[object] = None
    # batch index of this call's first sequence in the dropout counter (the CPU path
    # runs a packed batch one sequence at a time)
    dropout_batch_base: int = 0

    @property
    def is_varlen(self) -> bool:
        return self.cu_seqlens_q is not None

    @property
    def has_window(self) -> bool:
        return self.window_left >= 0 or self.window_right >= 0

    @property
    def has_dropout(self) -> bool:
        return self.dropout_p > 0.0
