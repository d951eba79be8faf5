"""The benchmark's cases (pure, no device): Case, the FLOPs and bytes a case is credited with (PERF.md's
convention, described in the package doc), the suites' case lists, and what picks and shrinks them."""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass
from typing import Optional, Sequence


SUITES = ("fwd", "fwdbwd", "features", "decode", "varlen", "memory", "headdims")
# `all` runs the suites cheapest first, so that a run cut short has the most rows.
ALL_ORDER = ("memory", "fwd", "decode", "varlen", "headdims", "fwdbwd", "features")
STANDARD_PEERS = ("cudnn", "flash", "efficient", "flex")
DTYPES = {"bf16": "bfloat16", "bfloat16": "bfloat16", "fp16": "float16", "float16": "float16",
          "half": "float16", "fp32": "float32", "float32": "float32"}
ELEM_SIZE = {"bfloat16": 2, "float16": 2, "float32": 4}
TOL = {"bfloat16": 2e-2, "float16": 1e-2, "float32": 1e-3}
TOKENS = 16384        # PERF.md's grid: 16k tokens per batch
HIDDEN = 2048         # H * D
DECODE_CACHE_LIMIT = 20e9   # bytes of K + V; bigger decode combinations are skipped


def fmt_len(n: int) -> str:
    """1024 -> '1k', 131072 -> '128k', 1000 -> '1000'."""
    return f"{n // 1024}k" if n >= 1024 and n % 1024 == 0 else str(n)


@dataclass(frozen=True)
class Case:
    suite: str
    mode: str                    # "fwd", "fwdbwd", "decode" (forward, bytes) or "memory" (fwd+bwd, GiB)
    B: int
    Sq: int
    Sk: int
    Hq: int
    Hkv: int
    D: int
    dtype: str = "bfloat16"
    causal: bool = False
    offset: int = 0              # causal offset: query i sits at position i + offset
    window: Optional[int] = None  # causal sliding window: keys i+offset-window .. i+offset
    bias: bool = False           # additive float bias [B, 1, Sq, Sk]
    bias_grad: bool = False      # ... that requires grad (its gradient is checked too)
    dropout: float = 0.0
    deterministic: bool = False
    seqlens: Optional[tuple] = None   # varlen: lengths of the packed sequences (B of them)
    peers: tuple = STANDARD_PEERS
    name: str = ""

    @property
    def label(self) -> str:
        if self.name:
            return self.name
        if self.seqlens:
            shape = f"D={self.D} {len(self.seqlens)} seqs {fmt_len(sum(self.seqlens))} tok"
        elif self.mode == "decode":
            shape = f"B={self.B} cache={fmt_len(self.Sk)}"
        else:
            s = fmt_len(self.Sq) if self.Sq == self.Sk else f"{fmt_len(self.Sq)}/{fmt_len(self.Sk)}"
            shape = f"D={self.D} S={s}"
        if self.Hq != self.Hkv:
            shape += f" GQA {self.Hq}/{self.Hkv}"
        return shape + (" causal" if self.causal and self.mode != "decode" else "") + \
            (" fp32" if self.dtype == "float32" else "")

    @property
    def pass_label(self) -> str:
        return {"fwd": "fwd", "fwdbwd": "fwd+bwd", "decode": "decode", "memory": "fwd+bwd"}[self.mode]

    @property
    def backward(self) -> bool:
        return self.mode in ("fwdbwd", "memory")

    @property
    def unit(self) -> str:
        return {"decode": "GB/s", "memory": "GiB"}.get(self.mode, "TFLOP/s")

    def describe(self) -> dict:
        d = dataclasses.asdict(self)
        d["seqlens"] = list(self.seqlens) if self.seqlens else None
        d["peers"] = list(self.peers)
        d["label"] = self.label
        return d


def visible_pairs(Sq: int, Sk: int, causal: bool = False, offset: int = 0, window: Optional[int] = None) -> float:
    """(query, key) pairs a kernel is credited with, PERF.md's convention (see the package doc)."""
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


def throughput(case: Case, ms: Optional[float]) -> Optional[float]:
    """TFLOP/s (or GB/s for decode) of a run of `ms` milliseconds."""
    if ms is None or not ms > 0:
        return None
    if case.mode == "decode":
        return case_bytes(case) / (ms * 1e-3) / 1e9
    return case_flops(case) / (ms * 1e-3) / 1e12


def grid_cases(mode: str, dtype: str = "bfloat16") -> list:
    """PERF.md's standard grid: B = 16384 / S, H * D = 2048."""
    return [Case("fwd" if mode == "fwd" else "fwdbwd", mode, TOKENS // S, S, S, HIDDEN // D, HIDDEN // D, D, dtype,
                 causal=causal)
            for D in (64, 128) for S in (1024, 4096, 16384) for causal in (False, True)]


def feature_cases(dtype: str = "bfloat16") -> list:
    B, S, H, D, G = 4, 4096, 32, 128, 8
    base = dict(suite="features", B=B, Sq=S, Sk=S, Hq=H, Hkv=H, D=D, dtype=dtype)
    out = []
    for mode in ("fwd", "fwdbwd"):
        out.append(Case(**{**base, "Hkv": G}, mode=mode, causal=True, name="GQA 32/8 causal"))
    for mode in ("fwd", "fwdbwd"):
        out.append(Case(**base, mode=mode, bias=True, name="bias [B,1,S,S]"))
    out.append(Case(**base, mode="fwdbwd", bias=True, dropout=0.1, peers=("cudnn", "efficient"),
                    name="bias + dropout 0.1"))
    out.append(Case(**base, mode="fwdbwd", bias=True, bias_grad=True, peers=("efficient", "cudnn"),
                    name="bias with grad"))
    win = ("cudnn", "efficient", "flex")  # FA2 takes no mask
    for mode in ("fwd", "fwdbwd"):
        out.append(Case(**base, mode=mode, causal=True, window=1023, peers=win, name="causal window 1024"))
    for mode in ("fwd", "fwdbwd"):
        out.append(Case(**base, mode=mode, causal=True, name="causal (dense)"))
    big = dict(base, B=1, Sq=16384, Sk=16384, Hq=16, Hkv=16)
    for mode in ("fwd", "fwdbwd"):
        out.append(Case(**big, mode=mode, causal=True, window=1023, peers=win, name="causal window 1024 S=16k"))
    for mode in ("fwd", "fwdbwd"):
        out.append(Case(**big, mode=mode, causal=True, name="causal (dense) S=16k"))
    out.append(Case(**{**base, "Sq": 1024, "Sk": 16384}, mode="fwd", causal=True, offset=15 * 1024, peers=win,
                    name="prefill 1k on 16k (offset 15k)"))
    out.append(Case(**base, mode="fwdbwd", causal=True, deterministic=True, peers=("ours_default",),
                    name="causal deterministic=True"))
    return out


def decode_cases(dtype: str = "bfloat16") -> list:
    out = []
    for B in (1, 4, 32, 128):
        for L in (4096, 32768, 131072):
            c = Case("decode", "decode", B, 1, L, 32, 8, 128, dtype, peers=("cudnn", "flash", "flex"))
            if case_bytes(c) <= DECODE_CACHE_LIMIT:
                out.append(c)
    return out


def varlen_lengths(n: int = 16, total: int = TOKENS, seed: int = 0, min_len: int = 128) -> tuple:
    """n random lengths >= min_len summing to total (reproducible)."""
    if n * min_len > total:
        raise ValueError(f"{n} sequences of at least {min_len} do not fit in {total} tokens")
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, total - n * min_len + 1), n - 1)) if n > 1 else []
    bounds = [0] + cuts + [total - n * min_len]
    return tuple(b - a + min_len for a, b in zip(bounds[:-1], bounds[1:]))


def varlen_cases(dtype: str = "bfloat16") -> list:
    """16 random lengths (16k tokens), and 4 equal ones of 4k: there the padded batch is the dense
    B = 4, S = 4k batch itself, so ours / ours-pad is what packing costs on equal total tokens."""
    lens = varlen_lengths(16, TOKENS)
    equal = (TOKENS // 4,) * 4
    return [Case("varlen", mode, len(ls), max(ls), max(ls), 16, 16, 128, dtype, causal=causal, seqlens=ls,
                 peers=("varlen_attn", "flex", "ours_padded"), name=name and name + (" causal" if causal else ""))
            for ls, name in ((lens, ""), (equal, "varlen 4 x 4k (equal)"))
            for causal in (False, True) for mode in ("fwd", "fwdbwd")]


def memory_cases(dtype: str = "bfloat16") -> list:
    S = 131072
    return [Case("memory", "memory", 1, S, S, 16, 16, 128, dtype, causal=True, peers=("cudnn", "flash"))]


def headdim_cases(dtype: str = "bfloat16") -> list:
    B, S = 4, 4096
    out = []
    for D in (32, 96, 256):
        H = max(1, round(HIDDEN / D))
        out += [Case("headdims", mode, B, S, S, H, H, D, dtype) for mode in ("fwd", "fwdbwd")]
    if dtype != "float32":
        for D in (64, 128):
            H = HIDDEN // D
            out += [Case("headdims", mode, B, S, S, H, H, D, "float32") for mode in ("fwd", "fwdbwd")]
    return out


_BUILDERS = {"fwd": lambda dt: grid_cases("fwd", dt), "fwdbwd": lambda dt: grid_cases("fwdbwd", dt),
             "features": feature_cases, "decode": decode_cases, "varlen": varlen_cases,
             "memory": memory_cases, "headdims": headdim_cases}


def parse_suites(text: str) -> list:
    names = [s.strip() for s in text.split(",") if s.strip()]
    if names == ["all"]:
        return list(ALL_ORDER)
    bad = [n for n in names if n not in SUITES]
    if bad or not names:
        raise ValueError(f"unknown suite {', '.join(bad) or repr(text)}; choose from {', '.join(SUITES)}, all "
                         "(or a comma-separated list)")
    return names


def build_cases(suite: str, dtype: str = "bfloat16") -> list:
    return _BUILDERS[suite](dtype)


def trim_flex(cases: Sequence[Case]) -> list:
    """`all` keeps FlexAttention where PERF.md has Flex anchors (every compile costs seconds): not on the
    D = 64 grid, nor for head dims other than 256 (--full-flex keeps it everywhere)."""
    def keep(c: Case) -> bool:
        return not ((c.suite in ("fwd", "fwdbwd") and c.D == 64) or (c.suite == "headdims" and c.D != 256))
    return [c if keep(c) or "flex" not in c.peers else dataclasses.replace(c, peers=tuple(p for p in c.peers
                                                                                            if p != "flex"))
            for c in cases]


def shrink(case: Case, f: int = 64) -> Case:
    """A tiny version of a case (same features, same peers) for --cpu-smoke and the tests."""
    def s(n):
        return n if n <= 1 else max(16, n // f)
    Sq, Sk = s(case.Sq), s(case.Sk)
    gqa = case.Hq != case.Hkv
    seqlens = tuple(max(1, n // f) for n in case.seqlens[:4]) if case.seqlens else None
    if seqlens:
        Sq = Sk = max(seqlens)
    return dataclasses.replace(
        case, B=len(seqlens) if seqlens else min(case.B, 2), Sq=Sq, Sk=Sk, Hq=4 if gqa else 2, Hkv=1 if gqa else 2,
        D=min(case.D, 64), offset=Sk - Sq if case.offset else 0, seqlens=seqlens,
        window=None if case.window is None else max(3, case.window // f))
