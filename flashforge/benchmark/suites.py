"""The suites' case lists (attention_bench's --suite), the main job's rows, and what picks and shrinks them.
Pure: no device."""

from __future__ import annotations

import dataclasses
import random
from typing import Optional, Sequence

from .cases import STANDARD_PEERS, Case
from .flops import case_bytes

SUITES = ("fwd", "fwdbwd", "features", "decode", "varlen", "memory", "headdims", "compare")
# `all` runs the suites cheapest first, so that a run cut short has the most rows; `compare` repeats
# rows of fwd, fwdbwd and headdims, so it is not part of it
ALL_ORDER = ("memory", "fwd", "decode", "varlen", "headdims", "fwdbwd", "features")
TOKENS = 16384        # PERF.md's grid: 16k tokens per batch
HIDDEN = 2048         # H * D
DECODE_CACHE_LIMIT = 20e9   # bytes of K + V; bigger decode combinations are skipped
# the yardsticks: the faster of the two is what every ratio is taken against
YARDSTICK_PEERS = ("fa4", "cudnn")
NO_FA4 = tuple(p for p in STANDARD_PEERS if p != "fa4")   # rows FA4 cannot take (a bias, dropout, float32)


def grid_cases(mode: str, dtype: str = "bfloat16", suite: Optional[str] = None,
               peers: tuple = STANDARD_PEERS) -> list:
    """PERF.md's standard grid: B = 16384 / S, H * D = 2048, D 64/128, S 1k/4k/16k, causal or not."""
    suite = suite or ("fwd" if mode == "fwd" else "fwdbwd")
    return [Case(suite, mode, TOKENS // S, S, S, HIDDEN // D, HIDDEN // D, D, dtype, causal=causal, peers=peers,
                 grid=True)
            for D in (64, 128) for S in (1024, 4096, 16384) for causal in (False, True)]


def feature_cases(dtype: str = "bfloat16") -> list:
    B, S, H, D, G = 4, 4096, 32, 128, 8
    base = dict(suite="features", B=B, Sq=S, Sk=S, Hq=H, Hkv=H, D=D, dtype=dtype)
    out = []
    for mode in ("fwd", "fwdbwd"):
        out.append(Case(**{**base, "Hkv": G}, mode=mode, causal=True, name="GQA 32/8 causal"))
    for mode in ("fwd", "fwdbwd"):
        out.append(Case(**base, mode=mode, bias=True, peers=NO_FA4, name="bias [B,1,S,S]"))
    out.append(Case(**base, mode="fwdbwd", bias=True, dropout=0.1, peers=("cudnn", "efficient"),
                    name="bias + dropout 0.1"))
    out.append(Case(**base, mode="fwdbwd", bias=True, bias_grad=True, peers=("efficient", "cudnn"),
                    name="bias with grad"))
    win = ("fa4", "cudnn", "efficient", "flex")  # FA2 takes no mask
    for mode in ("fwd", "fwdbwd"):
        out.append(Case(**base, mode=mode, causal=True, window=1023, peers=win, name="causal window 1024"))
    for mode in ("fwd", "fwdbwd"):
        out.append(Case(**base, mode=mode, causal=True, name="causal (dense)"))
    big = dict(base, B=1, Sq=16384, Sk=16384, Hq=16, Hkv=16)
    for mode in ("fwd", "fwdbwd"):
        out.append(Case(**big, mode=mode, causal=True, window=1023, peers=win, name="causal window 1024 S=16k"))
    for mode in ("fwd", "fwdbwd"):
        out.append(Case(**big, mode=mode, causal=True, name="causal (dense) S=16k"))
    # the offset is Sk - Sq: FA4's causal (bottom-right) is the same mask
    out.append(Case(**{**base, "Sq": 1024, "Sk": 16384}, mode="fwd", causal=True, offset=15 * 1024, peers=win,
                    name="prefill 1k on 16k (offset 15k)"))
    out.append(Case(**base, mode="fwdbwd", causal=True, deterministic=True, peers=("ours_default",),
                    name="causal deterministic=True"))
    return out


def decode_cases(dtype: str = "bfloat16") -> list:
    out = []
    for B in (1, 4, 32, 128):
        for L in (4096, 32768, 131072):
            c = Case("decode", "decode", B, 1, L, 32, 8, 128, dtype, peers=("fa4", "cudnn", "flash", "flex"))
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
                 peers=("fa4", "varlen_attn", "flex", "ours_padded"),
                 name=name and name + (" causal" if causal else ""))
            for ls, name in ((lens, ""), (equal, "varlen 4 x 4k (equal)"))
            for causal in (False, True) for mode in ("fwd", "fwdbwd")]


def memory_cases(dtype: str = "bfloat16") -> list:
    S = 131072
    return [Case("memory", "memory", 1, S, S, 16, 16, 128, dtype, causal=True, peers=("fa4", "cudnn", "flash"))]


def headdim_cases(dtype: str = "bfloat16") -> list:
    B, S = 4, 4096
    out = []
    for D in (32, 96, 256):
        H = max(1, round(HIDDEN / D))
        peers = NO_FA4 if dtype == "float32" else STANDARD_PEERS
        out += [Case("headdims", mode, B, S, S, H, H, D, dtype, peers=peers) for mode in ("fwd", "fwdbwd")]
    if dtype != "float32":
        for D in (64, 128):
            H = HIDDEN // D
            out += [Case("headdims", mode, B, S, S, H, H, D, "float32", peers=NO_FA4) for mode in ("fwd", "fwdbwd")]
    return out


def compare_cases(dtype: str = "bfloat16") -> list:
    """ours beside FA4 and cuDNN only (the issue-18 table): the grid forward, then forward+backward, then
    GQA 32/8 at S = 4k causal, a causal window of 1023 at S = 16k (cuDNN only through a dense mask),
    D = 256 (H = 8) at S = 4k and 16k, causal or not, and D = 128 S = 4k causal with softcap 30."""
    out = grid_cases("fwd", dtype, "compare", YARDSTICK_PEERS) + grid_cases("fwdbwd", dtype, "compare",
                                                                            YARDSTICK_PEERS)
    base = dict(suite="compare", dtype=dtype, peers=YARDSTICK_PEERS)
    for mode in ("fwd", "fwdbwd"):
        out.append(Case(mode=mode, B=4, Sq=4096, Sk=4096, Hq=32, Hkv=8, D=128, causal=True, **base))
    for mode in ("fwd", "fwdbwd"):
        out.append(Case(mode=mode, B=1, Sq=16384, Sk=16384, Hq=16, Hkv=16, D=128, causal=True, window=1023,
                        name="D=128 S=16k causal window 1023", **base))
    for S in (4096, 16384):
        for causal in (False, True):
            for mode in ("fwd", "fwdbwd"):
                out.append(Case(mode=mode, B=TOKENS // S, Sq=S, Sk=S, Hq=8, Hkv=8, D=256, causal=causal, **base))
    for mode in ("fwd", "fwdbwd"):  # Gemma 2's softcap (cuDNN has none: ours / FA4)
        out.append(Case(mode=mode, B=4, Sq=4096, Sk=4096, Hq=16, Hkv=16, D=128, causal=True, softcap=30.0, **base))
    return out


_BUILDERS = {"fwd": lambda dt: grid_cases("fwd", dt), "fwdbwd": lambda dt: grid_cases("fwdbwd", dt),
             "features": feature_cases, "decode": decode_cases, "varlen": varlen_cases,
             "memory": memory_cases, "headdims": headdim_cases, "compare": compare_cases}


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


# ---------------------------------------------------------------------------------------------
# the main job's rows (python -m flashforge.bench)

CPU_SEQLENS = (512, 1024, 2048)
CPU_DECODE_KEYS = 16384


def cpu_cases(default_threads: int) -> list:
    """B = 1, H = 8, D = 64, S 512/1024/2048 causal or not, forward and forward+backward, and one decoding
    step (1 query, 16k keys), against SDPA: in float32 and bfloat16, on torch's default number of threads
    and, where that is more than one, on one thread."""
    out = []
    for threads in ((None, 1) if default_threads > 1 else (None,)):
        for dtype in ("float32", "bfloat16"):
            for S in CPU_SEQLENS:
                for causal in (False, True):
                    out += [Case("cpu", mode, 1, S, S, 8, 8, 64, dtype, causal=causal, peers=("sdpa",),
                                 threads=threads) for mode in ("fwd", "fwdbwd")]
            out.append(Case("cpu", "fwd", 1, 1, CPU_DECODE_KEYS, 8, 8, 64, dtype, peers=("sdpa",), threads=threads))
    return out


def gpu_main_cases(dtype: str = "bfloat16") -> list:
    """The standard grid, each shape forward then forward+backward, against FA4 and cuDNN."""
    fwd, fwdbwd = (grid_cases(m, dtype, "main", YARDSTICK_PEERS) for m in ("fwd", "fwdbwd"))
    return [c for pair in zip(fwd, fwdbwd) for c in pair]


def main_cases(device_type: str, default_threads: int = 1) -> list:
    return gpu_main_cases() if device_type == "cuda" else cpu_cases(default_threads)


# ---------------------------------------------------------------------------------------------
# picking and shrinking

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
