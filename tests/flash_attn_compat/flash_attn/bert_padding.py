"""flash_attn.bert_padding's pad_input / unpad_input by their documented meaning (for flash-attn's tests)."""
from __future__ import annotations

import torch


def unpad_input(hidden_states, attention_mask, unused_mask=None):
    """hidden_states ``[B, S, ...]``, attention_mask bool/int ``[B, S]`` (1 = keep) ->
    (the kept tokens ``[total, ...]``, their flat indices in ``B*S``, cu_seqlens int32 ``[B+1]``,
    the longest length, the lengths int32 ``[B]``).  ``unused_mask`` marks tokens that are kept
    in the packed tensor but not counted as used (flash-attn's signature)."""
    keep = attention_mask.bool() if unused_mask is None else (attention_mask.bool() | unused_mask.bool())
    lengths = keep.sum(dim=-1, dtype=torch.int32)
    used = attention_mask.sum(dim=-1, dtype=torch.int32)
    indices = torch.nonzero(keep.flatten(), as_tuple=False).flatten()
    cu = torch.nn.functional.pad(torch.cumsum(lengths, dim=0, dtype=torch.int32), (1, 0))
    flat = hidden_states.reshape(-1, *hidden_states.shape[2:])
    return flat[indices], indices, cu, int(lengths.max()), used


def pad_input(hidden_states, indices, batch, seqlen):
    """The inverse: ``[total, ...]`` back to ``[batch, seqlen, ...]`` with zeros elsewhere."""
    out = torch.zeros(batch * seqlen, *hidden_states.shape[1:], dtype=hidden_states.dtype,
                      device=hidden_states.device)
    out = out.index_put((indices,), hidden_states)
    return out.view(batch, seqlen, *hidden_states.shape[1:])
