"""The lse merge of two partial attentions (context parallelism's ring), the PyTorch path."""
from __future__ import annotations

import torch
from torch import Tensor

_NEG_INF = float("-inf")


def merge_(o_acc: Tensor, lse_acc: Tensor, o: Tensor, lse: Tensor) -> None:
    """Fold a partial result into running ones, in place: ``o_acc [B, n, H, Dv]`` (float32) and
    ``lse_acc [B, H, n]`` become the attention over the union of both key sets.

    ``o_new = (o_acc * w_acc + o * w) / (w_acc + w)`` with the weights taken relative to the
    larger lse, ``w_acc = exp(lse_acc - max)``: they sum to one exactly however large the lse is
    (``exp(lse_acc - logaddexp(...))`` would carry the new lse's float32 rounding, 5e-4 at 1e4, into
    every weight).  Rows that no key of either part sees stay at o = 0, lse = -inf (weights 0, not
    NaN)."""
    mx = torch.maximum(lse_acc, lse)
    ref = mx.masked_fill_(mx == _NEG_INF, 0.0)
    w_acc = (lse_acc - ref).exp_()
    w = (lse - ref).exp_()
    total = w_acc + w
    new = total.log().add_(ref)  # log(0) = -inf where neither part sees a key
    inv = total.reciprocal_()  # (in place: total is not needed again)
    inv.masked_fill_(inv == float("inf"), 0.0)  # 1/0 where neither part sees a key
    w_acc = w_acc.mul_(inv).transpose(1, 2).unsqueeze(-1)  # [B, n, H, 1]
    w = w.mul_(inv).transpose(1, 2).unsqueeze(-1)
    o_acc.mul_(w_acc).addcmul_(o, w)  # o in its own dtype: no float32 copy of it
    lse_acc.copy_(new)
