"""GPU benchmark of flashforge against the attention kernels PyTorch ships, on identical inputs.

    PYTHONPATH=. python benchmarks/attention_bench.py --suite SUITE --out DIR [options]

SUITE is one of fwd, fwdbwd, features, decode, varlen, memory, headdims, all, or a comma-separated
list of them.  One process times flashforge and every peer available on the machine on the same
tensors, checks flashforge's output (and gradients) against a reference in the same run, prints a
table (last) and writes DIR/<suite>.json and DIR/<suite>.png for each suite, and the table as
DIR/<suite>.txt (for `all` or a list also DIR/all.json, .txt and .png, a chart of the ratios).  The
JSON is rewritten after every case, so a run cut short still leaves what it measured.

Peers: SDPA with one backend forced (`sdpa_kernel`: cudnn = CUDNN_ATTENTION, flash = FLASH_ATTENTION,
efficient = EFFICIENT_ATTENTION), FlexAttention compiled (`torch.compile(flex_attention)`, block
masks from `create_block_mask`), and where a case calls for them: PyTorch's `varlen_attn`
(FA2 varlen), our own padded dense kernel (`ours_padded`) and our default-mode kernel
(`ours_default`, next to `deterministic=True`).  A peer that cannot run a case gets null in the
JSON and "-" in the table; why is in the row's `peer_errors`.

Suites (bf16 unless --dtype):
  fwd, fwdbwd  PERF.md's grid: 16k tokens (B = 16384 / S), H*D = 2048, D 64/128, S 1k/4k/16k, causal or not.
  features     D = 128, B = 4, S = 4k, H = 32: GQA 32/8 causal; additive bias [B,1,S,S]; bias + dropout
               0.1; bias with gradient; causal sliding window 1024 (and 16k, B = 1, H = 16, PERF's
               anchor) next to dense causal; prefill Sq = 1k against Sk = 16k keys (causal offset 15k);
               deterministic=True vs default.
  decode       Sq = 1, GQA 32/8, D = 128: B 1/4/32/128 x cache 4k/32k/128k (caches over 20 GB skipped);
               ours contiguous and paged (block 256) with automatic split-KV, in one row each.
  varlen       16 sequences of random lengths summing to 16k, H = 16, D = 128, causal or not.
  memory       peak memory of one forward+backward, B = 1, H = 16, S = 128k, D = 128, causal.
  headdims     D 32/96/256 (H = round(2048 / D)) and float32 at D 64/128, B = 4, S = 4k, non-causal.
  all          all of them, cheapest first.  Runs of several suites (all, or a list) stop starting cases
               after --max-seconds (default 510, to fit a 10-minute job) and run FlexAttention (seconds
               of compilation per new shape or mask) only where PERF.md has Flex anchors: not on the
               D = 64 grid nor head dims other than 256 (--full-flex: everywhere).  A single suite has
               no time limit and Flex everywhere.

Units and FLOPs (PERF.md's convention): forward = 4 * B * Hq * pairs * D, where pairs = Sq * Sk
without masking, Sq * Sk / 2 causal with Sq = Sk, Sq * offset + Sq^2 / 2 causal with a key offset
(prefill), and Sq * (window + 1) for a causal sliding window (the band, as PERF.md counts it; the
first `window` rows see fewer keys).  Varlen sums over the sequences (our padded kernel is credited
the same useful FLOPs).  forward+backward = 3.5 x forward.  Decode is judged in bytes: K and V read
once, 2 * B * Sk * Hkv * D * bytes per element, in GB/s (1e9).  Memory rows are GiB (2**30): peak
`torch.cuda.max_memory_allocated` during one forward+backward minus what was allocated before it
(inputs, do); the gradients count.  `ratio` = ours / cuDNN ("ratio_cudnn"); where cuDNN cannot run
the case, ours / the best peer that ran ("ratio", "ratio_to" names it).  For GiB lower is better.

Correctness: each case compares flashforge's output (forward) or output and dq, dk, dv (and dbias)
(forward+backward) with a reference computed in the same run: the first of cuDNN, FA2, mem-efficient
that ran, else SDPA's math backend in float32 (float32 cases: always that); decode against a float32
computation in PyTorch; varlen against SDPA run one sequence at a time.  The row is `ok` when
||ours - ref|| / ||ref|| < 2e-2 (bf16; fp16 1e-2, fp32 1e-3) for every tensor.  Dropout rows are only
checked for shapes and finite values.  Peers' errors against the same reference are recorded too.

Timing: triton.testing.do_bench(fn, warmup, rep, return_mode="median") after a warm-up call outside
the timed region (L2 flushed before every repetition by do_bench); random normal inputs.

Exit status: 0 all rows ok, 1 a check failed (everything is still printed and written), 2 no CUDA GPU
or bad arguments, 130 interrupted (Ctrl-C or SIGTERM: the rows measured so far are still printed and
written).  Nothing touches CUDA at import time.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import functools
import inspect
import json
import math
import os
import platform
import random
import signal
import subprocess
import sys
import time
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import torch
import torch.nn.functional as F

SUITES = ("fwd", "fwdbwd", "features", "decode", "varlen", "memory", "headdims")
# `all` runs the suites cheapest first, so that a run cut short has the most rows.
ALL_ORDER = ("memory", "fwd", "decode", "varlen", "headdims", "fwdbwd", "features")
SDPA_PEERS = ("cudnn", "flash", "efficient")
STANDARD_PEERS = ("cudnn", "flash", "efficient", "flex")
# column order of the table; names not listed go last
PEER_ORDER = ("cudnn", "flash", "efficient", "flex", "varlen_attn", "ours_padded", "ours_default")
SHORT = {"efficient": "mem-eff", "varlen_attn": "fa-varlen", "ours_padded": "ours-pad",
         "ours_default": "ours-dflt"}
DTYPES = {"bf16": "bfloat16", "bfloat16": "bfloat16", "fp16": "float16", "float16": "float16",
          "half": "float16", "fp32": "float32", "float32": "float32"}
ELEM_SIZE = {"bfloat16": 2, "float16": 2, "float32": 4}
TOL = {"bfloat16": 2e-2, "float16": 1e-2, "float32": 1e-3}
TOKENS = 16384        # PERF.md's grid: 16k tokens per batch
HIDDEN = 2048         # H * D
DECODE_CACHE_LIMIT = 20e9   # bytes of K + V; bigger decode combinations are skipped
MATH_REF_LIMIT = 48e9       # bytes of score matrices the float32 math reference may allocate
DROPOUT_SEED = 1234
OUTPUT_NAMES = ("o", "dq", "dk", "dv", "dbias")


# ---------------------------------------------------------------------------------------------
# cases (pure)


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
    """(query, key) pairs a kernel is credited with, PERF.md's convention (see the module doc)."""
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
    lens = varlen_lengths(16, TOKENS)
    return [Case("varlen", mode, len(lens), max(lens), max(lens), 16, 16, 128, dtype, causal=causal, seqlens=lens,
                 peers=("varlen_attn", "flex", "ours_padded"))
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


# ---------------------------------------------------------------------------------------------
# rows, table, plots (pure)


def ratios(ours: Optional[float], peers: dict, unit: str):
    """(ours / cuDNN or None, ours / (cuDNN, else the best peer that ran), the name of that peer)."""
    if ours is None:
        return None, None, None
    c = peers.get("cudnn")
    if c:
        return ours / c, ours / c, "cudnn"
    ran = {n: v for n, v in peers.items() if v}
    if not ran:
        return None, None, None
    best = (min if unit == "GiB" else max)(ran, key=ran.get)
    return None, ours / ran[best], best


def make_row(case: Case, ours: Optional[float], peers: dict, *, ok: bool, error: str = "", ms: Optional[dict] = None,
             check: Optional[dict] = None, peer_errors: Optional[dict] = None, extra: Optional[dict] = None,
             layout: Optional[str] = None) -> dict:
    ratio_cudnn, ratio, ratio_to = ratios(ours, peers, case.unit)
    desc = case.describe()
    name = case.label
    if layout:
        desc["layout"] = layout
        name += f" {layout}"
    return {"suite": case.suite, "name": name, "pass": case.pass_label, "case": desc, "unit": case.unit,
            "ours": ours, "peers": dict(peers), "ratio_cudnn": ratio_cudnn, "ratio": ratio, "ratio_to": ratio_to,
            "ok": bool(ok), "error": error, "ms": ms or {}, "check": check or {}, "peer_errors": peer_errors or {},
            "extra": extra or {}}


def _fmt_value(x: Optional[float], unit: str) -> str:
    if x is None:
        return "-"
    if unit == "GiB":
        return f"{x:.2f}"
    return f"{x:.0f}" if abs(x) >= 10 else f"{x:.1f}"


def peer_columns(rows: Sequence[dict]) -> list:
    names = {n for r in rows for n in r["peers"]}
    return [n for n in PEER_ORDER if n in names] + sorted(names - set(PEER_ORDER))


def format_table(rows: Sequence[dict], title: str = "") -> str:
    """One compact table (one row per case): ours, each peer, the ratio, ok."""
    if not rows:
        return ""
    cols = peer_columns(rows)
    units = sorted({r["unit"] for r in rows})
    wname = max(28, max(len(r["name"]) for r in rows))
    head = f"{'case':<{wname}} {'pass':<7} {'ours':>7}" + "".join(f" {SHORT.get(c, c):>9}" for c in cols)
    head += f" {'ratio':>14}  ok"
    lines = []
    if title:
        lines.append(f"== {title} ({', '.join(units)}; ratio = ours / cuDNN, else / the named best peer) ==")
    lines += [head, "-" * len(head)]
    for r in rows:
        u = r["unit"]
        line = f"{r['name']:<{wname}} {r['pass']:<7} {_fmt_value(r['ours'], u):>7}"
        line += "".join(f" {_fmt_value(r['peers'].get(c), u) if c in r['peers'] else '':>9}" for c in cols)
        if r["ratio"] is None:
            ratio = "-"
        elif r["ratio_to"] == "cudnn":
            ratio = f"{r['ratio']:.2f}"
        else:
            ratio = f"{r['ratio']:.2f} {SHORT.get(r['ratio_to'], r['ratio_to'])}"
        status = "skip" if r["extra"].get("skipped") else ("ok" if r["ok"] else "FAIL")
        lines.append(line + f" {ratio:>14}  {status}")
    notes = [f"  {r['name']} {r['pass']}: {r['error']}" for r in rows if r["error"] and not r["extra"].get("skipped")]
    skipped = [r for r in rows if r["extra"].get("skipped")]
    if skipped:
        notes.append(f"  {len(skipped)} rows not run: {skipped[0]['error']}")
    if notes:
        lines.append("notes:")
        lines += notes
    return "\n".join(lines)


def _impl_series(rows: Sequence[dict]) -> list:
    return ["ours"] + peer_columns(rows)


def _value(row: dict, impl: str) -> Optional[float]:
    return row["ours"] if impl == "ours" else row["peers"].get(impl)


def plot_rows(rows: Sequence[dict], path: str, title: str) -> Optional[str]:
    """Write a PNG of the rows; returns None, or why it could not (matplotlib missing, nothing to plot).

    fwd/fwdbwd: TFLOP/s against S, one panel per (head dim, causal).  Anything else: grouped bars
    (one group per row, one bar per implementation), one panel per unit.  all: ratios."""
    rows = [r for r in rows if r["ours"] is not None or any(v is not None for v in r["peers"].values())]
    if not rows:
        return "nothing to plot"
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as e:  # ImportError, or a broken install
        return f"matplotlib unavailable ({type(e).__name__}: {e})"
    suites = {r["suite"] for r in rows}
    if len(suites) > 1:
        fig = _plot_ratios(plt, rows, title)
    elif suites <= {"fwd", "fwdbwd"}:
        fig = _plot_grid(plt, rows, title)
    elif suites == {"decode"}:
        fig = _plot_decode(plt, rows, title)
    else:
        fig = _plot_bars(plt, rows, title)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return None


def _plot_grid(plt, rows, title):
    panels = sorted({(r["case"]["D"], r["case"]["causal"]) for r in rows})
    ncol = 2 if len(panels) > 1 else 1
    nrow = -(-len(panels) // ncol)
    fig, axes = plt.subplots(nrow, ncol, figsize=(6 * ncol, 4 * nrow), squeeze=False)
    for ax, (D, causal) in zip(axes.flat, panels):
        sub = sorted((r for r in rows if r["case"]["D"] == D and r["case"]["causal"] == causal),
                     key=lambda r: r["case"]["Sq"])
        for impl in _impl_series(sub):
            pts = [(r["case"]["Sq"], _value(r, impl)) for r in sub if _value(r, impl) is not None]
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o",
                        linewidth=2.5 if impl == "ours" else 1.2, label=SHORT.get(impl, impl))
        ax.set_xscale("log", base=2)
        ax.set_xlabel("sequence length")
        ax.set_ylabel(sub[0]["unit"] if sub else "")
        ax.set_title(f"D={D} {'causal' if causal else 'non-causal'}")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    fig.suptitle(title)
    fig.tight_layout()
    return fig


def _plot_bars(plt, rows, title):
    units = sorted({r["unit"] for r in rows})
    fig, axes = plt.subplots(len(units), 1, figsize=(max(8, 0.9 * len(rows) + 3), 4.5 * len(units)), squeeze=False)
    for ax, unit in zip(axes.flat, units):
        sub = [r for r in rows if r["unit"] == unit]
        impls = _impl_series(sub)
        width = 0.8 / len(impls)
        for i, impl in enumerate(impls):
            xs = [j + (i - (len(impls) - 1) / 2) * width for j in range(len(sub))]
            ys = [_value(r, impl) or 0.0 for r in sub]
            ax.bar(xs, ys, width, label=SHORT.get(impl, impl))
        ax.set_xticks(range(len(sub)))
        ax.set_xticklabels([f"{r['name']}\n{r['pass']}" for r in sub], rotation=45, ha="right", fontsize=7)
        ax.set_ylabel(unit)
        ax.grid(axis="y", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    return fig


def _plot_decode(plt, rows, title):
    """One panel per batch size; groups = cache length; bars = ours contiguous / paged and each peer."""
    batches = sorted({r["case"]["B"] for r in rows})
    ncol = 2 if len(batches) > 1 else 1
    nrow = -(-len(batches) // ncol)
    fig, axes = plt.subplots(nrow, ncol, figsize=(7 * ncol, 3.8 * nrow), squeeze=False)
    for ax, B in zip(axes.flat, batches):
        sub = [r for r in rows if r["case"]["B"] == B]
        caches = sorted({r["case"]["Sk"] for r in sub})
        series = {"ours contiguous": {}, "ours paged": {}}
        for r in sub:
            L = r["case"]["Sk"]
            series["ours " + r["case"].get("layout", "contiguous")][L] = r["ours"]
            for n, v in r["peers"].items():
                series.setdefault(n, {})[L] = v
        width = 0.8 / len(series)
        for i, (name, vals) in enumerate(series.items()):
            xs = [j + (i - (len(series) - 1) / 2) * width for j in range(len(caches))]
            ax.bar(xs, [vals.get(L) or 0.0 for L in caches], width, label=SHORT.get(name, name))
        ax.set_xticks(range(len(caches)))
        ax.set_xticklabels([f"cache {fmt_len(L)}" for L in caches])
        ax.set_ylabel("GB/s (K+V bytes / time)")
        ax.set_title(f"B={B}")
        ax.grid(axis="y", alpha=0.3)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(batches):]:
        ax.axis("off")
    fig.suptitle(title)
    fig.tight_layout()
    return fig


def _plot_ratios(plt, rows, title):
    rows = [r for r in rows if r["ratio"] is not None]
    fig, ax = plt.subplots(figsize=(9, max(3, 0.22 * len(rows) + 1)))
    ys = range(len(rows))
    colors = ["tab:blue" if r["ratio_to"] == "cudnn" else "tab:orange" for r in rows]
    ax.barh(list(ys), [r["ratio"] for r in rows], color=colors)
    ax.set_yticks(list(ys))
    ax.set_yticklabels([f"{r['suite']}: {r['name']} {r['pass']}" +
                        ("" if r["ratio_to"] == "cudnn" else f" (vs {r['ratio_to']})") for r in rows], fontsize=6)
    ax.axvline(1.0, color="k", linewidth=0.8)
    ax.invert_yaxis()
    ax.set_xlabel("ours / cuDNN (blue), ours / best peer (orange); GiB rows: lower is better")
    ax.set_title(title)
    fig.tight_layout()
    return fig


def timing_plan(n_timed: int, warmup: float, rep: float, budget_s: Optional[float]) -> tuple:
    """(warmup, rep) in ms, scaled down (not below 5 / 20) so that n_timed do_bench calls take about
    budget_s seconds (each costs about 1.3 x (warmup + rep) ms plus 0.1 s of overhead)."""
    if not budget_s or n_timed <= 0:
        return warmup, rep
    per_call = budget_s / n_timed - 0.1
    need = 1.3 * (warmup + rep) / 1e3
    if per_call >= need:
        return warmup, rep
    f = max(per_call, 0.0) / need
    return max(5.0, round(warmup * f, 1)), max(20.0, round(rep * f, 1))


def count_timed(cases: Sequence[Case]) -> int:
    """do_bench calls a list of cases makes (ours + every peer; decode times two layouts)."""
    return sum(1 + len(c.peers) + (c.mode == "decode") for c in cases if c.mode != "memory")


# ---------------------------------------------------------------------------------------------
# environment, output files


def git_commit(repo: str) -> dict:
    """The checkout's commit and whether it has local changes (None without git; $GIT_COMMIT wins)."""
    if os.environ.get("GIT_COMMIT"):
        return {"commit": os.environ["GIT_COMMIT"], "dirty": None}

    def run(*args):
        proc = subprocess.run(["git", "-C", repo, *args], capture_output=True, text=True, timeout=10)
        if proc.returncode:
            raise RuntimeError((proc.stderr.strip().splitlines() or ["git failed"])[0])
        return proc.stdout.strip()
    try:
        return {"commit": run("rev-parse", "HEAD"), "dirty": bool(run("status", "--porcelain", "--untracked-files=no"))}
    except Exception as e:  # no git, not a checkout
        return {"commit": None, "dirty": None, "git_error": f"{type(e).__name__}: {e}"[:200]}


def environment(device: torch.device, args: Optional[dict] = None) -> dict:
    env: dict[str, Any] = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                           "python": platform.python_version(), "torch": torch.__version__,
                           "device": str(device), "args": args or {}}
    try:
        import flashforge
        env["flashforge"] = flashforge.__version__
    except Exception as e:
        env["flashforge"] = f"import failed: {e}"
    try:
        import triton
        env["triton"] = triton.__version__
    except Exception:
        env["triton"] = None
    env.update(git_commit(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env.update(gpu=props.name, sm_count=props.multi_processor_count,
                   gpu_memory_gib=round(props.total_memory / 2**30, 1),
                   capability=f"{props.major}.{props.minor}", cuda=torch.version.cuda,
                   cudnn=torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None)
    else:
        env.update(cpu=platform.processor() or platform.machine(), threads=torch.get_num_threads())
    return env


def _plain(x):
    """JSON-safe copy: non-finite floats become strings ("inf"), so strict parsers read the file."""
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    if isinstance(x, dict):
        return {str(k): _plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    return x


def write_json(path: str, report: dict) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(_plain(report), f, indent=1, default=str, allow_nan=False)
    os.replace(tmp, path)


# ---------------------------------------------------------------------------------------------
# running a case (needs a device; the CPU works for --cpu-smoke and the tests)


def _short_error(e: BaseException, caught: Sequence = ()) -> str:
    msg = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"[:240]
    why = [str(w.message).strip().splitlines()[0][:160] for w in caught if str(w.message).strip()]
    return msg + (" | " + "; ".join(why[:2]) if why else "")


def band_mask(Sq: int, Sk: int, offset: int = 0, window: Optional[int] = None, device="cpu") -> torch.Tensor:
    """Bool [1, 1, Sq, Sk], True = visible: causal with offset (and a left window), as flashforge means it."""
    i = torch.arange(Sq, device=device).view(Sq, 1) + offset
    j = torch.arange(Sk, device=device).view(1, Sk)
    keep = j <= i
    if window is not None:
        keep &= j >= i - window
    return keep.view(1, 1, Sq, Sk)


@functools.lru_cache(maxsize=None)
def band_mod(offset: int = 0, window: Optional[int] = None):
    """FlexAttention mask_mod of band_mask (one function object per parameters: no needless recompiles)."""
    def mask_mod(b, h, q_idx, kv_idx):
        keep = q_idx + offset >= kv_idx
        if window is not None:
            keep = keep & (q_idx + offset - kv_idx <= window)
        return keep
    return mask_mod


def doc_mod(doc: torch.Tensor, causal: bool):
    """FlexAttention mask_mod for packed sequences: same document (and causal)."""
    def mask_mod(b, h, q_idx, kv_idx):
        keep = doc[q_idx] == doc[kv_idx]
        if causal:
            keep = keep & (q_idx >= kv_idx)
        return keep
    return mask_mod


def bias_mod(bias: torch.Tensor):
    def score_mod(score, b, h, q_idx, kv_idx):
        return score + bias[b, 0, q_idx, kv_idx]
    return score_mod


_FLEX: dict = {}


def flex_function(compiled: bool, dynamic: Optional[bool] = None):
    """flex_attention, compiled once per process (recompile limits raised, as PERF.md says)."""
    from torch.nn.attention.flex_attention import flex_attention
    if not compiled:
        return flex_attention
    key = ("compiled", dynamic)
    if key not in _FLEX:
        import torch._dynamo
        cfg = torch._dynamo.config
        for name, value in (("recompile_limit", 1024), ("cache_size_limit", 1024),
                            ("accumulated_recompile_limit", 1 << 14), ("accumulated_cache_size_limit", 1 << 14)):
            try:
                if hasattr(cfg, name):
                    setattr(cfg, name, value)
            except Exception:
                pass
        _FLEX[key] = torch.compile(flex_attention, dynamic=dynamic)
    return _FLEX[key]


def _sdpa_backend(name: str):
    from torch.nn.attention import SDPBackend
    return {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}[name]


def _sdpa_ctx(name: str):
    from torch.nn.attention import sdpa_kernel
    be = _sdpa_backend(name)
    return lambda: sdpa_kernel(be)


@dataclass
class Impl:
    name: str
    fn: Callable                       # fn(*leaves) -> output, in the layout of ours
    ctx: Callable = contextlib.nullcontext
    leaves: Optional[list] = None      # own inputs (then never compared with the reference)
    do: Optional[torch.Tensor] = None
    timed: bool = True
    role: str = "peer"                 # "ours", "peer", "ref" (reference only, untimed)


@dataclass
class Inputs:
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    do: Optional[torch.Tensor] = None
    bias: Optional[torch.Tensor] = None
    keep: Optional[torch.Tensor] = None       # dense bool mask equivalent to the case (window / offset)
    cu: Optional[torch.Tensor] = None

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
        cu = torch.tensor([0] + list(_cumsum(case.seqlens)), dtype=torch.int32, device=device)
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


def _cumsum(xs):
    total = 0
    for x in xs:
        total += x
        yield total


def _window_arg(case: Case):
    return None if case.window is None else (case.window, 0)


def ours_impl(case: Case, inp: Inputs, name: str = "ours", deterministic: Optional[bool] = None) -> Impl:
    import flashforge
    det = case.deterministic if deterministic is None else deterministic
    if case.seqlens:
        mx = max(case.seqlens)

        def fn(q, k, v):
            return flashforge.attention_varlen(q, k, v, inp.cu, inp.cu, mx, mx, causal=case.causal,
                                               window=_window_arg(case), deterministic=det)
        return Impl(name, fn, role="ours")
    opts = dict(causal=case.causal, causal_offset=case.offset, window=_window_arg(case), dropout_p=case.dropout,
                seed=DROPOUT_SEED if case.dropout else None, deterministic=det)

    def fn(q, k, v, bias=inp.bias):
        return flashforge.attention(q, k, v, mask=bias, **opts)
    return Impl(name, fn, role="ours")


def sdpa_impl(case: Case, inp: Inputs, name: str, float32: bool = False) -> Impl:
    """SDPA with one backend forced, on transposed [B, H, S, D] views of our BSHD tensors."""
    mask = inp.keep
    is_causal = case.causal and mask is None
    kw = dict(dropout_p=case.dropout, is_causal=is_causal)
    if case.Hq != case.Hkv:
        kw["enable_gqa"] = True

    def fn(q, k, v, bias=inp.bias):
        m = bias if bias is not None else mask
        if float32:
            q, k, v = q.float(), k.float(), v.float()
            m = m.float() if m is not None and m.dtype != torch.bool else m
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                           attn_mask=m, **kw)
        return o.transpose(1, 2)
    return Impl(name, fn, _sdpa_ctx(name), timed=not float32, role="ref" if float32 else "peer")


def flex_impl(case: Case, inp: Inputs, compiled: bool, dynamic: Optional[bool]) -> Impl:
    from torch.nn.attention.flex_attention import create_block_mask
    if case.dropout or case.bias_grad:
        raise NotImplementedError("FlexAttention has no dropout / no bias gradient here")
    flex = flex_function(compiled, dynamic)
    dev = inp.q.device
    kw: dict = {}
    if case.Hq != case.Hkv:
        kw["enable_gqa"] = True
    if case.seqlens:
        total = sum(case.seqlens)
        doc = torch.repeat_interleave(torch.arange(len(case.seqlens), device=dev),
                                      torch.tensor(case.seqlens, device=dev))
        kw["block_mask"] = create_block_mask(doc_mod(doc, case.causal), None, None, total, total, device=dev)

        def fn(q, k, v):
            o = flex(q.unsqueeze(0).transpose(1, 2), k.unsqueeze(0).transpose(1, 2), v.unsqueeze(0).transpose(1, 2),
                     **kw)
            return o.transpose(1, 2).squeeze(0)
        return Impl("flex", fn)
    if case.causal and case.mode != "decode":
        kw["block_mask"] = create_block_mask(band_mod(case.offset, case.window), None, None, case.Sq, case.Sk,
                                             device=dev)
    if case.bias:
        kw["score_mod"] = bias_mod(inp.bias)

    def fn(q, k, v):
        return flex(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), **kw).transpose(1, 2)
    return Impl("flex", fn)


def varlen_attn_impl(case: Case, inp: Inputs) -> Impl:
    """PyTorch's own FA2 varlen entry point (torch.nn.attention.varlen), where this torch has it."""
    from torch.nn.attention.varlen import varlen_attn
    params = inspect.signature(varlen_attn).parameters
    kw: dict = {}
    if case.causal:
        if "is_causal" in params:
            kw["is_causal"] = True
        elif "window_size" in params:
            kw["window_size"] = (-1, 0)
        else:
            raise NotImplementedError("varlen_attn takes neither is_causal nor window_size")
    mx = max(case.seqlens)

    def fn(q, k, v):
        return varlen_attn(q, k, v, inp.cu, inp.cu, mx, mx, **kw)
    return Impl("varlen_attn", fn)


def padded_impl(case: Case, device: torch.device) -> Impl:
    """Our dense kernel on the batch padded to its longest sequence (own inputs; not compared)."""
    import flashforge
    n, mx = len(case.seqlens), max(case.seqlens)
    dtype = getattr(torch, case.dtype)
    g = torch.Generator(device=device).manual_seed(1)
    leaves = [torch.randn(n, mx, h, case.D, generator=g, device=device, dtype=dtype)
              for h in (case.Hq, case.Hkv, case.Hkv)]
    do = torch.randn(n, mx, case.Hq, case.D, generator=g, device=device, dtype=dtype) if case.backward else None
    for t in leaves if case.backward else ():
        t.requires_grad_(True)

    def fn(q, k, v):
        return flashforge.attention(q, k, v, causal=case.causal, window=_window_arg(case))
    return Impl("ours_padded", fn, leaves=leaves, do=do)


def sdpa_loop_impl(case: Case, inp: Inputs) -> Impl:
    """Varlen reference: SDPA on each sequence alone (math backend for float32)."""
    bounds = [0] + list(_cumsum(case.seqlens))

    def fn(q, k, v):
        outs = []
        for a, b in zip(bounds[:-1], bounds[1:]):
            qs, ks, vs = (t[a:b].transpose(0, 1).unsqueeze(0) for t in (q, k, v))
            outs.append(F.scaled_dot_product_attention(qs, ks, vs, is_causal=case.causal)[0].transpose(0, 1))
        return torch.cat(outs, 0)
    ctx = _sdpa_ctx("math") if case.dtype == "float32" else contextlib.nullcontext
    return Impl("sdpa_loop", fn, ctx, timed=False, role="ref")


def decode_impls(case: Case, inp: Inputs, peers: Sequence[str], flex_compiled: bool, flex_dynamic) -> list:
    """Decode: q [B, 1, Hq, D] against full caches [B, L, Hkv, D]; ours contiguous and paged."""
    import flashforge
    B, L, Hkv, D = case.B, case.Sk, case.Hkv, case.D
    page = 256 if L % 256 == 0 else 16  # 16: the shrunk caches of --cpu-smoke
    impls = [Impl("fp32_reference", _decode_reference, timed=False, role="ref")]
    for name in peers:
        if name in SDPA_PEERS:
            impls.append(sdpa_impl(case, inp, name))
        elif name == "flex":
            impls.append(_Deferred(name, functools.partial(flex_impl, case, inp, flex_compiled, flex_dynamic)))

    def ours(q, k, v):
        return flashforge.attention_with_kvcache(q, k, v, cache_seqlens=L)
    impls.append(Impl("ours", ours, role="ours"))

    def build_paged():
        nb = B * L // page
        perm = torch.randperm(nb, device=inp.q.device)
        kp = torch.empty(nb, page, Hkv, D, dtype=inp.k.dtype, device=inp.k.device)
        vp = torch.empty_like(kp)
        kp[perm] = inp.k.reshape(nb, page, Hkv, D)
        vp[perm] = inp.v.reshape(nb, page, Hkv, D)
        table = perm.view(B, L // page).to(torch.int32)

        def paged(q, k, v):
            return flashforge.attention_with_kvcache(q, kp, vp, cache_seqlens=L, block_table=table)
        return Impl("ours_paged", paged, role="ours")
    impls.append(_Deferred("ours_paged", build_paged, role="ours"))
    return impls


def _decode_reference(q, k, v):
    """float32 attention of one query per row over the whole cache, a few rows at a time."""
    B, _, Hq, D = q.shape
    L, Hkv = k.shape[1], k.shape[2]
    G = Hq // Hkv
    out = torch.empty(B, 1, Hq, D, dtype=torch.float32, device=q.device)
    step = max(1, int(2**30 // max(1, L * Hkv * D * 4)))
    for b0 in range(0, B, step):
        b1 = min(B, b0 + step)
        qf = q[b0:b1, 0].float().view(b1 - b0, Hkv, G, D)
        kf, vf = k[b0:b1].float(), v[b0:b1].float()
        s = torch.einsum("cngd,clnd->cngl", qf, kf) / math.sqrt(D)
        out[b0:b1, 0] = torch.einsum("cngl,clnd->cngd", s.softmax(-1), vf).reshape(b1 - b0, Hq, D)
    return out


class _Deferred(Impl):
    """An Impl whose setup (block masks, paged copies, imports) runs inside the per-peer error handling."""

    def __init__(self, name: str, build: Callable, role: str = "peer"):
        super().__init__(name, None, role=role)
        self.build = build


def build_impls(case: Case, inp: Inputs, device: torch.device, *, flex_compiled: bool = True,
                flex_dynamic: Optional[bool] = None, skip: Sequence[str] = ()) -> list:
    """Every implementation of a case, in run order: references first, then ours, then the others."""
    peers = [p for p in case.peers if p not in skip]
    if case.mode == "decode":
        return decode_impls(case, inp, peers, flex_compiled, flex_dynamic)
    impls: list = []
    if case.seqlens:
        impls.append(sdpa_loop_impl(case, inp))
    for name in peers:  # SDPA backends first: the first that runs is the reference
        if name in SDPA_PEERS and not case.seqlens:
            impls.append(sdpa_impl(case, inp, name))
    impls.append(ours_impl(case, inp))
    for name in peers:
        if name == "flex":
            impls.append(_Deferred("flex", functools.partial(flex_impl, case, inp, flex_compiled, flex_dynamic),
                                   "peer"))
        elif name == "varlen_attn":
            impls.append(_Deferred("varlen_attn", functools.partial(varlen_attn_impl, case, inp), "peer"))
        elif name == "ours_padded":
            impls.append(_Deferred("ours_padded", functools.partial(padded_impl, case, device), "peer"))
        elif name == "ours_default":
            impls.append(ours_impl(case, inp, "ours_default", deterministic=False))
            impls[-1].role = "peer"
    return impls


def reference_order(case: Case) -> list:
    """Names whose output may serve as the reference, best first; [] = no comparison (dropout)."""
    if case.dropout:
        return []
    if case.mode == "decode":
        return ["fp32_reference"]
    if case.seqlens:
        return ["sdpa_loop"]
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


@dataclass
class _CaseState:
    ref: Optional[list] = None
    ref_name: Optional[str] = None
    kept: dict = dataclasses.field(default_factory=dict)         # ours* outputs, checked at the end
    values: dict = dataclasses.field(default_factory=dict)       # name -> TFLOP/s, GB/s or GiB
    ms: dict = dataclasses.field(default_factory=dict)
    errs: dict = dataclasses.field(default_factory=dict)         # peers' errors against the reference
    peer_errors: dict = dataclasses.field(default_factory=dict)  # why a peer has no number
    ours_errors: dict = dataclasses.field(default_factory=dict)
    extra: dict = dataclasses.field(default_factory=dict)

    def fail(self, name: str, role: str, msg: str) -> None:
        if role == "ours":
            self.ours_errors[name] = msg
        else:
            self.peer_errors[name] = msg
        if role != "ref":
            self.values[name] = None


class Runner:
    """Runs cases on one device: warm-up (and check) each implementation, then time it."""

    def __init__(self, device: torch.device, warmup: float = 25, rep: float = 100, *, flex_compiled: bool = True,
                 flex_dynamic: Optional[bool] = None, skip: Sequence[str] = (), cudagraph: bool = False,
                 log: Callable[[str], None] = lambda s: None):
        self.device = device
        self.warmup, self.rep = warmup, rep
        self.flex_compiled, self.flex_dynamic = flex_compiled, flex_dynamic
        self.skip = tuple(skip)
        self.cudagraph = cudagraph
        self.log = log

    # -- device helpers
    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def time_ms(self, fn: Callable, grad_to_none=None) -> float:
        if self.cuda:
            import triton.testing
            return float(triton.testing.do_bench(fn, warmup=self.warmup, rep=self.rep, grad_to_none=grad_to_none,
                                                 return_mode="median"))
        for t in grad_to_none or ():  # --cpu-smoke: one wall-clock run checks the plumbing, not the speed
            t.grad = None
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3

    def peak_gib(self, fn: Callable, leaves: Sequence[torch.Tensor]) -> tuple:
        """(peak GiB above what was allocated before, ms) of one call (None GiB on the CPU)."""
        if not self.cuda:  # --cpu-smoke: run it, measure nothing
            t0 = time.perf_counter()
            fn()
            return None, (time.perf_counter() - t0) * 1e3
        for t in leaves:
            t.grad = None
        self.sync()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        base = torch.cuda.memory_allocated(self.device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        self.sync()
        peak = torch.cuda.max_memory_allocated(self.device) - base
        for t in leaves:
            t.grad = None
        return peak / 2**30, start.elapsed_time(end)

    # -- one implementation
    def _call(self, impl: Impl, leaves: list, do, backward: bool) -> list:
        if not backward:
            with torch.no_grad():
                return [impl.fn(*leaves).detach()]
        o = impl.fn(*leaves)
        grads = torch.autograd.grad(o, leaves, do.to(o.dtype))
        return [o.detach(), *grads]

    def _timed_fn(self, impl: Impl, leaves: list, do, backward: bool) -> Callable:
        if backward:
            return lambda: impl.fn(*leaves).backward(do)
        return lambda: impl.fn(*leaves)

    # -- one case
    def run_case(self, case: Case) -> list:
        """Warm up, check and time every implementation of a case; returns its rows (two for decode)."""
        t0 = time.perf_counter()
        inp = make_inputs(case, self.device)
        impls = build_impls(case, inp, self.device, flex_compiled=self.flex_compiled, flex_dynamic=self.flex_dynamic,
                            skip=self.skip)
        backward = case.backward
        order = reference_order(case)
        st = _CaseState()
        for impl in impls:
            if impl.role == "ref" and st.ref is not None:
                continue
            self._run_impl(case, inp, impl, order, st)
            self._cleanup()
        if st.ref is None and "math" in order:  # no peer could serve: SDPA math in float32
            if math_ref_bytes(case) > MATH_REF_LIMIT:
                st.peer_errors["math"] = f"float32 math reference skipped: ~{math_ref_bytes(case) / 1e9:.0f} GB"
            else:
                try:
                    impl = sdpa_impl(case, inp, "math", float32=True)
                    with impl.ctx():
                        st.ref = self._call(impl, self._leaves(case, inp, impl), inp.do, backward)
                    st.ref_name = "math"
                except Exception as e:
                    st.peer_errors["math"] = _short_error(e)
                self._cleanup()

        tol = TOL[case.dtype]
        expected = [tuple(inp.q.shape)] + ([tuple(t.shape) for t in inp.leaves(case)] if backward else [])
        rows = []
        peer_names = [n for n in case.peers if n not in self.skip]
        for oname in (["ours", "ours_paged"] if case.mode == "decode" else ["ours"]):
            out = st.kept.get(oname)
            err, check, ok = st.ours_errors.get(oname, ""), None, False
            if not err and out is not None:
                if case.dropout:
                    check = finite_check(out, expected)
                elif st.ref is not None:
                    check = rel_errors(out, st.ref)
                if check is None:
                    err = "no reference could run: output unchecked"
                else:
                    bad = {k: v for k, v in check.items() if not v < (math.inf if case.dropout else tol)}
                    ok = not bad
                    if bad:
                        detail = ", ".join(f"{k}={v:.2e}" for k, v in bad.items())
                        err = (f"non-finite or misshapen output ({detail})" if case.dropout
                               else f"differs from {st.ref_name}: {detail} (tol {tol:g})")
            elif not err:
                err = "ours produced no output"
            info = {"ref": None if case.dropout else st.ref_name, "tol": tol, "ours": check, "peers": st.errs}
            if case.dropout:
                info["note"] = "dropout: only shapes and finite values checked"
            others = {k: v for k, v in st.ours_errors.items() if k != oname}
            rows.append(make_row(
                case, st.values.get(oname), {n: st.values.get(n) for n in peer_names}, ok=ok, error=err,
                ms={"ours": st.ms.get(oname), **{n: st.ms.get(n) for n in peer_names}}, check=info,
                peer_errors={**st.peer_errors, **others}, extra=dict(st.extra, seconds=round(time.perf_counter() - t0, 1)),
                layout=None if case.mode != "decode" else ("contiguous" if oname == "ours" else "paged")))
        del inp, impls, st
        self._cleanup()
        return rows

    def _leaves(self, case: Case, inp: Inputs, impl: Impl) -> list:
        if impl.leaves is not None:
            return impl.leaves
        return inp.leaves(case) if case.backward else [inp.q, inp.k, inp.v]

    def _run_impl(self, case: Case, inp: Inputs, impl: Impl, order: Sequence[str], st: "_CaseState") -> None:
        backward = case.backward
        role = impl.role
        # 1. set up and run once (compilation, autotuning, cuDNN plans), keeping what the check needs
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                if isinstance(impl, _Deferred):
                    impl = impl.build()
                    impl.role = role
                leaves = self._leaves(case, inp, impl)
                do = impl.do if impl.leaves is not None else inp.do
                with impl.ctx():
                    out = self._call(impl, leaves, do, backward)
                self.sync()
            except Exception as e:
                st.fail(impl.name, role, _short_error(e, caught))
                return
        if st.ref is None and impl.name in order:
            st.ref, st.ref_name = out, impl.name
        elif role == "ours":
            st.kept[impl.name] = out
        elif st.ref is not None and impl.leaves is None:
            st.errs[impl.name] = rel_errors(out, st.ref)
        del out
        if role == "ref" or not impl.timed:
            return
        # 2. time it (or measure its peak memory)
        try:
            with impl.ctx(), (contextlib.nullcontext() if backward else torch.no_grad()):
                if case.mode == "memory":
                    gib, one_ms = self.peak_gib(self._timed_fn(impl, leaves, do, True), leaves)
                    st.values[impl.name], st.ms[impl.name] = gib, one_ms
                    st.extra.setdefault("tflops_one_run", {})[impl.name] = throughput(
                        dataclasses.replace(case, mode="fwdbwd"), one_ms)
                else:
                    st.ms[impl.name] = self.time_ms(self._timed_fn(impl, leaves, do, backward),
                                                    leaves if backward else None)
                    st.values[impl.name] = throughput(case, st.ms[impl.name])
        except Exception as e:
            st.fail(impl.name, role, _short_error(e))
            return
        if self.cudagraph and case.mode == "decode" and impl.name in ("ours", "ours_paged", "cudnn"):
            try:
                with impl.ctx():
                    st.extra.setdefault("cudagraph_gbps", {})[impl.name] = self._cudagraph(
                        case, self._timed_fn(impl, leaves, do, False))
            except Exception as e:
                st.extra.setdefault("cudagraph_errors", {})[impl.name] = _short_error(e)

    def _cudagraph(self, case: Case, fn: Callable) -> Optional[float]:
        import triton.testing
        with torch.no_grad():
            ms = float(triton.testing.do_bench_cudagraph(fn, rep=self.rep, return_mode="median"))
        return throughput(case, ms)

    def _cleanup(self) -> None:
        if self.cuda:
            try:
                torch.cuda.synchronize(self.device)
            except Exception:
                pass
            torch.cuda.empty_cache()


# ---------------------------------------------------------------------------------------------
# driver


def skipped_row(case: Case, why: str) -> dict:
    return make_row(case, None, {n: None for n in case.peers}, ok=True, error=why, extra={"skipped": True})


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="attention_bench.py", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="\n\n".join(__doc__.split("\n\n")[2:]))
    p.add_argument("--suite", required=True, help=f"{', '.join(SUITES)}, all, or a comma-separated list")
    p.add_argument("--out", default=os.environ.get("OUT") or "bench_results",
                   help="output directory (default: $OUT, else ./bench_results)")
    p.add_argument("--dtype", default="bf16", choices=sorted(DTYPES), help="input dtype (default bf16)")
    p.add_argument("--warmup", type=float, default=25.0, help="do_bench warm-up, ms (default 25)")
    p.add_argument("--rep", type=float, default=100.0, help="do_bench repetition time, ms (default 100)")
    p.add_argument("--timing-budget", type=float, default=None,
                   help="seconds of do_bench time to aim for; warm-up/rep shrink to fit (default: 200 for several suites)")
    p.add_argument("--max-seconds", type=float, default=None,
                   help="stop starting new cases after this many seconds (default: 510 for several suites, else none)")
    p.add_argument("--skip", default="", help="comma-separated peers not to run, e.g. flex")
    p.add_argument("--flex-static", action="store_true",
                   help="compile FlexAttention with dynamic=False (one compile per shape; default: torch's automatic dynamic)")
    p.add_argument("--full-flex", action="store_true",
                   help="several suites: FlexAttention on every case (default: only where PERF.md has Flex anchors)")
    p.add_argument("--cudagraph", action="store_true",
                   help="decode: also time ours and cuDNN inside a CUDA graph (do_bench_cudagraph), in 'extra'")
    p.add_argument("--filter", default="", help="only cases whose label contains this text")
    p.add_argument("--cpu-smoke", action="store_true",
                   help="testing aid: run every case shrunk, on the CPU, with wall-clock timing (numbers meaningless)")
    args = p.parse_args(argv)
    if hasattr(sys.stdout, "reconfigure"):
        sys.stdout.reconfigure(line_buffering=True)

    try:
        suites = parse_suites(args.suite)
    except ValueError as e:
        print(f"attention_bench: {e}", file=sys.stderr)
        return 2
    dtype = DTYPES[args.dtype]
    if args.cpu_smoke:
        device = torch.device("cpu")
    else:
        if not torch.cuda.is_available():
            print("attention_bench: no CUDA GPU here (torch.cuda.is_available() is False). This benchmark times GPU "
                  "kernels against cuDNN, FA2 and FlexAttention; on a CPU use `python -m flashforge.bench` or "
                  "benchmarks/cpu_vs_sdpa.py.", file=sys.stderr)
            return 2
        if os.environ.get("TRITON_INTERPRET") == "1":
            print("attention_bench: warning: TRITON_INTERPRET=1 is set; the Triton kernels run in the interpreter",
                  file=sys.stderr)
        device = torch.device("cuda", torch.cuda.current_device())

    multi = len(suites) > 1
    tag = "all" if suites == list(ALL_ORDER) else "+".join(suites)
    cases = [c for s in suites for c in build_cases(s, dtype)]
    if multi and not args.full_flex:
        cases = trim_flex(cases)
    if args.filter:
        cases = [c for c in cases if args.filter in c.label]
    if args.cpu_smoke:
        cases = [shrink(c) for c in cases]
    budget = args.timing_budget if args.timing_budget is not None else (200.0 if multi else None)
    warmup, rep = timing_plan(count_timed(cases), args.warmup, args.rep, budget)
    max_seconds = args.max_seconds if args.max_seconds is not None else (510.0 if multi else None)
    skip = [s.strip() for s in args.skip.split(",") if s.strip()]

    t_start = time.perf_counter()
    env = environment(device, {**vars(args), "warmup_used": warmup, "rep_used": rep})
    print("attention_bench " + " ".join(f"{k}={env[k]}" for k in
                                        ("torch", "triton", "gpu", "cudnn", "commit", "dirty") if k in env))
    print(f"suites: {', '.join(suites)}; {len(cases)} cases, ~{count_timed(cases)} timed runs; do_bench warmup "
          f"{warmup:g} ms, rep {rep:g} ms" + (f"; stopping new cases after {max_seconds:g} s" if max_seconds else ""))
    runner = Runner(device, warmup, rep, flex_compiled=not args.cpu_smoke,
                    flex_dynamic=False if args.flex_static else None, skip=skip, cudagraph=args.cudagraph)
    os.makedirs(args.out, exist_ok=True)
    rows: list = []
    report = {"environment": env, "rows": rows}
    combined = os.path.join(args.out, f"{tag}.json")
    interrupted = ""

    def on_term(signum, frame):  # `timeout` sends SIGTERM: still print and write what was measured
        raise KeyboardInterrupt("SIGTERM")
    old_term = signal.signal(signal.SIGTERM, on_term) if hasattr(signal, "SIGTERM") else None
    try:
        for i, case in enumerate(cases):
            elapsed = time.perf_counter() - t_start
            if interrupted or (max_seconds and elapsed > max_seconds):
                why = interrupted or f"--max-seconds {max_seconds:g} reached"
                rows.append(skipped_row(case, f"skipped: {why}"))
                continue
            t0 = time.perf_counter()
            try:
                new = runner.run_case(case)
            except KeyboardInterrupt as e:
                interrupted = f"interrupted ({e or 'Ctrl-C'})"
                rows.append(skipped_row(case, f"skipped: {interrupted}"))
                continue
            except Exception as e:  # a harness bug or a dead CUDA context: report the case, go on
                new = [make_row(case, None, {n: None for n in case.peers}, ok=False,
                                error="harness: " + _short_error(e))]
                runner._cleanup()
            rows.extend(new)
            status = " ".join(f"{r['name']}: ours {_fmt_value(r['ours'], r['unit'])} {r['unit']}"
                              f"{'' if r['ok'] else ' FAIL'}" for r in new)
            print(f"[{i + 1}/{len(cases)} {time.perf_counter() - t_start:5.0f}s] {case.suite} {case.pass_label}: "
                  f"{status} ({time.perf_counter() - t0:.1f} s)", file=sys.stderr, flush=True)
            write_json(combined, report)
    finally:
        if old_term is not None:
            signal.signal(signal.SIGTERM, old_term)

    written = [combined]
    for s in suites:
        sub = [r for r in rows if r["suite"] == s]
        if not sub:
            continue
        if multi:
            write_json(os.path.join(args.out, f"{s}.json"), {"environment": env, "rows": sub})
            written.append(os.path.join(args.out, f"{s}.json"))
        png = os.path.join(args.out, f"{s}.png")
        why = _safe_plot(sub, png, f"{s} ({dtype}, {env.get('gpu', device)})")
        written.append(png if why is None else f"{png} not written: {why}")
    if multi:
        png = os.path.join(args.out, f"{tag}.png")
        why = _safe_plot(rows, png, f"{tag}: ours / cuDNN ({dtype}, {env.get('gpu', device)})")
        written.append(png if why is None else f"{png} not written: {why}")

    failed = [r for r in rows if not r["ok"]]
    skipped = [r for r in rows if r["extra"].get("skipped")]
    report["ok"] = not failed
    report["seconds"] = round(time.perf_counter() - t_start, 1)
    write_json(combined, report)
    tables = [format_table([r for r in rows if r["suite"] == s], f"{s} {dtype}") for s in suites]
    text = "\n\n".join(t for t in tables if t)
    txt = os.path.join(args.out, f"{tag}.txt")
    with open(txt, "w") as f:
        f.write(text + "\n")
    written.append(txt)
    print()
    print(text + "\n")
    print("wrote: " + "; ".join(written))
    print(f"RESULT: {'ok' if not failed else 'FAILED'}: {len(rows)} rows, {len(failed)} failed"
          + (f", {len(skipped)} skipped ({interrupted or 'time'})" if skipped else "") + f", {report['seconds']:.0f} s")
    return 1 if failed else (130 if interrupted else 0)


def _safe_plot(rows, path, title) -> Optional[str]:
    try:
        return plot_rows(rows, path, title)
    except Exception as e:  # a plot must never cost the numbers
        return _short_error(e)


if __name__ == "__main__":
    sys.exit(main())
