"""Kernel launches with less host work: a repeat launch of a kernel with the same
specialization goes straight to the compiled kernel's launcher.  On by default;
$FLASHFORGE_LAUNCH_CACHE=0 turns it off (every launch then takes Triton's own path).

Why: `kernel[grid](*args)` binds every argument, rebuilds the specialization key (a
tuple of every argument's type and divisibility, plus the options' string), builds launch
metadata and looks the kernel up before launching.  On the device's CPU, a profile
(scripts/host_profile.py) put that at roughly half of `JITFunction.run`'s time, and the
grid's S = 1k causal training step was host-bound: ~1.0-1.3 ms of host work per
forward+backward against ~0.8 ms of GPU work (scripts/short_calls.py).

The cache key here is what Triton specializes on (checked against
`native_specialize_impl`, tests/test_launch.py): a tensor's dtype and 16-byte alignment; an
integer's being 1, a multiple of 16 and its width; a descriptor's dtype, box and layout;
every constexpr.  A first launch (or a profiler's launch hooks, or the interpreter) takes
Triton's own path, which compiles and returns the kernel kept here.
"""
from __future__ import annotations

import os

import torch

try:
    from triton import knobs
    from triton.runtime import driver
    from triton.runtime.jit import JITFunction
except ImportError:  # pragma: no cover - a Triton without these: always the plain launch
    JITFunction = None

# On the H200 (scripts/short_calls.py, D = 128, S = 1k) it took the host time of a
# forward+backward from 0.98-1.17 ms to 0.72-0.86 ms, and the whole GPU suite passed with it.
ENABLED = os.environ.get("FLASHFORGE_LAUNCH_CACHE", "1") != "0"
_compiled: dict = {}
hits = 0  # launches served from the cache (tests read it)
_layouts: dict = {}  # id -> layout, kept alive so that an id in a key is never reused
_MISSING = object()


def _layout_key(layout):
    if layout is None:
        return None
    _layouts.setdefault(id(layout), layout)
    return id(layout)


class _Unknown(Exception):
    pass


def _arg_key(a):
    if isinstance(a, torch.Tensor):
        return a.dtype, a.data_ptr() % 16 == 0
    if isinstance(a, bool):
        return "b"
    if isinstance(a, int):
        return "i", a == 1, a % 16 == 0, -2**31 <= a < 2**31, a < 2**63
    if isinstance(a, float):
        return "f"
    if a is None:
        return None
    base = getattr(a, "base", None)
    if isinstance(base, torch.Tensor):  # a host tensor descriptor (TMA)
        return "d", base.dtype, tuple(a.block_shape), _layout_key(getattr(a, "layout", None))
    raise _Unknown


def launch_key(args) -> tuple | None:
    """The specialization-relevant summary of positional arguments, or None when one is of a
    type without a rule here (that launch then takes Triton's own path)."""
    try:
        return tuple(_arg_key(a) for a in args)
    except _Unknown:
        return None


def _trailing(kernel, n_positional, kwargs):
    """The parameters after the positional ones, from kwargs or their defaults; None if one is missing."""
    out = []
    for p in kernel.params[n_positional:]:
        v = kwargs.get(p.name, _MISSING)
        if v is _MISSING:
            if not p.has_default:
                return None
            v = p.default
        out.append(v)
    return out


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for grids (`triton.cdiv` is a constexpr function in Triton 3.6: ~2 us a call)."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def _hooked() -> bool:
    """Whether a profiler hooks launches (Triton 3.6 keeps an always-present, maybe empty,
    chain of hooks): such launches take Triton's own path, which calls the hooks."""
    for hook in (knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook):
        if hook is not None and getattr(hook, "calls", True):
            return True
    return False


def launch(kernel, grid, *args, **kwargs):
    """`kernel[grid](*args, **kwargs)`: positional arguments first, then keywords for the rest
    (constexprs and launch options), each parameter named."""
    if not ENABLED or JITFunction is None or not isinstance(kernel, JITFunction) or _hooked():
        kernel[grid](*args, **kwargs)
        return
    arg_key = launch_key(args)
    if arg_key is None:
        kernel[grid](*args, **kwargs)
        return
    device = driver.active.get_current_device()
    key = (kernel, device, arg_key, tuple(kwargs.items()))
    compiled = _compiled.get(key)
    trailing = _trailing(kernel, len(args), kwargs) if compiled is not None else None
    if trailing is None:
        compiled = kernel[grid](*args, **kwargs)
        if compiled is not None and not hasattr(compiled, "result"):
            _compiled[key] = compiled
        return
    global hits
    hits += 1
    stream = driver.active.get_current_stream(device)
    compiled.run(grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1, stream,
                 compiled.function, compiled.packed_metadata, None, None, None, *args, *trailing)
