"""Impl: one implementation of a case, as the Runner calls it (every peer module builds these)."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, Optional

import torch


@dataclass
class Impl:
    name: str
    fn: Optional[Callable]             # fn(*leaves) -> output, in the layout of ours
    ctx: Callable = contextlib.nullcontext
    leaves: Optional[list] = None      # own inputs (then never compared with the reference)
    do: Optional[torch.Tensor] = None
    timed: bool = True
    role: str = "peer"                 # "ours", "peer", "ref" (reference only, untimed)


class Deferred(Impl):
    """An Impl whose setup (block masks, paged copies, imports) runs inside the per-peer error handling:
    `build()` returns the real Impl, or raises why this peer cannot run the case."""

    def __init__(self, name: str, build: Callable[[], Impl], role: str = "peer"):
        super().__init__(name, None, role=role)
        self.build = build
