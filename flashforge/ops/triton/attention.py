"""Launchers for the Triton attention kernels: take tensors, compute grids.

Same interface as `flashforge.ops.attention_torch` (the autograd layer picks
one of the two modules).  Inputs are BSHD with unit last-dim stride; the mask
is a 4-D view whose size-1 dims broadcast (passed with stride 0).
"""
from __future__ import annotations

import dataclasses
import functools
import logging
import os
from typing import Optional

import torch

from .. import replay
from ..dropout import keep_threshold
from ..gluon import attention as gluon_attention
from ..launch import cdiv, launch, next_power_of_2
from ..params import AttnParams
from ..tma import tma_ready
from .attention_bwd import (attn_bwd_dkdv_kernel, attn_bwd_dmask_kernel, attn_bwd_dq_cast_kernel, attn_bwd_dq_kernel,
                            attn_bwd_preprocess_kernel)
from .attention_fwd import attn_fwd_combine_kernel, attn_fwd_kernel
from .configs import generation, get_config, gluon_config, head_dim_block, with_mask
from .rope import rope_turns


# Why a call takes a slower kernel than the fastest one for its device, in one place: at DEBUG
# level each distinct reason is logged once per pass, e.g.
#   logging.getLogger("flashforge.dispatch").setLevel(logging.DEBUG)  (and a handler)
# "forward: portable kernel: softcap (not in the Gluon kernels)".  The reasons are
# `gluon.attention.scope_reason` / `forward_reason` / `bwd_call_reason` and the table's.
dispatch_log = logging.getLogger("flashforge.dispatch")
_explained: set = set()


def explain(pass_: str, kernel: str, reason, *args) -> None:
    """Log (DEBUG, once per distinct message) that `pass_` runs `kernel` because of `reason`: a
    string, or a function of `args` that gives it (called only when the log is on)."""
    if dispatch_log.isEnabledFor(logging.DEBUG):
        msg = f"{pass_}: {kernel}: {reason(*args) if callable(reason) else reason}"
        if msg not in _explained:
            _explained.add(msg)
            dispatch_log.debug(msg)


def _no_gluon_tiles(D: int, q, arch) -> str:
    return (f"the tile table has no Gluon entry for D = {D}, {str(q.dtype)[6:]} on sm_{arch[0]}{arch[1]}, or its "
            f"portable entry is overridden without gluon=True")


@functools.lru_cache(maxsize=None)
def _device_arch(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def _arch(q: torch.Tensor) -> tuple[int, int]:
    """Compute capability of q's GPU (picks the tile table); sm_90 under the interpreter."""
    if q.device.type != "cuda":
        return (9, 0)
    return _device_arch(q.device.index if q.device.index is not None else torch.cuda.current_device())


def _interpreting(q: torch.Tensor) -> bool:
    if q.device.type == "cuda":
        return False
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(f"backend='triton' got tensors on {q.device}; the Triton kernels run on CUDA GPUs, "
                         f"or on the CPU under the interpreter (set TRITON_INTERPRET=1 before importing triton)")
    return True


def _mask_args(mask: Optional[torch.Tensor], q: torch.Tensor):
    """(tensor, 4 strides, is_bool): size-1 dims get stride 0 so they broadcast."""
    if mask is None:
        return q, (0, 0, 0, 0), False
    strides = tuple(0 if n == 1 else s for n, s in zip(mask.shape, mask.stride()))
    if mask.dtype == torch.bool:
        return mask.view(torch.uint8), strides, True
    return mask, strides, False


def _common_args(q, params: AttnParams):
    """(offsets, alibi, its 2 strides, cu_seqlens_q, cu_seqlens_k, seed tensor), scalar
    arguments and constexpr flags shared by every attention kernel."""
    per_batch = params.offset_tensor is not None
    offsets = params.offset_tensor if per_batch else q
    slopes = params.alibi_slopes
    tensors = (offsets, q, 0, 0) if slopes is None else (offsets, slopes, slopes.stride(0), slopes.stride(1))
    if params.is_varlen:
        tensors += (params.cu_seqlens_q, params.cu_seqlens_k)
    else:  # CU_K doubles as the per-row key counts of a KV cache
        tensors += (offsets, params.seqlens_k if params.seqlens_k is not None else offsets)
    tensors += (params.seed_tensor if params.seed_tensor is not None else offsets,)
    scalars = (params.scale, params.softcap if params.softcap > 0 else 1.0, params.offset,
               params.window_left, params.window_right, params.seed, keep_threshold(params.dropout_p),
               1.0 / (1.0 - params.dropout_p))
    flags = dict(HAS_WL=params.window_left >= 0, HAS_WR=params.window_right >= 0,
                 OFFSET_PER_BATCH=per_batch, HAS_SOFTCAP=params.softcap > 0,
                 HAS_DROPOUT=params.dropout_p > 0, HAS_ALIBI=params.alibi_slopes is not None,
                 IS_VARLEN=params.is_varlen, OFFSET_BR=params.offset_bottom_right,
                 SEED_FROM_PTR=params.has_dropout and params.seed_tensor is not None,
                 DOT_PRECISION="tf32" if params.allow_tf32 or q.dtype != torch.float32 else "ieee")
    return tensors, scalars, flags


def _padded(D: int, Dv: int) -> int:
    # One padded width for q/k and v: on sm90, bf16/fp16 kernels whose two
    # widths differ (e.g. 64 and 32 for D=40, Dv=24) gave wrong o and dq/dk
    # while fp32 was right, so both are padded to the larger.
    return head_dim_block(max(D, Dv))


def _tma_descriptors(q, k, v, params: AttnParams, cfg, BD: int, interpret: bool):
    """TensorDescriptors over k, v ``[B, Sk, Hkv, *]`` (or a paged cache's ``[blocks, page, Hkv, *]``)
    with ``[1, block_n, 1, BD]`` boxes, or None where the copy engine cannot serve: not asked
    for, no sm_90, packed layouts, pages smaller than (or not a multiple of) the key tile, or
    strides / addresses that are not 16-byte aligned.  (The interpreter emulates them.)"""
    if not cfg.tma or params.is_varlen:
        return None
    if params.block_table is not None and k.shape[1] % cfg.block_n:
        return None
    if not interpret and torch.cuda.get_device_capability(q.device)[0] < 9:
        return None
    try:
        from triton.tools.tensor_descriptor import TensorDescriptor
    except ImportError:
        return None
    descs = []
    for t in (k, v):
        if not tma_ready(t):
            return None
        descs.append(TensorDescriptor(t, shape=list(t.shape), strides=list(t.stride()),
                                      block_shape=[1, cfg.block_n, 1, BD]))
    return descs


def _bshd_strides(x: torch.Tensor, varlen: bool = False):
    # a packed batch is one [1, total, H, E] tensor: sequences are found through
    # cu_seqlens, so the batch stride must not move the pointer
    return 0 if varlen else x.stride(0), x.stride(1), x.stride(2)


def _longest_first(params: AttnParams, dummy: torch.Tensor) -> torch.Tensor:
    """A packed batch's sequence indices, longest (query rows, then keys) first: the kernels
    take their programs' sequences in this order so that long sequences do not start last
    and leave a tail (estimated 3-8% of a 16-sequence batch).  On the device: no host sync."""
    if not params.is_varlen:
        return dummy
    cu_q, cu_k = params.cu_seqlens_q.to(torch.int64), params.cu_seqlens_k.to(torch.int64)
    work = (cu_q[1:] - cu_q[:-1]) * (cu_k[1:] - cu_k[:-1] + 1)  # score tiles, roughly
    return torch.argsort(work, descending=True, stable=True).to(torch.int32)


def _batch_and_lengths(q, k, params: AttnParams):
    """(B, longest Sq, longest Sk): the grid's extent."""
    if params.is_varlen:
        return params.cu_seqlens_q.shape[0] - 1, params.max_seqlen_q, params.max_seqlen_k
    return q.shape[0], q.shape[1], k.shape[1]


def attention_forward(q, k, v, mask, params: AttnParams, lse_lo=None):
    """(o, lse); with ``lse_lo`` (float32, lse's shape) also its low part (`flashforge.ops.params`)."""
    if _planned(q, mask, params, lse_lo):
        # replayed from a plan (ops/replay.py) keyed by everything this launcher reads but the
        # tensors' addresses: a KV-cache call (decoding: host-bound, repeated with one shape), or,
        # with replay.TRAINING, a training step's (the grid's S = 1k rows are bound by the host)
        key, named = replay.signature(
            ("attention_forward", generation(), replay.generation[0], q.device, torch.cuda.current_device()),
            dict(q=q, k=k, v=v, lse_lo=lse_lo), params)
        return replay.call(key, named, lambda rec: _forward(q, k, v, None, params, rec, lse_lo))
    return _forward(q, k, v, mask, params, replay.DIRECT, lse_lo)


def _planned(q, mask, params: AttnParams, lse_lo) -> bool:
    """Whether a call goes through a launch plan: on a GPU, plans usable, no mask (the backward's
    dmask and the masks' own paths are not written for plans), no dropout (its seed changes every
    call, and so would the key), and training plans on unless it is a KV-cache call."""
    if q.device.type != "cuda" or mask is not None or params.has_dropout or not replay.usable():
        return False
    if lse_lo is not None and max(1, params.num_splits) > 1:  # (_forward zeroes lse_lo in place there)
        return False
    return params.seqlens_k is not None or replay.TRAINING


def _forward(q, k, v, mask, params: AttnParams, rec, lse_lo=None):
    """The forward's launches; `rec` makes fresh tensors and launches (`replay.DIRECT`, or a
    recorder that notes both for a plan)."""
    _, Sq, Hq, D = q.shape  # Sq: rows per (b, h) of o and lse (a packed batch's total)
    Sk, Hkv, Dv = k.shape[1], k.shape[2], v.shape[3]
    B, max_sq, _ = _batch_and_lengths(q, k, params)
    vl, paged = params.is_varlen, params.block_table is not None
    interpret = _interpreting(q)
    cfg = get_config("fwd", max(D, Dv), q.element_size(), interpret, causal=params.window_right >= 0, arch=_arch(q))
    if not interpret:
        g_cfg = cfg if cfg.gluon else gluon_config(max(D, Dv), q.element_size(), params.window_right >= 0, _arch(q))
        if g_cfg is not None and not cfg.gluon:
            g_cfg = _long_fwd(g_cfg, q, k, v, mask, params, _arch(q))
        if g_cfg is None:
            explain("forward", "portable kernel", _no_gluon_tiles, max(D, Dv), q, _arch(q))
        else:
            why = gluon_attention.forward_reason(q, k, v, mask, params, g_cfg, _arch(q))
            if why is None:
                return gluon_attention.attention_forward(q, k, v, params, g_cfg, _longest_first(params, None),
                                                         lse_lo, rec)
            explain("forward", "portable kernel", why)
    else:
        explain("forward", "portable kernel", "the Triton interpreter (TRITON_INTERPRET=1)")
    if cfg.block_m & (cfg.block_m - 1):  # three Gluon consumers' 192 rows: the portable kernel's are a power of two
        cfg = dataclasses.replace(cfg, block_m=next_power_of_2(cfg.block_m) // 2)
    group = Hq // Hkv
    if params.seqlens_k is not None and mask is None:
        # a KV-cache call: its own tiles where its rows (x the group, packed) fit one of them
        d_cfg = get_config("fwd", max(D, Dv), q.element_size(), interpret, causal=params.window_right >= 0,
                           arch=_arch(q), decode=True)
        # the latter two: every KV-cache call; D > 128 keeps its fwd_decode tiles (ptxas-checked for
        # paged and split calls, configs.py) under the taller forward tiles
        if max_sq * group <= d_cfg.block_m or d_cfg.block_m >= cfg.block_m or max(D, Dv) > 128:
            cfg = d_cfg
    o = rec.fresh(torch.empty, q.shape[0], Sq, Hq, Dv, dtype=q.dtype, device=q.device)
    lse = rec.fresh(torch.empty, q.shape[0], Hq, Sq, dtype=torch.float32, device=q.device)
    if mask is not None:
        cfg = with_mask("fwd", cfg)
    mask_t, m_strides, mask_bool = _mask_args(mask, q)
    (offsets, alibi, s_ab, s_ah, cu_q, cu_k, seed_t), scalars, flags = _common_args(q, params)
    splits = max(1, params.num_splits)
    if splits > 1:  # partials in float32, merged below
        o_out = rec.fresh(torch.empty, splits, *o.shape, dtype=torch.float32, device=q.device)
        lse_out = rec.fresh(torch.empty, splits, *lse.shape, dtype=torch.float32, device=q.device)
        split_strides = (o_out.stride(0), lse_out.stride(0))
    else:
        o_out, lse_out, split_strides = o, lse, (0, 0)
    if paged:
        bt, page = params.block_table, k.shape[1]
        paging = (bt.stride(0), k.stride(0), v.stride(0))
        k_strides, v_strides = (0, k.stride(1), k.stride(2)), (0, v.stride(1), v.stride(2))
        Sk = bt.shape[1] * page  # the capacity: each row's key count is clamped to it
    else:
        bt, page, paging = offsets, 1, (0, 0, 0)
        k_strides, v_strides = _bshd_strides(k, vl), _bshd_strides(v, vl)
    # decoding-like calls (the group's rows fit one tile) read K/V once per group
    pack = group > 1 and max_sq * group <= cfg.block_m
    rows, heads = (max_sq * group, Hkv) if pack else (max_sq, Hq)
    rope = params.q_rope
    turns = offsets if rope is None else rec.fresh(rope_turns, rope.rotary_dim, float(rope.theta), q.device)
    descs = _tma_descriptors(q, k, v, params, cfg, _padded(D, Dv), interpret)
    k_desc, v_desc = descs if descs is not None else (k, v)
    grid = (cdiv(rows, cfg.block_m) * splits, B * heads)
    # the merge of a split call launches as a programmatic dependent (sm_90+): a decoding
    # step is a few microseconds of work, so the second kernel's launch latency counts
    pdl = splits > 1 and not interpret and _arch(q)[0] >= 9
    store_lo = lse_lo is not None and splits == 1
    if lse_lo is not None and not store_lo:  # (split-KV serves KV caches only: no backward)
        lse_lo.zero_()
    rec.launch(attn_fwd_kernel, grid,
        q, k, v, o_out, lse_out, lse_lo if store_lo else lse_out, mask_t, offsets, alibi, cu_q, cu_k, bt, seed_t,
        turns, k_desc, v_desc,
        _longest_first(params, offsets),
        *_bshd_strides(q, vl), *k_strides, *v_strides, *_bshd_strides(o, vl),
        *m_strides, s_ab, s_ah, *paging, *split_strides, splits, params.seqlens_k_add, k.shape[0],
        Hq, Sq, Sk, D, Dv, Hq // Hkv, *scalars,
        HAS_MASK=mask is not None, MASK_BOOL=mask_bool, **flags, HAS_SEQLENS_K=params.seqlens_k is not None,
        PAGED=paged, PAGE=page, IS_SPLIT=splits > 1, PACK_GQA=pack, USE_TMA=descs is not None,
        ROPE_DIM=0 if rope is None else rope.rotary_dim, ROPE_INTERLEAVED=rope is not None and rope.interleaved,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_D=_padded(D, Dv), BLOCK_DV=_padded(D, Dv),
        SCALE_POS=params.scale > 0, WS=cfg.ws and not interpret,
        # (poly_exp2 not with dropout: Triton 3.6 fails to lower its column split beside the
        # dropout's keep tile, an assertion in applyLinearLayout, seen on the H200)
        POLY_EXP2=cfg.poly_exp2 if q.element_size() == 2 and not params.has_dropout else 0, PDL=pdl, STORE_LO=store_lo,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    if splits > 1:
        rec.launch(attn_fwd_combine_kernel, (Sq, q.shape[0] * Hq),
            o_out, lse_out, o, lse,
            o_out.stride(0), o_out.stride(1), o_out.stride(2), o_out.stride(3),
            o.stride(0), o.stride(1), o.stride(2),
            lse_out.stride(0), Hq, Sq, splits, Dv, BLOCK_S=min(64, next_power_of_2(splits)),
            BLOCK_DV=_padded(Dv, Dv), PDL=pdl, launch_pdl=pdl,
        )
    return o, lse


def _long_fwd(g_cfg, q, k, v, mask, params: AttnParams, arch):
    """The table's Gluon forward tiles for this call: its "fwd_long" entry where the call has its
    min_keys keys, no window narrower, and the entry's kernel takes it; else `g_cfg`.  Why: D = 64's
    entry is three consumers, 192-row programs: on the H200 (bf16, benchmarks/RESULTS.md v0.9.4)
    192 x 128 tiles ran 1.03x the one-warpgroup kernel at S = 4k and 1.12x at 16k, causal 0.96x at
    4k and 1.08x at 16k, but 0.80x (causal 0.54x) at 1k, where a program's fixed costs weigh.
    D = 128's is the plain-grid warp-specialized kernel from 8192 keys, where the persistent one the
    shorter calls take lost (v0.9.12, v0.9.14)."""
    D = max(q.shape[3], v.shape[3])
    long = gluon_config(D, q.element_size(), params.window_right >= 0, arch, "fwd_long")
    # (the key count first: a short call is not scoped twice, here and by the caller)
    if long is None or gluon_attention.key_count(k, params) < long.min_keys or 0 <= params.window_left < long.min_keys:
        return g_cfg
    return long if gluon_attention.forward_reason(q, k, v, mask, params, long, arch) is None else g_cfg


def _long_bwd_kv(g_kv, k, D: int, elem: int, arch, params: AttnParams):
    """The table's dK/dV tiles for this call: its "bwd_kv_ws" entry (the warp-specialized kernel,
    dQ fused in FA3's layout) where the call has its min_keys keys and no window narrower, and dQ
    may be added in varying order (not deterministic); else `g_kv` (the ordered pair's).  Why: on
    the H100 (bf16, benchmarks/RESULTS.md v0.9.6, v0.9.7) the half-dQ backward ran 1.17-1.26x the
    pair's from S = 4k and 1.10-1.16x at 2k, but at S = 1k causal 0.86-0.89x (a program's fixed
    costs: its zeroed accumulator, its conversion, few query tiles a key block), so masked calls
    have their own entry ("bwd_kv_ws_gluon_causal", from 2048 keys; the others from 1024).  A left
    window of w keys gives every key w + 1 queries: held to the unmasked entry's 1024 (the causal
    1023 window at 16k keys then takes this kernel: as fast as the pair there, RESULTS.md v0.9.21).  At D = 256 the
    entry is the wide kernel (consumers split the head dim): 1.17-1.31x a training step from S = 4k
    (v0.9.8)."""
    keys = gluon_attention.key_count(k, params)
    # (a masked call -- causal or windowed -- may have its own entry: shorter key blocks see fewer queries)
    ws = gluon_config(D, elem, params.has_window, arch, "bwd_kv_ws")
    if ws is None or keys < ws.min_keys:
        return g_kv
    # a left window: each key is seen by window_left + 1 queries however long the call, held to the
    # unmasked entry's min_keys (the masked entry's stands for a causal triangle's average key)
    plain = gluon_config(D, elem, False, arch, "bwd_kv_ws")
    if 0 <= params.window_left and params.window_left + 1 < (ws if plain is None else plain).min_keys:
        return g_kv
    if gluon_attention.fuses_dq(ws, D, params) and gluon_attention.bwd_tiles_fit("bwd_kv", ws, D):
        return ws
    return g_kv


def _gluon_backward(q, k, v, do, lse, mask, params: AttnParams, cfg_kv, cfg_q, arch, lse_lo):
    """(dK/dV tiles, dQ tiles) of the sm_90 Gluon kernels, each None where it does not serve:
    the call out of their scope, or no Gluon entry for that pass (either may serve alone)."""
    D, elem = max(q.shape[3], v.shape[3]), q.element_size()
    g_kv = cfg_kv if cfg_kv.gluon else gluon_config(D, elem, False, arch, "bwd_kv")
    if g_kv is not None and not cfg_kv.gluon:
        g_kv = _long_bwd_kv(g_kv, k, D, elem, arch, params)
    g_q = cfg_q if cfg_q.gluon else gluon_config(D, elem, False, arch, "bwd_q")
    why = None if g_kv is None and g_q is None else \
        gluon_attention.bwd_call_reason(q, k, v, do, lse, mask, params, arch, lse_lo)
    out = []
    for kind, g in (("bwd_kv", g_kv), ("bwd_q", g_q)):
        if g is None:
            explain("backward " + kind, "portable kernel", _no_gluon_tiles, D, q, arch)
        elif why is not None:
            explain("backward " + kind, "portable kernel", why)
            g = None
        elif not gluon_attention.bwd_tiles_fit(kind, g, D):
            explain("backward " + kind, "portable kernel", lambda g: f"its Gluon tiles {g} do not fit D = {D} "
                    "(one warp per 16 resident rows; past D = 128 dK/dV needs split_kv)", g)
            g = None
        elif kind == "bwd_kv" and g.consumers == 2 and not gluon_attention.fuses_dq(g, D, params):
            explain("backward " + kind, "portable kernel", "the warp-specialized dK/dV kernel adds dQ in varying "
                    "order, and the call asks to be deterministic")
            g = None
        out.append(g)
    return tuple(out)


def gluon_stats(lse, q, k, params: AttnParams, lse_lo, fused: bool):
    """(lse2, far) for the preprocess kernel to fill where the fused Gluon dK/dV kernel runs
    (`fused`), else (None, None): lse2, lse in log2 units (0 where a row sees no key), the stats
    ring's contents for the half-dQ and wide kernels; far, with lse_lo, the zeroed int32 flags of
    the GQA groups with a row far from 0 (`gluon_attention.far_flags`).  Why: each of those
    kernels' programs scaled every tile's lse again and, with lse_lo, scanned its whole group's lse
    before it started (ncu, benchmarks/RESULTS.md v0.9.19)."""
    if not fused:
        return None, None
    lse2 = torch.empty_like(lse)
    return lse2, gluon_attention.far_flags(q, k, params, lse_lo)


def dq_from_acc(dq_acc, scale: float, dtype):
    """dQ from a fused backward's float32 accumulator of dS K (unscaled): one pass, scale * acc
    rounded once into `dtype`."""
    dq = torch.empty(dq_acc.shape, dtype=dtype, device=dq_acc.device)
    n = dq_acc.numel()
    if n:
        launch(attn_bwd_dq_cast_kernel, (cdiv(n, 4096),), dq_acc, dq, n, float(scale), BLOCK=4096,
               num_warps=8)
    return dq


def attention_backward(do, dlse, q, k, v, mask, o, lse, params: AttnParams, need_dmask: bool, lse_lo=None):
    """(dq, dk, dv, dmask).  Through a launch plan where `_planned` allows (ops/replay.py: the
    dense Gluon pair's launches; the other paths bypass the recorder, so they are never planned)."""
    if not need_dmask and _planned(q, mask, params, lse_lo):
        key, named = replay.signature(
            ("attention_backward", generation(), replay.generation[0], q.device, torch.cuda.current_device()),
            dict(do=do, dlse=dlse, q=q, k=k, v=v, o=o, lse=lse, lse_lo=lse_lo), params)
        return replay.call(key, named, lambda rec: _backward(rec, do, dlse, q, k, v, None, o, lse, params, False,
                                                               lse_lo))
    return _backward(replay.DIRECT, do, dlse, q, k, v, mask, o, lse, params, need_dmask, lse_lo)


def _backward(rec, do, dlse, q, k, v, mask, o, lse, params: AttnParams, need_dmask: bool, lse_lo=None):
    _, Sq, Hq, D = q.shape
    Sk, Hkv, Dv = k.shape[1], k.shape[2], v.shape[3]
    B, max_sq, max_sk = _batch_and_lengths(q, k, params)
    vl = params.is_varlen
    interpret = _interpreting(q)
    arch = _arch(q)
    cfg_kv = get_config("bwd_kv", max(D, Dv), q.element_size(), interpret, arch=arch, dropout=params.has_dropout)
    cfg_q = get_config("bwd_q", max(D, Dv), q.element_size(), interpret, arch=arch)
    if mask is not None:
        cfg_kv, cfg_q = with_mask("bwd_kv", cfg_kv), with_mask("bwd_q", cfg_q)
    BD = _padded(D, Dv)
    if interpret:
        g_kv, g_q = None, None
        explain("backward", "portable kernels", "the Triton interpreter (TRITON_INTERPRET=1)")
    else:
        g_kv, g_q = _gluon_backward(q, k, v, do, lse, mask, params, cfg_kv, cfg_q, arch, lse_lo)

    offsets = params.offset_tensor if params.offset_tensor is not None else q  # (q: a placeholder pointer)
    order = _longest_first(params, offsets)
    # (contiguous, as the Gluon kernels require: a recipe a plan can repeat)
    delta = rec.fresh(torch.empty, lse.shape, dtype=lse.dtype, device=lse.device) if lse.is_contiguous() else \
        torch.empty_like(lse)
    # the Gluon dK/dV kernel computes dQ too (its adds come in varying order: not when asked to be deterministic)
    gluon_fused = g_kv is not None and gluon_attention.fuses_dq(g_kv, max(D, Dv), params)
    if g_kv is not None and g_q is not None and o.stride(-1) == 1 and not gluon_fused:  # the common dense case
        shared = None
        if gluon_attention.input_rows(g_kv, "bwd_kv") == gluon_attention.input_rows(g_q, "bwd_q"):
            shared = gluon_attention.input_descriptors(q, k, v, do, params, g_kv, "bwd_kv")
        # dQ first: it also computes delta = rowsum(o * dO) - dlse, which the dK/dV kernel reads
        # (and, with lse_lo, which GQA groups have a row far from 0: the dK/dV kernel's scan, done once)
        far = gluon_attention.far_flags(q, k, params, lse_lo, rec)
        dq = gluon_attention.attention_bwd_dq(q, k, v, do, lse, delta, params, g_q, order, shared, o, dlse,
                                              lse_lo=lse_lo, far=far, rec=rec)
        dk, dv = gluon_attention.attention_bwd_dkdv(q, k, v, do, lse, delta, params, g_kv, order, shared,
                                                    lse_lo=lse_lo, far=far, rec=rec)
        return dq, dk, dv, None

    # delta = rowsum(o * dO) - dlse (the portable kernel serves every other call); for the fused
    # Gluon kernels also lse in log2 units and, with lse_lo, the far GQA groups (`gluon_stats`)
    lse2, far = gluon_stats(lse, q, k, params, lse_lo, gluon_fused)
    launch(attn_bwd_preprocess_kernel, (cdiv(max_sq, cfg_q.block_m), B * Hq),
        o, do, dlse if dlse is not None else delta, delta, params.cu_seqlens_q if vl else offsets,
        lse, delta if lse2 is None else lse2, delta if far is None else far,
        *_bshd_strides(o, vl), *_bshd_strides(do, vl), Hq, Sq, Hq // Hkv, Dv,
        HAS_DLSE=dlse is not None, IS_VARLEN=vl, BLOCK_M=cfg_q.block_m, BLOCK_DV=BD,
        HAS_LSE2=lse2 is not None, HAS_FAR=far is not None,
    )

    mask_t, m_strides, mask_bool = _mask_args(mask, q)
    (offsets, alibi, s_ab, s_ah, cu_q, cu_k, seed_t), scalars, flags = _common_args(q, params)
    lo_t = lse_lo if lse_lo is not None else lse  # (lse: a placeholder pointer)

    def tiles(cfg):
        return dict(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_D=BD, BLOCK_DV=BD,
                    num_warps=cfg.num_warps, num_stages=cfg.num_stages)

    strides_qkvdo = (*_bshd_strides(q, vl), *_bshd_strides(k, vl), *_bshd_strides(v, vl), *_bshd_strides(do, vl))
    # fused: dQ summed by atomics inside the dK/dV kernel (order varies: never when asked
    # to be deterministic); else the dQ kernel recomputes the scores per query block
    fused = cfg_kv.fused_dq and not params.deterministic and g_kv is None and g_q is None
    if g_kv is not None:
        dq_acc = torch.zeros(q.shape, dtype=torch.float32, device=q.device) if gluon_fused else None
        dk, dv = gluon_attention.attention_bwd_dkdv(q, k, v, do, lse, delta, params, g_kv, order, lse_lo=lse_lo,
                                                    far=far, dq_acc=dq_acc, lse2=lse2)
    else:
        dk = torch.empty_like(k, memory_format=torch.contiguous_format)
        dv = torch.empty_like(v, memory_format=torch.contiguous_format)
        dq_acc = torch.zeros(q.shape, dtype=torch.float32, device=q.device) if fused else q
        # split_kv: dV (PART 1), then dK (PART 2, with the fused dQ if any); else both at once
        for part in (1, 2) if cfg_kv.split_kv else (0,):
            launch(attn_bwd_dkdv_kernel, (cdiv(max_sk, cfg_kv.block_n), B * Hkv),
                q, k, v, do, lse, lo_t, delta, dk, dv, mask_t, offsets, alibi, cu_q, cu_k, seed_t, dq_acc, order,
                *strides_qkvdo, *_bshd_strides(dk, vl), *_bshd_strides(dv, vl), *m_strides, s_ab, s_ah,
                *_bshd_strides(dq_acc, vl), Hq, Hkv, Sq, Sk, D, Dv, Hq // Hkv, *scalars,
                HAS_MASK=mask is not None, MASK_BOOL=mask_bool, **flags, **tiles(cfg_kv),
                FUSED_DQ=fused and part != 1, HAS_LO=lse_lo is not None, PART=part,
            )
    if gluon_fused or fused:
        dq = dq_from_acc(dq_acc, params.scale, q.dtype)
    elif g_q is not None:
        dq = gluon_attention.attention_bwd_dq(q, k, v, do, lse, delta, params, g_q, order, lse_lo=lse_lo)
    else:
        dq = torch.empty_like(q, memory_format=torch.contiguous_format)
        launch(attn_bwd_dq_kernel, (cdiv(max_sq, cfg_q.block_m), B * Hq),
            q, k, v, do, lse, lo_t, delta, dq, mask_t, offsets, alibi, cu_q, cu_k, seed_t, order,
            *strides_qkvdo, *_bshd_strides(dq, vl), *m_strides, s_ab, s_ah,
            Hq, Sq, Sk, D, Dv, Hq // Hkv, *scalars,
            HAS_MASK=mask is not None, MASK_BOOL=mask_bool, **flags, **tiles(cfg_q), HAS_LO=lse_lo is not None,
        )

    dmask = None
    if need_dmask:  # masks are for dense batches only (the public layer rejects them with cu_seqlens)
        Bm, Hm, Sqm, Skm = mask.shape
        dmask = torch.empty(Bm, Hm, Sqm, Skm, dtype=torch.float32, device=q.device)
        m_bcast, n_bcast = Sqm == 1 and Sq > 1, Skm == 1 and Sk > 1
        grid = (cdiv(Sqm, cfg_q.block_m), cdiv(Skm, cfg_q.block_n), Bm * Hm)
        launch(attn_bwd_dmask_kernel, grid,
            q, k, v, do, lse, lo_t, delta, dmask, mask_t, offsets, alibi, cu_q, cu_k, seed_t,
            *strides_qkvdo, *m_strides, s_ab, s_ah, *dmask.stride(),
            B, Hq, Sq, Sk, D, Dv, Hq // Hkv, Hm, Sqm, Skm, *scalars,
            MASK_BOOL=mask_bool, **flags,
            B_BCAST=Bm == 1 and B > 1, H_BCAST=Hm == 1 and Hq > 1, M_BCAST=m_bcast, N_BCAST=n_bcast,
            OUT_M=1 if m_bcast else cfg_q.block_m, OUT_N=1 if n_bcast else cfg_q.block_n, **tiles(cfg_q),
            HAS_LO=lse_lo is not None,
        )
    return dq, dk, dv, dmask
