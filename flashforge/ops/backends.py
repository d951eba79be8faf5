"""Which module implements an op on a backend: "torch" (the PyTorch path) or "triton"
(the kernels, importable only where triton is installed)."""
from __future__ import annotations

import importlib
from types import ModuleType

_MODULES = {
    ("attention", "torch"): "flashforge.ops.attention_torch",
    ("attention", "triton"): "flashforge.ops.triton.attention",
    ("rope", "torch"): "flashforge.ops.rope_torch",
    ("rope", "triton"): "flashforge.ops.triton.rope",
    ("kvcache", "torch"): "flashforge.ops.kvcache_torch",
    ("kvcache", "triton"): "flashforge.ops.triton.kvcache",
    ("merge", "torch"): "flashforge.ops.merge_torch",
    ("merge", "triton"): "flashforge.ops.triton.merge",
}


_loaded: dict = {}  # (op, backend) -> module: import_module costs host time on every call


def backend_module(op: str, backend: str) -> ModuleType:
    module = _loaded.get((op, backend))
    if module is not None:
        return module
    try:
        module = _loaded[op, backend] = importlib.import_module(_MODULES[op, backend])
    except ImportError as e:  # triton missing (e.g. macOS, Windows)
        raise ValueError(f"backend={backend!r} is not available here: {e}") from e
    return module
