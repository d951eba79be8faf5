"""FlashAttention-4 (the flash-attn-4 package, CuTe DSL kernels) as a peer.

Imported lazily, once: where it is missing or broken the peer has no number, `status()` says why, and
the ratios are taken against cuDNN alone.  The GPU machine gets it in two device calls
(../shared/tools/fa4/README.md; scripts/device.sh puts the staged packages on PYTHONPATH).  Its entry
points: `flash_attn_func(q, k, v, causal=, window_size=(left, right))` on [B, S, H, D] and
`flash_attn_varlen_func(q, k, v, cu_seqlens_q=, ...)` on packed [total, H, D], both returning
(out, lse), backward through autograd.  Its causal mask is aligned bottom-right, GQA is Hkv < Hq, and
it compiles one kernel per (dtype, head dim, mask kind, ...), not per sequence length: the Runner's
warm-up call pays that outside the timed region.
"""

from __future__ import annotations

import functools
import importlib
from typing import Optional

from .cases import Case
from .impl import Impl
from .inputs import Inputs

MODULE = "flash_attn.cute"
DIST = "flash-attn-4"


@functools.lru_cache(maxsize=None)
def load() -> tuple:
    """(the module, None), or (None, why it cannot be imported)."""
    try:
        return importlib.import_module(MODULE), None
    except Exception as e:  # not installed, or a broken install (a missing shared library is an OSError)
        return None, f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"[:240]


def status() -> dict:
    """{"available": True, "version": ...} or {"available": False, "error": why}, for the environment."""
    mod, why = load()
    if mod is None:
        return {"available": False, "error": why}
    try:
        from importlib.metadata import version
        ver = version(DIST)
    except Exception:  # imported from a folder on PYTHONPATH without its metadata
        ver = getattr(mod, "__version__", None)
    return {"available": True, "version": ver}


def unsupported(case: Case) -> Optional[str]:
    """Why FA4 cannot compute this case, or None."""
    if case.dtype not in ("bfloat16", "float16"):
        return f"FA4 takes float16 and bfloat16, not {case.dtype}"
    if case.bias:
        return "FA4 takes no additive bias"
    if case.dropout:
        return "FA4 has no dropout"
    if case.deterministic:
        return "FA4's deterministic backward is not compared here"
    if case.offset and case.offset != case.Sk - case.Sq:
        return f"FA4's causal mask is bottom-right (offset Sk - Sq = {case.Sk - case.Sq}), not offset {case.offset}"
    if case.D > 256 or case.D % 8:
        return f"FA4 takes head dims up to 256 in multiples of 8, not {case.D}"
    return None


def _out(result):
    """FA4 returns (out, lse); only out is compared and backpropagated."""
    return result[0] if isinstance(result, tuple) else result


def fa4_impl(case: Case, inp: Inputs) -> Impl:
    why = unsupported(case)
    if why:
        raise NotImplementedError(why)
    mod, err = load()
    if mod is None:
        raise ImportError(f"FA4 not importable: {err}")
    window = (case.window, 0) if case.window is not None else (None, None)
    causal = case.causal and case.mode != "decode"
    extra = dict(softcap=case.softcap) if case.softcap else {}
    if case.seqlens:
        longest = max(case.seqlens)

        def packed(q, k, v):
            return _out(mod.flash_attn_varlen_func(q, k, v, cu_seqlens_q=inp.cu, cu_seqlens_k=inp.cu,
                                                   max_seqlen_q=longest, max_seqlen_k=longest, causal=causal,
                                                   window_size=window, **extra))
        return Impl("fa4", packed)

    def fn(q, k, v):
        return _out(mod.flash_attn_func(q, k, v, causal=causal, window_size=window, **extra))
    return Impl("fa4", fn)
