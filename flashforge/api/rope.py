"""`flashforge.apply_rope`: rotary position embedding as a standalone differentiable op."""
from __future__ import annotations

from typing import Optional, Union

import torch

from ..autograd.rope import rope_function
from ..ops.rope_torch import RopeParams
from .validate import MAX_HEAD_DIM, check_backend, check_float, check_float_dtype, check_int, check_tensor

__all__ = ["apply_rope"]

STYLES = ("half", "interleaved")
_INT_DTYPES = (torch.int32, torch.int64)
_POS_MIN, _POS_MAX = -(2**31), 2**31 - 1


def _as_bshd(x: torch.Tensor, head_dim: Optional[int]) -> torch.Tensor:
    """A ``[B, S, H, D]`` view of x: ``[S, H*D]`` -> ``[1, S, H, D]``, ``[D]`` -> ``[1, 1, 1, D]``."""
    if x.dim() not in (1, 2, 4):
        raise ValueError(f"x has rank {x.dim()} (shape {tuple(x.shape)}); accepted: [B, S, H, D], "
                         f"[S, H*D] (with head_dim), [S, D] or a single token [D]")
    if head_dim is not None:
        head_dim = check_int("head_dim", head_dim, minimum=1)
    if x.dim() == 4:
        if head_dim is not None and head_dim != x.shape[-1]:
            raise ValueError(f"head_dim ({head_dim}) does not match x's last dim ({x.shape[-1]}) for a "
                             f"[B, S, H, D] input; leave head_dim=None")
        return x
    n = x.shape[-1]
    hd = n if head_dim is None else head_dim
    if hd == 0 or n % hd != 0:
        raise ValueError(f"x's last dim ({n}) must be a positive multiple of head_dim ({hd}): it holds "
                         f"[num_heads * head_dim]")
    x4 = x.unflatten(-1, (n // hd, hd))  # [S, H, D] or [H, D]
    return x4.unsqueeze(0) if x.dim() == 2 else x4.unsqueeze(0).unsqueeze(0)


def _check_index_tensor(name: str, t: torch.Tensor, x: torch.Tensor, shapes: tuple, accepted: str) -> None:
    if t.dtype not in _INT_DTYPES:
        raise ValueError(f"{name} tensor has dtype {t.dtype}; accepted: torch.int32 or torch.int64")
    if t.device != x.device:
        raise ValueError(f"{name} is on {t.device} but x is on {x.device}; it must be on x's device")
    if tuple(t.shape) not in shapes:
        raise ValueError(f"{name} has shape {tuple(t.shape)}; accepted: {accepted}")


def _normalise_positions(pos, position_ids, x: torch.Tensor, B: int, S: int):
    """(pos_base, pos tensor [B] or None, position_ids [B, S] or None)."""
    batched = x.dim() == 4
    if position_ids is not None:
        check_tensor("position_ids", position_ids)
        if isinstance(pos, torch.Tensor) or pos != 0:
            raise ValueError(f"pass either pos or position_ids, not both (got pos={pos!r} and position_ids "
                             f"of shape {tuple(position_ids.shape)})")
        shapes = ((B, S),) if batched else ((S,), (1, S)) + (((),) if x.dim() == 1 else ())
        accepted = f"[B, S] = {[B, S]}" if batched else f"[S] = [{S}] or [1, S] = [1, {S}]"
        _check_index_tensor("position_ids", position_ids, x, shapes, accepted)
        return 0, None, position_ids.reshape(B, S)
    if isinstance(pos, torch.Tensor):
        accepted = f"[B] = [{B}] (one start per sequence) or a 0-dim tensor"
        _check_index_tensor("pos", pos, x, ((B,), ()), accepted)
        return 0, pos.reshape(1).expand(B) if pos.dim() == 0 else pos, None
    if isinstance(pos, bool) or not isinstance(pos, int):
        raise TypeError(f"pos must be an int or an int tensor [B], got {type(pos).__name__} ({pos!r})")
    if pos < _POS_MIN or pos + max(S - 1, 0) > _POS_MAX:
        raise ValueError(f"positions pos .. pos + S - 1 = {pos} .. {pos + max(S - 1, 0)} must fit in int32 "
                         f"[{_POS_MIN}, {_POS_MAX}]")
    return pos, None, None


def _check_inplace(inplace, x: torch.Tensor) -> bool:
    if not isinstance(inplace, bool):
        raise TypeError(f"inplace must be a bool, got {type(inplace).__name__} ({inplace!r})")
    if not inplace:
        return False
    if x.requires_grad and torch.is_grad_enabled():
        base = x if x._base is None else x._base
        if base.is_leaf:
            raise ValueError("inplace=True would overwrite x, a leaf tensor (or a view of one) that requires "
                             "grad; use inplace=False, or apply it to a non-leaf tensor or under torch.no_grad()")
    if any(st == 0 and n > 1 for st, n in zip(x.stride(), x.shape)):
        raise ValueError(f"inplace=True needs x to own each element once, but x has stride {tuple(x.stride())} "
                         f"for shape {tuple(x.shape)} (an expanded tensor); use inplace=False")
    return True


def apply_rope(x: torch.Tensor, pos: Union[int, torch.Tensor] = 0, theta: float = 10000.0, style: str = "half",
               rotary_dim: Optional[int] = None, inplace: bool = False, *,
               position_ids: Optional[torch.Tensor] = None, head_dim: Optional[int] = None,
               backend: Optional[str] = None) -> torch.Tensor:
    """Rotary position embedding (RoPE).

    The first ``rotary_dim`` dims of each head are rotated in pairs, pair k by the angle
    ``position * theta ** (-2k / rotary_dim)``: ``(a, b) -> (a cos - b sin, b cos + a sin)``.
    The remaining dims pass through unchanged.

    Args:
        x: ``[B, S, H, D]``; ``[S, H*D]`` with ``head_dim=D`` (rotated per head);
            ``[S, D]`` (one head, when ``head_dim`` is None) or a single token ``[D]``
            (or ``[H*D]`` with ``head_dim``).  Any strides.  float16, bfloat16 or float32;
            head dim ``D`` from 2 to 256.
        pos: token s of sequence b sits at position ``pos + s``: an int (int32 range), or an
            int32/int64 tensor ``[B]`` (one start per sequence, e.g. KV-cache lengths; a 0-dim
            tensor applies to every sequence).  Unbatched layouts have B = 1.
        theta: the frequency base, > 0: a Hugging Face config's ``rope_theta``.
        style: "half" (rotate-half, Llama/NeoX: pairs ``(k, k + rotary_dim/2)``) or
            "interleaved" (GPT-J: pairs ``(2k, 2k + 1)``).
        rotary_dim: even, ``2 <= rotary_dim <= D``; default D (then D must be even).
        inplace: write the result into x and return x.  Allowed under autograd when x is not a
            leaf (nor a view of a leaf) that requires grad; the backward never needs x's old values.
        position_ids: int32/int64 ``[B, S]`` explicit positions (``[S]`` for the unbatched
            layouts), instead of ``pos``.  Values are not checked (no device sync).
        head_dim: the per-head dim of a packed ``[S, H*D]`` or ``[H*D]`` input.
        backend: None (Triton for CUDA tensors, PyTorch otherwise), "triton" or "torch".

    Returns:
        x's shape and dtype, rotated (x itself when ``inplace``).  Differentiable in x: the
        gradient is the inverse rotation of the output's gradient.

    Angles are reduced modulo 2 pi exactly (64-bit fixed point in Triton, float64 in PyTorch),
    so large positions (1e6 and more) keep float32 accuracy, unlike a float32 ``pos * inv_freq``.
    """
    check_tensor("x", x)
    check_float_dtype("x", x)
    x4 = _as_bshd(x, head_dim)
    B, S, H, D = x4.shape
    if D > MAX_HEAD_DIM:
        hint = "; for a packed [S, H*D] input pass head_dim" if x.dim() < 4 else ""
        raise ValueError(f"x has head dim {D}; accepted: 2..{MAX_HEAD_DIM}{hint}")
    if rotary_dim is None:
        if D % 2:
            raise ValueError(f"rotary_dim defaults to the head dim {D}, which is odd; pass an even "
                             f"rotary_dim <= {D}")
        rotary_dim = D
    rotary_dim = check_int("rotary_dim", rotary_dim)
    if rotary_dim % 2 or not 2 <= rotary_dim <= D:
        raise ValueError(f"rotary_dim is {rotary_dim}; accepted: an even int from 2 to the head dim {D}")
    if not isinstance(style, str):
        raise TypeError(f"style must be a str, one of {STYLES}, got {type(style).__name__} ({style!r})")
    if style not in STYLES:
        raise ValueError(f"style is {style!r}; accepted: 'half' (rotate-half, Llama/NeoX) or 'interleaved' (GPT-J)")
    theta = check_float("theta", theta)
    if theta <= 0.0:
        raise ValueError(f"theta must be > 0 (a config's rope_theta, e.g. 10000.0), got {theta}")
    inplace = _check_inplace(inplace, x)
    pos_base, pos_t, pos_ids = _normalise_positions(pos, position_ids, x, B, S)
    backend = check_backend(backend)
    if backend is None:
        backend = "triton" if x.device.type == "cuda" else "torch"

    params = RopeParams(theta=theta, rotary_dim=rotary_dim, interleaved=style == "interleaved", pos_base=pos_base)
    y4 = rope_function(x4, pos_t, pos_ids, params, backend, inplace)
    return x if inplace else y4.view(x.shape)
