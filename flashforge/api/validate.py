"""Input checks shared by the public entry points.

Every message names the argument, what was received and what is accepted
(SPEC.md section 5).  No `assert`: these must survive `python -O`.
"""
from __future__ import annotations

import math
from typing import Optional, Sequence

import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_HEAD_DIM = 256
MAX_SEED = 2**63


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
