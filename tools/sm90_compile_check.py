"""Compile the Triton attention kernels for sm_90 on a machine without a GPU.

The interpreter (TRITON_INTERPRET=1) runs kernels as numpy code and accepts
some programs the real compiler rejects.  This script runs the launchers on
CPU tensors with every kernel replaced by a recorder, then compiles each
recorded launch ahead of time for an H100/H200 target with Triton's bundled
ptxas: a kernel that would not compile on the GPU fails here.

    python tools/sm90_compile_check.py [--quick]
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import replace

os.environ.pop("TRITON_INTERPRET", None)  # the real compiler, not the interpreter

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402
from triton.experimental.gluon._runtime import GluonASTSource  # noqa: E402
from triton.runtime.jit import mangle_type  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from flashforge.ops.gluon import attention as gluon_launcher  # noqa: E402
from flashforge.ops.launch import launch_key  # noqa: E402
from flashforge.ops.params import AttnParams  # noqa: E402
from flashforge.ops.triton import attention as launchers  # noqa: E402
from flashforge.ops.triton import configs  # noqa: E402
from flashforge.ops.triton import kvcache  # noqa: E402
from flashforge.ops.rope_torch import RopeParams  # noqa: E402

_DTYPES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32", torch.float64: "fp64",
           torch.int32: "i32", torch.int64: "i64", torch.uint8: "u8", torch.int8: "i8", torch.bool: "i1"}
# shared memory a block may opt into, per compute capability
SMEM_LIMITS = {90: 232448, 80: 166912, 86: 101376, 89: 101376}
TARGET = GPUTarget("cuda", 90, 32)
SMEM_LIMIT = SMEM_LIMITS[90]


class Recorder:
    """Stands in for a JITFunction: `kernel[grid](*args, **kwargs)` records the launch."""

    def __init__(self, fn, log):
        self.fn, self.log = fn, log

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.log.append((self.fn, args, kwargs))
        return launch


def _signature(fn, args, kwargs):
    names = fn.arg_names
    values = dict(zip(names, args))
    values.update({k: v for k, v in kwargs.items() if k in names})
    options = {k: v for k, v in kwargs.items() if k not in names}
    if "num_warps" in kwargs:  # a Gluon kernel also reads it as a constexpr argument
        options["num_warps"] = kwargs["num_warps"]
    sig, consts, attrs = {}, {}, {}
    for i, name in enumerate(names):
        if name not in values and fn.params[i].is_constexpr and fn.params[i].has_default:
            values[name] = fn.params[i].default  # (a constexpr the launcher leaves at its default)
        v = values[name]
        if fn.params[i].is_constexpr:
            sig[name], consts[name] = "constexpr", v
        elif type(v) is int and v == 1 and not fn.params[i].do_not_specialize:
            # the JIT passes an int argument equal to 1 as a constant (a length of one key): the
            # kernel sees a Python int there, with no tensor methods
            sig[name], consts[name] = "constexpr", 1
            continue
        elif isinstance(v, torch.Tensor):
            sig[name] = "*" + _DTYPES[v.dtype]
            aligned = v.data_ptr() % 16 == 0
        elif type(v).__name__ == "TensorDescriptor":
            sig[name] = mangle_type(v)
            aligned = False
        elif isinstance(v, bool):
            sig[name] = "i1"
            aligned = False
        elif isinstance(v, int):
            sig[name] = "i32" if -2**31 <= v < 2**31 else "i64"
            aligned = v % 16 == 0
        elif isinstance(v, float):
            sig[name] = "fp32"
            aligned = False
        else:
            raise TypeError(f"{fn.__name__}: argument {name} of type {type(v).__name__}")
        if not fn.params[i].is_constexpr and aligned and not fn.params[i].do_not_specialize:
            # what the JIT tells the compiler on a GPU (16-byte aligned pointers, multiples of 16):
            # without it there is no vectorised or asynchronous (pipelined) load, and the shared
            # memory and register figures would not be the GPU's
            attrs[(i,)] = [["tt.divisibility", 16]]
    return sig, consts, options, attrs


def compile_all(log, found=None):
    """Compile each distinct recorded launch; returns the failures.  found: a list that gets one
    dict per compiled kernel (name, constexprs, smem, regs, stack) where given."""
    seen, failures = set(), []
    for fn, args, kwargs in log:
        if launch_key(args) is None:  # the launch cache (ops/launch.py) would not serve it
            failures.append((fn.__name__, {}, TypeError("an argument without a launch-cache rule")))
            print(f"FAIL {fn.__name__}: launch_key found an argument type it has no rule for", flush=True)
        if ONLY and ONLY not in fn.__name__:
            continue
        sig, consts, options, attrs = _signature(fn, args, kwargs)
        key = (fn.__name__, tuple(sorted(sig.items())), tuple(sorted((k, str(v)) for k, v in consts.items())),
               tuple(sorted(options.items())))
        if key in seen:
            continue
        seen.add(key)
        t0 = time.perf_counter()
        try:
            source = GluonASTSource if getattr(fn, "is_gluon", lambda: False)() else ASTSource
            kernel = triton.compile(source(fn, sig, consts, attrs), target=TARGET, options=options)
            if kernel.metadata.shared > SMEM_LIMIT:  # compiles, but the launch would fail on the GPU
                raise RuntimeError(f"needs {kernel.metadata.shared} B of shared memory; sm_{TARGET.arch} "
                                   f"gives a block at most {SMEM_LIMIT} B")
            ptx = kernel.asm["ptx"]
            _check_named_barrier_ids(ptx)
            mma = "wgmma" if "wgmma" in ptx else "mma" if "mma.sync" in ptx else "fma"
            res = _resources(kernel.asm["cubin"])
            if SASS_DIR:
                res += " " + _dump_sass(kernel.asm, fn.__name__, consts)
            if WGMMA_CHECK and mma == "wgmma" and source is GluonASTSource:
                res += " " + _wgmma_serialized(ptx)
            print(f"ok   {fn.__name__:28s} {time.perf_counter() - t0:5.1f}s {mma:5s} "
                  f"smem={kernel.metadata.shared:6d} {res} {_flags(consts)}", flush=True)
            if found is not None:
                nums = dict(re.findall(r"(\w+)=(\d+)", res))
                found.append(dict(name=fn.__name__, consts=_flags(consts), mma=mma, smem=kernel.metadata.shared,
                                  regs=int(nums.get("regs", -1)), stack=int(nums.get("stack", -1))))
        except Exception as e:  # report every failure, then exit non-zero
            failures.append((fn.__name__, consts, e))
            print(f"FAIL {fn.__name__}: {type(e).__name__}: {str(e)[:2000]}{_root_cause(e)}\n      {_flags(consts)}", flush=True)
    return failures


def _root_cause(e) -> str:
    # the innermost error of a chained CompilationError (the outer ones repeat the source)
    inner = e
    while inner.__cause__ is not None:
        inner = inner.__cause__
    return "" if inner is e else f"\n      cause: {type(inner).__name__}: {str(inner)[-1500:]}"


ONLY = ""  # --only: compile only the kernels whose name contains this
SASS_DIR = ""  # --sass: write each kernel's SASS there
WGMMA_CHECK = False  # --wgmma: ask ptxas, for each Gluon kernel, whether it serialized the wgmma pipeline


def _check_named_barrier_ids(ptx: str) -> None:
    """Triton's own named barriers (literal ids in the PTX) stay below the ids the kernels take
    for theirs (`flashforge.ops.gluon.named_barrier.FIRST_ID`, given as registers): a Triton
    that used more would make the two share a barrier, and the kernels hang or race."""
    from flashforge.ops.gluon.named_barrier import FIRST_ID
    ids = {int(i) for i in re.findall(r"\b(?:bar|barrier)\.(?:cta\.)?(?:sync|arrive|red\.\w+)(?:\.aligned)?\s+(\d+)", ptx)}
    clash = sorted(i for i in ids if i >= FIRST_ID.value)
    if clash:
        raise RuntimeError(f"Triton's PTX uses named barrier ids {clash}; flashforge's start at {FIRST_ID.value}")


def _wgmma_serialized(ptx: str) -> str:
    """"wgmma=ok", or "wgmma=SERIALIZED(<ptxas's reason>)": ptxas runs a kernel's warpgroup MMAs
    one at a time (each waited on before the next) where it cannot keep their registers (the
    accumulators, a register A operand) live, or where a register operand is redefined before its
    product retires.  Triton keeps ptxas's notes to itself, so the PTX goes through ptxas again.
    (The keys-by-queries dK/dV consumer was serialized until its wait named its register operands.)"""
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    with tempfile.TemporaryDirectory() as d:
        src = os.path.join(d, "k.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        try:
            out = subprocess.run([tool, f"-arch=sm_{TARGET.arch}a", "-v", src, "-o", os.path.join(d, "k.cubin")],
                                 capture_output=True, text=True, check=True).stderr
        except (OSError, subprocess.CalledProcessError):
            return "wgmma=?"
    why = re.search(r"wgmma.mma_async instructions are serialized due to (.*?) for the function", out)
    return f"wgmma=SERIALIZED({why.group(1)})" if why else "wgmma=ok"


def _dump_sass(asm: dict, name: str, consts) -> str:
    """The kernel's SASS into SASS_DIR (one file a variant, numbered in compile order), its PTX and
    TTGIR beside it (the same stem: where a SASS instruction came from), and its spill traffic: the
    LDL and STL instructions in it (a partition's own count shows in the file)."""
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(asm["cubin"])
        f.flush()
        try:
            sass = subprocess.run([tool, "-sass", f.name], capture_output=True, text=True, check=True).stdout
        except (OSError, subprocess.CalledProcessError):
            return "ldl=? stl=?"
    os.makedirs(SASS_DIR, exist_ok=True)
    # (numbered by the .sass files only: each variant also leaves its .ptx and .ttgir there)
    n = sum(f.endswith(".sass") for f in os.listdir(SASS_DIR))
    path = os.path.join(SASS_DIR, f"{n:03d}_{name}.sass")
    with open(path, "w") as out:
        out.write(f"// {_flags(consts)}\n{sass}")
    for kind in ("ptx", "ttgir"):
        with open(path[:-len(".sass")] + "." + kind, "w") as out:
            out.write(asm[kind])
    ldl, stl = (len(re.findall(rf"\b{op}\b", sass)) for op in ("LDL", "STL"))
    return f"ldl={ldl} stl={stl} sass={path}"


def _resources(cubin: bytes) -> str:
    """Registers per thread, stack frame and local-memory bytes of the compiled kernel, from the
    cuobjdump Triton ships.  Register spills go to the stack frame (STACK, per thread): a kernel
    with stack > 0 spills and runs far below its tile's speed.  (LOCAL counts only statically
    allocated local memory, 0 for Triton kernels: it said nothing about spills.)"""
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        try:
            out = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True, text=True,
                                 check=True).stdout
        except (OSError, subprocess.CalledProcessError):
            return "regs=?"
    regs, stack, local = (re.search(rf"{k}:(\d+)", out) for k in ("REG", "STACK", "LOCAL"))
    return (f"regs={regs.group(1) if regs else '?'} stack={stack.group(1) if stack else '?'} "
            f"local={local.group(1) if local else '?'}")


def _flags(consts):
    return " ".join(f"{k}={v}" for k, v in consts.items() if v not in (False, None) and not k.startswith("BLOCK"))


_KERNELS: dict = {}  # the real kernels, kept across record() calls (one per --arch)


def record_launches(log: list) -> None:
    """Replace every kernel the launchers call (portable and Gluon) by a Recorder into `log`."""
    for name in ("attn_fwd_kernel", "attn_fwd_combine_kernel", "attn_bwd_preprocess_kernel", "attn_bwd_dkdv_kernel",
                 "attn_bwd_dq_kernel", "attn_bwd_dmask_kernel", "attn_bwd_dq_cast_kernel"):
        setattr(launchers, name, Recorder(_KERNELS.setdefault(name, getattr(launchers, name)), log))
    kvcache.kvcache_append_kernel = Recorder(_KERNELS.setdefault("append", kvcache.kvcache_append_kernel), log)
    gluon = _KERNELS.setdefault("gluon_fwd", gluon_launcher._kernel())
    if gluon is not None:
        gluon_launcher._kernel = lambda: (Recorder(gluon[0], log), *gluon[1:])
        ws = _KERNELS.setdefault("gluon_ws", gluon_launcher._ws_kernel())
        gluon_launcher._ws_kernel = lambda: Recorder(ws, log)
        pers = _KERNELS.setdefault("gluon_persistent", gluon_launcher._persistent_kernel())
        gluon_launcher._persistent_kernel = lambda: Recorder(pers, log)
        ws_dq = _KERNELS.setdefault("gluon_ws_dq", gluon_launcher._ws_dq_kernel())
        gluon_launcher._ws_dq_kernel = lambda: Recorder(ws_dq, log)
        ws_kv = _KERNELS.setdefault("gluon_ws_dkdv", gluon_launcher._ws_dkdv_kernel())
        gluon_launcher._ws_dkdv_kernel = lambda: Recorder(ws_kv, log)
        half = _KERNELS.setdefault("gluon_halfdq", gluon_launcher._halfdq_dkdv_kernel())
        gluon_launcher._halfdq_dkdv_kernel = lambda: Recorder(half, log)
        wide = _KERNELS.setdefault("gluon_wide", gluon_launcher._wide_dkdv_kernel())
        gluon_launcher._wide_dkdv_kernel = lambda: Recorder(wide, log)
    gluon_bwd = _KERNELS.setdefault("gluon_bwd", gluon_launcher._bwd_kernels())
    if gluon_bwd is not None:
        gluon_launcher._bwd_kernels = lambda: tuple(Recorder(k, log) for k in gluon_bwd)


def record(quick: bool):
    log = []
    record_launches(log)
    launchers._interpreting = lambda q: False
    cap = divmod(TARGET.arch, 10)
    torch.cuda.get_device_capability = lambda device=None: cap  # the target, for the TMA path
    launchers._arch = lambda q: cap  # and for the tile table
    real_get = configs.get_config
    launchers.get_config = lambda kind, d, e, interpret, **kw: real_get(kind, d, e, False, **kw)

    def run(B=2, Sq=128, Sk=128, Hq=4, Hkv=2, D=64, dtype=torch.bfloat16, mask=None, bwd=True, lo=True, **kw):
        q = torch.randn(B, Sq, Hq, D, dtype=dtype)
        k = torch.randn(B, Sk, Hkv, D, dtype=dtype)
        v = torch.randn(B, Sk, Hkv, D, dtype=dtype)
        p = AttnParams(scale=0.1, **kw)
        # lse_lo: as a training step calls them (the forward writes it, the backward reads it);
        # lo=False as context parallelism's block calls do (the merged lse has no low part)
        lse_lo = torch.empty(q.shape[0], Hq, Sq, dtype=torch.float32) if lo else None
        o, lse = launchers.attention_forward(q, k, v, mask, p, lse_lo=lse_lo)
        if bwd:
            launchers.attention_backward(o, None, q, k, v, mask, o, lse, p, mask is not None and mask.is_floating_point(),
                                         lse_lo=lse_lo)

    run()
    run(window_right=0)
    run(Sq=64, Sk=1)  # one key: the JIT passes Sk as the constant 1
    run(Sq=64, Sk=1, window_right=0)
    run(D=256, dtype=torch.float16)  # the table's D = 256 (Gluon on sm_90; dV and dK in two launches)
    # sliding windows (Gluon on sm_90: HAS_WL, the right side folded into the offset)
    run(D=128, window_left=40, window_right=0)
    run(D=64, window_left=33, window_right=-1, dtype=torch.float16)
    run(D=256, window_left=50, window_right=16)
    # softcap and ALiBi (Gluon on sm_90: `scores.modified_score`), alone, together, with a window
    run(D=128, softcap=30.0, window_right=0)
    run(D=64, alibi_slopes=torch.rand(2, 4), window_left=50, window_right=0, dtype=torch.float16)
    for D in (64, 128):  # without lse_lo (the backward kernels' HAS_LO=False variants)
        run(D=D, window_right=0, lo=False)
        run(D=D, window_right=0, deterministic=True)  # (the dQ kernel where the table fuses dQ)
    run(D=128, window_right=0, dropout_p=0.1, seed=3)
    run(dropout_p=0.1, seed_tensor=torch.tensor(7))  # unseeded: the seed is read on the device
    # the forward with K/V through tensor descriptors (TMA), opt-in per tile config
    launchers.get_config = lambda kind, d, e, interpret, **kw: replace(real_get(kind, d, e, False, **kw), tma=kind == "fwd")
    run(bwd=False, window_right=0)
    run(D=128, bwd=False, mask=torch.randn(2, 1, 128, 128), dropout_p=0.1, seed=3)
    # warp-specialized key loop, with and without TMA (tile-config opt-ins, measured by the sweep)
    launchers.get_config = lambda kind, d, e, interpret, **kw: replace(real_get(kind, d, e, False, **kw), ws=kind == "fwd")
    run(D=128, bwd=False)
    launchers.get_config = lambda kind, d, e, interpret, **kw: replace(real_get(kind, d, e, False, **kw), ws=kind == "fwd",
                                                                 tma=kind == "fwd")
    run(D=128, bwd=False)  # (with a causal mask as well, triton 3.6 fails in its pass manager: not offered)
    # the sm_90 Gluon forward (opt-in per tile config), plain and causal, D = 64 and 128
    if TARGET.arch == 90:
        launchers.get_config = lambda kind, d, e, interpret, **kw: replace(
            real_get(kind, d, e, False, **kw), block_m=128, block_n=128, num_warps=8, gluon=True)
        for D in (64, 128):
            run(D=D, bwd=False)
            run(D=D, bwd=False, window_right=0, dtype=torch.float16)
        # the warp-specialized forward (a loader warp, two consumer warpgroups), with and without
        # ping-pong: plain, causal, window, softcap, ALiBi, packed
        record_ws(run, real_get)
        # the one-warpgroup forward with half / all of the unmasked tiles' exponentials on the FMA pipes
        for poly in (1, 2):
            launchers.get_config = lambda kind, d, e, interpret, poly=poly, **kw: replace(
                configs.gluon_config(d, e, kw.get("causal", False), cap), poly_exp2=poly) \
                if kind == "fwd" else real_get(kind, d, e, False, **kw)
            run(bwd=False)
            run(bwd=False, window_right=0, dtype=torch.float16)
        # the Gluon backward's variants (the table's own run above): one tile at a time, three-slot
        # rings, 32-query tiles (dK/dV), 128-key tiles (dQ), a one-slot V ring in the dQ kernel
        for over in (dict(overlap=False), dict(num_stages=3), dict(block_m=32), dict(block_m=32, num_stages=3),
                     dict(block_n=128), dict(v_stages=1, num_stages=3),
                     # two warpgroups per program: 128 resident keys (dK/dV) or queries (dQ)
                     dict(block_m=128, block_n=128, num_warps=8, overlap=False),
                     dict(block_m=64, block_n=128, num_warps=8, overlap=False),
                     # dQ inside the dK/dV kernel (FUSED_DQ), overlapped and one tile at a time
                     dict(fused_dq=True), dict(fused_dq=True, overlap=False, num_stages=3)):
            launchers.get_config = lambda kind, d, e, interpret, over=over, **kw: replace(
                configs.gluon_config(d, e, False, cap, kind) or configs.TileConfig(64, 64, 4, 2, gluon=True), **over) \
                if kind.startswith("bwd") else real_get(kind, d, e, False, **kw)
            for D in (64, 128):
                run(D=D, window_right=0)
        # the warp-specialized dQ kernel (tests/test_gluon_sm90.py's BWD_VARIANTS "...q-ws...")
        cu = torch.tensor([0, 150, 256], dtype=torch.int32)
        for pp in (False, True):
            ws_q = configs.TileConfig(128, 64, 4, 2, gluon=True, consumers=2, pingpong=pp)
            launchers.get_config = lambda kind, d, e, interpret, ws_q=ws_q, **kw: (
                ws_q if kind == "bwd_q" else real_get(kind, d, e, False, **kw))
            for D in (64, 128):
                run(D=D)
                run(D=D, window_left=40, window_right=0, softcap=20.0, dtype=torch.float16)
                run(D=D, window_right=0, lo=False, alibi_slopes=torch.rand(2, 4))
                run(B=1, Sq=256, Sk=256, D=D, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=150, max_seqlen_k=150,
                    window_right=0, offset_bottom_right=True)
        # the warp-specialized dK/dV kernel, dQ fused (BWD_VARIANTS "kv-ws-fused-...")
        for stages, shared, rs in ((2, False, False), (3, False, False), (2, True, False), (3, True, False),
                                   (2, False, True), (2, True, True)):
            ws_kv = configs.TileConfig(64, 128, 4, stages, gluon=True, consumers=2, fused_dq=True, shared_dq=shared,
                                       rs=rs)
            launchers.get_config = lambda kind, d, e, interpret, ws_kv=ws_kv, **kw: (
                ws_kv if kind == "bwd_kv" else real_get(kind, d, e, False, **kw))
            for D in (64, 128) if gluon_launcher.bwd_tiles_fit("bwd_kv", ws_kv, 128) else (64,):
                run(D=D)
                run(D=D, window_left=40, window_right=0, softcap=20.0, dtype=torch.float16)
                run(D=D, window_right=0, lo=False, alibi_slopes=torch.rand(2, 4))
                run(B=1, Sq=256, Sk=256, D=D, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=150, max_seqlen_k=150,
                    window_right=0, offset_bottom_right=True)
        # the half-dQ dK/dV kernel (each consumer half of every tile's dQ): 128-query tiles at D = 64,
        # 64 at D = 128, two and three stages, a tile's dQ part deferred to the next tile (overlap) or not
        for D, bm in ((64, 128), (128, 64)):
            for stages, ov in ((2, True), (3, True), (2, False)):
                ws_kv = configs.TileConfig(bm, 128, 4, stages, gluon=True, consumers=2, fused_dq=True, half_dq=True,
                                           overlap=ov)
                if not gluon_launcher.bwd_tiles_fit("bwd_kv", ws_kv, D):
                    continue
                launchers.get_config = lambda kind, d, e, interpret, ws_kv=ws_kv, **kw: (
                    ws_kv if kind == "bwd_kv" else real_get(kind, d, e, False, **kw))
                run(D=D)
                run(D=D, window_right=0)  # causal: the grid's masked training rows
                run(D=D, window_left=40, window_right=0, softcap=20.0, dtype=torch.float16)
                run(D=D, window_right=0, lo=False, alibi_slopes=torch.rand(2, 4))
                run(B=1, Sq=256, Sk=256, D=D, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=150, max_seqlen_k=150,
                    window_right=0, offset_bottom_right=True)
        # the wide dK/dV kernel (D = 256: the consumers split the head dim, dQ fused)
        wide = configs.TileConfig(64, 64, 4, 1, gluon=True, consumers=2, fused_dq=True, half_dq=True)
        launchers.get_config = lambda kind, d, e, interpret, **kw: (
            wide if kind == "bwd_kv" and d == 256 else real_get(kind, d, e, False, **kw))
        run(D=256)
        run(D=256, window_left=40, window_right=0, softcap=20.0, dtype=torch.float16)
        run(D=256, window_right=0, lo=False, alibi_slopes=torch.rand(2, 4))
        run(B=1, Sq=256, Sk=256, D=256, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=150, max_seqlen_k=150,
            window_right=0, offset_bottom_right=True)
        # D = 256's Gluon backward variants (tests/test_gluon_sm90.py's D256_BWD_VARIANTS)
        TC = configs.TileConfig
        for kv, dq in ((TC(32, 128, 8, 3, gluon=True, split_kv=True), TC(128, 32, 8, 2, gluon=True)),
                       (TC(32, 64, 4, 2, gluon=True, split_kv=True), TC(64, 32, 4, 3, gluon=True))):
            launchers.get_config = lambda kind, d, e, interpret, kv=kv, dq=dq, **kw: (
                kv if kind == "bwd_kv" else dq if kind == "bwd_q" else real_get(kind, d, e, False, **kw))
            run(D=256, window_right=0)
    launchers.get_config = lambda kind, d, e, interpret, **kw: real_get(kind, d, e, False, **kw)
    # packed (varlen) batches: the table's Gluon kernels through ragged descriptors on sm_90
    cu = torch.tensor([0, 150, 256], dtype=torch.int32)
    for D in (64, 128, 256):
        for causal in (dict(), dict(window_right=0, offset_bottom_right=True),
                       dict(window_left=70, window_right=0, offset_bottom_right=True)):
            run(B=1, Sq=256, Sk=256, D=D, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=150, max_seqlen_k=150,
                **causal)
    run(mask=torch.randn(2, 1, 128, 128), softcap=5.0)
    run(D=128, mask=torch.randn(2, 1, 128, 128), dropout_p=0.1, seed=5)  # the table's widest tiles, masked
    # the fused backward (dQ by atomics in the dK/dV kernel), opt-in per tile config
    launchers.get_config = lambda kind, d, e, interpret, **kw: replace(real_get(kind, d, e, False, **kw),
                                                                       fused_dq=kind == "bwd_kv")
    run(D=128, window_right=0)
    run(mask=torch.randn(2, 1, 128, 128), dropout_p=0.1, seed=3, softcap=5.0)
    # dV and dK in two launches (PART 1, 2), opt-in per tile config: with the table's tiles, and on
    # sm_90 with D = 256's 128-key tiles (benchmarks/tune/bwd256_sweep.py --compile-check: all candidates)
    launchers.get_config = lambda kind, d, e, interpret, **kw: replace(real_get(kind, d, e, False, **kw),
                                                                       split_kv=kind == "bwd_kv")
    run(window_right=0)
    if TARGET.arch == 90:
        launchers.get_config = lambda kind, d, e, interpret, **kw: (
            configs.TileConfig(16, 128, 8, 1, split_kv=True) if kind == "bwd_kv" and d > 128 else
            configs.TileConfig(128, 32, 8, 2) if kind == "bwd_q" and d > 128 else real_get(kind, d, e, False, **kw))
        run(D=256, window_right=0)
        run(D=256, dtype=torch.float16, mask=torch.randn(2, 1, 128, 128), dropout_p=0.1, seed=3, softcap=5.0)
    launchers.get_config = lambda kind, d, e, interpret, **kw: real_get(kind, d, e, False, **kw)
    if quick:
        return log
    run(D=40, mask=torch.rand(128, 128)[None, None] > 0.5, window_left=16, window_right=8)
    run(D=256, dtype=torch.float16, offset_tensor=torch.tensor([3, 5], dtype=torch.int32), window_right=0,
        alibi_slopes=torch.rand(2, 4))
    run(dtype=torch.float32, window_right=0)
    # int64 per-batch offsets, folded with the window sides inside the kernels (`load_offset`)
    run(offset_tensor=torch.tensor([2**40, -3]), window_left=4, window_right=0)
    run(D=128, mask=torch.randn(1, 4, 1, 128), dropout_p=0.2, seed=1)
    cu = torch.tensor([0, 50, 128], dtype=torch.int32)
    run(B=1, Sq=128, Sk=128, window_right=0, offset_bottom_right=True, cu_seqlens_q=cu, cu_seqlens_k=cu,
        max_seqlen_q=78, max_seqlen_k=78)
    # KV cache: paged, split, packed GQA (decode)
    B, Hq, Hkv, D, page = 4, 8, 2, 128, 64
    q = torch.randn(B, 1, Hq, D, dtype=torch.bfloat16)
    kc = torch.randn(16, page, Hkv, D, dtype=torch.bfloat16)
    p = AttnParams(scale=0.1, window_right=0, offset_tensor=torch.zeros(B, dtype=torch.int32),
                   seqlens_k=torch.full((B,), 100, dtype=torch.int32),
                   block_table=torch.zeros(B, 4, dtype=torch.int32), num_splits=3)
    launchers.attention_forward(q, kc, kc, None, p)
    rope = RopeParams(theta=10000.0, rotary_dim=64, interleaved=True)
    launchers.attention_forward(q, torch.randn(B, 256, Hkv, D, dtype=torch.bfloat16), kc[:B].clone(), None,
                                replace(p, block_table=None, num_splits=1, q_rope=rope))
    # D = 256, MQA, 256-row pages, split, queries x group past one tile (flash-attn's kvcache test):
    # crashed ptxas (exit -11) with the forward's tiles before D = 256 got its KV-cache entry
    q256, kc256 = torch.randn(2, 64, 6, 256, dtype=torch.float16), torch.randn(8, 256, 1, 256, dtype=torch.float16)
    launchers.attention_forward(q256, kc256, kc256, None, AttnParams(
        scale=0.0625, offset_bottom_right=True, seqlens_k=torch.full((2,), 100, dtype=torch.int32),
        block_table=torch.zeros(2, 4, dtype=torch.int32), num_splits=3))
    new = torch.randn(B, 1, Hkv, D, dtype=torch.bfloat16)
    kvcache.append(kc, kc, new, new, p.seqlens_k, p.block_table, rope)
    kvcache.append(kc[:B], kc[:B], new, new, p.seqlens_k, None, None)
    # int64 key counts (read as they are, clamped to the capacity in the kernels)
    launchers.attention_forward(q, kc, kc, None, replace(p, seqlens_k=p.seqlens_k.long(), seqlens_k_add=1))
    kvcache.append(kc, kc, new, new, p.seqlens_k.long(), p.block_table, None)
    return log


def record_ws(run, real_get):
    """The warp-specialized Gluon forward's variants (`WS_VARIANTS`)."""
    cu = torch.tensor([0, 150, 256], dtype=torch.int32)
    for i, over in enumerate(WS_VARIANTS.values()):
        launchers.get_config = lambda kind, d, e, interpret, over=over, **kw: (
            configs.TileConfig(**over) if kind == "fwd" else real_get(kind, d, e, False, **kw))
        # (the table's D = 128 entry runs every feature in `record`; where the tiles overflow shared
        # memory at D = 256 the launcher refuses them: `gluon.attention.forward_reason`)
        fits = gluon_launcher.ws_shared_bytes(configs.TileConfig(**over), 256) <= SMEM_LIMIT
        dims = (64,) if over["consumers"] == 3 else (64, 128, 256) if fits else (64, 128)  # (three: D = 64 only)
        for D in dims:
            run(D=D, bwd=False)
            run(D=D, bwd=False, window_left=40, window_right=0, dtype=torch.float16)
            if i == 0:
                run(D=D, bwd=False, softcap=30.0, alibi_slopes=torch.rand(2, 4), window_right=0, lo=False)
                run(B=1, Sq=256, Sk=256, D=D, bwd=False, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=150,
                    max_seqlen_k=150, window_right=0, offset_bottom_right=True)
    launchers.get_config = lambda kind, d, e, interpret, **kw: real_get(kind, d, e, False, **kw)


# the warp-specialized forward's tile variants beside the table's: those tests/test_gluon_sm90.py
# runs on the GPU (FWD_VARIANTS, D256_VARIANTS) and the ping-pong twins of the table's entries
_WS = dict(block_m=128, num_warps=4, gluon=True, consumers=2)
WS_VARIANTS = {
    "ws-n128-s2": dict(block_n=128, num_stages=2, **_WS),
    "ws-n128-s2-pingpong": dict(block_n=128, num_stages=2, pingpong=True, **_WS),
    "ws-n128-s3-v2-pingpong": dict(block_n=128, num_stages=3, v_stages=2, pingpong=True, **_WS),
    "ws-n64-s3-pingpong": dict(block_n=64, num_stages=3, pingpong=True, **_WS),
    "ws-n64-s2-pingpong": dict(block_n=64, num_stages=2, pingpong=True, **_WS),
    "ws-n32-s3": dict(block_n=32, num_stages=3, **_WS),
    # three consumers (192 rows, D = 64), with half the exponentials on the FMA pipes too
    "ws3-n64-s3": dict(block_m=192, block_n=64, num_stages=3, num_warps=4, gluon=True, consumers=3),
    "ws3-n128-s2": dict(block_m=192, block_n=128, num_stages=2, num_warps=4, gluon=True, consumers=3),
    "ws3-n64-s3-poly1": dict(block_m=192, block_n=64, num_stages=3, num_warps=4, gluon=True, consumers=3,
                             poly_exp2=1),
    # the persistent forward (one program an SM running several items): the table's D = 128 and
    # D = 64 long-call shapes
    "ws-n128-s2-pingpong-persistent": dict(block_n=128, num_stages=2, pingpong=True, persistent=True, **_WS),
    "ws3-n128-s2-persistent": dict(block_m=192, block_n=128, num_stages=2, num_warps=4, gluon=True, consumers=3,
                                   persistent=True),
}


def main():
    global TARGET, SMEM_LIMIT, WGMMA_CHECK, ONLY, SASS_DIR
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="only the common variants")
    ap.add_argument("--wgmma", action="store_true",
                    help="also ask ptxas whether each Gluon kernel's warpgroup MMAs run serialized (slower)")
    ap.add_argument("--arch", default="90",
                    help="comma-separated compute capabilities, e.g. 90,80,89 (default 90); each "
                         "compiles the variants its own tile table produces, against its shared-memory limit")
    ap.add_argument("--only", default="", help="compile only the kernels whose name contains this")
    ap.add_argument("--sass", default="", metavar="DIR",
                    help="write each compiled kernel's SASS into DIR and count its spill loads and stores")
    args = ap.parse_args()
    WGMMA_CHECK, ONLY, SASS_DIR = args.wgmma, args.only, args.sass
    failures = []
    for arch in (int(a) for a in args.arch.split(",")):
        if arch not in SMEM_LIMITS:
            ap.error(f"--arch {arch}: choose from {sorted(SMEM_LIMITS)}")
        TARGET, SMEM_LIMIT = GPUTarget("cuda", arch, 32), SMEM_LIMITS[arch]
        print(f"== sm_{arch} (shared memory limit {SMEM_LIMIT} B)", flush=True)
        failures += compile_all(record(args.quick))
    print(f"{len(failures)} failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
