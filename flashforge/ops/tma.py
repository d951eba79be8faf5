"""What the Hopper copy engine (TMA) needs of a tensor it reads through a descriptor."""
import math

import torch


def tma_ready(t: torch.Tensor) -> bool:
    """Unit last-dim stride, and a 16-byte aligned address and outer strides.  (Every outer
    stride is a multiple of 16 bytes exactly when their gcd is: one call, no generator, as this
    runs several times per training step.)"""
    s = t.stride()
    return s[-1] == 1 and t.data_ptr() % 16 == 0 and (math.gcd(*s[:-1]) * t.element_size()) % 16 == 0
