"""Self-check and small benchmark of flashforge on whatever device this machine has.

    python -m flashforge.bench [--json PATH] [--device cpu|cuda] [--check-only]

1. Self-check: a few small cases (forward and backward; causal with an offset, GQA, bias
   with gradient, bool mask with fully masked rows, dropout, window + softcap + lse) against
   `flashforge.reference.attention` in float64.  A case passes when each of o, lse and every
   gradient is within ``2 x`` the error of the same plain-PyTorch reference run in the input
   dtype, plus a rounding floor (the FlashAttention-4 test rule).
2. Benchmark: `flashforge.attention` against `torch.nn.functional.scaled_dot_product_attention`
   on the same inputs, forward and forward+backward.  CUDA: bf16 on PERF.md's standard grid
   (16k tokens, H*D = 2048, D 64/128, S 1k/4k/16k), SDPA's cuDNN backend where it takes the
   case, timed by `triton.testing.do_bench` (median).  CPU: float32, B=1, H=8, D=64,
   S 512/1024/2048, and one decoding step (1 query, 16k keys), median wall-clock of a few
   runs.  Every row also compares our output (and
   gradients) with SDPA's, so a fast wrong kernel cannot report a number.

FLOPs follow PERF.md (flash-attn's convention): forward 4*B*H*Sq*Sk*D, halved when causal;
forward+backward 3.5x that.  ``ratio`` is SDPA time / our time (above 1: we are faster).
Exits with status 1 if any check or benchmark comparison fails.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import time
import traceback
from dataclasses import asdict, dataclass
from typing import Callable, Optional

import torch
import torch.nn.functional as F

import flashforge
from flashforge import reference

# Rounding floor of the self-check, relative to the largest reference value (>= 1).
_FLOOR = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 8e-3}
# Largest |ours - sdpa| / max|sdpa| accepted in the benchmark's own comparison.
_BENCH_RTOL = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 3e-2}


# ---------------------------------------------------------------------------------------------
# self-check


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


# ---------------------------------------------------------------------------------------------
# benchmark


@dataclass
class BenchCase:
    B: int
    S: int
    H: int
    D: int
    causal: bool
    dtype: str
    Sq: Optional[int] = None  # queries, when not S (decoding: 1 query against S keys)

    @property
    def queries(self) -> int:
        return self.S if self.Sq is None else self.Sq

    @property
    def modes(self) -> tuple:
        return ("fwd",) if self.Sq is not None else ("fwd", "fwd+bwd")

    @property
    def label(self) -> str:
        seq = f"S={self.S}" if self.Sq is None else f"Sq={self.Sq} Sk={self.S}"
        return f"B={self.B} {seq} H={self.H} D={self.D}{' causal' if self.causal else ''}"

    def fwd_flops(self) -> float:
        flops = 4.0 * self.B * self.H * self.queries * self.S * self.D
        return flops / 2 if self.causal else flops


@dataclass
class BenchRow:
    case: BenchCase
    mode: str  # "fwd" or "fwd+bwd"
    ours_ms: Optional[float] = None
    sdpa_ms: Optional[float] = None
    sdpa_backend: str = ""
    rel_diff: Optional[float] = None  # max |ours - sdpa| / max |sdpa| over o (and dq, dk, dv)
    ok: bool = False
    error: str = ""

    @property
    def flops(self) -> float:
        return self.case.fwd_flops() * (3.5 if self.mode == "fwd+bwd" else 1.0)

    def tflops(self, ms: Optional[float]) -> Optional[float]:
        return None if ms is None else self.flops / (ms * 1e-3) / 1e12

    def to_json(self) -> dict:
        d = asdict(self)
        d["case"] = asdict(self.case)
        d.update(flops=self.flops, ours_tflops=self.tflops(self.ours_ms), sdpa_tflops=self.tflops(self.sdpa_ms),
                 ratio=None if not (self.ours_ms and self.sdpa_ms) else self.sdpa_ms / self.ours_ms)
        return d


def bench_cases(device: torch.device) -> list[BenchCase]:
    if device.type == "cuda":
        # PERF.md's standard grid: 16k tokens (B = 16384 / S), H * D = 2048
        return [BenchCase(16384 // S, S, 2048 // D, D, causal, "bfloat16")
                for D in (64, 128) for S in (1024, 4096, 16384) for causal in (False, True)]
    return ([BenchCase(1, S, 8, 64, causal, "float32") for S in (512, 1024, 2048) for causal in (False, True)]
            + [BenchCase(1, 16384, 8, 64, False, "float32", Sq=1)])  # one decoding step


def _time_cuda(fn: Callable, grad_to_none) -> float:
    import triton.testing
    return float(triton.testing.do_bench(fn, warmup=25, rep=100, grad_to_none=grad_to_none, return_mode="median"))


def _time_cpu(fn: Callable, grad_to_none, budget_s: float = 0.5) -> float:
    """Median wall-clock ms of 3..10 runs, stopping once budget_s is spent (the comparison run
    before it is the warm-up)."""
    times: list[float] = []
    deadline = time.perf_counter() + budget_s
    while len(times) < 3 or (len(times) < 10 and time.perf_counter() < deadline):
        for t in grad_to_none or ():
            t.grad = None
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _sdpa_choice(device: torch.device, q, k, v, causal: bool, backward: bool):
    """SDPA callable on [B, S, H, D] inputs (transposed views), and the backend's name.

    On CUDA, SDPA's cuDNN backend is PERF.md's yardstick; where it refuses the case (forward,
    or backward when asked) we fall back to SDPA's own choice and say so."""
    def plain(q, k, v):
        return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                              is_causal=causal).transpose(1, 2)
    if device.type != "cuda":
        return plain, "default"
    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        def cudnn(q, k, v):
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return plain(q, k, v)
        if backward:
            leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]
            cudnn(*leaves).sum().backward()
        else:
            with torch.no_grad():
                cudnn(q, k, v)
        torch.cuda.synchronize()
        return cudnn, "cudnn"
    except (ImportError, RuntimeError):
        return plain, "default"


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return _max_err(a, b) / max(float(b.abs().max()), 1e-30)


def run_bench(case: BenchCase, device: torch.device) -> list[BenchRow]:
    dtype = getattr(torch, case.dtype)
    g = torch.Generator(device=device).manual_seed(0)
    shape = (case.B, case.S, case.H, case.D)
    q_shape = (case.B, case.queries, case.H, case.D)
    q, do = (torch.randn(q_shape, generator=g, device=device, dtype=dtype) for _ in range(2))
    k, v = (torch.randn(shape, generator=g, device=device, dtype=dtype) for _ in range(2))
    timer = _time_cuda if device.type == "cuda" else _time_cpu
    rows = []
    for mode in case.modes:
        row = BenchRow(case, mode)
        rows.append(row)
        try:
            sdpa, row.sdpa_backend = _sdpa_choice(device, q, k, v, case.causal, backward=mode == "fwd+bwd")

            def ours(q, k, v):
                return flashforge.attention(q, k, v, causal=case.causal)
            # the comparison runs double as the warm-up (compilation, autotuning) of each timing
            if mode == "fwd":
                with torch.no_grad():
                    diffs = [_rel(ours(q, k, v), sdpa(q, k, v))]
                    row.ours_ms = timer(lambda: ours(q, k, v), None)
                    row.sdpa_ms = timer(lambda: sdpa(q, k, v), None)
            else:
                leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]
                got, want = ([o.detach()] + list(torch.autograd.grad(o, leaves, do))
                             for o in (ours(*leaves), sdpa(*leaves)))
                diffs = [_rel(a, b) for a, b in zip(got, want)]
                del got, want
                row.ours_ms = timer(lambda: ours(*leaves).backward(do), leaves)
                row.sdpa_ms = timer(lambda: sdpa(*leaves).backward(do), leaves)
            row.rel_diff = max(diffs)
            row.ok = row.rel_diff <= _BENCH_RTOL[dtype]
            if not row.ok:
                row.error = f"output differs from SDPA: max rel diff {row.rel_diff:.2e} > {_BENCH_RTOL[dtype]:.0e}"
        except Exception as e:  # report and go on: one broken row must not hide the others
            row.error = f"{type(e).__name__}: {e}".splitlines()[0][:200]
        finally:
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return rows


def _fmt(x: Optional[float], spec: str) -> str:
    return "-" if x is None else format(x, spec)


def _mul(x: Optional[float], factor: float) -> Optional[float]:
    return None if x is None else x * factor


def print_table(rows: list[BenchRow], dtype: str, device: torch.device, out=sys.stdout) -> None:
    # a CPU reaches GFLOP/s, not TFLOP/s; the JSON always holds TFLOP/s
    unit, per_tflop = ("TF/s", 1.0) if device.type == "cuda" else ("GF/s", 1e3)
    print(f"\nbenchmark ({dtype}; ratio = sdpa ms / ours ms, > 1: flashforge faster; FLOPs as in PERF.md)",
          file=out)
    header = (f"{'case':<34} {'pass':<8} {'ours ms':>9} {'sdpa ms':>9} {'ratio':>6} {'ours ' + unit:>9} "
              f"{'sdpa ' + unit:>9}  {'sdpa':<7} {'rel diff':>8}")
    print(header, file=out)
    print("-" * len(header), file=out)
    for r in rows:
        print(f"{r.case.label:<34} {r.mode:<8} {_fmt(r.ours_ms, '9.3f')} {_fmt(r.sdpa_ms, '9.3f')} "
              f"{_fmt(r.to_json()['ratio'], '6.2f')} {_fmt(_mul(r.tflops(r.ours_ms), per_tflop), '9.1f')} "
              f"{_fmt(_mul(r.tflops(r.sdpa_ms), per_tflop), '9.1f')}  {r.sdpa_backend:<7} {_fmt(r.rel_diff, '8.1e')}"
              f"{'' if r.ok else '  FAIL ' + r.error}", file=out)


# ---------------------------------------------------------------------------------------------
# driver


def _environment(device: torch.device) -> dict:
    env = {"flashforge": flashforge.__version__, "torch": torch.__version__, "python": platform.python_version(),
           "device": str(device), "threads": torch.get_num_threads()}
    try:
        import triton
        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    if device.type == "cuda":
        env["device_name"] = torch.cuda.get_device_name(device)
        env["cuda"] = torch.version.cuda
    else:
        env["device_name"] = platform.processor() or platform.machine()
        env["cpus"] = os.cpu_count()
    return env


def _write_json(path: Optional[str], report: dict) -> None:
    if not path:
        return
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(report, f, indent=1)
    os.replace(tmp, path)


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
    _write_json(json_path, report)
    return failed == 0


def benchmark(device: torch.device, report: dict, json_path: Optional[str]) -> bool:
    rows: list[BenchRow] = []
    t0 = time.perf_counter()
    cases = bench_cases(device)
    for case in cases:
        rows += run_bench(case, device)
        report["bench"] = [r.to_json() for r in rows]
        _write_json(json_path, report)  # a run cut short still leaves what it measured
        print(f"  {case.label}: done ({time.perf_counter() - t0:.0f} s)", file=sys.stderr, flush=True)
    print_table(rows, cases[0].dtype, device)
    return all(r.ok for r in rows)


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m flashforge.bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", metavar="PATH", help="also write the results here as JSON")
    parser.add_argument("--device", choices=("cpu", "cuda"), help="default: cuda if available, else cpu")
    parser.add_argument("--check-only", action="store_true", help="run the self-check, skip the benchmark")
    args = parser.parse_args(argv)
    sys.stdout.reconfigure(line_buffering=True)  # keep stdout in step with stderr's progress lines

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and os.environ.get("TRITON_INTERPRET") == "1":
        print("warning: TRITON_INTERPRET=1 is set, so the Triton kernels run in the interpreter", file=sys.stderr)
    env = _environment(device)
    print("flashforge " + " ".join(f"{k}={v}" for k, v in env.items()))
    report: dict = {"environment": env, "check": [], "bench": []}

    check_ok = self_check(device, report, args.json)
    bench_ok = True if args.check_only else benchmark(device, report, args.json)
    report["ok"] = check_ok and bench_ok
    _write_json(args.json, report)
    if args.json:
        print(f"\nwrote {args.json}")
    print("\nRESULT: " + ("ok" if report["ok"] else "FAILED") +
          ("" if check_ok else " (self-check)") + ("" if bench_ok else " (benchmark)"))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
