"""A case's inputs: random normal tensors in flashforge's layout ([B, S, H, D], or packed [total, H, D]),
the bias, and the dense bool mask that gives SDPA the same problem as a window or a causal offset."""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Optional

import torch

from .cases import Case


def band_mask(Sq: int, Sk: int, offset: int = 0, window: Optional[int] = None, device="cpu") -> torch.Tensor:
    """Bool [1, 1, Sq, Sk], True = visible: causal with offset (and a left window), as flashforge means it."""
    i = torch.arange(Sq, device=device).view(Sq, 1) + offset
    j = torch.arange(Sk, device=device).view(1, Sk)
    keep = j <= i
    if window is not None:
        keep &= j >= i - window
    return keep.view(1, 1, Sq, Sk)


@dataclass
class Inputs:
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    do: Optional[torch.Tensor] = None
    bias: Optional[torch.Tensor] = None
    keep: Optional[torch.Tensor] = None       # dense bool mask equivalent to the case (window / offset)
    cu: Optional[torch.Tensor] = None         # varlen: int32 [B + 1] sequence starts

    def leaves(self, case: Case) -> list:
        leaves = [self.q, self.k, self.v]
        if case.bias_grad:
            leaves.append(self.bias)
        return leaves


def make_inputs(case: Case, device: torch.device, seed: int = 0) -> Inputs:
    dtype = getattr(torch, case.dtype)
    g = torch.Generator(device=device).manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=g, device=device, dtype=dtype)

    grad = case.backward
    if case.seqlens:
        total = sum(case.seqlens)
        q, k, v = randn(total, case.Hq, case.D), randn(total, case.Hkv, case.D), randn(total, case.Hkv, case.D)
        do = randn(total, case.Hq, case.D) if grad else None
        cu = torch.tensor([0, *itertools.accumulate(case.seqlens)], dtype=torch.int32, device=device)
        inp = Inputs(q, k, v, do, cu=cu)
    else:
        q = randn(case.B, case.Sq, case.Hq, case.D)
        k, v = randn(case.B, case.Sk, case.Hkv, case.D), randn(case.B, case.Sk, case.Hkv, case.D)
        inp = Inputs(q, k, v, randn(case.B, case.Sq, case.Hq, case.D) if grad else None)
        if case.bias:
            inp.bias = randn(case.B, 1, case.Sq, case.Sk)
        if case.window is not None or case.offset:
            inp.keep = band_mask(case.Sq, case.Sk, case.offset, case.window, device)
    for t in inp.leaves(case) if grad else ():
        t.requires_grad_(True)
    return inp
