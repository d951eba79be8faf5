"""Head dim 256 on sm_90: check, time and rank backward (and forward) tile candidates in one run.

    PYTHONPATH=. python benchmarks/tune/bwd256_sweep.py [--budget 180] [--out $OUT] [--jobs 12]
                                                       [--only NAME,...] [--no-fwd]
    PYTHONPATH=. python benchmarks/tune/bwd256_sweep.py --compile-check     # offline, no GPU

Candidates (CANDIDATES, FWD_CANDIDATES below) are selected through the tile table's override
hook, `configs.set_config(kind, 256, 2, TileConfig(...))` (bucket 256, 2-byte elements: bf16 and
fp16 alike), restored afterwards; configs.py is not edited.  For each candidate, in order:

1. check (fails loudly): o, dq, dk, dv (o only for a forward candidate) on small shapes that
   are no multiple of the tiles (CHECK: bf16 and fp16 S = 336, and bf16 causal GQA 4/2 at the odd
   S = 333; B = 2, D = 256) against flashforge.reference in float64: relative error norm below
   2e-2 and below 2x the table config's + 1e-3; deterministic=True twice gives equal bits.  At the
   timed shapes the gradients must match the table config's (rel. err < 2e-2).  A candidate
   that fails is printed WRONG, never timed, and the exit status is 1.
2. time (`triton.testing.do_bench`, median): bf16 S = 4k non-causal (B = 4, H = 8) and S = 16k
   causal (B = 1, H = 8), backward only (`autograd.grad` on one saved forward) and
   forward+backward; fp16 S = 4k non-causal, both.  Forward candidates: the forward only, on
   the two bf16 rows.  TFLOP/s by PERF.md: fwd = 4*B*H*S*S*D (halved causal), bwd = 2.5x,
   fwd+bwd = 3.5x.

Compiling dominates (a backward candidate is ~4 call variants x 4 kernels + the forward's, each
2-4 s to compile): a pool of --jobs spawned processes (one per candidate, all at once on 16
cores) runs every call of every candidate once first, so the Triton cache on disk serves the
timing process; its wait is capped at 55% of the budget.  --budget bounds the whole run:
candidates that would start past it are reported "skipped".  Prints a table and writes
$OUT/bwd256_sweep.json (with the table lines to paste for the best candidate).

--compile-check (no GPU): compiles every candidate for sm_90 with Triton's bundled ptxas
(tools/sm90_compile_check.py) over the features (plain, causal + GQA, fp16, float bias,
dropout, softcap + ALiBi, varlen) and prints registers and stack (spill) bytes per kernel.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from dataclasses import asdict, replace
from typing import Optional

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from sweep import parse_configs  # noqa: E402  (benchmarks/tune/sweep.py: "16x128w8s2skv" -> TileConfig)

D = 256
BUCKET, ELEM = 256, 2
# name -> {kind: config spec}; the first is the table (as configs.py has it).  "stack" notes the
# spill bytes the offline compile check found (sm_90, D = 256, bf16, plain call), kernel by kernel.
CANDIDATES = [
    # table: dK/dV 16 x 64 (8 warps: both warpgroups compute the same 64-key q k^T, and dK + dV
    # hold 128 registers a thread), dQ 64 x 32 (the same duplication); both spill (504 / 296 B)
    ("table", {}),
    # dQ only: 128 resident queries over two warpgroups (no duplicated product), 2 stages; 241 regs, 0 B
    ("q128", {"bwd_q": "128x32w8s2"}),
    # dV, dK in two launches (split_kv), 128 resident keys each, one float32 accumulator (128 regs)
    ("skv16s2", {"bwd_kv": "16x128w8s2skv", "bwd_q": "128x32w8s2"}),      # 238 / 243 regs, 0 B
    ("skv32s1", {"bwd_kv": "32x128w8s1skv", "bwd_q": "128x32w8s2"}),      # 255 / 255, 0 B
    ("skv16s1", {"bwd_kv": "16x128w8s1skv", "bwd_q": "128x32w8s2"}),      # 252 / 255, 0 B
    ("skv16s3", {"bwd_kv": "16x128w8s3skv", "bwd_q": "128x32w8s2"}),      # 255 / 255, 0 B
    ("skv16s2-q16", {"bwd_kv": "16x128w8s2skv", "bwd_q": "128x16w8s3"}),  # dQ 221 regs, 0 B
    ("skv32s1-q16", {"bwd_kv": "32x128w8s1skv", "bwd_q": "128x16w8s2"}),  # dQ 211 regs, 0 B
    # dQ by atomics in the dK launch (no dQ kernel: 6 products a tile pair instead of 8); its dK
    # launch spills 8 B (the only candidate that does), measured for the atomics' cost
    ("skv16s1-fdq", {"bwd_kv": "16x128w8s1skvfdq", "bwd_q": "128x32w8s2"}),
]
# forward: the table's 64 x 32 (4 warps) against 128-query tiles over two warpgroups; all 0 B
FWD_CANDIDATES = [
    ("fwd-table", {}),
    ("fwd128x32s2", {"fwd": "128x32w8s2"}),        # 238 regs
    ("fwd128x32s3", {"fwd": "128x32w8s3"}),        # 255
    ("fwd128x32s2tma", {"fwd": "128x32w8s2tma"}),  # 233
    ("fwd128x32s3tma", {"fwd": "128x32w8s3tma"}),  # 227
    ("fwd64x32s3tma", {"fwd": "64x32w4s3tma"}),    # 252
]
# the check's calls: (tag, dtype, B, S, Hq, Hkv, causal).  S = 336: not a multiple of any tile (the
# masked edge tiles run) but, like the timed rows' lengths, of 16 -- Triton compiles one kernel
# for both (a length's divisibility by 16 is part of the specialization), so the check costs no
# compile of its own; the causal GQA call at S = 333 does (odd length, two query heads a kv head)
CHECK = [
    ("bf16", torch.bfloat16, 2, 336, 2, 2, False),
    ("bf16 causal gqa S333", torch.bfloat16, 2, 333, 4, 2, True),
    ("fp16", torch.float16, 2, 336, 2, 2, False),
]
ROWS = [  # (name, dtype, B, H, S, causal)
    ("bf16 S4k", torch.bfloat16, 4, 8, 4096, False),
    ("bf16 S16k causal", torch.bfloat16, 1, 8, 16384, True),
    ("fp16 S4k", torch.float16, 4, 8, 4096, False),
]
FWD_ROWS = ROWS[:2]
TOL = 2e-2
DEV = "cuda"
CALL_KW: dict = {}  # --cpu-smoke: backend="triton" (the interpreter)


def configs_of(spec: dict) -> dict:
    return {kind: parse_configs(text)[0] for kind, text in spec.items()}


def apply(spec: dict) -> None:
    from flashforge.ops.triton.configs import set_config
    for kind in ("fwd", "bwd_kv", "bwd_q"):
        set_config(kind, BUCKET, ELEM, None)
    for kind, cfg in configs_of(spec).items():
        set_config(kind, BUCKET, ELEM, cfg)


def short(c) -> str:
    """A TileConfig as sweep.parse_configs reads it: 16x128w8s1skv."""
    return (f"{c.block_m}x{c.block_n}w{c.num_warps}s{c.num_stages}" + ("tma" if c.tma else "")
            + ("skv" if c.split_kv else "") + ("fdq" if c.fused_dq else ""))


def fwd_flops(B, H, S, causal):
    f = 4.0 * B * H * S * S * D
    return f / 2 if causal else f


def sync() -> None:
    if DEV == "cuda":
        torch.cuda.synchronize()


def smoke() -> None:
    """--cpu-smoke: tiny shapes through the interpreter (TRITON_INTERPRET=1 must be set before start)."""
    global DEV, ROWS, FWD_ROWS
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("--cpu-smoke needs TRITON_INTERPRET=1 in the environment")
    DEV = "cpu"
    CALL_KW["backend"] = "triton"
    # (float16 throughout: the interpreter's bfloat16 is not faithful, tests/test_extreme_logits.py)
    CHECK[:] = [(t, torch.float16, 1, 21 if c else 32, hq, hkv, c) for t, dt, _, _, hq, hkv, c in CHECK]
    ROWS = [(n, torch.float16, 1, 1, 32, c) for n, dt, _, _, _, c in ROWS]
    FWD_ROWS = ROWS[:2]


def rel_err(a, b) -> float:
    a, b = a.double(), b.double()
    if not bool(torch.isfinite(a).all()):
        return math.inf
    den = float(b.norm())
    return float((a - b).norm()) / den if den > 0 else float((a - b).norm())


class Inputs:
    """Every tensor the calls need, made the same way in each process (seeded)."""

    def __init__(self):
        dev = DEV
        g = torch.Generator(device=dev).manual_seed(0)
        self.check = {}
        for tag, dtype, B, S, Hq, Hkv, causal in CHECK:
            q, do = (torch.randn(B, S, Hq, D, generator=g, device=dev).to(dtype) for _ in range(2))
            k, v = (torch.randn(B, S, Hkv, D, generator=g, device=dev).to(dtype) for _ in range(2))
            self.check[tag] = (q, k, v, do)
        self.rows = {}
        for name, dtype, B, H, S, causal in ROWS:
            self.rows[name] = tuple(torch.randn(B, S, H, D, generator=g, device=dev, dtype=dtype) for _ in range(4))


def grads(q, k, v, do, causal, **kw):
    import flashforge
    leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
    o = flashforge.attention(*leaves, causal=causal, **kw, **CALL_KW)
    return [o.detach()] + list(torch.autograd.grad(o, leaves, do))


def check_calls(inp: Inputs, fwd_only: bool = False) -> dict:
    """The check's outputs: {tag: [o, dq, dk, dv]}, and "det": two deterministic=True runs of the
    causal GQA call."""
    import flashforge
    out = {}
    for tag, dtype, B, S, Hq, Hkv, causal in CHECK:
        q, k, v, do = inp.check[tag]
        if fwd_only:
            with torch.no_grad():
                out[tag] = [flashforge.attention(q, k, v, causal=causal, **CALL_KW)]
        else:
            out[tag] = grads(q, k, v, do, causal)
    if not fwd_only:
        q, k, v, do = inp.check[CHECK[1][0]]
        out["det"] = [grads(q, k, v, do, True, deterministic=True) for _ in range(2)]
    return out


def row_calls(inp: Inputs, fwd_only: bool = False, rows=None) -> dict:
    import flashforge
    out = {}
    for name, dtype, B, H, S, causal in ROWS if rows is None else rows:
        q, k, v, do = inp.rows[name]
        if fwd_only:
            with torch.no_grad():
                out[name] = [flashforge.attention(q, k, v, causal=causal, **CALL_KW)]
        else:
            out[name] = grads(q, k, v, do, causal)[1:]
    return out


def reference64(inp: Inputs) -> dict:
    from flashforge import reference
    ref = {}
    for tag, dtype, B, S, Hq, Hkv, causal in CHECK:
        q, k, v, do = (t.double() for t in inp.check[tag])
        leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
        o = reference.attention(*leaves, causal=causal)
        ref[tag] = [o.detach()] + list(torch.autograd.grad(o, leaves, do))
    return ref


# ---------------------------------------------------------------- warm-up processes
_W: dict = {}


def _worker_init(smoke_test: bool):
    if smoke_test:
        smoke()
    _W["inp"] = Inputs()


def _worker_job(job):
    section, name, spec = job
    t0 = time.perf_counter()
    try:
        apply(spec)
        fwd_only = section == "fwd"
        check_calls(_W["inp"], fwd_only)
        row_calls(_W["inp"], fwd_only, FWD_ROWS if fwd_only else ROWS)
        sync()
        return name, "", time.perf_counter() - t0
    except Exception as e:
        return name, f"{type(e).__name__}: {str(e).strip().splitlines()[0][:300] if str(e).strip() else ''}", \
            time.perf_counter() - t0
    finally:
        apply({})


def warm(jobs, workers: int, wait_s: float, log=print) -> dict:
    """Run every job once in `workers` spawned processes (compiles into Triton's disk cache);
    stops waiting after wait_s (the rest then compiles in the timing process).  {name: error}."""
    import multiprocessing as mp
    t0 = time.perf_counter()
    errors = {}
    pool = mp.get_context("spawn").Pool(workers, initializer=_worker_init, initargs=(DEV == "cpu",))
    try:
        it = pool.imap_unordered(_worker_job, jobs)
        for _ in jobs:
            left = wait_s - (time.perf_counter() - t0)
            if left <= 0:
                log(f"warm-up: stopped waiting after {wait_s:.0f} s")
                break
            try:
                name, err, sec = it.next(timeout=left)
            except mp.TimeoutError:
                log(f"warm-up: stopped waiting after {wait_s:.0f} s")
                break
            log(f"  warm-up {name}: {sec:.0f} s" + (f" ERROR {err}" if err else ""))
            if err:
                errors[name] = err
    finally:
        pool.terminate()
        pool.join()
    log(f"warm-up: {len(jobs)} jobs in {workers} processes, {time.perf_counter() - t0:.0f} s")
    return errors


# ---------------------------------------------------------------- the run on the GPU
def run(args) -> int:
    import flashforge
    from flashforge.benchmark.timing import Timing
    from flashforge.ops.triton.configs import get_config

    t_start = time.perf_counter()
    deadline = t_start + args.budget
    only = set(filter(None, args.only.split(",")))
    bwd = [c for c in CANDIDATES if not only or c[0] in only or c[0] == "table"]
    fwd = [] if args.no_fwd else [c for c in FWD_CANDIDATES if not only or c[0] in only or c[0] == "fwd-table"]
    device_name = torch.cuda.get_device_name() if DEV == "cuda" else "cpu (smoke test: the interpreter's tiles)"
    print(f"bwd256_sweep: {len(bwd)} backward, {len(fwd)} forward candidates; budget {args.budget:.0f} s; "
          f"{device_name} torch {torch.__version__}", flush=True)
    jobs = [("bwd", n, s) for n, s in bwd] + [("fwd", n, s) for n, s in fwd]
    if args.jobs > 1:
        warm(jobs, min(args.jobs, len(jobs)), 0.55 * args.budget)
    inp = Inputs()
    ref = reference64(inp)
    timing = Timing(args.warmup, args.rep)
    dev = torch.device(DEV)
    results, wrong = [], []
    base_err, base_rows = {}, {}
    per_cand = [0.0]

    def over_budget():
        return time.perf_counter() + max(per_cand) > deadline

    for section, cands in (("bwd", bwd), ("fwd", fwd)):
        fwd_only = section == "fwd"
        for name, spec in cands:
            res = {"name": name, "section": section, "configs": {k: asdict(c) for k, c in configs_of(spec).items()},
                   "ok": False}
            results.append(res)
            if over_budget():
                res["error"] = "skipped: --budget"
                print(f"{name:14s} skipped (budget)", flush=True)
                continue
            t0 = time.perf_counter()
            try:
                apply(spec)
                res["tiles"] = " ".join(f"{k}={short(get_config(k, D, ELEM, False, causal=False, arch=(9, 0)))}"
                                        for k in (("fwd",) if fwd_only else ("bwd_kv", "bwd_q")))
                out = check_calls(inp, fwd_only)
                errs, problems = {}, []
                for key, got in out.items():
                    if key == "det":
                        continue
                    for label, a, b in zip(("o", "dq", "dk", "dv"), got, ref[key]):
                        e = rel_err(a, b)
                        tag = f"{key} {label}"
                        errs[tag] = e
                        base = base_err.get((section, tag))
                        limit = TOL if base is None else min(TOL, 2 * base + 1e-3)
                        if not e < limit:
                            problems.append(f"{tag} rel err {e:.2e} (limit {limit:.2e})")
                if "det" in out and not all(torch.equal(a, b) for a, b in zip(*out["det"])):
                    problems.append("deterministic=True: two runs differ")
                res["check_rel_err"] = errs
                rows_out = row_calls(inp, fwd_only, FWD_ROWS if fwd_only else ROWS)
                sync()
                for row, got in rows_out.items():
                    if (section, row) in base_rows:
                        for label, a, b in zip(("o",) if fwd_only else ("dq", "dk", "dv"), got,
                                               base_rows[(section, row)]):
                            e = rel_err(a, b)
                            if not e < TOL:
                                problems.append(f"{row} {label}: rel err {e:.2e} against the table config's")
                    elif name in ("table", "fwd-table"):
                        base_rows[(section, row)] = got
                if name in ("table", "fwd-table"):
                    base_err.update({(section, t): e for t, e in errs.items()})
                if problems:
                    res["error"] = "WRONG: " + "; ".join(problems)
                    wrong.append(name)
                    print(f"{name:14s} WRONG\n    " + "\n    ".join(problems), flush=True)
                    continue
                del rows_out
                res["rows"] = {}
                for row, dtype, B, H, S, causal in (FWD_ROWS if fwd_only else ROWS):
                    q, k, v, do = inp.rows[row]
                    f = fwd_flops(B, H, S, causal)
                    r = res["rows"][row] = {}
                    if fwd_only:
                        def call(q=q, k=k, v=v, causal=causal):
                            with torch.no_grad():
                                flashforge.attention(q, k, v, causal=causal, **CALL_KW)
                        r["fwd_ms"] = timing.ms(call, dev)
                        r["fwd_tflops"] = f / r["fwd_ms"] / 1e9
                        continue
                    leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
                    o = flashforge.attention(*leaves, causal=causal, **CALL_KW)

                    def bwd_call(o=o, leaves=leaves, do=do):
                        torch.autograd.grad(o, leaves, do, retain_graph=True)

                    def fwdbwd_call(leaves=leaves, do=do, causal=causal):
                        torch.autograd.grad(flashforge.attention(*leaves, causal=causal, **CALL_KW), leaves, do)
                    r["bwd_ms"] = timing.ms(bwd_call, dev)
                    r["bwd_tflops"] = 2.5 * f / r["bwd_ms"] / 1e9
                    del o
                    r["fwdbwd_ms"] = timing.ms(fwdbwd_call, dev)
                    r["fwdbwd_tflops"] = 3.5 * f / r["fwdbwd_ms"] / 1e9
                res["ok"] = True
            except Exception as e:  # compile / launch failure: reported, the rest go on
                res["error"] = f"{type(e).__name__}: {str(e).strip()[:400]}"
                print(f"{name:14s} FAILED {res['error']}", flush=True)
                try:
                    sync()
                except Exception:
                    pass
            finally:
                apply({})
                res["seconds"] = round(time.perf_counter() - t0, 1)
                per_cand.append(min(res["seconds"], 60.0))
            if res["ok"]:
                cells = "  ".join(
                    (f"{row}: fwd {v['fwd_tflops']:4.0f}" if fwd_only else
                     f"{row}: bwd {v['bwd_tflops']:4.0f} f+b {v['fwdbwd_tflops']:4.0f}") for row, v in res["rows"].items())
                print(f"{name:14s} {cells}  ({res['seconds']} s; max check err {max(errs.values()):.1e})", flush=True)

    # summary: ranked by the bf16 fwd+bwd geomean of the two rows (forward: the forward's)
    def score(r):
        key = "fwd_tflops" if r["section"] == "fwd" else "fwdbwd_tflops"
        vals = [r["rows"][row][key] for row, *_ in FWD_ROWS]
        return math.exp(sum(map(math.log, vals)) / len(vals))

    from sweep import table_line
    best = {}
    print("\nTFLOP/s (PERF.md: fwd 4BHS^2D, halved causal; bwd 2.5x; fwd+bwd 3.5x)")
    for section in ("bwd", "fwd"):
        ok = sorted((r for r in results if r["ok"] and r["section"] == section), key=score, reverse=True)
        if not ok:
            continue
        if section == "bwd":
            print(f"{'candidate':14s} | " + " | ".join(f"{row} bwd / f+b" for row, *_ in ROWS) + " | tiles")
        else:
            print(f"{'candidate':14s} | " + " | ".join(f"{row} fwd" for row, *_ in FWD_ROWS) + " | tiles")
        for r in ok:
            if section == "bwd":
                cells = " | ".join(f"{r['rows'][row]['bwd_tflops']:5.0f} / {r['rows'][row]['fwdbwd_tflops']:5.0f}"
                                   for row, *_ in ROWS)
            else:
                cells = " | ".join(f"{r['rows'][row]['fwd_tflops']:5.0f}" for row, *_ in FWD_ROWS)
            print(f"{r['name']:14s} | {cells} | {r['tiles']}")
        best[section] = ok[0]
        lines = [table_line(k, BUCKET, ELEM, parse_configs(s)[0]).strip()
                 for k, s in dict(CANDIDATES + FWD_CANDIDATES)[ok[0]["name"]].items()]
        best[section + "_table_lines"] = lines
        print(f"best {section}: {ok[0]['name']}" + ("".join("\n    " + x for x in lines) if lines else " (the table)"))
    for r in results:
        if not r["ok"]:
            print(f"{r['name']}: {r.get('error', '')}")
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "bwd256_sweep.json")
    with open(path, "w") as f:
        json.dump({"device": device_name, "torch": torch.__version__,
                   "flops_convention": "fwd 4*B*H*S*S*D (halved causal); bwd 2.5x; fwd+bwd 3.5x",
                   "check": [[t, str(dt), B, S, hq, hkv, c] for t, dt, B, S, hq, hkv, c in CHECK],
                   "results": results,
                   "best": {k: (v["name"] if isinstance(v, dict) else v) for k, v in best.items()},
                   "seconds": round(time.perf_counter() - t_start, 1)}, f, indent=1)
    print(f"\nwrote {path} ({time.perf_counter() - t_start:.0f} s)" + (f"; WRONG: {wrong}" if wrong else ""))
    return 1 if wrong else 0


# ---------------------------------------------------------------- offline: compile for sm_90
def compile_check(args) -> int:
    """Each candidate's kernels over the features, compiled for sm_90 without a GPU."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tools"))
    import sm90_compile_check as cc
    from flashforge.ops.params import AttnParams
    from flashforge.ops.triton import attention as launchers
    from flashforge.ops.triton import configs

    log: list = []
    for kname in ("attn_fwd_kernel", "attn_bwd_preprocess_kernel", "attn_bwd_dkdv_kernel", "attn_bwd_dq_kernel",
                  "attn_bwd_dmask_kernel"):
        setattr(launchers, kname, cc.Recorder(getattr(launchers, kname), log))
    launchers._interpreting = lambda q: False
    torch.cuda.get_device_capability = lambda device=None: (9, 0)
    launchers._arch = lambda q: (9, 0)
    real_get = configs.get_config
    launchers.get_config = lambda kind, d, e, interpret, **kw: real_get(kind, d, e, False, **kw)

    def call(B=2, S=128, Hq=4, Hkv=2, dtype=torch.bfloat16, mask=None, fwd_only=False, **kw):
        q = torch.randn(B, S, Hq, D, dtype=dtype)
        k, v = torch.randn(B, S, Hkv, D, dtype=dtype), torch.randn(B, S, Hkv, D, dtype=dtype)
        p = AttnParams(scale=0.0625, **kw)
        lse_lo = torch.empty(B, Hq, S)
        o, lse = launchers.attention_forward(q, k, v, mask, p, lse_lo=lse_lo)
        if not fwd_only:
            launchers.attention_backward(o, None, q, k, v, mask, o, lse, p, mask is not None, lse_lo=lse_lo)

    cu = torch.tensor([0, 50, 128], dtype=torch.int32)
    features = {
        "plain": dict(Hkv=4),
        "causal-gqa": dict(window_right=0),
        "fp16": dict(dtype=torch.float16, Hkv=4),
        "bias": dict(mask=torch.randn(2, 1, 128, 128), Hkv=4),
        "dropout": dict(dropout_p=0.1, seed=3, window_right=0),
        "softcap-alibi": dict(softcap=5.0, alibi_slopes=torch.rand(2, 4), window_left=20, window_right=3),
        "varlen": dict(B=1, window_right=0, offset_bottom_right=True, cu_seqlens_q=cu, cu_seqlens_k=cu,
                       max_seqlen_q=78, max_seqlen_k=78),
    }
    if args.features:
        features = {k: v for k, v in features.items() if k in args.features.split(",")}
    only = set(filter(None, args.only.split(",")))
    cands = [("bwd", n, s) for n, s in CANDIDATES] + [("fwd", n, s) for n, s in FWD_CANDIDATES]
    failures, summary = 0, []
    for section, name, spec in cands:
        if only and name not in only:
            continue
        apply(spec)
        stats = {}
        for feat, kw in features.items():
            log.clear()
            call(fwd_only=section == "fwd", **kw)
            keep = ("attn_fwd_kernel",) if section == "fwd" else ("attn_bwd_dkdv_kernel", "attn_bwd_dq_kernel",
                                                                   "attn_bwd_dmask_kernel")
            todo = [x for x in log if x[0].__name__ in keep]
            print(f"== {name} {feat}", flush=True)
            found: list = []
            failures += len(cc.compile_all(todo, found))
            for f in found:
                part = f" PART={f['consts'].split('PART=')[1].split()[0]}" if "PART=" in f["consts"] else ""
                stats.setdefault(f["name"].replace("attn_", "").replace("_kernel", "") + part, []).append(
                    (feat, f["regs"], f["stack"]))
        apply({})
        cells = "; ".join(f"{k}: regs<={max(r for _, r, _ in v)} stack<={max(s for *_, s in v)}"
                          + "".join(f" [{ft} {s} B]" for ft, _, s in v if s > 0) for k, v in stats.items())
        summary.append(f"{name:14s} {cells}")
    print("\nsummary (stack > 0: spills; features listed where they spill)\n" + "\n".join(summary))
    print(f"{failures} failed")
    return 1 if failures else 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="bwd256_sweep.py", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="\n\n".join(__doc__.split("\n\n")[1:]))
    p.add_argument("--budget", type=float, default=180.0,
                   help="seconds for the whole run, compiles included (a candidate started just before it may run ~60 s past)")
    p.add_argument("--out", default=os.environ.get("OUT") or "bench_results")
    p.add_argument("--jobs", type=int, default=max(1, (os.cpu_count() or 2) - 1),
                   help="warm-up processes, at most one per candidate (default: the cores less one); 1: none")
    p.add_argument("--only", default="", help="comma-separated candidate names (the tables' are always run)")
    p.add_argument("--no-fwd", action="store_true", help="skip the forward candidates")
    p.add_argument("--warmup", type=float, default=20.0, help="do_bench warm-up, ms")
    p.add_argument("--rep", type=float, default=80.0, help="do_bench repetition time, ms")
    p.add_argument("--compile-check", action="store_true", help="offline: compile the candidates for sm_90")
    p.add_argument("--features", default="", help="--compile-check: a subset of the features")
    p.add_argument("--cpu-smoke", action="store_true",
                   help="testing aid: the whole run on the CPU (Triton interpreter, tiny shapes; tiles have no effect)")
    args = p.parse_args(argv)
    if hasattr(sys.stdout, "reconfigure"):
        sys.stdout.reconfigure(line_buffering=True)
    if args.compile_check:
        os.environ.pop("TRITON_INTERPRET", None)
        return compile_check(args)
    if args.cpu_smoke:
        smoke()
        args.jobs = min(args.jobs, 2)
    elif not torch.cuda.is_available():
        print("bwd256_sweep: no CUDA GPU (use --compile-check offline)", file=sys.stderr)
        return 2
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
