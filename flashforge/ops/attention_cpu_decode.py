"""A decoding step on the CPU (one query per kv head, many keys): PyTorch's CPU flash kernel a chunk of keys at a time.

The kernel (`flashforge.ops.attention_cpu_aten`) runs each head's walk over all of its keys before
the next head's; at one query row per kv head that walk reads K and V ``D`` elements every
``H * D`` straight from memory, and sets the time.  Cut into chunks of `KEY_CHUNK` keys, every
head walks the same few MiB in turn, which the first walk has brought near: a 16k-key step takes
0.65-0.75x the time of one call, on 1 and 2 threads (for two or more query rows per kv head the
kernel's own order measured as fast).  Each chunk's call returns its part of the softmax with its
own lse; the parts are merged once at the end by their lse,

    lse = log sum_c exp(lse_c),   o = sum_c exp(lse_c - lse) o_c,

from ``n_chunks`` stacked part results of one query row each: O(B·H·Sk/KEY_CHUNK·D) memory.
float16/bfloat16 chunks are upcast one at a time (float32 arithmetic, as in the aten route).

It serves the calls `serves` names: those the kernel serves (`attention_cpu_aten.serves`: no
mask, dropout, softcap, ALiBi; ``D == Dv``), with ``Sq * (Hq / Hkv) == 1``, every key visible
(not causal, or a causal offset ``>= Sk - 1``) and at least two chunks of keys.  Every row sees
every key, so every lse is finite.  lse is float32 like the kernel's, and the backward is the
kernel's (`attention_cpu_aten.backward`, with ``lse_lo`` as there).

A fixed order of calls and one merge: results are bitwise reproducible.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from . import attention_cpu_aten as aten
from .params import AttnParams

__all__ = ["serves", "forward", "KEY_CHUNK"]

#: Keys per kernel call (measured best of 1k-4k keys at H * D = 512, float32 and bfloat16).
KEY_CHUNK = 2048


def serves(q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor], params: AttnParams) -> bool:
    """Whether this call is a decoding step this route computes (module docstring)."""
    Sq, Sk = q.shape[1], k.shape[1]
    if Sq != 1 or q.shape[2] != k.shape[2] or Sk <= KEY_CHUNK or not aten.serves(q, k, v, mask, params):
        return False
    return params.window_right < 0 or aten._causal_offset(params, Sq, Sk) >= Sk - 1


def forward(q: Tensor, k: Tensor, v: Tensor, params: AttnParams) -> tuple[Tensor, Tensor]:
    """``o [B, 1, H, D]`` in q's dtype and ``lse [B, H, 1]`` (float32) of a call `serves` accepts."""
    B, _, H, D = q.shape
    Sk = k.shape[1]
    n = -(-Sk // KEY_CHUNK)
    qk = aten._f32(q).transpose(1, 2)  # [B, H, 1, D]
    o_parts = torch.empty(n, B, 1, H, D, dtype=torch.float32)  # the kernel's o memory: [B, 1, H, D]
    lse_parts = torch.empty(n, B, H, 1, dtype=torch.float32)
    for i in range(n):
        keys = slice(i * KEY_CHUNK, min(Sk, (i + 1) * KEY_CHUNK))
        o_c, lse_c = aten._FWD(qk, aten._f32(k[:, keys]).transpose(1, 2), aten._f32(v[:, keys]).transpose(1, 2),
                               0.0, False, scale=params.scale)
        o_parts[i].copy_(o_c.transpose(1, 2))
        lse_parts[i].copy_(lse_c)
    lse = torch.logsumexp(lse_parts, dim=0)  # [B, H, 1]
    w = lse_parts.sub_(lse).exp_()  # [n, B, H, 1]: each part's share of its row
    o = o_parts.mul_(w.view(n, B, 1, H, 1)).sum(dim=0)  # [B, 1, H, D]
    return (o if q.dtype == torch.float32 else o.to(q.dtype)), lse
