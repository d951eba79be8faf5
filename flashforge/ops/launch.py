"""Kernel launches with less host work: a repeat launch of a kernel with the same
specialization goes straight to the compiled kernel's launcher.  On by default;
$FLASHFORGE_LAUNCH_CACHE=0 turns it off (every launch then takes Triton's own path).

Why: `kernel[grid](*args)` binds every argument, rebuilds the specialization key (a
tuple of every argument's type and divisibility, plus the options' string), builds launch
metadata and looks the kernel up before launching.  On the device's CPU, a profile
(benchmarks/profile/host_profile.py) put that at roughly half of `JITFunction.run`'s time, and the
grid's S = 1k causal training step was host-bound: ~1.0-1.3 ms of host work per
forward+backward against ~0.8 ms of GPU work (benchmarks/profile/short_calls.py).

The cache key here is what Triton specializes on (checked against
`native_specialize_impl`, tests/test_launch.py): a tensor's dtype and 16-byte alignment; an
integer's being 1, a multiple of 16 and its width; a descriptor's dtype, box and layout;
every constexpr's value, whether passed by keyword or by position.  A first launch (or a
profiler's launch hooks, or the interpreter) takes Triton's own path, which compiles and
returns the kernel kept here.  A repeat launch then calls Triton's C launcher directly (see
`_direct`).  $FLASHFORGE_LAUNCH_CACHE=verify checks every repeat launch against Triton's own
choice.
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

# On the H200 (benchmarks/profile/short_calls.py, D = 128, S = 1k) it took the host time of a
# forward+backward from 0.98-1.17 ms to 0.72-0.86 ms (v0.6.0).  That version's key missed
# constexprs passed by position, which only some test orders exposed; a GPU test now runs
# varied calls in verify mode, and the whole suite passed in it (benchmarks/RESULTS.md v0.7.0).
ENABLED = os.environ.get("FLASHFORGE_LAUNCH_CACHE", "1") != "0"
# "verify": every launch served from the cache first asks Triton which kernel it would pick and
# raises if that is another one (a test aid: it costs Triton's own lookup on every launch)
VERIFY = os.environ.get("FLASHFORGE_LAUNCH_CACHE") == "verify"
_compiled: dict = {}
_constexpr_at: dict = {}  # kernel -> positions of its constexpr parameters
hits = 0  # launches served from the cache (tests read it)
launches = 0  # every call of `launch` (a launch plan's recording counts what passed through it: ops/replay.py)
_layouts: dict = {}  # id -> layout, kept alive so that an id in a key is never reused
_MISSING = object()


def _layout_key(layout):
    if layout is None:
        return None
    _layouts.setdefault(id(layout), layout)
    return id(layout)


class _Unknown(Exception):
    pass


def _tensor_key(a):
    return a.dtype, a.data_ptr() % 16 == 0


def _int_key(a):
    return "i", a == 1, a % 16 == 0, -2**31 <= a < 2**31, a < 2**63


def _descriptor_key(a):
    return "d", a.base.dtype, tuple(a.block_shape), _layout_key(getattr(a, "layout", None))


# exact type -> key rule: one dict lookup per argument instead of a chain of isinstance checks
# (a training step keys ~70 arguments); descriptor classes join on first sight
_BY_TYPE = {torch.Tensor: _tensor_key, torch.nn.Parameter: _tensor_key, bool: lambda a: "b", int: _int_key,
            float: lambda a: "f", type(None): lambda a: None}


def _arg_key(a):
    rule = _BY_TYPE.get(type(a))
    if rule is not None:
        return rule(a)
    if isinstance(a, torch.Tensor):
        return _tensor_key(a)
    if isinstance(a, bool):
        return "b"
    if isinstance(a, int):
        return _int_key(a)
    if isinstance(a, float):
        return "f"
    if isinstance(getattr(a, "base", None), torch.Tensor) and hasattr(a, "block_shape"):  # a TMA descriptor
        _BY_TYPE[type(a)] = _descriptor_key
        return _descriptor_key(a)
    raise _Unknown


def launch_key(args) -> tuple | None:
    """The specialization-relevant summary of positional arguments, or None when one is of a
    type without a rule here (that launch then takes Triton's own path)."""
    try:
        return tuple(map(_arg_key, args))
    except _Unknown:
        return None


def cache_key(kernel, device, args, kwargs) -> tuple | None:
    """The launch cache's key of `kernel[grid](*args, **kwargs)` on `device`, or None (no rule
    for an argument's type: Triton's own path)."""
    arg_key = launch_key(args)
    if arg_key is None:
        return None
    n = len(args)
    # a constexpr passed by position is compiled in by value (the preprocess kernel's head dim:
    # 96 and 128 share every integer property above), so its value is part of the key
    constexprs = tuple(args[i] for i in _constexprs(kernel) if i < n)
    return kernel, device, arg_key, constexprs, tuple(kwargs.items())


def _constexprs(kernel) -> tuple:
    positions = _constexpr_at.get(kernel)
    if positions is None:
        positions = _constexpr_at[kernel] = tuple(i for i, p in enumerate(kernel.params) if p.is_constexpr)
    return positions


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


class _Ready:
    """A compiled kernel and what its repeat launches need, worked out once: the trailing
    parameters' values, and where possible Triton's C launcher itself with its fixed leading
    arguments and the positions of descriptor arguments to expand."""
    __slots__ = ("compiled", "trailing", "raw", "head", "expand")

    def __init__(self, compiled, trailing, n_args):
        self.compiled, self.trailing = compiled, tuple(trailing)
        self.raw, self.head, self.expand = None, (), ()
        try:
            direct = _direct(compiled, n_args)
        except Exception:  # noqa: BLE001 -- Triton internals of another version: its own launcher
            direct = None
        if direct is not None:
            self.raw, self.head, self.expand = direct


def _direct(compiled, n_args):
    """(C launcher, its arguments between function and the kernel's, ((position, expander), ...)),
    or None.  Triton 3.6's Python launcher (`CudaLauncher.__call__` and its descriptor wrapper)
    allocates no scratch for our kernels, so it only passes fixed values and expands each TMA
    descriptor into (CUtensorMap, shape, strides).  Calling the C launcher here took one Gluon
    launch from 44-55 to 29-35 us of host time on the device (benchmarks/profile/host_breakdown.py)."""
    from triton.backends.nvidia.driver import make_tensordesc_arg

    run = compiled.run  # (loads the binary)
    if run.global_scratch_size or run.profile_scratch_size:
        return None
    raw = run.launch
    if getattr(raw, "__closure__", None):  # Triton's wrapper that expands descriptors: the launcher inside
        inner = [c.cell_contents for c in raw.__closure__
                 if callable(c.cell_contents) and getattr(c.cell_contents, "__name__", "") == "launch"]
        if len(inner) != 1:
            return None
        raw = inner[0]
    metas = getattr(compiled.metadata, "tensordesc_meta", None) or None
    expand, n_desc = [], 0
    for i, sig in enumerate(compiled.src.signature.values()):
        if isinstance(sig, str) and sig.startswith("tensordesc"):
            if i >= n_args:  # passed by keyword: not expanded here
                return None
            meta = metas[n_desc] if metas else None
            n_desc += 1
            expand.append((i, lambda d, meta=meta: make_tensordesc_arg(d, meta)))
    head = (run.launch_cooperative_grid, run.launch_pdl, None, None, compiled.packed_metadata, None, None, None)
    return raw, head, tuple(reversed(expand))  # back to front: earlier positions stay valid


def launch(kernel, grid, *args, **kwargs):
    """`kernel[grid](*args, **kwargs)`: positional arguments first, then keywords for the rest
    (constexprs and launch options), each parameter named.  Returns the cache's entry that
    serves these arguments from now on (`_Ready`, which `launch_ready` takes), or None where
    the launch took Triton's own path and nothing was cached."""
    global launches
    launches += 1
    if not ENABLED or JITFunction is None or not isinstance(kernel, JITFunction) or _hooked():
        kernel[grid](*args, **kwargs)
        return None
    device = driver.active.get_current_device()
    key = cache_key(kernel, device, args, kwargs)
    if key is None:
        kernel[grid](*args, **kwargs)
        return None
    ready = _compiled.get(key)
    if ready is None:
        compiled = kernel[grid](*args, **kwargs)
        if compiled is not None and not hasattr(compiled, "result"):
            trailing = _trailing(kernel, len(args), kwargs)
            if trailing is not None:
                ready = _compiled[key] = _Ready(compiled, trailing, len(args))
        return ready
    if VERIFY and kernel.warmup(*args, grid=grid, **kwargs) is not ready.compiled:
        raise RuntimeError(f"launch cache: {kernel.fn.__name__} served a kernel Triton would not pick for "
                           f"these arguments (key {key[2:4]})")
    global hits
    hits += 1
    stream = driver.active.get_current_stream(device)
    launch_ready(ready, grid, stream, args)
    return ready


def launch_ready(ready: _Ready, grid, stream, args) -> None:
    """Launch a cached kernel: through Triton's C launcher directly where `_direct` found it,
    else through the compiled kernel's own launcher."""
    gx, gy, gz = grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1
    compiled = ready.compiled
    if ready.raw is None:
        compiled.run(gx, gy, gz, stream, compiled.function, compiled.packed_metadata, None, None, None, *args,
                     *ready.trailing)
        return
    if ready.expand:
        args = list(args)
        for i, expander in ready.expand:
            args[i:i + 1] = expander(args[i])
    ready.raw(gx, gy, gz, stream, compiled.function, *ready.head, *args, *ready.trailing)
