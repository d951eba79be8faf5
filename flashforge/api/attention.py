"""`flashforge.attention`: the public attention entry point."""
from __future__ import annotations

import math
from typing import Optional, Union

import torch

from ..autograd.attention import attention_function
from ..ops.params import AttnParams
from .validate import (MAX_HEAD_DIM, MAX_OFFSET, MAX_SEED, SAFE_INDEX, canonical_visibility, check_backend,
                       check_bool, check_float, check_float_dtype, check_int, check_same_device, check_tensor,
                       check_window, draw_seed, values_visible)

__all__ = ["attention"]


def _as_bshd(name: str, x: torch.Tensor, rank: int) -> torch.Tensor:
    """View the seed's layouts as BSHD: ``[S, D]`` -> ``[1, S, 1, D]``, ``[N, S, D]`` -> ``[N, S, 1, D]``."""
    if rank == 2:
        return x.unsqueeze(0).unsqueeze(2)
    if rank == 3:
        return x.unsqueeze(2)
    return x


def _normalise_mask(mask, q: torch.Tensor, rank: int, B: int, Hq: int, Sq: int, Sk: int) -> Optional[torch.Tensor]:
    """Return the mask as a 4-D view ``[Bm, Hm, Sqm, Skm]`` with every dim 1 or full (never expanded)."""
    if mask is None:
        return None
    check_tensor("mask", mask)
    if mask.dtype != torch.bool and not mask.dtype.is_floating_point:
        raise ValueError(f"mask has dtype {mask.dtype}; accepted: torch.bool (True = keep) or a float dtype (additive)")
    if mask.device != q.device:
        raise ValueError(f"mask is on {mask.device} but q is on {q.device}")
    # The logical score shape as the caller sees it, by input rank.
    logical = {2: (Sq, Sk), 3: (B, Sq, Sk), 4: (B, Hq, Sq, Sk)}[rank]
    if mask.dim() < 2 or mask.dim() > len(logical):
        raise ValueError(f"mask has shape {tuple(mask.shape)}; it must have rank 2..{len(logical)} and broadcast "
                         f"to the scores' shape {tuple(logical)}")
    shape = (1,) * (len(logical) - mask.dim()) + tuple(mask.shape)
    for have, want in zip(shape, logical):
        if have != 1 and have != want:
            raise ValueError(f"mask of shape {tuple(mask.shape)} is not broadcastable to the scores' shape "
                             f"{tuple(logical)} (each dim must be 1 or equal)")
    m = mask.reshape(shape)
    if rank == 2:
        m = m.reshape(1, 1, *shape)
    elif rank == 3:
        m = m.unsqueeze(1)
    return m


def _normalise_offset(causal_offset, q: torch.Tensor, B: int, check_inputs: bool,
                      alibi: bool) -> tuple[int, Optional[torch.Tensor], bool]:
    """(int offset, per-batch int32/int64 tensor or None, bottom-right flag).  A tensor keeps its
    dtype (int64 values are not truncated); its values are checked where `values_visible`."""
    if isinstance(causal_offset, str):
        if causal_offset != "bottom_right":
            raise ValueError(f"causal_offset string must be 'bottom_right' (offset Sk - Sq per sequence), "
                             f"got {causal_offset!r}")
        return 0, None, True
    if isinstance(causal_offset, torch.Tensor):
        if causal_offset.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"causal_offset tensor has dtype {causal_offset.dtype}; accepted: int32 or int64")
        if causal_offset.shape != (B,):
            raise ValueError(f"causal_offset tensor has shape {tuple(causal_offset.shape)}; accepted: [B] = [{B}]")
        if causal_offset.device != q.device:
            raise ValueError(f"causal_offset is on {causal_offset.device} but q is on {q.device}")
        if values_visible(causal_offset, check_inputs):
            limit = SAFE_INDEX if alibi else MAX_OFFSET
            values = causal_offset.tolist()
            for b, value in enumerate(values):
                if not -limit <= value <= limit:
                    why = " with alibi_slopes (its distance term uses the offset itself)" if alibi else ""
                    raise ValueError(f"causal_offset[{b}] is {value}; accepted{why}: -2**{limit.bit_length() - 1} "
                                     f"to 2**{limit.bit_length() - 1}")
        return 0, causal_offset.contiguous(), False
    if isinstance(causal_offset, bool) or not isinstance(causal_offset, int):
        raise TypeError(f"causal_offset must be an int, an int32/int64 tensor [B] or 'bottom_right', "
                        f"got {type(causal_offset).__name__} ({causal_offset!r})")
    if alibi and abs(causal_offset) > SAFE_INDEX:
        raise ValueError(f"causal_offset is {causal_offset}; accepted with alibi_slopes (its distance term uses "
                         f"the offset itself): -2**29 to 2**29")
    return causal_offset, None, False


def _normalise_slopes(alibi_slopes, q: torch.Tensor, B: int, Hq: int) -> Optional[torch.Tensor]:
    """ALiBi slopes ``[Hq]`` or ``[B, Hq]`` -> a float32 ``[B, Hq]`` view (stride 0 where broadcast)."""
    if alibi_slopes is None:
        return None
    check_tensor("alibi_slopes", alibi_slopes)
    if not alibi_slopes.dtype.is_floating_point:
        raise ValueError(f"alibi_slopes has dtype {alibi_slopes.dtype}; accepted: a float dtype (float32 preferred)")
    if alibi_slopes.device != q.device:
        raise ValueError(f"alibi_slopes is on {alibi_slopes.device} but q is on {q.device}")
    if alibi_slopes.shape not in ((Hq,), (B, Hq)):
        raise ValueError(f"alibi_slopes has shape {tuple(alibi_slopes.shape)}; accepted: [Hq] = [{Hq}] "
                         f"or [B, Hq] = [{B}, {Hq}]")
    return alibi_slopes.detach().to(torch.float32).expand(B, Hq)


def check_qkv_rank(q, k, v, ranks: tuple, layouts: str) -> int:
    """Types, rank (one of ``ranks``, equal for all three), dtype and device of q, k, v."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_tensor(name, t)
    rank = q.dim()
    if rank not in ranks:
        raise ValueError(f"q has rank {rank} (shape {tuple(q.shape)}); accepted: {layouts}")
    for name, t in (("k", k), ("v", v)):
        if t.dim() != rank:
            raise ValueError(f"{name} has rank {t.dim()} (shape {tuple(t.shape)}) but q has rank {rank}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_float_dtype(name, t)
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v must share a dtype; got {q.dtype}, {k.dtype}, {v.dtype}")
    check_same_device(("q", "k", "v"), (q, k, v))
    return rank


def check_heads_and_dims(q4, k4, v4) -> None:
    """Sequence lengths of k/v, head counts (GQA) and head dims of BSHD views."""
    Hq, D = q4.shape[2:]
    Sk, Hkv, Dk = k4.shape[1:]
    Skv, Hv, Dv = v4.shape[1:]
    if Skv != Sk:
        raise ValueError(f"k and v must have the same sequence length; got {Sk} and {Skv}")
    if Hv != Hkv:
        raise ValueError(f"k and v must have the same number of heads; got {Hkv} and {Hv}")
    if Dk != D:
        raise ValueError(f"head_dim of q ({D}) and k ({Dk}) must match")
    for name, d in (("head_dim of q/k", D), ("head_dim of v", Dv)):
        if not 1 <= d <= MAX_HEAD_DIM:
            raise ValueError(f"{name} is {d}; accepted: 1..{MAX_HEAD_DIM}")
    if Hkv == 0 or Hq % Hkv != 0:
        raise ValueError(f"num_heads ({Hq}) must be a multiple of num_kv_heads ({Hkv})")


def build_params(q4, B: int, extent: int, *, causal, causal_offset, window, dropout_p, seed, scale, softcap,
                 alibi_slopes, deterministic, allow_tf32, backend, check_inputs=False, **varlen):
    """Validate the options shared by every attention entry point: (AttnParams, seed tensor or None, backend).
    ``extent`` bounds every sequence's ``Sq_b + Sk_b`` (`canonical_visibility`)."""
    Hq, D = q4.shape[2], q4.shape[3]
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    check_bool("check_inputs", check_inputs)
    alibi = alibi_slopes is not None
    offset, offset_tensor, bottom_right = _normalise_offset(causal_offset, q4, B, check_inputs, alibi)
    left, right = check_window(window)
    if causal:
        right = 0
    if offset_tensor is None:
        offset, left, right = canonical_visibility(offset, left, right, extent, alibi)
    else:  # per-batch values are folded per sequence inside the kernels (`load_offset`)
        left, right = min(left, 2 * MAX_OFFSET), min(right, 2 * MAX_OFFSET)
    dropout_p = check_float("dropout_p", dropout_p, minimum=0.0, below=1.0)
    seed_tensor = draw_seed(q4.device) if seed is None and dropout_p > 0.0 else None
    seed = 0 if seed is None else check_int("seed", seed, minimum=0, maximum=MAX_SEED - 1)
    scale = check_float("scale", scale, allow_none=True)
    if scale is None:
        scale = 1.0 / math.sqrt(D)
    softcap = check_float("softcap", softcap, minimum=0.0)
    backend = check_backend(backend)
    if backend is None:
        backend = "triton" if q4.device.type == "cuda" else "torch"
    params = AttnParams(scale=scale, window_left=left, window_right=right, offset=offset,
                        offset_tensor=offset_tensor, offset_bottom_right=bottom_right, softcap=softcap,
                        alibi_slopes=_normalise_slopes(alibi_slopes, q4, B, Hq), dropout_p=dropout_p, seed=seed,
                        deterministic=bool(deterministic), allow_tf32=bool(allow_tf32), **varlen)
    return params, seed_tensor, backend


def unit_last_stride(*tensors):
    """Only the last dim needs unit stride: copy once here otherwise."""
    return tuple(t if t.stride(-1) == 1 or t.shape[-1] == 1 else t.contiguous() for t in tensors)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False,
              causal_offset: Union[int, torch.Tensor] = 0, window=None, mask: Optional[torch.Tensor] = None,
              dropout_p: float = 0.0, seed: Optional[int] = None, scale: Optional[float] = None,
              softcap: float = 0.0, alibi_slopes: Optional[torch.Tensor] = None, deterministic: bool = False,
              return_lse: bool = False, backend: Optional[str] = None, allow_tf32: bool = False,
              check_inputs: bool = False):
    """Exact (flash) attention.

    Args:
        q: ``[B, Sq, Hq, D]`` (or ``[S, D]``, or flat ``[N, S, D]`` = N independent heads).
        k: ``[B, Sk, Hkv, D]``; ``Hq % Hkv == 0`` (grouped-query attention).
        v: ``[B, Sk, Hkv, Dv]``.
        causal: key j visible from query i iff ``j <= i + causal_offset`` (top-left by default).
        causal_offset: int, int32/int64 tensor ``[B]`` (per-sequence, e.g. KV-cache lengths), or
            ``"bottom_right"`` (``Sk - Sq``: the queries are the last Sq of Sk positions, flash-attn's alignment).
        window: None, int w (``|i + off - j| < w``) or ``(left, right)`` with -1 = unbounded;
            with ``causal`` the right side is 0.
        mask: bool (True = keep) or float (additive bias) tensor broadcastable to
            ``[B, Hq, Sq, Sk]``; a float mask that requires grad gets its gradient.
        dropout_p: probability in [0, 1) of dropping an attention weight (kept ones scale by 1/(1-p)).
        seed: int in [0, 2**63) for the dropout mask; None draws one from torch's generator of q's
            device (a new one at every CUDA-graph replay).
        scale: score scale, default ``1/sqrt(D)``.
        softcap: if > 0, ``score = softcap * tanh(score / softcap)`` before masking.
        alibi_slopes: float tensor ``[Hq]`` or ``[B, Hq]``: adds ``-slope * |i + causal_offset - j|``
            to the score (after softcap), as flash-attn's ``alibi_slopes``; treated as a constant
            (no gradient).
        deterministic: bitwise-reproducible gradients.
        return_lse: also return ``lse [B, Hq, Sq]`` (float32, natural log), differentiable.
        backend: None (Triton for CUDA tensors, PyTorch on CPU), "triton" or "torch".
        allow_tf32: float32 inputs may use TF32 tensor-core products (faster, ~1e-3 relative error).
        check_inputs: also check the values of a device ``causal_offset`` tensor (a device sync);
            CPU tensors are always checked: per-batch values must lie within +-2**61 (with
            ``alibi_slopes``, whose distance term uses the offset itself, +-2**29).  Unchecked
            device values beyond act as that bound.  Every int offset and window side is exact.

    Returns:
        ``o [B, Sq, Hq, Dv]`` in q's dtype, or ``(o, lse)`` if ``return_lse``.
    """
    rank = check_qkv_rank(q, k, v, (2, 3, 4), "[B, Sq, Hq, D], [N, S, D] or [S, D]")
    q4, k4, v4 = (_as_bshd(n, t, rank) for n, t in (("q", q), ("k", k), ("v", v)))
    B, Sq, Hq, D = q4.shape
    Bk, Sk = k4.shape[:2]
    if Bk != B or v4.shape[0] != B:
        raise ValueError(f"batch sizes differ: q has {B}, k has {Bk}, v has {v4.shape[0]}")
    check_heads_and_dims(q4, k4, v4)
    mask4 = _normalise_mask(mask, q, rank, B, Hq, Sq, Sk)
    params, seed_tensor, backend = build_params(
        q4, B, Sq + Sk, causal=causal, causal_offset=causal_offset, window=window, dropout_p=dropout_p, seed=seed,
        scale=scale, softcap=softcap, alibi_slopes=alibi_slopes, deterministic=deterministic,
        allow_tf32=allow_tf32, backend=backend, check_inputs=check_inputs)
    q4, k4, v4 = unit_last_stride(q4, k4, v4)
    o, lse = attention_function(q4, k4, v4, mask4, params, backend, seed_tensor)

    if rank == 2:
        o, lse = o[0, :, 0], lse[0, 0]
    elif rank == 3:
        o, lse = o[:, :, 0], lse[:, 0]
    return (o, lse) if return_lse else o
