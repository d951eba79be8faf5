"""Context parallelism on GPUs: exactness and weak scaling across GPUs, and one-GPU checks of a ring step.

Under torchrun, one process per GPU (NCCL):

    torchrun --nproc-per-node W benchmarks/context_parallel.py [--mode check|scale|all] [--out DIR]

* ``check``: forward, lse and gradients of `context_parallel_attention`, bf16, for every layout x
  strategy x causal or not x heads 16/16 and 32/8 (D = 128, ``--check-tokens`` per GPU), against
  single-GPU `flashforge.attention` on the full tensors: the error against a float32 run of the full
  tensors may be at most 3x the single-GPU bf16 error on the same rows, plus a floor of 1e-3 (relative).
* ``scale``: weak scaling, bf16, D = 128, heads 16/16 and 32/8, causal, forward+backward, ``--tokens``
  per GPU (32k).  Efficiency = (causal FLOPs per GPU / time at W) / (FLOPs / time of single-GPU
  `flashforge.attention` on one GPU's tokens) = W x (tokens/s per GPU at W) / (tokens/s at W = 1),
  up to the exact causal count.  For the ring it also times each pass three ways (the ring; the same
  attention with the transfers left out; the transfers alone) and prints the communication time
  per step and how much of it the compute hid: (compute + comm - ring) / (W - 1).

One process, one GPU (no torchrun):

    python benchmarks/context_parallel.py --mode step      # a ring step against the dense kernel
    python benchmarks/context_parallel.py --mode overlap   # an emulated ring of W ranks on one GPU

* ``step``: one ring step (one block against one block, through the plan's call, with the lse merge
  into the float32 accumulators; backward: the call's backward plus the float32 accumulation of
  dQ/dK/dV) against our dense kernel on the same shapes, for the steps of a 32k-token shard.
* ``overlap``: W ranks as W threads on one GPU, each with its own compute stream; a transport
  stands in for NCCL (the copy of a send into the peer's receive buffer on the receiver's side
  stream, after the sender's event, and a spin kernel for the link's time at ``--link-gbps``).  It
  checks that every transfer is issued from the rank's compute stream before the step's attention
  is queued and waited on only after it (per step: the transfer of step i+1 in flight while step i
  computes; printed as the fraction of each transfer that overlaps its step's compute), and that the
  ranks' outputs and gradients, forward and backward, equal single-GPU attention (bf16).

What one GPU cannot show: NCCL's own stream and its kernels' interference with the attention (the
emulated copy runs on a side stream the same way, but is not NCCL), the link's real bandwidth, and
the all-gather strategy's collectives at W > 1 (``check`` and ``scale`` run them, at W = 1 too).
``--device cpu`` runs every mode on the CPU (gloo, float32, tiny sizes) as a smoke test.
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import queue
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.distributed as dist

import flashforge
from flashforge.distributed import block, comm, context_parallel_attention, shard_sequence
from flashforge.distributed.layout import shard
from flashforge.distributed.plan import Schedule, schedule
from flashforge.distributed.ring import ring_backward, ring_forward
from flashforge.ops.backends import backend_module
from flashforge.ops.params import AttnParams

HEADS = ((16, 16), (32, 8))
LAYOUTS = ("zigzag", "contiguous")
STRATEGIES = ("ring", "allgather")


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time_ms(fn, reps: int, device, group=None) -> float:
    """Median milliseconds of ``fn`` after a warm-up; with a group, the ranks start each run together
    and the slowest rank's median counts."""
    fn()
    times = []
    for _ in range(reps):
        if group is not None:
            dist.barrier(group)
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(1e3 * (time.perf_counter() - t0))
    t = statistics.median(times)
    if group is not None:
        worst = torch.tensor([t], device=device)
        dist.all_reduce(worst, dist.ReduceOp.MAX, group=group)
        t = worst.item()
    return t


def _time_pair_ms(fa, fb, reps: int, device) -> tuple[float, float]:
    """Median milliseconds of ``fa`` and of ``fb``, timed alternately (a, b, a, b, ...) after a warm-up
    of each, so that drift of the clocks falls on both alike."""
    fa(), fb()
    times = ([], [])
    for _ in range(reps):
        for fn, out in ((fa, times[0]), (fb, times[1])):
            _sync(device)
            t0 = time.perf_counter()
            fn()
            _sync(device)
            out.append(1e3 * (time.perf_counter() - t0))
    return statistics.median(times[0]), statistics.median(times[1])


def _causal_pairs(S: int) -> int:
    return S * (S + 1) // 2


def _fwd_bwd_flops(S: int, Hq: int, D: int, causal: bool) -> float:
    """Forward 2 matmuls, backward 5 (dQ, dK, dV, dP and the recomputed scores), 2 FLOPs a multiply-add."""
    pairs = _causal_pairs(S) if causal else S * S
    return 7 * 2 * pairs * Hq * D


def _randn(shape, gen, device, dtype):
    return torch.randn(shape, generator=gen, device=device).to(dtype)


def _grads(fn, q, k, v, do, dlse):
    """(o, lse, dq, dk, dv) of ``fn(q, k, v) -> (o, lse)`` for upstream gradients do, dlse."""
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    o, lse = fn(*leaves)
    grads = torch.autograd.grad((o, lse), leaves, (do.to(o.dtype), dlse))
    return (o.detach(), lse.detach(), *grads)


# ---------------------------------------------------------------- torchrun: exactness


def check(group, device, dtype, tokens: int, D: int) -> list[dict]:
    W = group.size()
    S = tokens * W
    rows = []
    for (Hq, Hkv), causal, layout, strategy in itertools.product(HEADS, (False, True), LAYOUTS, STRATEGIES):
        gen = torch.Generator(device).manual_seed(1234)  # the same full tensors on every rank
        q, k, v = (_randn((1, S, h, D), gen, device, dtype) for h in (Hq, Hkv, Hkv))
        do, dlse = _randn((1, S, Hq, D), gen, device, dtype), _randn((1, Hq, S), gen, device, torch.float32)

        def single(*t):
            return flashforge.attention(*t, causal=causal, return_lse=True)

        truth = _grads(single, q.float(), k.float(), v.float(), do.float(), dlse)
        one_gpu = _grads(single, q, k, v, do, dlse)

        def cut(x, dim=1):
            return shard_sequence(x, group, layout, dim)

        mine = _grads(lambda *t: context_parallel_attention(*t, group=group, layout=layout, strategy=strategy,
                                                            causal=causal, return_lse=True),
                      cut(q), cut(k), cut(v), cut(do), cut(dlse, 2))
        errs = []
        for what, m, o1, t in zip(("o", "lse", "dq", "dk", "dv"), mine, one_gpu, truth):
            dim = 2 if what == "lse" else 1
            t_mine = cut(t, dim)
            e_cp = (m.float() - t_mine).abs().max()
            e_one = (cut(o1, dim).float() - t_mine).abs().max()
            scale = t.abs().max().clamp(min=1.0)
            errs.append(torch.stack([e_cp, e_one, scale]))
        errs = torch.stack(errs)  # [5, 3]: this rank's errors; the worst rank's ratio counts
        ok = (errs[:, 0] <= 3 * errs[:, 1] + 1e-3 * errs[:, 2]).all().float()
        dist.all_reduce(ok, dist.ReduceOp.MIN, group=group)
        dist.all_reduce(errs, dist.ReduceOp.MAX, group=group)
        rows.append(dict(heads=f"{Hq}/{Hkv}", causal=causal, layout=layout, strategy=strategy, ok=bool(ok.item()),
                         err_cp=errs[:, 0].tolist(), err_one_gpu=errs[:, 1].tolist()))
    return rows


def print_check(rows, W, tokens, desc) -> None:
    print(f"\ncheck: W={W}, {tokens} tokens per GPU, {desc}; max |error| against float32 "
          f"(o, lse, dq, dk, dv): context parallel / single GPU")
    print(f"{'heads':>6} {'causal':>6} {'layout':>10} {'strategy':>9} {'pass':>5}  errors")
    for r in rows:
        pairs = " ".join(f"{a:.1e}/{b:.1e}" for a, b in zip(r["err_cp"], r["err_one_gpu"]))
        print(f"{r['heads']:>6} {str(r['causal']):>6} {r['layout']:>10} {r['strategy']:>9} "
              f"{'yes' if r['ok'] else 'NO':>5}  {pairs}")


# ---------------------------------------------------------------- torchrun: weak scaling


class NoComm:
    """A transport that moves nothing: the ring's compute alone (the receive buffers keep whatever
    they hold, which changes no kernel's time)."""

    def start(self, sends, recvs):
        return comm.Pending(())


def _silent(sched: Schedule) -> Schedule:
    """The same routes with no calls: the ring's transfers alone."""
    W = sched.world
    return Schedule(W, tuple(tuple(() for _ in range(W)) for _ in range(W)), sched.last)


def _ring_split(q, k, v, do, group, layout, params, backend, reps, device) -> dict:
    """Per pass: the ring, its compute alone, its transfers alone (ms), and the transfer time per
    step that the compute hid."""
    W, r = group.size(), group.rank()
    sched = schedule(layout, W, q.shape[1], params.window_left, params.window_right)
    p2p = comm.P2P(group)
    o, lse = ring_forward(q, k, v, r, sched, params, backend, p2p)
    out = {}
    for name, run in (("fwd", lambda s, t: ring_forward(q, k, v, r, s, params, backend, t)),
                      ("bwd", lambda s, t: ring_backward(do, None, q, k, v, o, lse, r, s, params, backend, t))):
        full = _time_ms(lambda: run(sched, p2p), reps, device, group)
        compute = _time_ms(lambda: run(sched, NoComm()), reps, device, group)
        transfers = _time_ms(lambda: run(_silent(sched), p2p), reps, device, group)
        out[name] = dict(ring_ms=full, compute_ms=compute, comm_ms=transfers,
                         comm_per_step_ms=transfers / (W - 1),
                         hidden_per_step_ms=max(0.0, compute + transfers - full) / (W - 1))
    return out


def scale(group, device, dtype, tokens: int, D: int, reps: int) -> list[dict]:
    W = group.size()
    S = tokens * W
    backend = "triton" if device.type == "cuda" else "torch"
    rows = []
    for Hq, Hkv in HEADS:
        gen = torch.Generator(device).manual_seed(group.rank())
        q, k, v = (_randn((1, tokens, h, D), gen, device, dtype).requires_grad_() for h in (Hq, Hkv, Hkv))
        do = _randn((1, tokens, Hq, D), gen, device, dtype)

        def train(fn):
            def run():
                torch.autograd.grad(fn(q, k, v), (q, k, v), do)
            return run

        base = _time_ms(train(lambda *t: flashforge.attention(*t, causal=True)), reps, device, group)
        base_rate = _fwd_bwd_flops(tokens, Hq, D, True) / base
        for layout, strategy in itertools.product(LAYOUTS, STRATEGIES):
            ms = _time_ms(train(lambda *t: context_parallel_attention(
                *t, group=group, layout=layout, strategy=strategy, causal=True)), reps, device, group)
            rate = _fwd_bwd_flops(S, Hq, D, True) / W / ms
            row = dict(heads=f"{Hq}/{Hkv}", layout=layout, strategy=strategy, W=W, tokens_per_gpu=tokens,
                       ms=ms, single_gpu_ms=base, tokens_per_s_per_gpu=tokens / ms * 1e3,
                       tflops_per_gpu=rate / 1e9, efficiency=rate / base_rate)
            if strategy == "ring" and W > 1:
                params = AttnParams(scale=D ** -0.5, window_right=0)
                row["ring"] = _ring_split(q.detach(), k.detach(), v.detach(), do, group, layout, params, backend,
                                          reps, device)
            rows.append(row)
    return rows


def print_scale(rows, desc) -> None:
    W, tokens = rows[0]["W"], rows[0]["tokens_per_gpu"]
    print(f"\nweak scaling: W={W}, {tokens} tokens per GPU, {desc}, causal, forward+backward; "
          f"efficiency against single-GPU flashforge.attention on {tokens} tokens")
    print(f"{'heads':>6} {'layout':>10} {'strategy':>9} {'ms':>8} {'1-GPU ms':>8} {'tok/s/GPU':>10} "
          f"{'TFLOP/s':>8} {'eff':>5}  ring per step: fwd comm/hidden ms, bwd comm/hidden ms")
    for r in rows:
        ring = r.get("ring")
        extra = "-" if ring is None else ", ".join(
            f"{ring[p]['comm_per_step_ms']:.2f}/{ring[p]['hidden_per_step_ms']:.2f}" for p in ("fwd", "bwd"))
        print(f"{r['heads']:>6} {r['layout']:>10} {r['strategy']:>9} {r['ms']:8.2f} {r['single_gpu_ms']:8.2f} "
              f"{r['tokens_per_s_per_gpu']:10.0f} {r['tflops_per_gpu']:8.1f} {r['efficiency']:5.2f}  {extra}")


# ---------------------------------------------------------------- one GPU: a ring step against the dense kernel


def step(device, dtype, tokens: int, D: int, reps: int) -> list[dict]:
    """The steps of rank 1 of 4 (causal): an earlier block (contiguous: all x all; zigzag: all x the
    first half), a later block (zigzag: the second half x all) and the diagonal (one causal call)."""
    backend = "triton" if device.type == "cuda" else "torch"
    mod = backend_module("attention", backend)
    params = AttnParams(scale=D ** -0.5, window_right=0)
    T = tokens
    steps = (("contiguous", 0, "earlier block"), ("zigzag", 0, "earlier block"), ("zigzag", 2, "later block"),
             ("zigzag", 1, "diagonal"))
    rows = []
    for Hq, Hkv in HEADS:
        gen = torch.Generator(device).manual_seed(0)
        q, k, v = (_randn((1, T, h, D), gen, device, dtype) for h in (Hq, Hkv, Hkv))
        do = _randn((1, T, Hq, D), gen, device, dtype)
        o, lse = ring_forward(q, k, v, 0, schedule("zigzag", 1, T, -1, 0), params, backend, NoComm())
        acc_o = torch.zeros(1, T, Hq, D, dtype=torch.float32, device=device)
        acc_lse = torch.full((1, Hq, T), float("-inf"), device=device)
        acc = [torch.zeros(t.shape, dtype=torch.float32, device=device) for t in (q, k, v)]
        for layout, src, what in steps:
            (call,) = schedule(layout, 4, T, -1, 0).calls[1][src]
            p = block.call_params(params, call)
            qs, ks, vs, dos = (t[:, a:b].contiguous() for t, a, b in ((q, call.q0, call.q1), (k, call.k0, call.k1),
                                                                        (v, call.k0, call.k1), (do, call.q0, call.q1)))
            o_s, lse_s = (x.contiguous() for x in (o[:, call.q0:call.q1], lse[:, :, call.q0:call.q1]))
            rows_q, rows_k = slice(call.q0, call.q1), slice(call.k0, call.k1)

            def step_fwd():
                o_c, lse_c = block.forward(q, k, v, call, params, backend)
                block.merge(acc_o[:, rows_q], acc_lse[:, :, rows_q], o_c, lse_c, backend)

            def step_bwd():
                dq, dk, dv = block.backward(do, None, q, k, v, o, lse, call, params, backend)
                acc[0][:, rows_q] += dq
                acc[1][:, rows_k] += dk
                acc[2][:, rows_k] += dv

            times = {}
            times["dense_fwd"], times["step_fwd"] = _time_pair_ms(
                lambda: mod.attention_forward(qs, ks, vs, None, p), step_fwd, reps, device)
            times["dense_bwd"], times["step_bwd"] = _time_pair_ms(
                lambda: mod.attention_backward(dos, None, qs, ks, vs, None, o_s, lse_s, p, False), step_bwd, reps,
                device)
            pairs = (call.q1 - call.q0) * (call.k1 - call.k0) if not call.masked else _causal_pairs(T)
            rows.append(dict(heads=f"{Hq}/{Hkv}", layout=layout, step=what, q_rows=call.q1 - call.q0,
                             k_rows=call.k1 - call.k0, masked=call.masked,
                             fwd_tflops=4 * pairs * Hq * D / times["step_fwd"] / 1e9, **times))
    return rows


def print_step(rows, tokens, desc) -> None:
    print(f"\nring step vs dense kernel: a {tokens}-token shard, rank 1 of 4, causal, {desc} "
          f"(step = the call + lse merge / + float32 dQ, dK, dV accumulation)")
    print(f"{'heads':>6} {'layout':>10} {'step':>14} {'q x k':>13} {'fwd dense':>9} {'fwd step':>9} {'ratio':>6} "
          f"{'bwd dense':>9} {'bwd step':>9} {'ratio':>6}")
    for r in rows:
        print(f"{r['heads']:>6} {r['layout']:>10} {r['step']:>14} {r['q_rows']:>6}x{r['k_rows']:<6} "
              f"{r['dense_fwd']:9.2f} {r['step_fwd']:9.2f} {r['dense_fwd'] / r['step_fwd']:6.3f} "
              f"{r['dense_bwd']:9.2f} {r['step_bwd']:9.2f} {r['dense_bwd'] / r['step_bwd']:6.3f}")


# ---------------------------------------------------------------- one GPU: an emulated ring, ranks as threads


class _Link:
    """Mailboxes between emulated ranks: a send is its tensor and the event that marks it ready."""

    def __init__(self, world: int):
        self.boxes = {(a, b): queue.Queue() for a in range(world) for b in range(world)}


def _event(stream):
    e = torch.cuda.Event(enable_timing=True)
    e.record(stream)
    return e


class _Waiting:
    def __init__(self, log, index, issued, c0, c1):
        self.log, self.index, self.issued, self.c0, self.c1 = log, index, issued, c0, c1

    def wait(self):
        stream = torch.cuda.current_stream()
        waited = _event(stream)  # where the step's attention ends on the compute stream
        stream.wait_event(self.c1)
        self.log.append((self.index, self.issued, self.c0, self.c1, waited))


class ThreadP2P:
    """An emulated rank's transport, standing in for NCCL: a receive copies the peer's sent tensor
    into the buffer on this rank's side stream once the sender's event (its compute stream at the
    send) has passed, then spins for the link's time; ``wait`` makes the compute stream wait for it.
    Each round with receives logs CUDA events: issued (compute stream, at ``start``), copy start and
    end (side stream), waited (compute stream, at ``wait``)."""

    def __init__(self, rank: int, link: _Link, compute, side, link_gbps: float, cycles_per_ms: float):
        self.rank, self.link, self.compute, self.side = rank, link, compute, side
        self.cycles_per_byte = cycles_per_ms * 1e3 / (link_gbps * 1e9)
        self.log = {"fwd": [], "bwd": []}
        self.phase = "fwd"
        self.rounds = {"fwd": 0, "bwd": 0}
        self.wrong_stream = 0

    def start(self, sends, recvs):
        if torch.cuda.current_stream() != self.compute:
            self.wrong_stream += 1
        index = self.rounds[self.phase]
        self.rounds[self.phase] += 1
        issued = _event(self.compute)
        for t, peer in sends:
            self.link.boxes[self.rank, peer].put((t, _event(self.compute)))
        if not recvs:
            return comm.Pending(())
        got = [(t, *self.link.boxes[peer, self.rank].get(timeout=120)) for t, peer in recvs]
        self.side.wait_stream(self.compute)  # as NCCL: after the work queued so far (the buffers' allocation)
        for _, _, ready in got:
            self.side.wait_event(ready)
        c0 = _event(self.side)
        with torch.cuda.stream(self.side):
            for buf, sent, _ in got:
                buf.copy_(sent)
                sent.record_stream(self.side)  # the sender's allocator must not reuse it before the copy
                buf.record_stream(self.side)
            nbytes = sum(buf.numel() * buf.element_size() for buf, _, _ in got)
            torch.cuda._sleep(int(nbytes * self.cycles_per_byte))
        return _Waiting(self.log[self.phase], index, issued, c0, _event(self.side))


class _CpuLink:
    """``--device cpu``: the same rendezvous, with synchronous copies (numerics only)."""

    def __init__(self, rank: int, link: _Link):
        self.rank, self.link, self.log, self.phase, self.wrong_stream = rank, link, {"fwd": [], "bwd": []}, "fwd", 0

    def start(self, sends, recvs):
        for t, peer in sends:
            self.link.boxes[self.rank, peer].put((t, None))
        for t, peer in recvs:
            t.copy_(self.link.boxes[peer, self.rank].get(timeout=120)[0])
        return comm.Pending(())


def _cycles_per_ms(device) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(10_000_000)
    end.record()
    torch.cuda.synchronize(device)
    return 10_000_000 / start.elapsed_time(end)


def _overlapped(issued, c0, c1, waited) -> float:
    """The fraction of the transfer [c0, c1] that ran while the step's attention [issued, waited] did."""
    t0, t1, tw = issued.elapsed_time(c0), issued.elapsed_time(c1), issued.elapsed_time(waited)
    if t1 <= t0:
        return 1.0
    return max(0.0, min(t1, tw) - max(t0, 0.0)) / (t1 - t0)


def overlap(device, dtype, W: int, tokens: int, D: int, link_gbps: float) -> list[dict]:
    backend = "triton" if device.type == "cuda" else "torch"
    cuda = device.type == "cuda"
    cycles = _cycles_per_ms(device) if cuda else 0.0
    params = AttnParams(scale=D ** -0.5, window_right=0)
    rows = []
    t_start = time.perf_counter()
    for (Hq, Hkv), layout in itertools.product(HEADS, LAYOUTS):
        S = W * tokens
        gen = torch.Generator(device).manual_seed(5)
        q, k, v = (_randn((1, S, h, D), gen, device, dtype) for h in (Hq, Hkv, Hkv))
        do, dlse = _randn((1, S, Hq, D), gen, device, dtype), _randn((1, Hq, S), gen, device, torch.float32)
        sched = schedule(layout, W, tokens, -1, 0)

        def cut(x, r, dim=1):
            return shard(x, layout, r, W, dim).contiguous()

        shards = [[cut(t, r) for t in (q, k, v, do)] + [cut(dlse, r, 2)] for r in range(W)]
        for r, b in itertools.product(range(W), range(W)):  # compile the calls' kernels before the threads run
            qr, dor, dlr = shards[r][0], shards[r][3], shards[r][4]
            o_r, lse_r = torch.zeros_like(dor), torch.zeros_like(dlr)
            for call in sched.calls[r][b]:
                block.forward(qr, shards[b][1], shards[b][2], call, params, backend)
                block.backward(dor, dlr, qr, shards[b][1], shards[b][2], o_r, lse_r, call, params, backend)

        def rank_run(r, link):
            if cuda:
                compute, side = torch.cuda.Stream(device), torch.cuda.Stream(device)
                t, ctx = ThreadP2P(r, link, compute, side, link_gbps, cycles), torch.cuda.stream(compute)
            else:
                t, ctx = _CpuLink(r, link), torch.no_grad()
            qr, kr, vr, dor, dlr = shards[r]
            with ctx, torch.no_grad():
                o, lse = ring_forward(qr, kr, vr, r, sched, params, backend, t)
                t.phase = "bwd"
                grads = ring_backward(dor, dlr, qr, kr, vr, o, lse, r, sched, params, backend, t)
            _sync(device)
            return (o, lse, *grads), t

        for _ in range(2):  # the first round allocates and warms up; the second is the one reported
            link = _Link(W)
            with ThreadPoolExecutor(W) as pool:
                results = list(pool.map(lambda r: rank_run(r, link), range(W)))

        def single(*t):
            return flashforge.attention(*t, causal=True, return_lse=True)

        truth = _grads(single, q.float(), k.float(), v.float(), do.float(), dlse)
        one_gpu = _grads(single, q, k, v, do, dlse)
        ok = True
        for r, (outs, _) in enumerate(results):
            for i, (m, o1, t) in enumerate(zip(outs, one_gpu, truth)):
                dim = 2 if i == 1 else 1
                e_cp = (m.float() - cut(t, r, dim)).abs().max().item()
                e_one = (cut(o1, r, dim).float() - cut(t, r, dim)).abs().max().item()
                ok &= e_cp <= 3 * e_one + 1e-3 * max(1.0, t.abs().max().item())
        # the backward's last round (index W) only sends dK/dV home, after all the attention: nothing hides it
        fwd = [_overlapped(*e[1:]) for _, t in results for e in t.log["fwd"]]
        bwd = [_overlapped(*e[1:]) for _, t in results for e in t.log["bwd"] if e[0] < W]
        print(f"  overlap {Hq}/{Hkv} {layout}: exact={ok} ({time.perf_counter() - t_start:.0f} s since the start)",
              flush=True)  # progress: compiling the first case's kernels takes a while on a fresh machine
        rows.append(dict(heads=f"{Hq}/{Hkv}", layout=layout, W=W, tokens_per_rank=tokens, exact=ok,
                         wrong_stream=sum(t.wrong_stream for _, t in results),
                         fwd_steps=len(fwd), fwd_overlapped_min=min(fwd, default=None),
                         fwd_overlapped_mean=statistics.mean(fwd) if fwd else None,
                         bwd_steps=len(bwd), bwd_overlapped_min=min(bwd, default=None),
                         bwd_overlapped_mean=statistics.mean(bwd) if bwd else None))
    return rows


def print_overlap(rows, link_gbps, desc) -> None:
    r0 = rows[0]
    print(f"\nemulated ring on one GPU: W={r0['W']} threads, {r0['tokens_per_rank']} tokens per rank, causal, "
          f"{desc}, link {link_gbps:g} GB/s; overlapped: the part of each transfer that ran during its step's "
          f"attention (min/mean over ranks and steps)")
    print(f"{'heads':>6} {'layout':>10} {'exact':>6} {'wrong stream':>12} {'fwd steps':>9} {'overlapped':>11} "
          f"{'bwd steps':>9} {'overlapped':>11}")

    def pair(lo, mean):
        return "-" if lo is None else f"{lo:.2f}/{mean:.2f}"

    for r in rows:
        print(f"{r['heads']:>6} {r['layout']:>10} {'yes' if r['exact'] else 'NO':>6} {r['wrong_stream']:>12} "
              f"{r['fwd_steps']:>9} {pair(r['fwd_overlapped_min'], r['fwd_overlapped_mean']):>11} "
              f"{r['bwd_steps']:>9} {pair(r['bwd_overlapped_min'], r['bwd_overlapped_mean']):>11}")


# ---------------------------------------------------------------- entry point


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mode", default=None, choices=["check", "scale", "all", "step", "overlap"],
                    help="default: all (check + scale) under torchrun, else step + overlap")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--tokens", type=int, default=32768, help="tokens per GPU (scale, step)")
    ap.add_argument("--check-tokens", type=int, default=2048, help="tokens per GPU (check)")
    ap.add_argument("--overlap-tokens", type=int, default=8192, help="tokens per emulated rank (overlap)")
    ap.add_argument("--overlap-world", type=int, default=4)
    ap.add_argument("--link-gbps", type=float, default=300.0, help="emulated link bandwidth (overlap)")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default=None, help="write the rows as JSON files into this folder")
    args = ap.parse_args()
    distributed = "LOCAL_RANK" in os.environ
    mode = args.mode or ("all" if distributed else "step+overlap")
    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        raise SystemExit("no CUDA GPU here: pass --device cpu for a smoke test")
    dtype = torch.bfloat16 if cuda else torch.float32
    desc = f"{str(dtype).replace('torch.', '')}, D={args.head_dim}"
    results = {}
    if mode in ("check", "scale", "all"):
        if not distributed:
            raise SystemExit(f"--mode {mode} runs under torchrun (one process per GPU)")
        rank = int(os.environ["LOCAL_RANK"])
        device = torch.device("cuda", rank) if cuda else torch.device("cpu")
        if cuda:
            torch.cuda.set_device(device)
        dist.init_process_group("nccl" if cuda else "gloo")
        group = dist.group.WORLD
        lead = dist.get_rank() == 0
        if mode in ("check", "all"):
            results["check"] = check(group, device, dtype, args.check_tokens, args.head_dim)
            if lead:
                print_check(results["check"], group.size(), args.check_tokens, desc)
        if mode in ("scale", "all"):
            results["scale"] = scale(group, device, dtype, args.tokens, args.head_dim, args.reps)
            if lead:
                print_scale(results["scale"], desc)
        dist.destroy_process_group()
    else:
        lead = True
        device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
        if "step" in mode:
            results["step"] = step(device, dtype, args.tokens, args.head_dim, args.reps)
            print_step(results["step"], args.tokens, desc)
        if "overlap" in mode:
            results["overlap"] = overlap(device, dtype, args.overlap_world, args.overlap_tokens, args.head_dim,
                                         args.link_gbps)
            print_overlap(results["overlap"], args.link_gbps, desc)
    if args.out and lead:
        os.makedirs(args.out, exist_ok=True)
        for name, rows in results.items():
            with open(os.path.join(args.out, f"context_parallel_{name}.json"), "w") as f:
                json.dump(rows, f, indent=1)
    failed = [r for r in results.get("check", []) + results.get("overlap", []) if not r.get("ok", r.get("exact"))]
    if failed:
        raise SystemExit(f"{len(failed)} exactness checks failed")


if __name__ == "__main__":
    main()
