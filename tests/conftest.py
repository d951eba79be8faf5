"""Test configuration shared by the whole suite.

* Without CUDA the Triton kernels run in the Triton interpreter on CPU tensors:
  ``TRITON_INTERPRET=1`` is set here, before anything imports triton.
* Every test runs with poisoned allocations: ``torch.empty`` and friends return
  NaN-filled floats (ints: a sentinel), so an output element a kernel forgets
  to write shows up as NaN instead of as plausible leftover memory.
* ``@pytest.mark.gpu`` tests are skipped, with the reason, when CUDA is absent.
* ``FF_TEST_HANG_S=N``: a test still running after N seconds ends its process (exit 70), naming
  the test on stderr.  A GPU kernel that deadlocks cannot be interrupted, and it stalls every later
  launch in the process; under pytest-xdist the worker is replaced and the test reported as crashed,
  so one hang costs N seconds of a device call instead of the rest of it.  A test known to run
  longer says so with ``@pytest.mark.hang_s(M)``: its limit is then max(N, M).
"""
import os
import threading

import torch

if not torch.cuda.is_available():
    # must precede the first `import triton` anywhere in the process
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

NO_CUDA_REASON = "needs a CUDA GPU (torch.cuda.is_available() is False)"


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU; skipped (with the reason) when there is none")
    config.addinivalue_line("markers", "hang_s(seconds): this test's FF_TEST_HANG_S watchdog waits at least that long")
    # the Triton interpreter's own numpy usage, once per scalar load: noise, not ours
    config.addinivalue_line("filterwarnings",
                            "ignore:Conversion of an array with ndim > 0 to a scalar:DeprecationWarning")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    limit = float(os.environ.get("FF_TEST_HANG_S") or 0)
    timer = None
    if limit > 0:
        own = item.get_closest_marker("hang_s")
        if own is not None:
            limit = max(limit, float(own.args[0]))
        def give_up():
            capture = item.config.pluginmanager.getplugin("capturemanager")
            if capture is not None:  # pytest holds file descriptor 2 in a file os._exit would drop
                capture.suspend_global_capture(in_=False)
            os.write(2, f"\nFF_TEST_HANG_S: {item.nodeid} still running after {limit:g} s: ending this process\n"
                     .encode())
            os._exit(70)

        timer = threading.Timer(limit, give_up)
        timer.daemon = True
        timer.start()
    try:
        yield
    finally:
        if timer is not None:
            timer.cancel()


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason=NO_CUDA_REASON)
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def _poison_value(dtype: torch.dtype):
    """What a fresh allocation of `dtype` is filled with; None leaves it as is."""
    if dtype.is_floating_point or dtype.is_complex:
        return float("nan")
    if dtype == torch.bool:
        return None
    try:
        info = torch.iinfo(dtype)
    except TypeError:  # quantised and other exotic dtypes
        return None
    return -7777 if info.min <= -7777 else info.max


def _poisoned(t: torch.Tensor) -> torch.Tensor:
    if t.layout != torch.strided or t.device.type == "meta" or t.numel() == 0:
        return t
    value = _poison_value(t.dtype)
    if value is not None:
        with torch.no_grad():  # the tensor may be a leaf created with requires_grad=True
            t.fill_(value)
    return t


@pytest.fixture(autouse=True)
def poison_empty(monkeypatch):
    """Fill every ``torch.empty*`` allocation with NaN (floats) or a sentinel (ints)."""
    empty, empty_like, empty_strided = torch.empty, torch.empty_like, torch.empty_strided
    new_empty = torch.Tensor.new_empty

    monkeypatch.setattr(torch, "empty", lambda *a, **kw: _poisoned(empty(*a, **kw)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **kw: _poisoned(empty_like(*a, **kw)))
    monkeypatch.setattr(torch, "empty_strided", lambda *a, **kw: _poisoned(empty_strided(*a, **kw)))
    monkeypatch.setattr(torch.Tensor, "new_empty", lambda self, *a, **kw: _poisoned(new_empty(self, *a, **kw)))
    yield
