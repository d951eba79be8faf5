"""How a row is checked: which output serves as the reference, the error measure and its tolerance.

Each case compares flashforge's output (forward) or output and dq, dk, dv (and dbias) (forward+backward)
with a reference computed in the same run: the first of cuDNN, FA2, mem-efficient that ran, else SDPA's
math backend in float32 (float32 cases: always that); softcap, which SDPA has not, against our PyTorch
path (`backend="torch"`, not the kernels) in float32; decode against a float32 computation in PyTorch;
varlen against SDPA run one sequence at a time.  The row is `ok` when ||ours - ref|| / ||ref|| < TOL for
every tensor.  Dropout rows are only checked for shapes and finite values.  Peers' errors against the
same reference are recorded too.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch

from .cases import Case

TOL = {"bfloat16": 2e-2, "float16": 1e-2, "float32": 1e-3}
OUTPUT_NAMES = ("o", "dq", "dk", "dv", "dbias")
MATH_REF_LIMIT = 48e9       # bytes of score matrices the float32 math reference may allocate


def reference_order(case: Case) -> list:
    """Names whose output may serve as the reference, best first; [] = no comparison (dropout)."""
    if case.dropout:
        return []
    if case.mode == "decode":
        return ["fp32_reference"]
    if case.seqlens:
        return ["sdpa_loop"]
    if case.softcap:
        return ["fp32_torch"]
    if case.dtype == "float32":
        return ["math"]
    return ["cudnn", "flash", "efficient", "math"]


def math_ref_bytes(case: Case) -> float:
    """Rough size of the float32 math reference's score tensors."""
    per = case.B * case.Hq * case.Sq * case.Sk * 4.0
    return per * (4 if case.backward else 2) + (per if case.bias else 0)


def rel_errors(out: Sequence[torch.Tensor], ref: Sequence[torch.Tensor]) -> dict:
    """||out - ref|| / ||ref|| per tensor (inf for a shape mismatch or a non-finite value)."""
    errs = {}
    for name, a, b in zip(OUTPUT_NAMES, out, ref):
        if a is None or b is None or a.shape != b.shape:
            errs[name] = math.inf
            continue
        a, b = a.float(), b.float()
        if not bool(torch.isfinite(a).all()):
            errs[name] = math.inf
            continue
        num, den = float((a - b).norm()), float(b.norm())
        errs[name] = num / den if den > 0 else num
    if len(out) != len(ref):
        errs["count"] = math.inf
    return errs


def finite_check(out: Sequence[torch.Tensor], shapes: Sequence[tuple]) -> dict:
    """Dropout rows: only shapes and finiteness (inf marks a failure)."""
    return {name: (0.0 if tuple(a.shape) == tuple(s) and bool(torch.isfinite(a.float()).all()) else math.inf)
            for name, a, s in zip(OUTPUT_NAMES, out, shapes)}
