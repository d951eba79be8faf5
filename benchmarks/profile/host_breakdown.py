"""Where the host time of a short training step goes, piece by piece (a GPU diagnostic for the
grid's S = 1k rows, whose eager timing measures the host): the whole forward and
forward+backward; the backward called directly on this thread (no autograd engine); each
launch timed in place inside the step; the same with every kernel launch replaced by a no-op
(our Python, the allocations and autograd); one repeated launch of the Gluon forward alone; one TMA
descriptor's encoding; and the autograd engine's cost for a Python `autograd.Function`
against a built-in op.  Each is host microseconds per call, timed while the GPU is held busy
so that launches only queue.

    PYTHONPATH=. python benchmarks/profile/host_breakdown.py
"""
import gc
import time

import torch

import flashforge
from flashforge.ops import launch as launch_mod
from flashforge.ops.gluon import attention as gluon_attention
from flashforge.ops.triton import attention as launchers
from short_calls import host_us  # this folder is on sys.path when run as a script


class _Identity(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g


def main():
    S, D = 1024, 128
    B, H = 16384 // S, 2048 // D
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, do = (torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(4))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]

    def fwd():
        with torch.no_grad():
            flashforge.attention(q, k, v, causal=True)

    def fwdbwd():
        torch.autograd.grad(flashforge.attention(*leaves, causal=True), leaves, do)

    rows = [("fwd, whole", fwd), ("fwd+bwd, whole", fwdbwd)]
    results = [(name, host_us(fn)) for name, fn in rows]
    # the same with Python's cyclic garbage collector off (each launch allocates ~50 tracked
    # containers: is a collection's walk part of the in-step launch cost?)
    gc.collect()
    gc.disable()
    try:
        results += [(name + ", gc off", host_us(fn)) for name, fn in rows]
    finally:
        gc.enable()

    # the same backward called on this thread, without the autograd engine (its device thread)
    from flashforge.ops.params import AttnParams
    params = AttnParams(scale=D ** -0.5, window_right=0)
    with torch.no_grad():
        o, lse = launchers.attention_forward(q, k, v, None, params)
    results.append(("bwd alone, on this thread (no engine)",
                    host_us(lambda: launchers.attention_backward(do, None, q, k, v, None, o, lse, params, False))))

    # each launch timed where it happens inside the whole step (in-context cost, against the
    # repeated single launch below): kernel name -> [seconds, calls]
    spent: dict = {}

    def timed(real_launch):
        def wrapper(kernel, grid, *args, **kw):
            t0 = time.perf_counter()
            real_launch(kernel, grid, *args, **kw)
            name = getattr(getattr(kernel, "fn", kernel), "__name__", str(kernel))
            entry = spent.setdefault(name, [0.0, 0])
            entry[0] += time.perf_counter() - t0
            entry[1] += 1
        return wrapper

    # (the Gluon launchers launch through ops/launch.py's `launch`, looked up at each call: ops/replay.py)
    saved = (launchers.launch, launch_mod.launch)
    launchers.launch, launch_mod.launch = timed(saved[0]), timed(saved[1])
    try:
        host_us(fwdbwd)
    finally:
        launchers.launch, launch_mod.launch = saved
    for name, (sec, calls) in sorted(spent.items()):
        results.append((f"  launch of {name} inside the step", sec / calls * 1e6))

    # the same with no kernel launched (outputs stay unwritten: timing only)
    real = (launchers.launch, launch_mod.launch)
    launchers.launch = launch_mod.launch = lambda *a, **kw: None
    try:
        results += [("fwd, launches stubbed", host_us(fwd)), ("fwd+bwd, launches stubbed", host_us(fwdbwd))]
    finally:
        launchers.launch, launch_mod.launch = real

    # one repeated launch of the Gluon forward with the same arguments (the launch cache's path)
    captured = {}

    def spy(kernel, grid, *args, **kw):
        captured.setdefault("call", (kernel, grid, args, kw))
        return real[1](kernel, grid, *args, **kw)

    launch_mod.launch = spy
    try:
        fwd()
    finally:
        launch_mod.launch = real[1]
    if "call" in captured:
        kernel, grid, args, kw = captured["call"]
        results.append(("one Gluon forward launch (4 descriptors)", host_us(lambda: real[1](kernel, grid, *args, **kw))))
        from triton.backends.nvidia.driver import make_tensordesc_arg
        meta = {"swizzle": 3, "elem_size": 2, "elem_type": 10, "block_size": [1, 64, 1, 128], "fp4_padded": False}
        desc = args[0]
        try:
            results.append(("one TMA descriptor encoding", host_us(lambda: make_tensordesc_arg(desc, meta), n=500)))
        except Exception as e:  # noqa: BLE001 -- a diagnostic: report and go on
            print(f"(descriptor encoding not timed: {type(e).__name__}: {e})")
        results.append(("building one descriptor object", host_us(lambda: gluon_attention._descriptor(q, 64), n=500)))

    # the autograd engine: a Python Function against a built-in op, each alone in a graph
    x = torch.randn(16, device="cuda", requires_grad=True)
    gx = torch.ones(16, device="cuda")
    results.append(("autograd.grad through a Python Function", host_us(lambda: torch.autograd.grad(_Identity.apply(x), x, gx))))
    results.append(("autograd.grad through x * 1 (C++ node)", host_us(lambda: torch.autograd.grad(x * 1, x, gx))))
    results.append(("torch.empty_like of q", host_us(lambda: torch.empty_like(q), n=500)))

    print(f"D = {D}, S = {S}, causal, bf16: host us per call (GPU held busy)")
    for name, us in results:
        print(f"  {name:45s} {us:8.1f}")


if __name__ == "__main__":
    main()
