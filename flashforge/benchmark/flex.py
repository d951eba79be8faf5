"""FlexAttention as a peer: compiled once per process, with block masks for causal, windows, offsets and
packed sequences, and a score_mod for the bias."""

from __future__ import annotations

import functools
from typing import Optional

import torch

from .cases import Case
from .impl import Impl
from .inputs import Inputs


@functools.lru_cache(maxsize=None)
def band_mod(offset: int = 0, window: Optional[int] = None):
    """FlexAttention mask_mod of inputs.band_mask (one function object per parameters: no needless recompiles)."""
    def mask_mod(b, h, q_idx, kv_idx):
        keep = q_idx + offset >= kv_idx
        if window is not None:
            keep = keep & (q_idx + offset - kv_idx <= window)
        return keep
    return mask_mod


def doc_mod(doc: torch.Tensor, causal: bool):
    """FlexAttention mask_mod for packed sequences: same document (and causal)."""
    def mask_mod(b, h, q_idx, kv_idx):
        keep = doc[q_idx] == doc[kv_idx]
        if causal:
            keep = keep & (q_idx >= kv_idx)
        return keep
    return mask_mod


def bias_mod(bias: torch.Tensor):
    def score_mod(score, b, h, q_idx, kv_idx):
        return score + bias[b, 0, q_idx, kv_idx]
    return score_mod


_COMPILED: dict = {}


def flex_function(compiled: bool, dynamic: Optional[bool] = None):
    """flex_attention, compiled once per process (recompile limits raised, as PERF.md says: else its
    numbers collapse to eager after a few shapes)."""
    from torch.nn.attention.flex_attention import flex_attention
    if not compiled:
        return flex_attention
    key = ("compiled", dynamic)
    if key not in _COMPILED:
        import torch._dynamo
        cfg = torch._dynamo.config
        for name, value in (("recompile_limit", 1024), ("cache_size_limit", 1024),
                            ("accumulated_recompile_limit", 1 << 14), ("accumulated_cache_size_limit", 1 << 14)):
            try:  # the names changed across torch versions; an old alias may refuse to be set
                if hasattr(cfg, name):
                    setattr(cfg, name, value)
            except Exception:
                pass
        _COMPILED[key] = torch.compile(flex_attention, dynamic=dynamic)
    return _COMPILED[key]


def flex_impl(case: Case, inp: Inputs, compiled: bool, dynamic: Optional[bool]) -> Impl:
    from torch.nn.attention.flex_attention import create_block_mask
    if case.dropout or case.bias_grad:
        raise NotImplementedError("FlexAttention has no dropout / no bias gradient here")
    flex = flex_function(compiled, dynamic)
    dev = inp.q.device
    kw: dict = {}
    if case.Hq != case.Hkv:
        kw["enable_gqa"] = True
    if case.seqlens:
        total = sum(case.seqlens)
        doc = torch.repeat_interleave(torch.arange(len(case.seqlens), device=dev),
                                      torch.tensor(case.seqlens, device=dev))
        kw["block_mask"] = create_block_mask(doc_mod(doc, case.causal), None, None, total, total, device=dev)

        def packed(q, k, v):
            o = flex(q.unsqueeze(0).transpose(1, 2), k.unsqueeze(0).transpose(1, 2), v.unsqueeze(0).transpose(1, 2),
                     **kw)
            return o.transpose(1, 2).squeeze(0)
        return Impl("flex", packed)
    if case.causal and case.mode != "decode":
        kw["block_mask"] = create_block_mask(band_mod(case.offset, case.window), None, None, case.Sq, case.Sk,
                                             device=dev)
    if case.bias:
        kw["score_mod"] = bias_mod(inp.bias)

    def fn(q, k, v):
        return flex(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), **kw).transpose(1, 2)
    return Impl("flex", fn)
