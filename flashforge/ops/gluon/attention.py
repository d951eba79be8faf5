"""Launchers of the sm_90 Gluon kernels (`attention_fwd_sm90`, `attention_bwd_sm90`): which
calls they serve, and the calls.

Their inputs and outputs mean what the portable kernels' do (o, and lse in natural-log
units, -inf for rows with no visible key; delta from the portable preprocess kernel, or from
the Gluon dQ kernel when both Gluon backward kernels serve), so
either backward takes either forward's outputs, and each backward kernel (dK/dV, dQ) may be
Gluon or portable independently.
"""
from __future__ import annotations

import functools
import os
import struct

import torch

from .. import replay
from ..launch import cdiv
from ..params import AttnParams
from ..tma import tma_ready

# head dims (D = Dv) the kernels serve.  The forward's and the dQ kernel's accumulator is one
# [rows, D] float32 tile, which fits up to D = 256; the dK/dV kernel's two (dK, dV) do not past
# D = 128, so there it runs twice, one accumulator each (`bwd_tiles_fit`: split_kv)
_HEAD_DIMS = (64, 128, 256)
# q as a register operand instead of shared memory: measured mixed (H200, D = 128: causal
# 16k 586 against 569 TFLOP/s, plain 4k 504 against 544), so off; kept to re-measure
_Q_IN_REGS = os.environ.get("FLASHFORGE_GLUON_Q_REGS", "0") == "1"


@functools.lru_cache(maxsize=None)
def _bwd_kernels():
    """(dK/dV kernel, dQ kernel), or None where this Triton has no Gluon for Hopper."""
    try:
        from .attention_bwd_sm90 import attn_bwd_dkdv_sm90_kernel, attn_bwd_dq_sm90_kernel
    except ImportError:
        return None
    return attn_bwd_dkdv_sm90_kernel, attn_bwd_dq_sm90_kernel


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


@functools.lru_cache(maxsize=None)
def _ws_kernel():
    from .attention_fwd_ws_sm90 import attn_fwd_ws_sm90_kernel
    return attn_fwd_ws_sm90_kernel


@functools.lru_cache(maxsize=None)
def _persistent_kernel():
    from .attention_fwd_persistent_sm90 import attn_fwd_persistent_sm90_kernel
    return attn_fwd_persistent_sm90_kernel


# programs of a persistent grid: 0, one a multiprocessor (at most one item each); else this many.
# A test knob: a few programs, each running many items, check that ring indices, barrier phases
# and the ping-pong turns carry over from item to item (tests/test_gluon_sm90.py)
_PROGRAMS = int(os.environ.get("FLASHFORGE_PERSISTENT_PROGRAMS", "0"))


@functools.lru_cache(maxsize=None)
def _sm_count(device) -> int:
    """Multiprocessors of `device` (a persistent grid's programs); off a GPU (the offline compile
    check), an H100 / H200's 132."""
    if device.type != "cuda":
        return 132
    return torch.cuda.get_device_properties(device).multi_processor_count


def persistent_programs(grid, head_bytes: int, causal: bool, sms: int) -> int:
    """Programs of a persistent forward over `grid` (query blocks, heads): one an SM; with a causal
    mask, the items of one L2 section (`pipeline.program_order`: sect heads of n_blk blocks, longest
    first) where that is at most one an SM.  Why: the programs take items in snake-order rounds
    (attention_fwd_persistent_sm90), which balance only where each round is a whole section, long to
    short -- a model of the standard grid's causal rows puts the longest program at 1.03x the mean
    (four SMs idle at 128 programs) against 1.46-1.56x for rounds of one a multiprocessor."""
    from .pipeline import section_heads
    n_blk, n_bh = grid
    if not causal:
        return sms
    size = section_heads(head_bytes, n_blk, n_bh) * n_blk
    return min(size, sms)


def _ws_dkdv_kernel():
    from .attention_bwd_dkdv_ws_sm90 import attn_bwd_dkdv_ws_sm90_kernel
    return attn_bwd_dkdv_ws_sm90_kernel


@functools.lru_cache(maxsize=None)
def _halfdq_dkdv_kernel():
    from .attention_bwd_dkdv_halfdq_sm90 import attn_bwd_dkdv_halfdq_sm90_kernel
    return attn_bwd_dkdv_halfdq_sm90_kernel


@functools.lru_cache(maxsize=None)
def _wide_dkdv_kernel():
    from .attention_bwd_dkdv_wide_sm90 import attn_bwd_dkdv_wide_sm90_kernel
    return attn_bwd_dkdv_wide_sm90_kernel


@functools.lru_cache(maxsize=None)
def _ws_dq_kernel():
    from .attention_bwd_dq_ws_sm90 import attn_bwd_dq_ws_sm90_kernel
    return attn_bwd_dq_ws_sm90_kernel


_SMEM_SM90 = 232448  # bytes of shared memory a block may opt into on sm_90


def ws_shared_bytes(cfg, D: int, resident: int = 1) -> int:
    """A warp-specialized kernel's shared memory (16-bit tiles): each consumer's `resident` 64-row
    tiles (the forward: Q, o's staging too; the dQ kernel: Q and dO), the K and V rings, and 1 KB
    for the barriers and alignment (the compiled kernels use 120-472 B).  The persistent forward
    stages o in a tile of its own."""
    v_stages = cfg.v_stages or max(2, cfg.num_stages)
    resident += 1 if cfg.persistent else 0
    return 2 * (cfg.consumers * resident * 64 * D + (max(2, cfg.num_stages) + v_stages) * cfg.block_n * D) + 1024


def ws_dkdv_shared_bytes(cfg, D: int) -> int:
    """The warp-specialized dK/dV kernel's: both consumers' K and V, the Q / dO ring, both P and
    dS tiles (16-bit) and both dQ buffers (float32), 1 KB more.  half_dq: the ring's tiles are
    block_m rows, two two-slot dS^T rings of block_m x 64, two [64, 64] float32 dQ parts, and a
    ring slot's lse and delta (float32, block_m each).  half_dq at D = 256 (the wide kernel): K, V,
    one Q and dO slot, the shared P and dS tiles, both consumers' [64, D / 2] float32 dQ_t halves
    and the slot's lse and delta."""
    if cfg.half_dq and D > 128:
        return 2 * (4 * 64 * D + 2 * 64 * 64) + 64 * D * 4 + 2 * 64 * 4 + 1024
    if cfg.half_dq:
        stages = max(2, cfg.num_stages)
        return 2 * (4 * 64 * D + 2 * stages * cfg.block_m * D + 2 * 2 * 64 * cfg.block_m) + \
            2 * 64 * 64 * 4 + 2 * stages * cfg.block_m * 4 + 1024
    return 2 * (4 * 64 * D + 2 * max(2, cfg.num_stages) * 64 * D + 4 * 64 * 64) + 2 * 64 * D * 4 + 1024


# the warp-specialized forward's register split (setmaxnreg): 240 for each consumer warpgroup,
# 24 for the loader's, FA3's (the three warpgroups' 168 each at launch: 2 * 240 + 24 = 3 * 168)
_WS_REGS = (240, 24)
# three consumers (the forward at D = 64): four warpgroups of 128 registers at launch, 3 * 160 +
# 24 <= 4 * 128 (setmaxnreg takes multiples of 8)
_WS3_REGS = (160, 24)


def scope_reason(q, k, v, mask, params: AttnParams, arch: tuple[int, int]) -> str | None:
    """Why the Gluon kernels cannot compute this call's scores, or None where they can: sm_90,
    bf16/fp16 with D = Dv in {64, 128, 256}, dense or packed (varlen), plain, causal or windowed
    scores (an integer offset, or bottom-right aligned), softcap, ALiBi: no mask, bias, dropout,
    RoPE, KV cache or split keys; at least 64 query rows (the longest sequence's, when packed:
    decoding-sized query blocks take the portable kernel, which packs GQA groups; and with Sq = 1,
    an integer Triton specializes, triton 3.6 fails to compile the dK/dV kernel).  The one list of
    what sends a call to the portable kernels (`in_scope`, `bwd_call_in_scope`; the launcher logs
    the reason, ops/triton/attention.py `explain`)."""
    p = params
    if tuple(arch) != (9, 0):
        return f"sm_{arch[0]}{arch[1]}: the Gluon kernels are for sm_90"
    if q.dtype not in (torch.float16, torch.bfloat16):
        return f"{str(q.dtype)[6:]} inputs (Gluon: bfloat16, float16)"
    if q.shape[3] not in _HEAD_DIMS or v.shape[3] != q.shape[3]:
        return f"head dims D = {q.shape[3]}, Dv = {v.shape[3]} (Gluon: D = Dv in {_HEAD_DIMS})"
    if (p.max_seqlen_q if p.is_varlen else q.shape[1]) < 64:
        return "fewer than 64 query rows (the portable kernel packs GQA groups into a tile)"
    for what, present in _NOT_IN_GLUON:
        if present(mask, p):
            return what + " (not in the Gluon kernels)"
    return None


# the score features the Gluon kernels do not have: (what, present(mask, params))
_NOT_IN_GLUON = (
    ("a mask or bias", lambda mask, p: mask is not None),
    ("a KV cache", lambda mask, p: p.seqlens_k is not None),
    ("a paged KV cache", lambda mask, p: p.block_table is not None),
    ("split keys", lambda mask, p: p.num_splits > 1),
    ("RoPE inside the kernel", lambda mask, p: p.q_rope is not None),
    ("dropout", lambda mask, p: p.dropout_p > 0),
    ("per-sequence causal offsets", lambda mask, p: p.offset_tensor is not None),
    ("a scale <= 0", lambda mask, p: not p.scale > 0),
)


def _scores_in_scope(q, k, v, mask, params: AttnParams, arch: tuple[int, int]) -> bool:
    return scope_reason(q, k, v, mask, params, arch) is None


def key_count(k, params: AttnParams) -> int:
    """The keys a call's longest sequence has (what a tile entry's min_keys is compared with)."""
    return params.max_seqlen_k if params.is_varlen else k.shape[1]


def forward_reason(q, k, v, mask, params: AttnParams, cfg, arch: tuple[int, int]) -> str | None:
    """Why the Gluon forward does not compute this call with tiles `cfg`, or None where it does:
    `scope_reason`, tensors the copy engine can read, tiles of one warp per 16 query rows, and at
    least `cfg.min_keys` keys."""
    reason = scope_reason(q, k, v, mask, params, arch)
    if reason is not None:
        return reason
    if key_count(k, params) < cfg.min_keys:
        return f"fewer than the tiles' min_keys = {cfg.min_keys} keys"
    if cfg.consumers in (2, 3):
        if cfg.block_m != 64 * cfg.consumers or cfg.num_warps != 4:
            return (f"tiles {cfg.block_m} x {cfg.block_n} with {cfg.num_warps} warps, {cfg.consumers} consumers "
                    "(the warp-specialized Gluon forward: 64 rows and 4 warps a consumer)")
        if cfg.consumers == 3 and (q.shape[3] != 64 or cfg.pingpong):
            return (f"three consumers at D = {q.shape[3]}{' with ping-pong' if cfg.pingpong else ''} (the "
                    "warp-specialized Gluon forward: three at D = 64 only, without ping-pong)")
        smem = ws_shared_bytes(cfg, q.shape[3])
        if smem > _SMEM_SM90:
            return (f"tiles {cfg.block_m} x {cfg.block_n} x {cfg.num_stages} stages at D = {q.shape[3]}: {smem} B of "
                    f"shared memory (sm_90: {_SMEM_SM90})")
    elif cfg.block_m != 16 * cfg.num_warps:
        return f"tiles {cfg.block_m} x {cfg.block_n} with {cfg.num_warps} warps (Gluon: one warp per 16 rows)"
    if _kernel() is None:
        return "this Triton has no Gluon for Hopper"
    if not all(tma_ready(t) for t in (q, k, v)):
        return "q, k or v not readable by the copy engine (TMA: 16-byte aligned base and strides, unit last stride)"
    return None


def in_scope(q, k, v, mask, params: AttnParams, cfg, arch: tuple[int, int]) -> bool:
    """Whether the Gluon forward computes this call (`forward_reason`)."""
    return forward_reason(q, k, v, mask, params, cfg, arch) is None


def _batch(q, params: AttnParams) -> int:
    """The kernels' B: the sequences of a packed batch (its lse is [1, Hq, total]), else q's batch."""
    return params.cu_seqlens_q.shape[0] - 1 if params.is_varlen else q.shape[0]


def _sequences(q, k, params: AttnParams, order, lse):
    """The kernels' batch arguments: (B, descriptor builder, lse strides (batch, head), CU_Q, CU_K,
    ORDER, Sq, Sk, total_q, total_k, offset, bottom_right).  Dense: Sq, Sk are the lengths and a
    bottom-right alignment is folded into the offset.  Packed ([1, total, H, D], lse [1, Hq, total]):
    the longest lengths (the grid's extent; each program reads its sequence's own), the rows of the
    packed tensors (each sequence's bounds are clamped to them), the sequences in `order`, and
    ragged descriptors."""
    if params.is_varlen:
        return (_batch(q, params), _ragged_descriptor, 0, lse.stride(1), params.cu_seqlens_q, params.cu_seqlens_k,
                order, params.max_seqlen_q, params.max_seqlen_k, q.shape[1], k.shape[1], _right(params),
                int(params.offset_bottom_right))
    Sq, Sk = q.shape[1], k.shape[1]
    offset = _right(params) + (Sk - Sq if params.offset_bottom_right else 0)
    return _batch(q, params), _descriptor, lse.stride(0), lse.stride(1), lse, lse, lse, Sq, Sk, Sq, Sk, offset, 0


def _right(params: AttnParams) -> int:
    """The kernels' offset: key j is visible from query i only if j <= i + offset (their CAUSAL),
    so a window's right side folds into it (canonical_visibility keeps the sum int32-safe)."""
    return params.offset + max(params.window_right, 0)


def _window(params: AttnParams) -> dict:
    """The kernels' visibility arguments beside `_right`'s offset: CAUSAL (a right side: causal is
    right = 0), HAS_WL and span (a left side: j >= i + offset - span, i.e. i + params.offset -
    window_left)."""
    left, right = params.window_left, params.window_right
    span = left + max(right, 0) if left >= 0 else 0
    return dict(span=span, CAUSAL=right >= 0, HAS_WL=left >= 0)


def _modifiers(params: AttnParams, placeholder):
    """(args, constexprs) of the score modifiers (`scores.modified_score`): scale, softcap, the
    ALiBi slopes (float32 [B, Hq], or `placeholder`) and their strides, and the window's right
    side (ALiBi's distance is from the call's own offset, the kernels' less that side)."""
    slopes = params.alibi_slopes
    right = max(params.window_right, 0)
    if slopes is None:
        args = (params.scale, params.softcap, placeholder, 0, 0, right)
    else:
        args = (params.scale, params.softcap, slopes, slopes.stride(0), slopes.stride(1), right)
    return args, dict(HAS_SOFTCAP=params.softcap > 0, HAS_ALIBI=slopes is not None)


def _f32(x: float) -> float:
    return struct.unpack("f", struct.pack("f", x))[0]


@functools.lru_cache(maxsize=64)
def _qk_scale(scale: float) -> float:
    """scale * log2(e) rounded as the portable kernels compute it (float32 operands, one float32
    rounding), so both families scale a score into the same float32 (`rounding.py`)."""
    return _f32(_f32(scale) * _f32(1.4426950408889634))


def attention_forward(q, k, v, params: AttnParams, cfg, order=None, lse_lo=None, rec=replay.DIRECT):
    """o [B, Sq, Hq, D] and lse [B, Hq, Sq] (float32) for a call `in_scope` accepts (packed:
    [1, total, Hq, D] and [1, Hq, total]; `order`, the sequences longest first); with `lse_lo`
    (contiguous, lse's shape) also lse's low part (`flashforge.ops.params`).  `rec` makes the fresh
    tensors and launches (`replay.DIRECT`, or a launch plan's recorder: ops/replay.py)."""
    kernel = _kernel()[0]
    _, total, Hq, D = q.shape
    Hkv = k.shape[2]
    o = rec.fresh(torch.empty, q.shape, dtype=q.dtype, device=q.device)
    lse = rec.fresh(torch.empty, q.shape[0], Hq, total, dtype=torch.float32, device=q.device)
    B, desc, s_lb, s_lh, cu_q, cu_k, order, Sq, Sk, tot_q, tot_k, offset, br = _sequences(q, k, params, order, lse)
    w = _window(params)
    mod, mod_flags = _modifiers(params, lse)
    grid = (cdiv(Sq, cfg.block_m), B * Hq)
    ws = cfg.consumers >= 2
    rows = 64 if ws else cfg.block_m  # q's and o's boxes (warp-specialized: one consumer's rows)
    args = (desc(q, rows), desc(k, cfg.block_n), desc(v, cfg.block_n), desc(o, rows), lse,
            lse if lse_lo is None else lse_lo, s_lb, s_lh, cu_q, cu_k, order, Hq, Sq, Sk, tot_q, tot_k, Hq // Hkv, offset,
            br, w["span"], _qk_scale(params.scale), *mod)
    common = dict(CAUSAL=w["CAUSAL"], HAS_WL=w["HAS_WL"], **mod_flags, BLOCK_N=cfg.block_n, D=D,
                  STAGES=max(2, cfg.num_stages), V_STAGES=cfg.v_stages or max(2, cfg.num_stages),
                  VARLEN=params.is_varlen, STORE_LO=lse_lo is not None)
    # poly_exp2: part of the unmasked tiles' exponentials on the FMA pipes (`rounding.exp2_split`;
    # absent, the kernels' default of none, so the launch's specialization is the one before it)
    poly = dict(POLY_EXP2=cfg.poly_exp2) if cfg.poly_exp2 else {}
    if ws:
        regs = _WS3_REGS if cfg.consumers == 3 else _WS_REGS
        nc = dict(NC=3) if cfg.consumers == 3 else {}  # (the kernel's default: two)
        if cfg.persistent:  # at most one program an SM, taking the grid's items in rounds
            programs = _PROGRAMS or persistent_programs(grid, Sk * 4 * D // (Hq // Hkv), w["CAUSAL"],
                                                        _sm_count(q.device))
            programs = min(grid[0] * grid[1], programs)
            rec.launch(_persistent_kernel(), (programs,), *args, grid[1], **common, **poly, PINGPONG=cfg.pingpong,
                       CONSUMER_REGS=regs[0], LOADER_REGS=regs[1], num_warps=4, **nc)
        else:
            rec.launch(_ws_kernel(), grid, *args, **common, **poly, PINGPONG=cfg.pingpong, CONSUMER_REGS=regs[0],
                       LOADER_REGS=regs[1], num_warps=4, **nc)
    else:
        rec.launch(kernel, grid, *args, **common, **poly, BLOCK_M=cfg.block_m, Q_IN_REGS=_Q_IN_REGS,
                   num_warps=cfg.num_warps)
    return o, lse


def bwd_call_reason(q, k, v, do, lse, mask, params: AttnParams, arch: tuple[int, int], lse_lo=None) -> str | None:
    """Why the Gluon backward kernels may not compute this call, or None where they may (each then
    also needs `bwd_tiles_fit`): the forward's scope, dO in q's dtype and readable by the copy
    engine, a contiguous lse (and lse_lo)."""
    reason = scope_reason(q, k, v, mask, params, arch)
    if reason is not None:
        return reason
    if do.dtype != q.dtype:
        return f"dO in {str(do.dtype)[6:]}, q in {str(q.dtype)[6:]}"
    if not lse.is_contiguous() or (lse_lo is not None and not lse_lo.is_contiguous()):
        return "a non-contiguous lse"
    if _bwd_kernels() is None or _kernel() is None:
        return "this Triton has no Gluon for Hopper"
    if not all(tma_ready(t) for t in (q, k, v, do)):
        return "q, k, v or dO not readable by the copy engine (TMA: 16-byte aligned base and strides, unit last stride)"
    return None


def bwd_call_in_scope(q, k, v, do, lse, mask, params: AttnParams, arch: tuple[int, int], lse_lo=None) -> bool:
    """Whether the Gluon backward kernels may compute this call (`bwd_call_reason`)."""
    return bwd_call_reason(q, k, v, do, lse, mask, params, arch, lse_lo) is None


def bwd_tiles_fit(kind: str, cfg, head_dim: int) -> bool:
    """One warp per 16 rows of the kernel's resident block: keys for "bwd_kv" (dK/dV), queries
    for "bwd_q" (dQ); and past D = 128, dK and dV in two launches (split_kv: with both
    accumulators in registers, 256 a thread, the kernel would spill)."""
    if kind == "bwd_kv" and cfg.consumers == 2 and cfg.half_dq and head_dim > 128:
        # the wide kernel (consumers split the head dim): 64 keys, 64-query tiles, one Q / dO slot
        return head_dim == 256 and (cfg.block_m, cfg.block_n, cfg.num_warps, cfg.num_stages) == (64, 64, 4, 1) and \
            not cfg.split_kv and ws_dkdv_shared_bytes(cfg, head_dim) <= _SMEM_SM90
    if kind == "bwd_kv" and head_dim > 128 and not cfg.split_kv:
        return False
    if cfg.consumers > 2:  # (three consumers: the forward's only)
        return False
    if cfg.consumers == 2:  # the warp-specialized kernels: two 64-row consumers of 4 warps
        if kind == "bwd_kv" and cfg.half_dq:  # 128-query tiles at D = 64, 64 at D = 128
            return cfg.block_n == 128 and cfg.num_warps == 4 and not cfg.split_kv and \
                (head_dim, cfg.block_m) in ((64, 128), (128, 64)) and ws_dkdv_shared_bytes(cfg, head_dim) <= _SMEM_SM90
        if kind == "bwd_kv":  # (dQ fused: `fuses_dq` says where it serves)
            return cfg.block_n == 128 and cfg.block_m == 64 and cfg.num_warps == 4 and head_dim <= 128 and \
                not cfg.split_kv and ws_dkdv_shared_bytes(cfg, head_dim) <= _SMEM_SM90 and \
                (not cfg.rs or head_dim == 64)  # (rs: register operands, D = 64 only)
        return cfg.block_m == 128 and cfg.num_warps == 4 and ws_shared_bytes(cfg, head_dim, resident=2) <= _SMEM_SM90
    return (cfg.block_n if kind == "bwd_kv" else cfg.block_m) == 16 * cfg.num_warps


def fuses_dq(cfg, head_dim: int, params: AttnParams) -> bool:
    """Whether the dK/dV kernel with tiles `cfg` also computes dQ (FUSED_DQ: dQ_t = dS K added to
    a float32 accumulator by atomics, no dQ kernel, no second S and dP per tile): the table asks
    for it (`fused_dq`), the call does not ask to be deterministic (atomics add in a varying
    order), one launch computes dK and dV (no split_kv), and the query tiles are one wgmma tall
    (64 rows: dQ_t's; with two warpgroups, 128 keys, each computes half of its columns); overlapped
    tiles (`overlap`) for D = 64 only, and a Triton with the copy engine's reduce."""
    if cfg.consumers == 2:  # the warp-specialized dK/dV kernels always fuse dQ (D = 256: the wide one)
        return cfg.fused_dq and not params.deterministic and (head_dim <= 128 or cfg.half_dq) and _reduce_ready()
    return (cfg.fused_dq and not params.deterministic and not cfg.split_kv and cfg.num_warps in (4, 8)
            and cfg.block_m == 64 and (head_dim == 64 if cfg.overlap else head_dim <= 128) and _reduce_ready())


@functools.lru_cache(maxsize=None)
def _reduce_ready() -> bool:
    try:
        from .pipeline import tma_reduce_ready
    except ImportError:
        return False
    return tma_reduce_ready()


@functools.lru_cache(maxsize=None)
def _layout(rank=4):
    """The shared-memory layout of every tile (128-byte swizzle, 16-bit), built once per rank."""
    return _kernel()[1].NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=rank)


@functools.lru_cache(maxsize=None)
def _dq_layout(rank: int):
    """The float32 dQ accumulator's staging layout (128-byte swizzle), built once per rank: the
    launch cache keys a descriptor's layout by identity (ops/launch.py), so a layout built per call
    made every fused launch miss it (Triton's own path, ~0.5 ms of host time a backward on the
    device, RESULTS.md v0.9.1) and grow the cache by one entry a call."""
    return _kernel()[1].NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=32, rank=rank)


def _descriptor(t, rows, cols=None):
    """A 4-D box [1, rows, 1, D] over [B, S, H, D]: the copy engine zero-fills rows past a
    sequence's end and clips stores there, so no tile reads or writes another sequence's rows.

    Built without the dataclass's __post_init__: its checks (16-byte aligned address and
    strides, unit last stride, power-of-two box) are what `tma_ready` and the tile table
    already guarantee, and a training step builds 11 descriptors (host time: the S = 1k rows
    of the benchmark are host-bound on the device's CPU).  cols: a box narrower than D (the wide
    dK/dV kernel's outputs, each consumer storing half of the head dim)."""
    return _unchecked_descriptor(t, list(t.shape), list(t.stride()), [1, rows, 1, cols or t.shape[3]], _layout())


RAGGED = 2**30  # pipeline.RAGGED: the ragged descriptors' row extent


def ragged_shape_strides(t):
    """(shape, strides) of the 5-D ragged descriptor over a packed [1, total, H, D] tensor.
    Element (RAGGED, start + n, RAGGED - n + r, h, d) is row start + r of the sequence
    [start, start + n): the first two strides sum to 2**34 elements, which wrap to nothing (the
    copy engine's addresses are 64-bit, and RAGGED * 2**34 = 2**64), and the third coordinate is
    in bounds (< RAGGED) exactly when r < n."""
    rs = t.stride(1)
    big = 0x7FFF0000
    return [big, big, RAGGED, t.shape[2], t.shape[3]], [2**34 - rs, rs, rs, t.stride(2), 1]


def _ragged_descriptor(t, rows, cols=None):
    """A 5-D box [1, 1, rows, 1, D] (or cols wide) over a packed [1, total, H, D] tensor
    (pipeline.py's ragged addressing): rows past each sequence's end are zero-filled and clipped,
    as above."""
    shape, strides = ragged_shape_strides(t)
    return _unchecked_descriptor(t, shape, strides, [1, 1, rows, 1, cols or t.shape[3]], _layout(5))


def _unchecked_descriptor(t, shape, strides, block_shape, layout):
    TensorDescriptor = _kernel()[2]
    d = object.__new__(TensorDescriptor)
    if not hasattr(d, "__dict__"):  # a Triton whose descriptor has slots: the checked constructor
        return TensorDescriptor(base=t, shape=shape, strides=strides, block_shape=block_shape, layout=layout,
                                padding="zero")
    d.__dict__.update(base=t, shape=shape, strides=strides, block_shape=block_shape, layout=layout, padding="zero")
    return d


DQ_COLS = 32  # float32 columns per 128-byte swizzle row: the widest box (the kernel reads its DQ_N off it)


def dq_descriptor(dq_acc, params: AttnParams):
    """The float32 dQ accumulator's descriptor for the fused dK/dV kernel's reduce-adds: [1, 64, 1,
    DQ_COLS] boxes (dense, or ragged when packed), 128-byte swizzled as the kernel stages them."""
    layout = _dq_layout(5 if params.is_varlen else 4)
    if params.is_varlen:
        shape, strides = ragged_shape_strides(dq_acc)
        return _unchecked_descriptor(dq_acc, shape, strides, [1, 1, 64, 1, DQ_COLS], layout)
    return _unchecked_descriptor(dq_acc, list(dq_acc.shape), list(dq_acc.stride()), [1, 64, 1, DQ_COLS], layout)


def input_rows(cfg, kind: str) -> tuple[int, int]:
    """Rows of (q and dO, k and v) in the boxes of backward pass `kind` ("bwd_q", "bwd_kv") with
    tiles `cfg`: its tiles', but one consumer's 64 of a warp-specialized kernel's resident 128."""
    if cfg.consumers == 2:  # the dQ kernel's 128 queries, the dK/dV kernel's 128 keys
        return (64, cfg.block_n) if kind == "bwd_q" else (cfg.block_m, 64)
    return cfg.block_m, cfg.block_n


def input_descriptors(q, k, v, do, params: AttnParams, cfg, kind: str):
    """The descriptors of (q, k, v, dO) with the boxes of pass `kind` (`input_rows`): both backward
    kernels read them, so where their boxes agree one set serves both (four fewer to build and a
    step's host time shorter)."""
    desc = _ragged_descriptor if params.is_varlen else _descriptor
    rows_q, rows_k = input_rows(cfg, kind)
    return desc(q, rows_q), desc(k, rows_k), desc(v, rows_k), desc(do, rows_q)


def far_flags(q, k, params: AttnParams, lse_lo, rec=replay.DIRECT):
    """With lse_lo: the zeroed int32 [B * Hkv] (B: `_batch`, one per dK/dV program row of the grid)
    the dQ kernel marks the GQA groups with a row far from 0 in, for the dK/dV kernel launched
    after it (`attention_bwd_dq`'s `far`); else None."""
    if lse_lo is None:
        return None
    return rec.fresh(torch.zeros, _batch(q, params) * k.shape[2], device=q.device, dtype=torch.int32)


def attention_bwd_dkdv(q, k, v, do, lse, delta, params: AttnParams, cfg, order=None, inputs=None, lse_lo=None,
                       far=None, dq_acc=None, lse2=None, rec=replay.DIRECT):
    """dK, dV [B, Sk, Hkv, D] for a call in the Gluon backward's scope (`bwd_call_in_scope`,
    `bwd_tiles_fit`); delta from the preprocess kernel or the dQ kernel; `inputs`: `input_descriptors`
    with this cfg, or None to build them; `far`: `far_flags` as the dQ or preprocess kernel filled
    them, or None for this kernel to find them.  With `dq_acc` (zeroed float32 in q's shape; only
    where `fuses_dq`), the kernel also adds dS K into it, unscaled (the caller scales:
    `triton.attention.dq_from_acc`).  The half-dQ and wide kernels (cfg.half_dq) read `lse2` (lse
    in log2 units, 0 where a row sees no key) and, with lse_lo, a filled `far`: the preprocess
    kernel's (`triton.attention.gluon_stats`)."""
    if cfg.consumers == 2 and cfg.half_dq and (lse2 is None or (lse_lo is not None and far is None)):
        raise ValueError("attention_bwd_dkdv: the half-dQ kernels need lse2 and, with lse_lo, far filled "
                         "(triton.attention.gluon_stats and the preprocess kernel)")
    dkdv, _ = _bwd_kernels()
    Hq, D, Hkv = q.shape[2], q.shape[3], k.shape[2]
    dk = rec.fresh(torch.empty, k.shape, dtype=k.dtype, device=k.device)
    dv = rec.fresh(torch.empty, v.shape, dtype=v.dtype, device=v.device)
    B, desc, s_lb, s_lh, cu_q, cu_k, order, Sq, Sk, tot_q, tot_k, offset, br = _sequences(q, k, params, order, lse)
    grid = (cdiv(Sk, cfg.block_n), B * Hkv)
    # with lse_lo, two launches (the kernel's docstring): the second redoes the blocks of the
    # GQA groups the first marks in `far`, and its other programs leave at once
    ready = far is not None
    w = _window(params)
    mod, mod_flags = _modifiers(params, lse)
    if not ready:
        far = lse if lse_lo is None else rec.fresh(torch.empty, B * Hkv, device=lse.device, dtype=torch.int32)
    if cfg.consumers == 2:  # warp-specialized, dQ fused (`fuses_dq`): k, v, dK, dV in 64-row boxes
        dk_desc = desc(dk, 64)
        args = (*(inputs or input_descriptors(q, k, v, do, params, cfg, "bwd_kv")), dk_desc, desc(dv, 64), lse,
                lse if lse_lo is None else lse_lo, delta, far, s_lb, s_lh, cu_q, cu_k, order, Hq, Sq, Sk, tot_q, tot_k,
                Hq // Hkv, offset, br, w["span"], _qk_scale(params.scale), *mod, dq_descriptor(dq_acc, params))
        if cfg.half_dq:  # (the stats rings take lse2: `lse`'s place, which these kernels read for nothing else)
            args = (*args[:6], lse2, *args[7:])
        if cfg.half_dq and D > 128:  # the wide kernel: each consumer stores D / 2 columns of dK and dV
            args = (*args[:4], desc(dk, 64, D // 2), desc(dv, 64, D // 2), *args[6:])
        for second in ((False,) if lse_lo is None else (False, True)):
            if cfg.half_dq and D > 128:
                rec.launch(_wide_dkdv_kernel(), grid, *args, CAUSAL=w["CAUSAL"], HAS_WL=w["HAS_WL"], **mod_flags, D=D,
                           VARLEN=params.is_varlen, HAS_LO=lse_lo is not None, LO_PASS=second, FAR_READY=ready,
                           CONSUMER_REGS=_WS_REGS[0], LOADER_REGS=_WS_REGS[1], num_warps=4)
                continue
            if cfg.half_dq:
                rec.launch(_halfdq_dkdv_kernel(), grid, *args, CAUSAL=w["CAUSAL"], HAS_WL=w["HAS_WL"], **mod_flags,
                           BLOCK_M=cfg.block_m, D=D, STAGES=max(2, cfg.num_stages), VARLEN=params.is_varlen,
                           HAS_LO=lse_lo is not None, LO_PASS=second, FAR_READY=ready, CONSUMER_REGS=_WS_REGS[0],
                           LOADER_REGS=_WS_REGS[1], DEFER=cfg.overlap, num_warps=4)
                continue
            rec.launch(_ws_dkdv_kernel(), grid, *args, CAUSAL=w["CAUSAL"], HAS_WL=w["HAS_WL"], **mod_flags,
                       BLOCK_M=cfg.block_m, D=D, STAGES=max(2, cfg.num_stages), VARLEN=params.is_varlen,
                       HAS_LO=lse_lo is not None, LO_PASS=second, FAR_READY=ready, CONSUMER_REGS=_WS_REGS[0],
                       LOADER_REGS=_WS_REGS[1], SHARED_DQ=cfg.shared_dq, RS=cfg.rs,
                       num_warps=4)
        return dk, dv
    dk_desc = desc(dk, cfg.block_n)
    args = (*(inputs or input_descriptors(q, k, v, do, params, cfg, "bwd_kv")), dk_desc, desc(dv, cfg.block_n), lse,
            lse if lse_lo is None else lse_lo, delta, far, s_lb, s_lh, cu_q, cu_k, order, Hq, Sq, Sk, tot_q, tot_k,
            Hq // Hkv, offset, br, w["span"], _qk_scale(params.scale), *mod,
            dk_desc if dq_acc is None else dq_descriptor(dq_acc, params))  # (dk's: a placeholder, never read)
    # split_kv: dV (PART 1), then dK (PART 2); the second part's scan finds what the first's did
    for part in (1, 2) if cfg.split_kv else (0,):
        for second in ((False,) if lse_lo is None else (False, True)):
            rec.launch(dkdv, grid, *args, CAUSAL=w["CAUSAL"], HAS_WL=w["HAS_WL"], **mod_flags, BLOCK_M=cfg.block_m,
                       BLOCK_N=cfg.block_n, D=D, STAGES=max(2, cfg.num_stages), PIPE=cfg.overlap,
                       VARLEN=params.is_varlen, HAS_LO=lse_lo is not None, LO_PASS=second, FAR_READY=ready,
                       PART=part, FUSED_DQ=dq_acc is not None, num_warps=cfg.num_warps)
    return dk, dv


def attention_bwd_dq(q, k, v, do, lse, delta, params: AttnParams, cfg, order=None, inputs=None, o=None,
                     dlse=None, lse_lo=None, far=None, rec=replay.DIRECT):
    """dQ [B, Sq, Hq, D] for a call in the Gluon backward's scope (`inputs` as for dK/dV).  With
    `o` (unit last stride), the kernel also computes delta = rowsum(o * dO) - dlse into `delta`
    for the dK/dV kernel launched after it (no preprocess kernel); else it reads `delta`.  With
    `far` (`far_flags`), it also marks the GQA groups the dK/dV kernel must redo with lse_lo."""
    _, dq_kernel = _bwd_kernels()
    Hq, D, Hkv = q.shape[2], q.shape[3], k.shape[2]
    dq = rec.fresh(torch.empty, q.shape, dtype=q.dtype, device=q.device)
    B, desc, s_lb, s_lh, cu_q, cu_k, order, Sq, Sk, tot_q, tot_k, offset, br = _sequences(q, k, params, order, lse)
    grid = (cdiv(Sq, cfg.block_m), B * Hq)
    here = o is not None
    w = _window(params)
    mod, mod_flags = _modifiers(params, lse)
    o_strides = ((0 if params.is_varlen else o.stride(0)), o.stride(1), o.stride(2)) if here else (0, 0, 0)
    ws = cfg.consumers == 2
    rows = input_rows(cfg, "bwd_q")[0]  # dQ's box: q's
    args = (*(inputs or input_descriptors(q, k, v, do, params, cfg, "bwd_q")), desc(dq, rows), lse,
            lse if lse_lo is None else lse_lo, delta, lse if far is None else far, s_lb, s_lh, cu_q, cu_k, order, Hq,
            Sq, Sk, tot_q, tot_k, Hq // Hkv, offset, br, w["span"], _qk_scale(params.scale), params.scale,
            o if here else lse, dlse if dlse is not None else lse, *o_strides, *mod[1:])
    common = dict(CAUSAL=w["CAUSAL"], HAS_WL=w["HAS_WL"], **mod_flags, BLOCK_N=cfg.block_n, D=D,
                  STAGES=max(2, cfg.num_stages), V_STAGES=cfg.v_stages or max(2, cfg.num_stages),
                  VARLEN=params.is_varlen, DELTA_HERE=here, HAS_DLSE=here and dlse is not None,
                  HAS_LO=lse_lo is not None, FAR_OUT=far is not None)
    if ws:
        rec.launch(_ws_dq_kernel(), grid, *args, **common, PINGPONG=cfg.pingpong, CONSUMER_REGS=_WS_REGS[0],
                   LOADER_REGS=_WS_REGS[1], num_warps=4)
    else:
        rec.launch(dq_kernel, grid, *args, **common, BLOCK_M=cfg.block_m, num_warps=cfg.num_warps)
    return dq
