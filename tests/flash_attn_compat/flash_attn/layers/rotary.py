"""flash_attn.layers.rotary.apply_rotary_emb by its documented meaning (for flash-attn's tests)."""
from __future__ import annotations

import torch


def apply_rotary_emb(x, cos, sin, interleaved=False, inplace=False, seqlen_offsets=0, cu_seqlens=None,
                     max_seqlen=None):
    """x ``[B, S, H, D]``; cos, sin ``[seqlen_ro, rotary_dim / 2]``: token s of sequence b at row
    ``seqlen_offsets (+ [b]) + s`` of the tables; the first rotary_dim dims rotate (GPT-J pairs
    when interleaved, else the two halves).  Computed in float32, returned in x's dtype."""
    if cu_seqlens is not None:
        raise NotImplementedError("packed inputs (cu_seqlens) are not needed by the tests run here")
    B, S = x.shape[:2]
    half = cos.shape[-1]
    off = seqlen_offsets.long().view(B, 1) if isinstance(seqlen_offsets, torch.Tensor) else seqlen_offsets
    pos = off + torch.arange(S, device=x.device).view(1, S)  # [B, S] (or [1, S])
    c = cos[pos].float()[:, :, None, :]
    s = sin[pos].float()[:, :, None, :]
    xr = x[..., :2 * half].float()
    if interleaved:
        x1, x2 = xr[..., 0::2], xr[..., 1::2]
        rot = torch.stack([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).flatten(-2)
    else:
        x1, x2 = xr[..., :half], xr[..., half:]
        rot = torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)
    out = torch.cat([rot.to(x.dtype), x[..., 2 * half:]], dim=-1)
    if inplace:
        x.copy_(out)
        return x
    return out
