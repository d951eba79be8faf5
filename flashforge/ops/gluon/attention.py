"""Launcher of the sm_90 Gluon forward (`attention_fwd_sm90`): which calls it serves, and the call.

Its outputs mean what the portable forward's do (o, and lse in natural-log units, -inf
for rows with no visible key), so the backward kernels take them unchanged.
"""
from __future__ import annotations

import functools
import math
import os

import torch
import triton

from ..params import AttnParams
from ..tma import tma_ready

_HEAD_DIMS = (64, 128)
# q as a register operand instead of shared memory: measured mixed (H200, D = 128: causal
# 16k 586 against 569 TFLOP/s, plain 4k 504 against 544), so off; kept to re-measure
_Q_IN_REGS = os.environ.get("FLASHFORGE_GLUON_Q_REGS", "0") == "1"


@functools.lru_cache(maxsize=None)
def _kernel():
    """The kernel, or None where this Triton has no Gluon for Hopper (imported on first use:
    Gluon is experimental, and the portable path must not depend on it)."""
    try:
        from .attention_fwd_sm90 import attn_fwd_sm90_kernel
        from triton.experimental.gluon import language as gl
        from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    except ImportError:
        return None
    return attn_fwd_sm90_kernel, gl, TensorDescriptor


def in_scope(q, k, v, mask, params: AttnParams, cfg, arch: tuple[int, int]) -> bool:
    """Whether the Gluon forward computes this call: sm_90, dense bf16/fp16 with D = Dv in
    {64, 128}, tensors the copy engine can read, plain or causal scores (an integer offset),
    no mask, bias, dropout, softcap, ALiBi, window, RoPE, KV cache or split keys; and tiles
    of one warp per 16 query rows, and at least `cfg.min_keys` keys."""
    p = params
    if tuple(arch) != (9, 0) or q.dtype not in (torch.float16, torch.bfloat16):
        return False
    if q.shape[3] not in _HEAD_DIMS or v.shape[3] != q.shape[3]:
        return False
    if (mask is not None or p.is_varlen or p.seqlens_k is not None or p.block_table is not None
            or p.num_splits > 1 or p.q_rope is not None or p.softcap > 0 or p.alibi_slopes is not None
            or p.dropout_p > 0 or p.offset_tensor is not None or p.offset_bottom_right
            or p.window_left >= 0 or p.window_right > 0 or not p.scale > 0):
        return False
    if q.shape[1] < 64:  # decoding-sized query blocks: the portable kernel packs GQA groups
        return False
    if k.shape[1] < cfg.min_keys or cfg.block_m != 16 * cfg.num_warps:
        return False
    return _kernel() is not None and all(tma_ready(t) for t in (q, k, v))


def attention_forward(q, k, v, params: AttnParams, cfg):
    """o [B, Sq, Hq, D] and lse [B, Hq, Sq] (float32) for a call `in_scope` accepts."""
    kernel, gl, TensorDescriptor = _kernel()
    B, Sq, Hq, D = q.shape
    Sk, Hkv = k.shape[1], k.shape[2]
    o = torch.empty_like(q, memory_format=torch.contiguous_format)
    lse = torch.empty(B, Hq, Sq, dtype=torch.float32, device=q.device)
    # 4-D boxes [1, rows, 1, D]: the copy engine zero-fills rows past a sequence's end and
    # clips o's store there, so no tile reads or writes another sequence's rows
    layout = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=4)

    def desc(t, rows):
        return TensorDescriptor(t, list(t.shape), list(t.stride()), [1, rows, 1, D], layout)

    causal = params.window_right == 0
    grid = (triton.cdiv(Sq, cfg.block_m), B * Hq)
    kernel[grid](desc(q, cfg.block_m), desc(k, cfg.block_n), desc(v, cfg.block_n), desc(o, cfg.block_m),
                 lse, lse.stride(0), lse.stride(1), Hq, Sq, Sk, Hq // Hkv, params.offset,
                 params.scale * math.log2(math.e),
                 CAUSAL=causal, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, D=D, STAGES=max(2, cfg.num_stages),
                 V_STAGES=cfg.v_stages or max(2, cfg.num_stages), Q_IN_REGS=_Q_IN_REGS, num_warps=cfg.num_warps)
    return o, lse
