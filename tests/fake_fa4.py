"""A stand-in for FA4's `flash_attn.cute` on the CPU (the real one needs an sm90 GPU), for the benchmark
tests: put it in sys.modules["flash_attn.cute"] and clear flashforge.benchmark.fa4.load's cache."""
import types

import flashforge


def fake_fa4_module(calls: list):
    """flash_attn.cute's two entry points with FA4's meaning (bottom-right causal, window_size = (left,
    right), (out, lse) returned), computed by our CPU path; qv, FA4's fourth positional argument, must stay
    unset: every other argument has to be passed by keyword."""
    mod = types.ModuleType("flash_attn.cute")

    def flash_attn_func(q, k, v, qv=None, *, causal=False, window_size=(None, None), softcap=0.0, **rest):
        assert qv is None and not rest
        calls.append(("dense", causal, window_size, softcap))
        left = window_size[0]
        o = flashforge.attention(q, k, v, causal=causal or left is not None, causal_offset="bottom_right",
                                 window=None if left is None else (left, 0), softcap=softcap)
        return o, None

    def flash_attn_varlen_func(q, k, v, qv=None, *, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                               causal=False, window_size=(None, None), **rest):
        assert qv is None and not rest and window_size == (None, None)
        calls.append(("varlen", causal, window_size))
        return flashforge.attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                           causal=causal), None
    mod.flash_attn_func, mod.flash_attn_varlen_func = flash_attn_func, flash_attn_varlen_func
    return mod
