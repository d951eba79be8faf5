"""The dropout mask: one counter-based definition for every path.

Entry (b, h, i, j) of a [B, H, Sq, Sk] attention matrix is *kept* iff

    w = philox4x32_10(key=(seed_lo, seed_hi), counter=(j >> 3, i, b*H + h, 0))[(j & 7) >> 1]
    half(w, j & 1) >= threshold(p)

where ``half(w, 0)`` is w's low 16 bits, ``half(w, 1)`` its high 16 bits, and
``threshold(p) = floor(p * 2**16)``.  One Philox call (four 32-bit words) thus
serves eight keys: the generator is the dropout's main cost in the kernels (ten
rounds of two wide multiplies per call, regenerated in each backward kernel), and
16-bit draws halve it.  The keep probability is ``1 - threshold / 2**16``, within
2**-16 of ``1 - p`` (flash-attn draws 8-bit).  Integer comparison (not a float in
[0, 1)) keeps the mask bit-identical between the Triton kernels, the Triton
interpreter and this PyTorch code.

This module is the PyTorch implementation (CPU path, tests, the public
`dropout_mask`); `flashforge.ops.triton.dropout` is its Triton twin.
"""
from __future__ import annotations

import torch

PHILOX_KEY_A = 0x9E3779B9
PHILOX_KEY_B = 0xBB67AE85
PHILOX_ROUND_A = 0xD2511F53
PHILOX_ROUND_B = 0xCD9E8D57
PHILOX_ROUNDS = 10
_M32 = 0xFFFFFFFF


def keep_threshold(p: float) -> int:
    """Unsigned 16-bit threshold: a half-word >= it is kept (probability ~ 1 - p)."""
    return min(int(p * 65536.0), 0xFFFF)


def split_seed(seed: int) -> tuple[int, int]:
    return seed & _M32, (seed >> 32) & _M32


def _mul_wide(a: int, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(hi, lo) 32-bit halves of the 64-bit product a * b, for a constant a < 2**32
    and int64 tensor b < 2**32, without overflowing int64."""
    b_lo = b & 0xFFFF
    b_hi = b >> 16
    t_lo = a * b_lo  # < 2**48
    t_hi = a * b_hi  # < 2**48
    mid = t_hi + (t_lo >> 16)  # < 2**49
    hi = mid >> 16
    lo = ((mid & 0xFFFF) << 16) | (t_lo & 0xFFFF)
    return hi, lo


def philox4x32(seed: int, c0, c1, c2, c3):
    """Philox-4x32-10 on int64 tensors holding uint32 values (broadcasting)."""
    k0, k1 = split_seed(seed)
    for _ in range(PHILOX_ROUNDS):
        hi_b, lo_b = _mul_wide(PHILOX_ROUND_B, c2)
        hi_a, lo_a = _mul_wide(PHILOX_ROUND_A, c0)
        c0, c1, c2, c3 = hi_b ^ c1 ^ k0, lo_b, hi_a ^ c3 ^ k1, lo_a
        k0 = (k0 + PHILOX_KEY_A) & _M32
        k1 = (k1 + PHILOX_KEY_B) & _M32
    return c0, c1, c2, c3


def keep_block(seed: int, p: float, bh: torch.Tensor, rows: torch.Tensor, c0: int, c1: int) -> torch.Tensor:
    """Keep-mask for the entries (bh, rows, j) with keys j in [c0, c1) along a new last dim.

    ``bh`` is b*H + h and ``rows`` the query indices, integer tensors (any
    device) broadcastable together; the result is a bool tensor of their
    broadcast shape plus a last dim of c1 - c0.  One Philox call serves eight
    consecutive keys, as in the Triton kernels.
    """
    bh = (bh.to(torch.int64) & _M32).unsqueeze(-1)
    rows = (rows.to(torch.int64) & _M32).unsqueeze(-1)
    g0, g1 = c0 >> 3, (c1 + 7) >> 3
    groups = torch.arange(g0, g1, dtype=torch.int64, device=rows.device)  # counter c0 = j >> 3
    zero = torch.zeros((), dtype=torch.int64, device=rows.device)
    words = torch.stack(philox4x32(seed, groups, rows, bh, zero), dim=-1)  # [..., groups, 4]
    halves = torch.stack((words & 0xFFFF, words >> 16), dim=-1)  # [..., groups, 4, 2]: key 8g + 2w + half
    halves = halves.flatten(-3)[..., c0 - 8 * g0:c1 - 8 * g0]
    return halves >= keep_threshold(p)


def dropout_mask(seed: int, B: int, H: int, Sq: int, Sk: int, p: float,
                 device: torch.device | str = "cpu") -> torch.Tensor:
    """The full bool keep-mask ``[B, H, Sq, Sk]`` (materialised: tests and small inputs)."""
    dev = torch.device(device)
    bh = torch.arange(B * H, device=dev, dtype=torch.int64).view(B, H, 1)
    rows = torch.arange(Sq, device=dev, dtype=torch.int64).view(1, 1, Sq)
    return keep_block(seed, p, bh, rows, 0, Sk)
