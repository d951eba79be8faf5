"""Input checks shared by the public entry points.

Every message names the argument, what was received and what is accepted
(SPEC.md section 5).  No `assert`: these must survive `python -O`.
"""
from __future__ import annotations

import math
import os
from typing import Optional, Sequence

import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_HEAD_DIM = 256
MAX_SEED = 2**63
# Offsets and window sides up to this size reach the kernels as given: every index sum there
# (query + offset + window side + a tile) stays inside int32 for sequences below 2**28 rows.
# Larger ones are folded into this range first, keeping which keys each query sees
# (`canonical_visibility`); with ALiBi, whose distance term needs the offset itself, a larger
# offset is refused where it can be seen, and clamped to this range where it cannot.
SAFE_INDEX = 2**29
# Per-batch offset values are exact within this range, whatever the window (the kernels fold
# them with the sides in int64, the sides bounded to 2 * MAX_OFFSET); outside it they are
# refused where they can be seen, and clamped to it where they cannot.
MAX_OFFSET = 2**61
# FLASHFORGE_CHECK_INPUTS=1: every call checks the values of its device index tensors
# (cu_seqlens, cache_seqlens, block_table, causal_offset), as check_inputs=True does; read
# once at import.  CPU tensors are always checked: reading them costs no device sync.
CHECK_INPUTS = os.environ.get("FLASHFORGE_CHECK_INPUTS", "0") not in ("", "0")
_PLAIN = (torch.Tensor, torch.nn.Parameter)


def check_tensor(name: str, x) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    return x


def check_float_dtype(name: str, x: torch.Tensor) -> None:
    if x.dtype not in FLOAT_DTYPES:
        raise ValueError(f"{name} has dtype {x.dtype}; accepted: float16, bfloat16, float32")


def check_int(name: str, value, *, minimum: Optional[int] = None, maximum: Optional[int] = None) -> int:
    # bool is an int subclass; reject it so that window=True is not a window of 1
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} ({value!r})")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise ValueError(f"{name} must be <= {maximum}, got {value}")
    return value


def check_float(name: str, value, *, minimum: Optional[float] = None, below: Optional[float] = None,
                allow_none: bool = False) -> Optional[float]:
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a float, got {type(value).__name__} ({value!r})")
    value = float(value)
    if not -math.inf < value < math.inf:  # NaN fails too; math.isfinite would break torch.compile's trace
        raise ValueError(f"{name} must be finite, got {value}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    if below is not None and value >= below:
        raise ValueError(f"{name} must be < {below}, got {value}")
    return value


def check_same_device(names: Sequence[str], tensors: Sequence[torch.Tensor]) -> None:
    dev = tensors[0].device
    for n, t in zip(names[1:], tensors[1:]):
        if t.device != dev:
            raise ValueError(f"{n} is on {t.device} but {names[0]} is on {dev}; all inputs must be on one device")


def check_window(window) -> tuple[int, int]:
    """None, an int w > 0 (``|i - j| < w``) or ``(left, right)`` with -1 = unbounded."""
    if window is None:
        return -1, -1
    if isinstance(window, bool):
        raise TypeError(f"window must be None, an int or a (left, right) pair, got {window!r}")
    if isinstance(window, int):
        if window <= 0:
            raise ValueError(f"window must be a positive int (|i - j| < window) or a (left, right) pair, got {window}")
        return window - 1, window - 1
    if isinstance(window, (tuple, list)) and len(window) == 2:
        left = check_int("window[0] (left)", window[0])
        right = check_int("window[1] (right)", window[1])
        for side, val in (("left", left), ("right", right)):
            if val < -1:
                raise ValueError(f"window {side} must be >= 0, or -1 for unbounded; got {val}")
        return left, right
    raise TypeError(f"window must be None, an int or a (left, right) pair, got {window!r}")


def values_visible(t: torch.Tensor, check_inputs) -> bool:
    """Whether the values of index tensor ``t`` are checked on the host in this call: always for
    CPU tensors, for device tensors with ``check_inputs`` (or $FLASHFORGE_CHECK_INPUTS; a device
    sync), never while tracing (fake tensors carry no values) or for tensor subclasses."""
    if not (check_inputs or CHECK_INPUTS or t.device.type == "cpu"):
        return False
    return type(t) in _PLAIN and t.device.type != "meta" and not torch.compiler.is_compiling()


def check_bool(name: str, value) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__} ({value!r})")
    return value


def _clamp(x: int, lo: int, hi: int) -> int:
    return max(lo, min(hi, x))


def canonical_visibility(offset: int, left: int, right: int, extent: int, exact_offset: bool) -> tuple[int, int, int]:
    """(offset, left, right) with the same visible keys for every query i and key j of a call whose
    sequences have ``Sq_b + Sk_b <= extent`` (offsets aligned bottom-right or not), each value small
    enough for the kernels' int32 index arithmetic.  Calls within `SAFE_INDEX` are returned as given.

    Visibility depends on the offset only through ``t = offset + right`` and ``offset - left``,
    compared with ``j - i`` (or ``j - i - (Sk_b - Sq_b)``), which lies in ``(-extent, extent)``:
    each may be clamped to ``[-extent, extent]``.  ``exact_offset`` (ALiBi, whose distance term
    uses the offset itself; the caller keeps ``|offset| <= SAFE_INDEX``) keeps the offset and
    folds only the window sides."""
    if abs(offset) <= SAFE_INDEX and left <= SAFE_INDEX and right <= SAFE_INDEX:
        return offset, left, right
    if exact_offset:  # only a side beyond SAFE_INDEX needs folding (ALiBi keeps |offset| <= SAFE_INDEX)
        if right > SAFE_INDEX:
            right = max(0, _clamp(offset + right, -extent, extent) - offset)
        if left > SAFE_INDEX:
            left = max(0, offset - _clamp(offset - left, -extent, extent))
        return offset, left, right
    off = _clamp(offset, -extent, extent)
    # clamping is monotone, so both sides stay >= 0 (and a causal right = 0 stays 0)
    if right >= 0:
        right = _clamp(offset + right, -extent, extent) - off
    if left >= 0:
        left = off - _clamp(offset - left, -extent, extent)
    return off, left, right


def check_backend(backend) -> Optional[str]:
    if backend not in (None, "triton", "torch"):
        raise ValueError(f"backend must be None, 'triton' or 'torch', got {backend!r}")
    return backend


def draw_seed(device) -> torch.Tensor:
    """A fresh dropout seed from torch's generator of ``device`` (so it follows
    torch.manual_seed), as an int64 scalar tensor there.  It is read only inside the
    kernels: no host sync, no graph break under torch.compile, and a new seed at
    every CUDA-graph replay (PyTorch's graph-safe generator)."""
    return torch.randint(0, 2**62, (), dtype=torch.int64, device=device)
