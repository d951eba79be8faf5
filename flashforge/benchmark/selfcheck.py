"""The main job's self-check: a few small cases (forward and backward; causal with an offset, GQA, bias
with gradient, bool mask with fully masked rows, dropout, window + softcap + lse) against
`flashforge.reference.attention` in float64.  A case passes when each of o, lse and every gradient is
within ``2 x`` the error of the same plain-PyTorch reference run in the input dtype, plus a rounding
floor (the FlashAttention-4 test rule); a dropout case must also repeat bit for bit with its seed."""

from __future__ import annotations

import math
import time
import traceback
from dataclasses import dataclass
from typing import Callable, Optional

import torch

import flashforge
from flashforge import reference

from .report import write_json

# Rounding floor of the self-check, relative to the largest reference value (>= 1).
_FLOOR = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 8e-3}


@dataclass
class CheckCase:
    name: str
    B: int = 2
    Sq: int = 65
    Sk: int = 65
    Hq: int = 4
    Hkv: int = 4
    D: int = 64
    Dv: Optional[int] = None
    causal: bool = False
    causal_offset: object = 0  # int, or "per-batch" for an int tensor [B]
    window: object = None
    mask: Optional[str] = None  # None, "bias" ([B, 1, Sq, Sk] float, with grad) or "bool" ([Sq, Sk])
    dropout_p: float = 0.0
    softcap: float = 0.0
    lse_grad: bool = False  # backpropagate through lse as well as o


CHECKS = [
    CheckCase("plain"),
    CheckCase("causal, Sq < Sk, bottom-right offset", Sq=33, Sk=80, causal=True, causal_offset=47),
    CheckCase("GQA 8/2, causal, D=40, Dv=24", Hq=8, Hkv=2, D=40, Dv=24, causal=True),
    CheckCase("float bias [B,1,Sq,Sk] with grad", Sq=50, Sk=70, mask="bias"),
    CheckCase("bool mask [Sq,Sk], fully masked rows", Sq=40, Sk=56, mask="bool"),
    CheckCase("dropout 0.2", dropout_p=0.2),
    CheckCase("window (16, 8), softcap 20, grad through lse, per-batch offsets", Sq=48, Sk=96,
              window=(16, 8), softcap=20.0, causal_offset="per-batch", lse_grad=True),
]


def _max_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    """max |ours - ref|, where equal entries (both -inf, say) count 0 and NaN counts inf."""
    ours, ref = ours.double(), ref.double()
    diff = torch.where(ours == ref, torch.zeros_like(ref), (ours - ref).abs())
    return float(torch.nan_to_num(diff, nan=math.inf).max()) if diff.numel() else 0.0


def _scale(ref: torch.Tensor) -> float:
    finite = ref[torch.isfinite(ref)]
    return max(1.0, float(finite.abs().max())) if finite.numel() else 1.0


def _make_inputs(case: CheckCase, device: torch.device, dtype: torch.dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    Dv = case.Dv or case.D

    def randn(*shape):
        return torch.randn(*shape, generator=g).to(device=device, dtype=dtype)

    q = randn(case.B, case.Sq, case.Hq, case.D)
    k = randn(case.B, case.Sk, case.Hkv, case.D)
    v = randn(case.B, case.Sk, case.Hkv, Dv)
    do = randn(case.B, case.Sq, case.Hq, Dv)
    dlse = torch.randn(case.B, case.Hq, case.Sq, generator=g).to(device) if case.lse_grad else None
    mask = None
    if case.mask == "bias":
        mask = randn(case.B, 1, case.Sq, case.Sk)
    elif case.mask == "bool":
        mask = (torch.rand(case.Sq, case.Sk, generator=g) > 0.3)
        mask[::7] = False  # every 7th query row sees no key at all
        mask = mask.to(device)
    offset = case.causal_offset
    if offset == "per-batch":
        offset = torch.tensor([(7 * b) % (case.Sk + 1) for b in range(case.B)], dtype=torch.int64, device=device)
    return q, k, v, do, dlse, mask, offset


def _run(fn: Callable, case: CheckCase, q, k, v, do, dlse, mask, offset, seed: int, dtype=None):
    """Forward + backward of fn (flashforge.attention or the reference); returns name -> tensor."""
    # detached copies: the caller's tensors never get requires_grad or a .grad
    cast = (lambda t: t.detach()) if dtype is None else (lambda t: t.detach().to(dtype))
    leaves = {"q": cast(q), "k": cast(k), "v": cast(v)}
    if case.mask == "bias":
        leaves["mask"] = cast(mask)
    for t in leaves.values():
        t.requires_grad_(True)
    m = leaves.get("mask", mask)
    o, lse = fn(leaves["q"], leaves["k"], leaves["v"], causal=case.causal, causal_offset=offset,
                window=case.window, mask=m, dropout_p=case.dropout_p, seed=seed, softcap=case.softcap,
                return_lse=True)
    outs, grads_in = [o], [cast(do)]
    if dlse is not None:
        outs.append(lse)
        grads_in.append(dlse.to(lse.dtype))
    grads = torch.autograd.grad(outs, list(leaves.values()), grads_in)
    result = {"o": o.detach(), "lse": lse.detach()}
    result.update({"d" + name: gr for name, gr in zip(leaves, grads)})
    return result


def run_check(case: CheckCase, device: torch.device, dtype: torch.dtype, index: int) -> dict:
    seed = 1000 + index
    inputs = _make_inputs(case, device, dtype, seed)
    ours = _run(flashforge.attention, case, *inputs, seed=seed)
    gold = _run(reference.attention, case, *inputs, seed=seed, dtype=torch.float64)
    plain = _run(reference.attention, case, *inputs, seed=seed)  # PyTorch's own error in dtype
    errors, ok = {}, True
    for name, ref in gold.items():
        err = _max_err(ours[name], ref)
        bound = 2.0 * _max_err(plain[name], ref) + _FLOOR[dtype] * _scale(ref)
        errors[name] = {"err": err, "bound": bound}
        ok = ok and err <= bound
    if case.dropout_p > 0:
        again = _run(flashforge.attention, case, *inputs, seed=seed)
        same = all(torch.equal(again[n], ours[n]) for n in ours)
        errors["repeat with same seed"] = {"bitwise_equal": same}
        ok = ok and same
    return {"name": case.name, "ok": ok, "errors": errors}


def _check_line(res: dict) -> str:
    if res["ok"]:
        detail = " ".join(f"{n}={v['err']:.1e}" for n, v in res["errors"].items() if "err" in v)
    elif "error" in res:
        detail = res["error"].splitlines()[0][:200]
    else:  # only what went wrong
        detail = " ".join(f"{n}={v['err']:.1e}>{v['bound']:.1e}" if "err" in v else f"{n}: {v}"
                          for n, v in res["errors"].items()
                          if not v.get("bitwise_equal", True) or v.get("err", 0) > v.get("bound", 0))
    return f"{'PASS' if res['ok'] else 'FAIL'}  {res['dtype']:<8} {res['name']:<62} {detail}"


def self_check(device: torch.device, report: dict, json_path: Optional[str]) -> bool:
    # one dtype each: kernel compilation dominates on a GPU, and the GPU tests
    # (tests/test_gpu.py) cover fp16/bf16/fp32 there
    dtypes = (torch.bfloat16,) if device.type == "cuda" else (torch.float32,)
    print("\nself-check (against flashforge.reference in float64)")
    t0 = time.perf_counter()
    for dtype in dtypes:
        for i, case in enumerate(CHECKS):
            try:
                res = run_check(case, device, dtype, i)
            except Exception as e:
                res = {"name": case.name, "ok": False, "error": f"{type(e).__name__}: {e}",
                       "traceback": traceback.format_exc()}
            res["dtype"] = str(dtype).replace("torch.", "")
            report["check"].append(res)
            print(_check_line(res))
    passed = sum(r["ok"] for r in report["check"])
    failed = len(report["check"]) - passed
    print(f"self-check: {passed} passed, {failed} failed ({time.perf_counter() - t0:.1f} s)")
    if json_path:
        write_json(json_path, report)
    return failed == 0
