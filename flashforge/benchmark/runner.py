"""Running cases on one device: the Runner warms up, checks and times (or measures the peak memory of)
every implementation of a case and turns the results into rows (report.make_row)."""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time
import warnings
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch

from .cases import Case
from .checks import MATH_REF_LIMIT, TOL, finite_check, math_ref_bytes, reference_order, rel_errors
from .flops import row_unit, throughput
from .impl import Deferred, Impl
from .inputs import Inputs, make_inputs
from .peers import build_impls, sdpa_impl
from .report import make_row, short_error
from .timing import Timing, graph_ms, peak_gib


@dataclass
class _CaseState:
    ref: Optional[list] = None
    ref_name: Optional[str] = None
    kept: dict = dataclasses.field(default_factory=dict)         # ours* outputs, checked at the end
    values: dict = dataclasses.field(default_factory=dict)       # name -> throughput or GiB
    ms: dict = dataclasses.field(default_factory=dict)
    errs: dict = dataclasses.field(default_factory=dict)         # peers' errors against the reference
    pending: dict = dataclasses.field(default_factory=dict)      # peers' outputs awaiting a late reference
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


@contextlib.contextmanager
def _threads(n: Optional[int]):
    """torch.set_num_threads(n) for the block (None: leave torch's setting)."""
    if not n:
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


class Runner:
    """Runs cases on one device: warm-up (and check) each implementation, then time it."""

    def __init__(self, device: torch.device, timing: Timing = Timing(), *, flex_compiled: bool = True,
                 flex_dynamic: Optional[bool] = None, skip: Sequence[str] = (), cudagraph: bool = False):
        self.device = device
        self.timing = timing
        self.flex_compiled, self.flex_dynamic = flex_compiled, flex_dynamic
        self.skip = tuple(skip)
        self.cudagraph = cudagraph

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def unit(self, case: Case) -> str:
        return row_unit(case, self.device.type)

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
    def run_or_report(self, case: Case) -> list:
        """run_case, where a harness bug or a dead CUDA context becomes a failed row instead of an
        exception, so that the cases after it still run (Ctrl-C still stops)."""
        try:
            return self.run_case(case)
        except Exception as e:
            self._cleanup()
            return [make_row(case, None, {n: None for n in case.peers}, ok=False, error="harness: " + short_error(e),
                             unit=self.unit(case))]

    def run_case(self, case: Case) -> list:
        """Warm up, check and time every implementation of a case; returns its rows (two for decode)."""
        with _threads(case.threads):
            return self._run_case(case)

    def _run_case(self, case: Case) -> list:
        t0 = time.perf_counter()
        inp = make_inputs(case, self.device)
        impls = build_impls(case, inp, self.device, flex_compiled=self.flex_compiled, flex_dynamic=self.flex_dynamic,
                            skip=self.skip)
        backward = case.backward
        order = reference_order(case)
        st = _CaseState()
        if "math" in order and not {i.name for i in impls} & set(order):
            self._math_reference(case, inp, st)  # first, so that every peer is checked against it
        for impl in impls:
            if impl.role == "ref" and st.ref is not None:
                continue
            self._run_impl(case, inp, impl, order, st)
            self._cleanup()
        if st.ref is None and "math" in order and "math" not in st.peer_errors:  # no peer could serve
            self._math_reference(case, inp, st)
        if st.ref is not None:
            st.errs.update({name: rel_errors(out, st.ref) for name, out in st.pending.items()})
        st.pending.clear()

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
                layout=None if case.mode != "decode" else ("contiguous" if oname == "ours" else "paged"),
                unit=self.unit(case)))
        del inp, impls, st
        self._cleanup()
        return rows

    def _math_reference(self, case: Case, inp: Inputs, st: _CaseState) -> None:
        """SDPA's math backend in float32 as the case's reference (unless its score matrices are too big)."""
        if math_ref_bytes(case) > MATH_REF_LIMIT:
            st.peer_errors["math"] = f"float32 math reference skipped: ~{math_ref_bytes(case) / 1e9:.0f} GB"
            return
        try:
            impl = sdpa_impl(case, inp, "math", float32=True)
            with impl.ctx():
                st.ref = self._call(impl, self._leaves(case, inp, impl), inp.do, case.backward)
            st.ref_name = "math"
        except Exception as e:
            st.peer_errors["math"] = short_error(e)
        self._cleanup()

    def _leaves(self, case: Case, inp: Inputs, impl: Impl) -> list:
        if impl.leaves is not None:
            return impl.leaves
        return inp.leaves(case) if case.backward else [inp.q, inp.k, inp.v]

    def _run_impl(self, case: Case, inp: Inputs, impl: Impl, order: Sequence[str], st: _CaseState) -> None:
        backward = case.backward
        role = impl.role
        # 1. set up and run once (compilation, autotuning, cuDNN plans), keeping what the check needs
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                if isinstance(impl, Deferred):
                    impl = impl.build()
                    impl.role = role
                leaves = self._leaves(case, inp, impl)
                do = impl.do if impl.leaves is not None else inp.do
                with impl.ctx():
                    out = self._call(impl, leaves, do, backward)
                self.sync()
            except Exception as e:
                st.fail(impl.name, role, short_error(e, caught))
                return
        if st.ref is None and impl.name in order:
            st.ref, st.ref_name = out, impl.name
        elif role == "ours":
            st.kept[impl.name] = out
        elif impl.leaves is None and st.ref is not None:
            st.errs[impl.name] = rel_errors(out, st.ref)
        elif impl.leaves is None:
            st.pending[impl.name] = out
        del out
        if role == "ref" or not impl.timed:
            return
        # 2. time it (or measure its peak memory)
        try:
            with impl.ctx(), (contextlib.nullcontext() if backward else torch.no_grad()):
                if case.mode == "memory":
                    gib, one_ms = peak_gib(self._timed_fn(impl, leaves, do, True), leaves, self.device)
                    st.values[impl.name], st.ms[impl.name] = gib, one_ms
                    st.extra.setdefault("tflops_one_run", {})[impl.name] = throughput(
                        dataclasses.replace(case, mode="fwdbwd"), one_ms)
                else:
                    st.ms[impl.name] = self.timing.ms(self._timed_fn(impl, leaves, do, backward), self.device,
                                                      leaves if backward else None)
                    st.values[impl.name] = throughput(case, st.ms[impl.name], self.unit(case))
        except Exception as e:
            st.fail(impl.name, role, short_error(e))
            return
        if self.cudagraph and case.mode == "decode" and impl.name in ("ours", "ours_paged", "cudnn", "flash"):
            try:
                with impl.ctx():
                    st.extra.setdefault("cudagraph_gbps", {})[impl.name] = self._cudagraph(
                        case, self._timed_fn(impl, leaves, do, False))
            except Exception as e:
                st.extra.setdefault("cudagraph_errors", {})[impl.name] = short_error(e)
            if impl.name == "ours":  # the floor of the same bytes, read by a kernel that only reads
                try:
                    from .read_floor import readers
                    st.extra.setdefault("cudagraph_gbps", {})["read"] = max(
                        self._cudagraph(case, fn) or 0.0 for fn in readers(inp.k, inp.v))
                except Exception as e:
                    st.extra.setdefault("cudagraph_errors", {})["read"] = short_error(e)

    def _cudagraph(self, case: Case, fn: Callable) -> Optional[float]:
        """Throughput of fn replayed from a CUDA graph (timing.graph_ms)."""
        ms = graph_ms(fn, self.device)
        return throughput(case, ms) if ms > 0 else None

    def _cleanup(self) -> None:
        if self.cuda:
            try:
                torch.cuda.synchronize(self.device)
            except Exception:  # a dead context: the next case reports it
                pass
            torch.cuda.empty_cache()
