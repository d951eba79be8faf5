"""Running cases on one device: the Runner warms up, checks and times (or measures the peak memory of) every
implementation of a case; the timing plan fits do_bench's warm-up and repetition times to a budget."""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time
import warnings
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch

from .cases import TOL, Case, throughput
from .impls import (Impl, Inputs, _Deferred, build_impls, finite_check, make_inputs, math_ref_bytes,
                    reference_order, rel_errors, sdpa_impl)
from .report import _short_error, make_row

MATH_REF_LIMIT = 48e9       # bytes of score matrices the float32 math reference may allocate


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
        if self.cudagraph and case.mode == "decode" and impl.name in ("ours", "ours_paged", "cudnn", "flash"):
            try:
                with impl.ctx():
                    st.extra.setdefault("cudagraph_gbps", {})[impl.name] = self._cudagraph(
                        case, self._timed_fn(impl, leaves, do, False))
            except Exception as e:
                st.extra.setdefault("cudagraph_errors", {})[impl.name] = _short_error(e)
            if impl.name == "ours":  # the floor of the same bytes, read by a kernel that only reads
                try:
                    from .read_floor import readers
                    st.extra.setdefault("cudagraph_gbps", {})["read"] = max(
                        self._cudagraph(case, fn) or 0.0 for fn in readers(inp.k, inp.v))
                except Exception as e:
                    st.extra.setdefault("cudagraph_errors", {})["read"] = _short_error(e)

    def _cudagraph(self, case: Case, fn: Callable) -> Optional[float]:
        """Throughput of fn replayed from a CUDA graph (`graph_ms`)."""
        ms = graph_ms(fn, self.device)
        return throughput(case, ms) if ms > 0 else None

    def _cleanup(self) -> None:
        if self.cuda:
            try:
                torch.cuda.synchronize(self.device)
            except Exception:
                pass
            torch.cuda.empty_cache()


def graph_ms(fn: Callable, device, n: int = 20, reps: int = 5) -> float:
    """Milliseconds per call of fn replayed from a CUDA graph, as a server's decoding loop runs
    it (no host work per call).  Each call follows an L2 flush, as in do_bench; the flushes
    alone are captured and timed too, and subtracted: median over `reps` replays of n calls."""
    flush = torch.empty(256 * 2**20, dtype=torch.int8, device=device)

    def graph(with_fn: bool):
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(n):
                flush.zero_()
                if with_fn:
                    fn()
        return g

    def replay_ms(g) -> float:
        times = []
        for _ in range(reps):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            g.replay()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b))
        return sorted(times)[len(times) // 2]

    with torch.no_grad():
        fn()  # compiled and warm before capture
        torch.cuda.synchronize(device)
        g_fn, g_flush = graph(True), graph(False)
        replay_ms(g_fn)
        return (replay_ms(g_fn) - replay_ms(g_flush)) / n
