"""When a call may skip the `torch.library` dispatch.

A custom op with registered autograd costs ~100-250 us of Python per call in eager
mode (schema default filling, alias checks, the autograd wrapper), which is longer than
a decoding step's kernel (~20 us).  The ops stay the path for everything that needs
their schema -- torch.compile, fake tensors, dispatch modes, functorch transforms,
tensor subclasses -- and plain eager calls go straight to the same implementations.
"""
from __future__ import annotations

import torch

_PLAIN = (torch.Tensor, torch.nn.Parameter)


def eager(*tensors) -> bool:
    """True when every tensor is a plain tensor (or None) and nothing is tracing."""
    if torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack() \
            or torch._C._are_functorch_transforms_active():
        return False
    return all(t is None or type(t) in _PLAIN for t in tensors)
