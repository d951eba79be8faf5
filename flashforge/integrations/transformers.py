"""Hugging Face transformers integration: ``attn_implementation="forge"``.

Importing this module registers flashforge with transformers (`register` does it again,
idempotently)::

    import flashforge.integrations.transformers
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="forge")

Every model whose attention dispatches through transformers' ``AttentionInterface`` (most
models in transformers 5; decoders such as Llama, Mistral, Qwen and Gemma from 4.53) then runs
`flashforge.attention`: grouped-query attention without repeating K and V, causal attention
aligned to the KV cache, sliding windows and softcapping as kernel flags, dropout in training
with flashforge's counter-based mask (seed drawn from torch's generator).

The name is ``"forge"``, not ``"flashforge"``: transformers 5 treats every implementation
whose name contains ``"flash"`` as a flash-attn kernel to fetch from the Hub, and refuses to
load the model when that fails.

Two functions are registered:

* `attention_forward` in ``AttentionInterface``. It reads ``attention_mask`` as follows.

  - ``None``: the module's causal flag (the ``is_causal`` argument, else ``module.is_causal``),
    aligned bottom-right (the Sq queries are the last Sq of the Sk key positions, as in
    decoding with a cache), and ``sliding_window=w`` as a window of ``w - 1`` keys on each
    side, the right one clamped by causality: transformers' flash-attention convention.
  - 4-D bool (True = attend) or float (added to the scores) mask: the whole visibility, as
    for SDPA; the causal flag and ``sliding_window`` are then not applied.

* `mask_interface` in ``AttentionMaskInterface``, which builds the
  masks above. It returns None, so that no ``[B, 1, Sq, Sk]`` tensor is built, for a plain
  causal or sliding-window pattern without padding whose queries end where the keys end
  (prefill, decoding and chunked prefill with a dynamic cache); a zero-copy view of the
  padding mask for bidirectional attention (encoders) with padding; and otherwise the same
  bool mask as SDPA (padding in a causal model, static caches, custom mask functions,
  chunked attention, ``torch.compile``).

Rows that see no key (left padding) give a zero output, never NaN. Not supported (a
``ValueError`` says so): attention sinks (``s_aux``) and ``head_mask``. ``output_attentions``
gives ``None`` weights (flashforge never forms the attention matrix).
"""
from __future__ import annotations

import warnings
from typing import Optional

import torch

try:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
except ImportError as e:  # transformers missing, or older than 4.53 (no AttentionMaskInterface)
    raise ImportError("flashforge.integrations.transformers needs transformers >= 4.53; "
                      "install it with: pip install 'flashforge[transformers]'") from e

from ..api.attention import attention

__all__ = ["ATTN_IMPLEMENTATION", "attention_forward", "mask_interface", "register"]

ATTN_IMPLEMENTATION = "forge"
"""The ``attn_implementation`` name under which flashforge is registered."""


def _tracing() -> bool:
    return torch.jit.is_tracing() or torch.compiler.is_compiling()


def _query_span(kwargs) -> Optional[tuple[int, object]]:
    """``(q_length, q_offset)`` in either calling convention of the mask functions: ``q_length``
    and ``q_offset`` (transformers 5; ``q_offset`` is a tensor for static caches) or a
    ``cache_position`` tensor of the query positions (4.x). None if the queries are not a run."""
    if "q_length" in kwargs:
        return kwargs["q_length"], kwargs.get("q_offset", 0)
    positions = kwargs.get("cache_position")
    if positions is None or positions.numel() == 0:
        return None
    first, last = int(positions[0]), int(positions[-1])
    return (positions.numel(), first) if last - first + 1 == positions.numel() else None


def _key_padding(attention_mask: Optional[torch.Tensor], kv_offset: int, kv_length: int) -> Optional[torch.Tensor]:
    """The 2-D padding mask's columns for the keys, bool ``[B, kv_length]``; None if no key is padding.

    Columns the 2-D mask does not reach count as padding, as transformers' own mask functions
    pad it (static caches are longer than what has been written to them)."""
    if attention_mask is None:
        return None
    keys = attention_mask[:, kv_offset:kv_offset + kv_length].bool()
    if keys.shape[-1] < kv_length:
        keys = torch.nn.functional.pad(keys, (0, kv_length - keys.shape[-1]), value=False)
    return None if bool(keys.all()) else keys


def _sliding_pattern(local_size: Optional[int], config) -> bool:
    """Whether the mask's ``local_size`` is the model's sliding window (which its attention layers
    then pass as ``sliding_window``), as opposed to a chunk size (Llama 4's chunked attention)."""
    return (local_size == getattr(config, "sliding_window", None)
            and local_size != getattr(config, "attention_chunk_size", None))


def mask_interface(**kwargs):
    """transformers' mask function for ``"forge"`` (``AttentionMaskInterface``), called with the
    keyword arguments of ``transformers.masking_utils.sdpa_mask``.

    Returns None when `attention_forward`'s flags give the pattern exactly: the pattern is
    plain causal (``allow_is_causal_skip``), or sliding-window causal with the model's
    ``sliding_window``, or plain bidirectional (``allow_is_bidirectional_skip``); no key is
    padding; and, when causal, the queries end where the keys end (bottom-right alignment).
    Returns a broadcast view ``[B, 1, Sq, Sk]`` of the padding mask for plain bidirectional
    attention with padding. Otherwise returns SDPA's bool mask ``[B, 1, Sq, Sk]`` (True = attend).
    """
    if not _tracing():
        kv_length, kv_offset = kwargs["kv_length"], kwargs.get("kv_offset", 0)
        local_size, config = kwargs.get("local_size"), kwargs.get("config")
        padding = _key_padding(kwargs.get("attention_mask"), kv_offset, kv_length)
        span = _query_span(kwargs)
        if kwargs.get("allow_is_causal_skip", True) and padding is None and span is not None:
            q_length, q_offset = span
            bottom_right = not isinstance(q_offset, torch.Tensor) and q_offset + q_length == kv_offset + kv_length
            if bottom_right and (local_size is None or _sliding_pattern(local_size, config)):
                return None
        if kwargs.get("allow_is_bidirectional_skip", False) and local_size is None:
            if padding is None:
                return None
            if span is not None:
                return padding[:, None, None, :].expand(kwargs["batch_size"], 1, span[0], kv_length)
    return sdpa_mask(**dict(kwargs, allow_is_causal_skip=False, allow_is_bidirectional_skip=False))


def _as_mask(attention_mask: Optional[torch.Tensor], Sk: int) -> Optional[torch.Tensor]:
    """transformers' 4-D ``attention_mask`` as a flashforge mask broadcastable to ``[B, H, Sq, Sk]``."""
    if attention_mask is None:
        return None
    if attention_mask.dim() != 4:
        # a 2-D padding mask arrives only when "forge" has no mask function (transformers'
        # flash-attention convention), and cannot say where a static cache's queries sit
        raise ValueError(f"attention_mask of shape {tuple(attention_mask.shape)} reached flashforge's attention "
                         f"function; accepted: None or 4-D [B, 1 or H, Sq, Sk]. Register the mask function too: "
                         f"flashforge.integrations.transformers.register()")
    # a 4-D mask may be longer than the keys (static caches in older transformers)
    return attention_mask[..., :Sk] if attention_mask.shape[-1] > Sk else attention_mask


def _with_bias(mask: Optional[torch.Tensor], bias: torch.Tensor) -> torch.Tensor:
    """One float mask adding ``bias`` (T5-style relative position bias, ALiBi) where ``mask`` keeps."""
    if mask is None:
        return bias
    if mask.dtype == torch.bool:
        return torch.where(mask, bias, float("-inf"))
    return bias + mask


_warned_attentions = False


def attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: Optional[torch.Tensor], dropout: float = 0.0,
                      scaling: Optional[float] = None, sliding_window: Optional[int] = None,
                      softcap: Optional[float] = None, is_causal: Optional[bool] = None,
                      position_bias: Optional[torch.Tensor] = None, **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention function for ``"forge"`` (``AttentionInterface``).

    Args:
        module: the attention layer; its ``is_causal`` is read when ``is_causal`` is None.
        query: ``[B, Hq, Sq, D]``.
        key: ``[B, Hkv, Sk, D]``, ``Hq % Hkv == 0`` (grouped-query attention, never repeated).
        value: ``[B, Hkv, Sk, Dv]``.
        attention_mask: None (the flags below) or 4-D ``[B, 1|Hq, Sq, Sk]`` bool (True = attend) or
            float (additive), which is then the whole visibility; see the module docstring.
        dropout: attention dropout probability (transformers passes 0 in eval mode).
        scaling: score scale, default ``1/sqrt(D)``.
        sliding_window: ``w`` = a window of ``w - 1`` keys each side (causal: to the left only);
            applied only without a 4-D mask.
        softcap: scores become ``softcap * tanh(score / softcap)`` (Gemma 2).
        is_causal: overrides ``module.is_causal``; applied only without a 4-D mask.
        position_bias: float ``[B|1, Hq, Sq, Sk]`` added to the scores (differentiable).
        kwargs: ``deterministic`` is honoured; ``s_aux`` and ``head_mask`` raise; the rest
            (position ids, cache bookkeeping) is ignored.

    Returns:
        ``(out [B, Sq, Hq, Dv], None)``: no attention weights are ever formed.
    """
    global _warned_attentions
    if kwargs.get("s_aux") is not None:
        raise ValueError(f"{type(module).__name__} uses attention sinks (s_aux), which flashforge does not "
                         "support; load the model with attn_implementation='eager' or 'sdpa'")
    if kwargs.get("head_mask") is not None:
        raise ValueError("head_mask is not supported by flashforge; use attn_implementation='eager' for it")
    if kwargs.get("output_attentions") and not _warned_attentions:
        _warned_attentions = True
        warnings.warn("attn_implementation='forge' does not return attention weights "
                      "(output_attentions=True gives None); use 'eager' for them", stacklevel=2)

    q, k, v = (t.transpose(1, 2) for t in (query, key, value))  # [B, S, H, D] views
    Sq, Sk = q.shape[1], k.shape[1]
    flags = attention_mask is None
    mask = _as_mask(attention_mask, Sk)
    if position_bias is not None:
        mask = _with_bias(mask, position_bias)
    causal = flags and bool(is_causal if is_causal is not None else getattr(module, "is_causal", True))
    window = (sliding_window - 1, sliding_window - 1) if flags and sliding_window else None
    out = attention(q, k.to(q.dtype), v.to(q.dtype), causal=causal, causal_offset=Sk - Sq if flags else 0,
                    window=window, mask=mask, dropout_p=float(dropout), scale=scaling,
                    softcap=float(softcap) if softcap else 0.0, deterministic=bool(kwargs.get("deterministic")))
    return out, None


def register() -> str:
    """Register ``"forge"`` with transformers' attention and mask interfaces.

    Idempotent; also run when this module is imported. Returns the name to pass as
    ``attn_implementation``."""
    AttentionInterface.register(ATTN_IMPLEMENTATION, attention_forward)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, mask_interface)
    return ATTN_IMPLEMENTATION


register()
