"""What the Hopper copy engine (TMA) needs of a tensor it reads through a descriptor."""
import torch


def tma_ready(t: torch.Tensor) -> bool:
    """Unit last-dim stride, and a 16-byte aligned address and outer strides."""
    e = t.element_size()
    return t.stride(-1) == 1 and t.data_ptr() % 16 == 0 and all((s * e) % 16 == 0 for s in t.stride()[:-1])
