"""What a case is credited with, PERF.md's convention (flash-attn's), and the throughput of a run.

forward = 4 * B * Hq * pairs * D, where pairs = Sq * Sk without masking, Sq * Sk / 2 causal with
Sq = Sk, Sq * offset + Sq^2 / 2 causal with a key offset (prefill), and Sq * (window + 1) for a causal
sliding window (the band, as PERF.md counts it; the first `window` rows see fewer keys).  Varlen sums
over the sequences.  forward+backward = 3.5 x forward.  Decode is judged in bytes: K and V read once,
2 * B * Sk * Hkv * D * bytes per element.
"""

from __future__ import annotations

from typing import Optional

from .cases import ELEM_SIZE, Case

PER_SECOND = {"TFLOP/s": 1e12, "GFLOP/s": 1e9, "GB/s": 1e9}


def visible_pairs(Sq: int, Sk: int, causal: bool = False, offset: int = 0, window: Optional[int] = None) -> float:
    """(query, key) pairs a kernel is credited with."""
    if window is not None:
        return float(Sq) * (window + 1)
    if causal:
        return float(Sq) * offset + Sq * Sq / 2.0
    return float(Sq) * Sk


def case_flops(case: Case) -> float:
    if case.seqlens:
        pairs = sum(visible_pairs(n, n, case.causal, 0, case.window) for n in case.seqlens)
    else:
        pairs = case.B * visible_pairs(case.Sq, case.Sk, case.causal, case.offset, case.window)
    flops = 4.0 * case.Hq * case.D * pairs
    return flops * 3.5 if case.backward else flops


def case_bytes(case: Case) -> float:
    """K and V read once (decode): 2 * B * Sk * Hkv * D * bytes per element."""
    return 2.0 * case.B * case.Sk * case.Hkv * case.D * ELEM_SIZE[case.dtype]


def row_unit(case: Case, device_type: str) -> str:
    """A CPU reaches GFLOP/s, not TFLOP/s: its rows are counted in GFLOP/s."""
    return "GFLOP/s" if device_type != "cuda" and case.unit == "TFLOP/s" else case.unit


def throughput(case: Case, ms: Optional[float], unit: Optional[str] = None) -> Optional[float]:
    """Work per second of a run of `ms` milliseconds, in `unit` (default: the case's): FLOPs, or bytes
    for decode."""
    if ms is None or not ms > 0:
        return None
    unit = unit or case.unit
    work = case_bytes(case) if case.mode == "decode" else case_flops(case)
    return work / (ms * 1e-3) / PER_SECOND[unit]
