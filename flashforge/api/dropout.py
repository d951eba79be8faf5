"""`flashforge.dropout_mask`: the exact keep-mask every attention path uses."""
from __future__ import annotations

import torch

from ..ops import dropout as _dropout
from .validate import MAX_SEED, check_float, check_int


def dropout_mask(seed: int, B: int, Hq: int, Sq: int, Sk: int, p: float, device="cpu") -> torch.Tensor:
    """Bool keep-mask ``[B, Hq, Sq, Sk]`` for ``attention(..., dropout_p=p, seed=seed)``.

    Entry (b, h, i, j) is True where the attention weight is kept (and scaled by
    ``1/(1-p)``).  Materialises the full matrix: for tests and inspection.
    """
    check_int("seed", seed, minimum=0, maximum=MAX_SEED - 1)
    for name, n in (("B", B), ("Hq", Hq), ("Sq", Sq), ("Sk", Sk)):
        check_int(name, n, minimum=0)
    p = check_float("p", p, minimum=0.0, below=1.0)
    return _dropout.dropout_mask(seed, B, Hq, Sq, Sk, p, device=device)
