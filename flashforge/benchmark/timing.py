"""How calls are timed, in one place: `triton.testing.do_bench` (median, L2 flushed before each
repetition) on a GPU, a wall-clock statistic of a few runs on the CPU, CUDA-graph replays, the peak memory
of one call, and the plan that fits do_bench's warm-up and repetition times to a budget.  Every timing
follows a warm-up call outside the timed region (the Runner's check run)."""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch

from .cases import Case


@dataclass(frozen=True)
class Timing:
    warmup: float = 25.0        # do_bench warm-up, ms
    rep: float = 100.0          # do_bench repetition time, ms
    cpu_budget_s: float = 0.5   # CPU: stop adding runs once this is spent ...
    cpu_min_runs: int = 3       # ... but make at least this many ...
    cpu_cap_s: float = 1.5      # ... unless the runs so far took this long: a call of seconds varies
    cpu_max_runs: int = 10      # little from run to run, and the slowest rows would dominate the job
    cpu_stat: str = "median"    # or "min": the run least disturbed by other load on the machine

    def ms(self, fn: Callable, device: torch.device, grad_to_none: Optional[Sequence[torch.Tensor]] = None) -> float:
        """Milliseconds per call of fn on `device`; grad_to_none: leaves whose .grad is cleared before
        each call (a backward would otherwise accumulate into it)."""
        if device.type == "cuda":
            import triton.testing
            return float(triton.testing.do_bench(fn, warmup=self.warmup, rep=self.rep, grad_to_none=grad_to_none,
                                                 return_mode="median"))
        return self.cpu_ms(fn, grad_to_none)

    def more_runs(self, times: Sequence[float], past_budget: bool) -> bool:
        """Whether cpu_ms makes another run after runs of `times` ms."""
        if len(times) < self.cpu_min_runs:
            return not times or sum(times) < self.cpu_cap_s * 1e3
        return len(times) < self.cpu_max_runs and not past_budget

    def cpu_ms(self, fn: Callable, grad_to_none=None) -> float:
        times: list = []
        deadline = time.perf_counter() + self.cpu_budget_s
        while self.more_runs(times, time.perf_counter() > deadline):
            for t in grad_to_none or ():
                t.grad = None
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        return min(times) if self.cpu_stat == "min" else statistics.median(times)


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


def peak_gib(fn: Callable, leaves: Sequence[torch.Tensor], device: torch.device) -> tuple:
    """(peak GiB above what was allocated before, ms) of one call (None GiB on the CPU, where nothing
    is measured but the call runs)."""
    if device.type != "cuda":
        t0 = time.perf_counter()
        fn()
        return None, (time.perf_counter() - t0) * 1e3
    for t in leaves:
        t.grad = None
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - base
    for t in leaves:
        t.grad = None
    return peak / 2**30, start.elapsed_time(end)


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
