"""Tile-config sweep of flashforge's Triton attention kernels (to fill flashforge/ops/triton/configs.py).

    PYTHONPATH=. python benchmarks/tune/sweep.py --head-dim 128 [--dtype bf16] [--causal] [--pass fwd|bwd|all]
                                            [--out DIR] [--top 5] [--quick] [--max-seconds 540]

For one (head dim, dtype, causal, pass) it times the kernels under each TileConfig candidate
(block_m, block_n, num_warps, num_stages), one kind at a time, overriding the table entry with
`flashforge.ops.triton.configs.set_config(kind, head_dim_bucket, elem_size, TileConfig(...))` and
restoring it afterwards.  Kinds: "fwd" (the forward kernel; timed: the forward), "bwd_kv" and
"bwd_q" (the two backward kernels; timed: the whole backward, `torch.autograd.grad(...,
retain_graph=True)` on one saved forward, so the other kernel's time is a constant offset).

Shape: PERF.md's grid at S = 4k: B = 16384 / S, H = 2048 / D, Sq = Sk = S.  TFLOP/s follow PERF.md:
forward 4*B*H*S^2*D (halved when causal), backward 2.5x that.  Every candidate's output (forward) or
dq, dk, dv (backward) is compared with the table config's (||x - ref|| / ||ref|| < 2e-2 for
bf16/fp16, 1e-3 for fp32): a config that compiles but computes something else is reported "wrong",
not ranked.  Configs that fail to compile or launch (out of shared memory, registers) are skipped
with their error.  Prints the best few per kind with the table entry to paste, and writes
DIR/sweep_D<D>_<dtype>_<causal|full>_<pass>.json.  Exit status 0; 2 without a CUDA GPU.
"""
from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import sys
import time
from dataclasses import asdict
from typing import Callable, Optional, Sequence

import torch

from flashforge.benchmark.environment import environment
from flashforge.benchmark.timing import Timing

KINDS = {"fwd": ("fwd",), "bwd": ("bwd_kv", "bwd_q"), "all": ("fwd", "bwd_kv", "bwd_q")}
# candidate axes per kind: block_m, block_n, num_warps, num_stages
GRID = {
    "fwd": ((64, 128), (32, 64, 128), (4, 8), (2, 3, 4)),
    "bwd_kv": ((16, 32, 64), (64, 128), (4, 8), (1, 2, 3)),
    "bwd_q": ((64, 128), (16, 32, 64), (4, 8), (1, 2, 3)),
}
QUICK_STAGES = {"fwd": (2, 3), "bwd_kv": (1, 2), "bwd_q": (1, 2)}
# --quick: the shapes that can win on sm90 (128-row forward tiles need 8 warps to hold
# their accumulators; 64-row ones run with 4), each with every pipelining depth
QUICK = {
    "fwd": [(bm, bn, w, st) for bm, w in ((128, 8), (64, 4)) for bn in (64, 128) for st in (2, 3, 4)],
    "bwd_kv": [(bm, bn, w, st) for bm in (32, 64) for bn in (64, 128) for w in (4, 8) for st in (1, 2, 3)],
    "bwd_q": [(bm, bn, w, st) for bm in (64, 128) for bn in (32, 64) for w in (4, 8) for st in (1, 2, 3)],
}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
TOL = {torch.bfloat16: 2e-2, torch.float16: 2e-2, torch.float32: 1e-3}


def head_dim_bucket(d: int) -> int:
    return 64 if d <= 64 else 128 if d <= 128 else 256


def shape(D: int, S: int = 4096, tokens: int = 16384, hidden: int = 2048) -> tuple:
    """(B, H) of PERF.md's grid: B * S = tokens, H * D = hidden (at least 1 each)."""
    return max(1, tokens // S), max(1, hidden // D)


def fwd_flops(B: int, H: int, S: int, D: int, causal: bool) -> float:
    f = 4.0 * B * H * S * S * D
    return f / 2 if causal else f


def candidates(kind: str, quick: bool = False, current=None) -> list:
    """Every TileConfig of the kind's grid (the current table entry first, added if missing)."""
    from flashforge.ops.triton.configs import TileConfig
    bm, bn, warps, stages = GRID[kind]
    shapes = QUICK[kind] if quick else list(itertools.product(bm, bn, warps, stages))
    out = [TileConfig(*c) for c in shapes]
    if kind == "fwd":  # each forward config also with K/V through TMA descriptors, and warp-specialized
        out += [TileConfig(*c, tma=True) for c in shapes]
        out += [TileConfig(*c, ws=True) for c in shapes]
        out += [TileConfig(*c, tma=True, ws=True) for c in shapes]
    if kind == "bwd_kv":  # each dK/dV config also fused with dQ (atomics; the dQ kernel skipped)
        out += [TileConfig(*c, fused_dq=True) for c in shapes]
    if current is not None:
        out = [current] + [c for c in out if c != current]
    return out


def parse_configs(text: str) -> list:
    """"128x128w8s3,64x64w4s3tma,64x128w8s3fdq,128x128w8s3poly1" -> TileConfigs (suffixes tma / ws /
    fdq (fused dQ) / skv (dV and dK in two launches) / poly1, poly2 (half or all of the forward's
    exponentials on the FMA pipes) / gluon (the sm_90 Gluon kernels; v1..v3: the V ring's slots;
    nopipe: the Gluon dK/dV kernel one query tile at a time) opt in)."""
    import re
    from flashforge.ops.triton.configs import TileConfig
    out = []
    for item in filter(None, (t.strip() for t in text.split(","))):
        m = re.fullmatch(r"(\d+)x(\d+)w(\d+)s(\d+)((?:tma|ws|fdq|skv|poly[12]|gluon|v[123]|nopipe)*)", item)
        if not m:
            raise ValueError(f"--configs: {item!r} is not like 128x64w8s3, 64x64w4s3tma, 128x64w8s3tmaws, "
                             f"64x128w8s3fdq (fused dQ), 128x128w8s3poly1 (exp2 on the FMA pipes) or "
                             f"128x128w8s2gluon (the sm_90 Gluon forward)")
        bm, bn, w, st, flags = m.groups()
        poly = re.search(r"poly([12])", flags)
        vs = re.search(r"v([123])", flags)
        out.append(TileConfig(int(bm), int(bn), int(w), int(st), tma="tma" in flags, ws="ws" in flags,
                              fused_dq="fdq" in flags, split_kv="skv" in flags,
                              poly_exp2=int(poly.group(1)) if poly else 0,
                              gluon="gluon" in flags, v_stages=int(vs.group(1)) if vs else 0,
                              overlap="nopipe" not in flags))
    return out


def table_line(kind: str, bucket: int, elem: int, cfg) -> str:
    tma = (", tma=True" if cfg.tma else "") + (", ws=True" if cfg.ws else "") + \
        (", fused_dq=True" if cfg.fused_dq else "") + (", split_kv=True" if cfg.split_kv else "") + \
        (f", poly_exp2={cfg.poly_exp2}" if cfg.poly_exp2 else "") + \
        (", gluon=True" if cfg.gluon else "") + (f", v_stages={cfg.v_stages}" if cfg.v_stages else "") + \
        (f", min_keys={cfg.min_keys}" if cfg.min_keys else "") + ("" if cfg.overlap else ", overlap=False")
    return (f'    ("{kind}", {bucket}, {elem}): TileConfig({cfg.block_m}, {cfg.block_n}, {cfg.num_warps}, '
            f'{cfg.num_stages}{tma}),')


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    if not bool(torch.isfinite(a).all()):
        return math.inf
    den = float(b.norm())
    return float((a - b).norm()) / den if den > 0 else float((a - b).norm())


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _short(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"[:200]


def sweep_kind(kind: str, runs: dict, cands: Sequence, bucket: int, elem: int, tol: float, flops: float,
               deadline: Optional[float], bench: Callable, log=print) -> list:
    """Time runs[kind] under each candidate; returns result dicts (the first is the table's config)."""
    from flashforge.ops.triton.configs import set_config
    run, reference = runs[kind]
    results = []
    for i, cfg in enumerate(cands):
        if deadline is not None and time.perf_counter() > deadline:
            results.append({"config": asdict(cfg), "ok": False, "error": "skipped: --max-seconds reached"})
            continue
        res = {"config": asdict(cfg), "ok": False, "error": "", "table": i == 0}
        t0 = time.perf_counter()
        try:
            set_config(kind, bucket, elem, cfg)
            out = run()
            _sync()
            errs = [rel_err(a, b) for a, b in zip(out, reference)]
            res["rel_err"] = max(errs)
            if not res["rel_err"] < tol:
                res["error"] = f"wrong: rel err {res['rel_err']:.2e} against the table config"
            else:
                res["ms"] = float(bench(run))
                res["tflops"] = flops / (res["ms"] * 1e-3) / 1e12
                res["ok"] = True
        except Exception as e:  # compile or launch failure (shared memory, registers): skip it
            res["error"] = _short(e)
            try:
                _sync()
            except Exception:
                pass
        finally:
            set_config(kind, bucket, elem, None)
        res["seconds"] = round(time.perf_counter() - t0, 1)
        results.append(res)
        c = cfg
        log(f"  {kind} {c.block_m:>3}x{c.block_n:<3} w{c.num_warps} s{c.num_stages}{' tma' if c.tma else ''}"
            f"{' ws' if c.ws else ''}{' fused-dq' if c.fused_dq else ''}{' split-kv' if c.split_kv else ''}{f' poly{c.poly_exp2}' if c.poly_exp2 else ''}{' gluon' if c.gluon else ''}{'' if c.overlap else ' nopipe'}{f' v{c.v_stages}' if c.v_stages else ''}: "
            + (f"{res['tflops']:.0f} TFLOP/s" if res["ok"] else res["error"]) + f" ({res['seconds']} s)")
    return results


_WORKER: dict = {}


def _worker_init(D: int, S: int, dtype_name: str, causal: bool) -> None:
    """A warm-up process: the sweep's inputs, built the same way (same seeds, same shapes,
    so the kernels compiled here are the ones the timing process loads from Triton's cache)."""
    dtype = DTYPES[dtype_name]
    B, H = shape(D, S)
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, do = (torch.randn(B, S, H, D, generator=g, device="cuda", dtype=dtype) for _ in range(4))
    _WORKER.update(q=q, k=k, v=v, do=do, causal=causal, bucket=head_dim_bucket(D),
                   elem=torch.tensor([], dtype=dtype).element_size())


def _worker_compile(job: tuple) -> tuple:
    """Run one (kind, config) once: compiles it into Triton's on-disk cache."""
    import flashforge
    from flashforge.ops.triton.configs import TileConfig, set_config
    kind, fields = job
    w = _WORKER
    try:
        set_config(kind, w["bucket"], w["elem"], TileConfig(**fields))
        if kind == "fwd":
            with torch.no_grad():
                flashforge.attention(w["q"], w["k"], w["v"], causal=w["causal"])
        else:
            leaves = [t.detach().clone().requires_grad_(True) for t in (w["q"], w["k"], w["v"])]
            o = flashforge.attention(*leaves, causal=w["causal"])
            torch.autograd.grad(o, leaves, w["do"])
        torch.cuda.synchronize()
        return job, ""
    except Exception as e:
        return job, _short(e)
    finally:
        set_config(kind, w["bucket"], w["elem"], None)


def warm_cache(jobs: list, workers: int, D: int, S: int, dtype_name: str, causal: bool, log=print) -> list:
    """Compile every (kind, config) in `workers` processes at once (compiling dominates a
    sweep; one GPU serves the single launches fine).  Returns [(job, error)] for failures."""
    import multiprocessing as mp
    t0 = time.perf_counter()
    ctx = mp.get_context("spawn")
    errors = []
    with ctx.Pool(workers, initializer=_worker_init, initargs=(D, S, dtype_name, causal)) as pool:
        for job, err in pool.imap_unordered(_worker_compile, jobs):
            if err:
                errors.append((job, err))
                log(f"  warm-up: {job[0]} {job[1]}: {err}")
    log(f"warm-up: compiled {len(jobs)} configs in {workers} processes in {time.perf_counter() - t0:.0f} s"
        f" ({len(errors)} failed)")
    return errors


def report(kind: str, results: list, bucket: int, elem: int, top: int) -> str:
    from flashforge.ops.triton.configs import TileConfig
    ok = sorted((r for r in results if r["ok"]), key=lambda r: -r["tflops"])
    base = next((r for r in results if r.get("table")), None)
    base_tf = base.get("tflops") if base else None
    lines = [f"{kind}: {len(ok)} of {len(results)} configs ran correctly"
             + (f"; table config {TileConfig(**base['config'])} = {base_tf:.0f} TFLOP/s" if base_tf else "")]
    for r in ok[:top]:
        c = r["config"]
        gain = f" ({r['tflops'] / base_tf:.2f}x table)" if base_tf else ""
        lines.append(f"  {c['block_m']:>3} x {c['block_n']:<3} warps {c['num_warps']} stages {c['num_stages']}"
                     f"{' tma' if c.get('tma') else ''}{' ws' if c.get('ws') else ''}"
                     f"{' fused-dq' if c.get('fused_dq') else ''}{' split-kv' if c.get('split_kv') else ''}{' poly%d' % c['poly_exp2'] if c.get('poly_exp2') else ''}{' gluon' if c.get('gluon') else ''}{'' if c.get('overlap', True) else ' nopipe'}{' v%d' % c['v_stages'] if c.get('v_stages') else ''}: "
                     f"{r['tflops']:6.0f} TFLOP/s  {r['ms']:.3f} ms{gain}")
    if ok:
        lines.append("  table entry: " + table_line(kind, bucket, elem, TileConfig(**ok[0]["config"])).strip())
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="sweep.py", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="\n\n".join(__doc__.split("\n\n")[1:]))
    p.add_argument("--head-dim", type=int, required=True)
    p.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    p.add_argument("--causal", action="store_true")
    p.add_argument("--pass", dest="pass_", default="all", choices=sorted(KINDS), help="fwd, bwd or all (default)")
    p.add_argument("--kinds", default="", help="comma-separated subset of fwd,bwd_kv,bwd_q (overrides --pass)")
    p.add_argument("--seqlen", type=int, default=4096)
    p.add_argument("--out", default=os.environ.get("OUT") or "bench_results")
    p.add_argument("--top", type=int, default=5)
    p.add_argument("--quick", action="store_true", help="fewer num_stages values")
    p.add_argument("--warmup", type=float, default=25.0)
    p.add_argument("--rep", type=float, default=100.0)
    p.add_argument("--max-seconds", type=float, default=540.0, help="stop trying configs after this (default 540)")
    p.add_argument("--jobs", type=int, default=min(12, os.cpu_count() or 1),
                   help="processes that compile the candidates before the (serial) timing; 1: no warm-up")
    p.add_argument("--configs", default="",
                   help="time only these candidates (with the table's), e.g. 128x128w8s3,64x64w4s3tma")
    p.add_argument("--write-configs", default="",
                   help="merge the best config of each kind into this JSON file ($FLASHFORGE_TILE_CONFIGS format)")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                   help="testing aid: cpu runs the PyTorch path (tile configs have no effect there)")
    args = p.parse_args(argv)
    if hasattr(sys.stdout, "reconfigure"):
        sys.stdout.reconfigure(line_buffering=True)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("sweep: no CUDA GPU here (torch.cuda.is_available() is False); the sweep times Triton kernels on a GPU.",
              file=sys.stderr)
        return 2
    kinds = tuple(k.strip() for k in args.kinds.split(",") if k.strip()) or KINDS[args.pass_]
    bad = [k for k in kinds if k not in GRID]
    if bad:
        print(f"sweep: unknown kind {bad}; choose from {', '.join(GRID)}", file=sys.stderr)
        return 2

    import flashforge
    from flashforge.ops.triton.configs import get_config

    t_start = time.perf_counter()
    deadline = t_start + args.max_seconds if args.max_seconds else None
    dtype = DTYPES[args.dtype]
    D, S = args.head_dim, args.seqlen
    B, H = shape(D, S)
    elem = torch.tensor([], dtype=dtype).element_size()
    bucket = head_dim_bucket(D)
    dev = torch.device(args.device)
    g = torch.Generator(device=dev).manual_seed(0)
    q, k, v, do = (torch.randn(B, S, H, D, generator=g, device=dev, dtype=dtype) for _ in range(4))
    flops = fwd_flops(B, H, S, D, args.causal)

    timing = Timing(args.warmup, args.rep)  # do_bench median; on the CPU a wall-clock median

    def bench(fn):
        return timing.ms(fn, dev)

    runs: dict = {}
    if "fwd" in kinds:
        def run_fwd():
            with torch.no_grad():
                return [flashforge.attention(q, k, v, causal=args.causal)]
        runs["fwd"] = (run_fwd, [t.detach() for t in run_fwd()])
    if any(kd.startswith("bwd") for kd in kinds):
        leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
        o = flashforge.attention(*leaves, causal=args.causal)  # one saved forward (table config)

        def run_bwd():
            return list(torch.autograd.grad(o, leaves, do, retain_graph=True))
        ref = [t.detach() for t in run_bwd()]
        for kd in kinds:
            if kd.startswith("bwd"):
                runs[kd] = (run_bwd, ref)
    _sync()

    env = environment(dev, vars(args))
    gpu = env.get("gpu", "cpu")
    label = f"D{D}_S{S}_{args.dtype}_{'causal' if args.causal else 'full'}_{args.pass_ if not args.kinds else '+'.join(kinds)}"
    print(f"sweep {label}: B={B} S={S} H={H} D={D} {args.dtype}{' causal' if args.causal else ''}; "
          f"{gpu} torch {torch.__version__} triton {env['triton']}")
    results: dict = {}
    summary = []
    arch = torch.cuda.get_device_capability(dev) if dev.type == "cuda" else (9, 0)  # which table is "current"
    if args.configs:
        given = parse_configs(args.configs)
        all_cands = {kind: [get_config(kind, D, elem, False, causal=args.causal, arch=arch)] + [c for c in given if c != get_config(kind, D, elem, False, causal=args.causal, arch=arch)]
                     for kind in kinds}
    else:
        all_cands = {kind: candidates(kind, args.quick, get_config(kind, D, elem, False, causal=args.causal, arch=arch)) for kind in kinds}
    if args.device == "cuda" and args.jobs > 1:
        jobs = [(kind, asdict(c)) for kind in kinds for c in all_cands[kind]]
        warm_cache(jobs, args.jobs, D, S, args.dtype, args.causal)
    for kind in kinds:
        current = get_config(kind, D, elem, False, causal=args.causal, arch=arch)
        cands = all_cands[kind]
        print(f"{kind}: {len(cands)} candidates (table: {current})", flush=True)
        kind_flops = flops if kind == "fwd" else 2.5 * flops
        results[kind] = sweep_kind(kind, runs, cands, bucket, elem, TOL[dtype], kind_flops, deadline, bench)
        summary.append(report("fwd_causal" if kind == "fwd" and args.causal else kind, results[kind], bucket, elem,
                              args.top))

    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"sweep_{label}.json")
    best = {kd: max((r for r in res if r["ok"]), key=lambda r: r["tflops"], default=None) for kd, res in results.items()}
    with open(path, "w") as f:
        json.dump({"shape": {"B": B, "S": S, "H": H, "D": D, "dtype": args.dtype, "causal": args.causal},
                   "environment": dict(env, gpu=gpu),
                   "flops_convention": "fwd 4*B*H*S*S*D (halved causal); bwd kinds time the whole backward, 2.5x",
                   "results": results, "best": {kd: (b["config"] if b else None) for kd, b in best.items()},
                   "seconds": round(time.perf_counter() - t_start, 1)}, f, indent=1)
    if args.write_configs:
        merged = {}
        if os.path.exists(args.write_configs):
            with open(args.write_configs) as f:
                merged = json.load(f)
        for kd, b in best.items():
            if b is not None:
                entry = "fwd_causal" if kd == "fwd" and args.causal else kd  # the table's causal forward key
                merged[f"{entry}/{bucket}/{elem}"] = b["config"]
        with open(args.write_configs, "w") as f:
            json.dump(merged, f, indent=1)
    print()
    print("\n\n".join(summary))
    print(f"\nwrote {path} ({time.perf_counter() - t_start:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
