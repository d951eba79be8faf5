"""One `Call` of a plan, forward and backward, on the backend's kernels, and the lse merge."""
from __future__ import annotations

from dataclasses import replace
from typing import Optional

from torch import Tensor

from ..ops.backends import backend_module
from ..ops.params import AttnParams
from .plan import Call

def call_params(params: AttnParams, call: Call) -> AttnParams:
    """The call's rule: the window at the call's offset, or no mask at all where every entry is visible."""
    if call.masked:
        return replace(params, offset=call.offset)
    return replace(params, window_left=-1, window_right=-1, offset=0)


def forward(q: Tensor, k: Tensor, v: Tensor, call: Call, params: AttnParams, backend: str) -> tuple[Tensor, Tensor]:
    """(o, lse) of the call's query rows of ``q`` against its rows of the block ``k``, ``v``."""
    # (no lse_lo: the backward takes the merged lse of every block, which has no low part)
    return backend_module("attention", backend).attention_forward(
        q[:, call.q0:call.q1], k[:, call.k0:call.k1], v[:, call.k0:call.k1], None, call_params(params, call))


def backward(do: Tensor, dlse: Optional[Tensor], q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor,
             call: Call, params: AttnParams, backend: str) -> tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv) of the call, for the rows it covers, given the *merged* o and lse of the shard:
    with them each block's probabilities are its share of the full softmax, so the per-block
    gradients sum to the full ones (the ring-attention backward)."""
    rows = slice(call.q0, call.q1)
    dlse_rows = None if dlse is None else dlse[:, :, rows].contiguous()
    dq, dk, dv, _ = backend_module("attention", backend).attention_backward(
        do[:, rows], dlse_rows, q[:, rows], k[:, call.k0:call.k1], v[:, call.k0:call.k1], None, o[:, rows],
        lse[:, :, rows].contiguous(), call_params(params, call), False)
    return dq, dk, dv


def merge(o_acc: Tensor, lse_acc: Tensor, o: Tensor, lse: Tensor, backend: str = "torch") -> None:
    """Fold a partial result into running ones, in place: ``o_acc [B, n, H, Dv]`` (float32) and
    ``lse_acc [B, H, n]`` become the attention over the union of both key sets; rows that no key
    of either part sees stay at o = 0, lse = -inf.  One kernel on "triton" (`ops.triton.merge`)."""
    backend_module("merge", backend).merge_(o_acc, lse_acc, o, lse)
