"""Case: the problem one benchmark row times (shapes, dtype, masking, threads, the peers asked for) and its
label.  Pure: no device, no timing."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

DTYPES = {"bf16": "bfloat16", "bfloat16": "bfloat16", "fp16": "float16", "float16": "float16",
          "half": "float16", "fp32": "float32", "float32": "float32"}
ELEM_SIZE = {"bfloat16": 2, "float16": 2, "float32": 4}
# the peers a GPU row asks for unless it says otherwise; each one that cannot take the row says why
STANDARD_PEERS = ("fa4", "cudnn", "flash", "efficient", "flex")


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
    softcap: float = 0.0         # tanh softcap of the scores (Gemma 2); SDPA and cuDNN have none
    deterministic: bool = False
    seqlens: Optional[tuple] = None   # varlen: lengths of the packed sequences (B of them)
    peers: tuple = STANDARD_PEERS
    name: str = ""
    threads: Optional[int] = None     # CPU: torch.set_num_threads for this row (None: torch's default)
    grid: bool = False           # one of PERF.md's 12 standard-grid shapes (the geometric means are over these)

    @property
    def label(self) -> str:
        if self.name:
            shape = self.name
        elif self.seqlens:
            shape = f"D={self.D} {len(self.seqlens)} seqs {fmt_len(sum(self.seqlens))} tok"
        elif self.mode == "decode":
            shape = f"B={self.B} cache={fmt_len(self.Sk)}"
        else:
            s = fmt_len(self.Sq) if self.Sq == self.Sk else f"{fmt_len(self.Sq)}/{fmt_len(self.Sk)}"
            shape = f"D={self.D} S={s}"
        if not self.name:
            if self.Hq != self.Hkv:
                shape += f" GQA {self.Hq}/{self.Hkv}"
            if self.causal and self.mode != "decode":
                shape += " causal"
        if self.softcap:
            shape += f" softcap {self.softcap:g}"
        if self.dtype == "float32":
            shape += " fp32"
        if self.threads:
            shape += f" {self.threads} thread{'s' if self.threads > 1 else ''}"
        return shape

    @property
    def pass_label(self) -> str:
        return {"fwd": "fwd", "fwdbwd": "fwd+bwd", "decode": "decode", "memory": "fwd+bwd"}[self.mode]

    @property
    def backward(self) -> bool:
        return self.mode in ("fwdbwd", "memory")

    @property
    def unit(self) -> str:
        """The unit on a GPU; CPU rows count GFLOP/s instead of TFLOP/s (flops.row_unit)."""
        return {"decode": "GB/s", "memory": "GiB"}.get(self.mode, "TFLOP/s")

    def describe(self) -> dict:
        d = dataclasses.asdict(self)
        d["seqlens"] = list(self.seqlens) if self.seqlens else None
        d["peers"] = list(self.peers)
        d["label"] = self.label
        return d
