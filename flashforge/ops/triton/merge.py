"""The lse merge of two partial attentions in one pass, the Triton twin of `flashforge.ops.merge_torch`.

Context parallelism folds every block's ``(o, lse)`` into float32 running ones.  As torch ops that
pass reads and writes ``o_acc`` several times and cost 5-13% of a ring step on the H200 (RESULTS
v0.8.0); here each tensor is read once and ``o_acc``/``lse_acc`` written once.  Every pointer comes
from the tensors' own shapes and strides (views such as ``o_acc[:, rows]`` included), and every
load and store is masked to them.
"""
from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor

__all__ = ["merge_"]

_BLOCK_M = 32  # rows per program: with Dv <= 256 a [32, 256] float32 tile is 8k elements


@triton.jit
def _merge_kernel(o_acc, lse_acc, o, lse, n, H, Dv,
                  s_ab, s_an, s_ah, s_ad, s_lab, s_lah, s_lan,
                  s_ob, s_on, s_oh, s_od, s_lb, s_lh, s_ln,
                  BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // H).to(tl.int64)
    h = (pid_bh % H).to(tl.int64)
    offs_m = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    row_ok = offs_m < n
    p_la = lse_acc + b * s_lab + h * s_lah + offs_m * s_lan
    la = tl.load(p_la, mask=row_ok, other=float("-inf"))
    lb = tl.load(lse + b * s_lb + h * s_lh + offs_m * s_ln, mask=row_ok, other=float("-inf"))
    # weights relative to the larger lse: exact for any magnitude, and 0 (not NaN) where both are -inf
    mx = tl.maximum(la, lb)
    ref = tl.where(mx == float("-inf"), 0.0, mx)
    wa = tl.exp(la - ref)
    wb = tl.exp(lb - ref)
    total = wa + wb
    inv = tl.where(total > 0, 1.0 / total, 0.0)
    new = tl.where(total > 0, ref + tl.log(total), float("-inf"))
    tile = row_ok[:, None] & (offs_d[None, :] < Dv)
    p_oa = o_acc + b * s_ab + h * s_ah + offs_m[:, None] * s_an + offs_d[None, :] * s_ad
    acc = tl.load(p_oa, mask=tile, other=0.0)
    part = tl.load(o + b * s_ob + h * s_oh + offs_m[:, None] * s_on + offs_d[None, :] * s_od, mask=tile, other=0.0)
    acc = acc * (wa * inv)[:, None] + part.to(tl.float32) * (wb * inv)[:, None]
    tl.store(p_oa, acc, mask=tile)
    tl.store(p_la, new, mask=row_ok)


def merge_(o_acc: Tensor, lse_acc: Tensor, o: Tensor, lse: Tensor) -> None:
    """In place, as `flashforge.ops.merge_torch.merge_`: ``o_acc [B, n, H, Dv]`` float32 and
    ``lse_acc [B, H, n]`` float32 take in ``o`` (any float dtype, same shape) and ``lse``; any strides."""
    B, n, H, Dv = o_acc.shape
    if o.shape != o_acc.shape or lse.shape != lse_acc.shape or lse_acc.shape != (B, H, n):
        raise ValueError(f"merge_: shapes o_acc {tuple(o_acc.shape)}, o {tuple(o.shape)}, lse_acc "
                         f"{tuple(lse_acc.shape)}, lse {tuple(lse.shape)} do not match [B, n, H, Dv] / [B, H, n]")
    if B * n * H == 0:
        return
    grid = (triton.cdiv(n, _BLOCK_M), B * H)
    _merge_kernel[grid](o_acc, lse_acc, o, lse, n, H, Dv, *o_acc.stride(), *lse_acc.stride(), *o.stride(),
                        *lse.stride(), BLOCK_M=_BLOCK_M, BLOCK_D=triton.next_power_of_2(Dv), num_warps=4)
