"""Where each rank's rows sit in the full sequence.

A layout cuts a sequence of S rows among the W ranks of a group:

* ``"contiguous"``: W equal chunks, rank r holds chunk r.
* ``"zigzag"``: 2W equal chunks, rank r holds chunks r and 2W-1-r, concatenated in that order.
  With causal attention every rank then owns one early and one late chunk, so every rank has
  the same number of visible (query, key) pairs: the load-balanced causal layout.

A rank's shard is described by its `Segment`s: runs of rows that are contiguous both in the
shard and in the full sequence.  Everything else (the block plans, the permutations of
gathered tensors) is derived from them.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

LAYOUTS = ("zigzag", "contiguous")


@dataclass(frozen=True)
class Segment:
    local: int  # its first row in the rank's shard
    length: int
    start: int  # the global position of its first row


def check_layout(layout) -> str:
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be 'zigzag' or 'contiguous', got {layout!r}")
    return layout


def chunks_per_rank(layout: str) -> int:
    return 2 if layout == "zigzag" else 1


def segments(layout: str, rank: int, world: int, local_len: int) -> tuple[Segment, ...]:
    """The segments of rank ``rank``'s shard of ``local_len`` rows (divisible by `chunks_per_rank`)."""
    if layout == "contiguous":
        return (Segment(0, local_len, rank * local_len),)
    c = local_len // 2
    return Segment(0, c, rank * c), Segment(c, c, (2 * world - 1 - rank) * c)


def check_divisible(name: str, length: int, layout: str, world: int) -> None:
    """S must split into W (contiguous) or 2W (zigzag) equal chunks."""
    n = world * chunks_per_rank(layout)
    if length % n:
        raise ValueError(f"{name} has {length} rows, not divisible by {n} "
                         f"({'2W' if layout == 'zigzag' else 'W'} chunks for layout={layout!r} with W={world} ranks)")


def shard(x: torch.Tensor, layout: str, rank: int, world: int, dim: int) -> torch.Tensor:
    """Rank ``rank``'s shard of the full ``x`` along ``dim``: a view (contiguous) or a new tensor (zigzag)."""
    local_len = x.shape[dim] // world
    parts = [x.narrow(dim, s.start, s.length) for s in segments(layout, rank, world, local_len)]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim)


def to_global(gathered: torch.Tensor, layout: str, world: int, dim: int) -> torch.Tensor:
    """Shards stacked in rank order along a new leading dim, ``[W, *shard shape]``, -> the full
    tensor in sequence order along ``dim`` (one copy)."""
    x = gathered.movedim(0, dim)  # [..., W, local, ...]
    if layout == "zigzag":
        # [..., W, 2, c, ...]: chunk r is (rank r, first half), chunk 2W-1-r is (rank r, second half)
        x = x.unflatten(dim + 1, (2, x.shape[dim + 1] // 2))
        x = torch.cat([x.select(dim + 1, 0), x.select(dim + 1, 1).flip(dim)], dim)
    return x.flatten(dim, dim + 1).contiguous()


def to_rank_order(full: torch.Tensor, layout: str, world: int, dim: int) -> torch.Tensor:
    """The inverse of `to_global`: the full tensor -> ``[W, *shard shape]``, contiguous."""
    x = full.unflatten(dim, (world * chunks_per_rank(layout), full.shape[dim] // (world * chunks_per_rank(layout))))
    if layout == "zigzag":
        # chunks [0, W) are the ranks' first halves, [W, 2W) their second halves, last rank first
        x = torch.stack([x.narrow(dim, 0, world), x.narrow(dim, world, world).flip(dim)], dim + 1)
        x = x.flatten(dim + 1, dim + 2)  # [..., W, 2c, ...]
    return x.movedim(dim, 0).contiguous()
