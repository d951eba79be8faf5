"""What runs a case (needs a device; the CPU works for --cpu-smoke and the tests): the inputs, flashforge
and its peers (SDPA backends, FlexAttention with its masks, PyTorch's varlen_attn, our padded kernel), the
references, and the error checks against them."""

from __future__ import annotations

import contextlib
import functools
import inspect
import math
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch
import torch.nn.functional as F

from .cases import Case

SDPA_PEERS = ("cudnn", "flash", "efficient")
DROPOUT_SEED = 1234
OUTPUT_NAMES = ("o", "dq", "dk", "dv", "dbias")


def band_mask(Sq: int, Sk: int, offset: int = 0, window: Optional[int] = None, device="cpu") -> torch.Tensor:
    """Bool [1, 1, Sq, Sk], True = visible: causal with offset (and a left window), as flashforge means it."""
    i = torch.arange(Sq, device=device).view(Sq, 1) + offset
    j = torch.arange(Sk, device=device).view(1, Sk)
    keep = j <= i
    if window is not None:
        keep &= j >= i - window
    return keep.view(1, 1, Sq, Sk)


@functools.lru_cache(maxsize=None)
def band_mod(offset: int = 0, window: Optional[int] = None):
    """FlexAttention mask_mod of band_mask (one function object per parameters: no needless recompiles)."""
    def mask_mod(b, h, q_idx, kv_idx):
        keep = q_idx + offset >= kv_idx
        if window is not None:
            keep = keep & (q_idx + offset - kv_idx <= window)
        return keep
    return mask_mod


def doc_mod(doc: torch.Tensor, causal: bool):
    """FlexAttention mask_mod for packed sequences: same document (and causal)."""
    def mask_mod(b, h, q_idx, kv_idx):
        keep = doc[q_idx] == doc[kv_idx]
        if causal:
            keep = keep & (q_idx >= kv_idx)
        return keep
    return mask_mod


def bias_mod(bias: torch.Tensor):
    def score_mod(score, b, h, q_idx, kv_idx):
        return score + bias[b, 0, q_idx, kv_idx]
    return score_mod


_FLEX: dict = {}


def flex_function(compiled: bool, dynamic: Optional[bool] = None):
    """flex_attention, compiled once per process (recompile limits raised, as PERF.md says)."""
    from torch.nn.attention.flex_attention import flex_attention
    if not compiled:
        return flex_attention
    key = ("compiled", dynamic)
    if key not in _FLEX:
        import torch._dynamo
        cfg = torch._dynamo.config
        for name, value in (("recompile_limit", 1024), ("cache_size_limit", 1024),
                            ("accumulated_recompile_limit", 1 << 14), ("accumulated_cache_size_limit", 1 << 14)):
            try:
                if hasattr(cfg, name):
                    setattr(cfg, name, value)
            except Exception:
                pass
        _FLEX[key] = torch.compile(flex_attention, dynamic=dynamic)
    return _FLEX[key]


def _sdpa_backend(name: str):
    from torch.nn.attention import SDPBackend
    return {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}[name]


def _sdpa_ctx(name: str):
    from torch.nn.attention import sdpa_kernel
    be = _sdpa_backend(name)
    return lambda: sdpa_kernel(be)


@dataclass
class Impl:
    name: str
    fn: Callable                       # fn(*leaves) -> output, in the layout of ours
    ctx: Callable = contextlib.nullcontext
    leaves: Optional[list] = None      # own inputs (then never compared with the reference)
    do: Optional[torch.Tensor] = None
    timed: bool = True
    role: str = "peer"                 # "ours", "peer", "ref" (reference only, untimed)


@dataclass
class Inputs:
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    do: Optional[torch.Tensor] = None
    bias: Optional[torch.Tensor] = None
    keep: Optional[torch.Tensor] = None       # dense bool mask equivalent to the case (window / offset)
    cu: Optional[torch.Tensor] = None

    def leaves(self, case: Case) -> list:
        leaves = [self.q, self.k, self.v]
        if case.bias_grad:
            leaves.append(self.bias)
        return leaves


def make_inputs(case: Case, device: torch.device, seed: int = 0) -> Inputs:
    dtype = getattr(torch, case.dtype)
    g = torch.Generator(device=device).manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=g, device=device, dtype=dtype)

    grad = case.backward
    if case.seqlens:
        total = sum(case.seqlens)
        q, k, v = randn(total, case.Hq, case.D), randn(total, case.Hkv, case.D), randn(total, case.Hkv, case.D)
        do = randn(total, case.Hq, case.D) if grad else None
        cu = torch.tensor([0] + list(_cumsum(case.seqlens)), dtype=torch.int32, device=device)
        inp = Inputs(q, k, v, do, cu=cu)
    else:
        q = randn(case.B, case.Sq, case.Hq, case.D)
        k, v = randn(case.B, case.Sk, case.Hkv, case.D), randn(case.B, case.Sk, case.Hkv, case.D)
        inp = Inputs(q, k, v, randn(case.B, case.Sq, case.Hq, case.D) if grad else None)
        if case.bias:
            inp.bias = randn(case.B, 1, case.Sq, case.Sk)
        if case.window is not None or case.offset:
            inp.keep = band_mask(case.Sq, case.Sk, case.offset, case.window, device)
    for t in inp.leaves(case) if grad else ():
        t.requires_grad_(True)
    return inp


def _cumsum(xs):
    total = 0
    for x in xs:
        total += x
        yield total


def _window_arg(case: Case):
    return None if case.window is None else (case.window, 0)


def ours_impl(case: Case, inp: Inputs, name: str = "ours", deterministic: Optional[bool] = None) -> Impl:
    import flashforge
    det = case.deterministic if deterministic is None else deterministic
    if case.seqlens:
        mx = max(case.seqlens)

        def fn(q, k, v):
            return flashforge.attention_varlen(q, k, v, inp.cu, inp.cu, mx, mx, causal=case.causal,
                                               window=_window_arg(case), deterministic=det)
        return Impl(name, fn, role="ours")
    opts = dict(causal=case.causal, causal_offset=case.offset, window=_window_arg(case), dropout_p=case.dropout,
                seed=DROPOUT_SEED if case.dropout else None, deterministic=det)

    def fn(q, k, v, bias=inp.bias):
        return flashforge.attention(q, k, v, mask=bias, **opts)
    return Impl(name, fn, role="ours")


def sdpa_impl(case: Case, inp: Inputs, name: str, float32: bool = False) -> Impl:
    """SDPA with one backend forced, on transposed [B, H, S, D] views of our BSHD tensors."""
    mask = inp.keep
    is_causal = case.causal and mask is None
    kw = dict(dropout_p=case.dropout, is_causal=is_causal)
    if case.Hq != case.Hkv:
        kw["enable_gqa"] = True

    def fn(q, k, v, bias=inp.bias):
        m = bias if bias is not None else mask
        if float32:
            q, k, v = q.float(), k.float(), v.float()
            m = m.float() if m is not None and m.dtype != torch.bool else m
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                           attn_mask=m, **kw)
        return o.transpose(1, 2)
    return Impl(name, fn, _sdpa_ctx(name), timed=not float32, role="ref" if float32 else "peer")


def flex_impl(case: Case, inp: Inputs, compiled: bool, dynamic: Optional[bool]) -> Impl:
    from torch.nn.attention.flex_attention import create_block_mask
    if case.dropout or case.bias_grad:
        raise NotImplementedError("FlexAttention has no dropout / no bias gradient here")
    flex = flex_function(compiled, dynamic)
    dev = inp.q.device
    kw: dict = {}
    if case.Hq != case.Hkv:
        kw["enable_gqa"] = True
    if case.seqlens:
        total = sum(case.seqlens)
        doc = torch.repeat_interleave(torch.arange(len(case.seqlens), device=dev),
                                      torch.tensor(case.seqlens, device=dev))
        kw["block_mask"] = create_block_mask(doc_mod(doc, case.causal), None, None, total, total, device=dev)

        def fn(q, k, v):
            o = flex(q.unsqueeze(0).transpose(1, 2), k.unsqueeze(0).transpose(1, 2), v.unsqueeze(0).transpose(1, 2),
                     **kw)
            return o.transpose(1, 2).squeeze(0)
        return Impl("flex", fn)
    if case.causal and case.mode != "decode":
        kw["block_mask"] = create_block_mask(band_mod(case.offset, case.window), None, None, case.Sq, case.Sk,
                                             device=dev)
    if case.bias:
        kw["score_mod"] = bias_mod(inp.bias)

    def fn(q, k, v):
        return flex(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), **kw).transpose(1, 2)
    return Impl("flex", fn)


def varlen_attn_impl(case: Case, inp: Inputs) -> Impl:
    """PyTorch's own FA2 varlen entry point (torch.nn.attention.varlen), where this torch has it."""
    from torch.nn.attention.varlen import varlen_attn
    params = inspect.signature(varlen_attn).parameters
    kw: dict = {}
    if case.causal:
        if "is_causal" in params:
            kw["is_causal"] = True
        elif "window_size" in params:
            kw["window_size"] = (-1, 0)
        else:
            raise NotImplementedError("varlen_attn takes neither is_causal nor window_size")
    mx = max(case.seqlens)

    def fn(q, k, v):
        return varlen_attn(q, k, v, inp.cu, inp.cu, mx, mx, **kw)
    return Impl("varlen_attn", fn)


def padded_impl(case: Case, device: torch.device) -> Impl:
    """Our dense kernel on the batch padded to its longest sequence (own inputs; not compared)."""
    import flashforge
    n, mx = len(case.seqlens), max(case.seqlens)
    dtype = getattr(torch, case.dtype)
    g = torch.Generator(device=device).manual_seed(1)
    leaves = [torch.randn(n, mx, h, case.D, generator=g, device=device, dtype=dtype)
              for h in (case.Hq, case.Hkv, case.Hkv)]
    do = torch.randn(n, mx, case.Hq, case.D, generator=g, device=device, dtype=dtype) if case.backward else None
    for t in leaves if case.backward else ():
        t.requires_grad_(True)

    def fn(q, k, v):
        return flashforge.attention(q, k, v, causal=case.causal, window=_window_arg(case))
    return Impl("ours_padded", fn, leaves=leaves, do=do)


def sdpa_loop_impl(case: Case, inp: Inputs) -> Impl:
    """Varlen reference: SDPA on each sequence alone (math backend for float32)."""
    bounds = [0] + list(_cumsum(case.seqlens))

    def fn(q, k, v):
        outs = []
        for a, b in zip(bounds[:-1], bounds[1:]):
            qs, ks, vs = (t[a:b].transpose(0, 1).unsqueeze(0) for t in (q, k, v))
            outs.append(F.scaled_dot_product_attention(qs, ks, vs, is_causal=case.causal)[0].transpose(0, 1))
        return torch.cat(outs, 0)
    ctx = _sdpa_ctx("math") if case.dtype == "float32" else contextlib.nullcontext
    return Impl("sdpa_loop", fn, ctx, timed=False, role="ref")


def decode_impls(case: Case, inp: Inputs, peers: Sequence[str], flex_compiled: bool, flex_dynamic) -> list:
    """Decode: q [B, 1, Hq, D] against full caches [B, L, Hkv, D]; ours contiguous and paged."""
    import flashforge
    B, L, Hkv, D = case.B, case.Sk, case.Hkv, case.D
    page = 256 if L % 256 == 0 else 16  # 16: the shrunk caches of --cpu-smoke
    impls = [Impl("fp32_reference", _decode_reference, timed=False, role="ref")]
    for name in peers:
        if name in SDPA_PEERS:
            impls.append(sdpa_impl(case, inp, name))
        elif name == "flex":
            impls.append(_Deferred(name, functools.partial(flex_impl, case, inp, flex_compiled, flex_dynamic)))

    # the key counts as a device tensor made once, as a server keeps them (an int would add a
    # fill kernel to every timed call: ~2 us of a 10 us B = 1 step)
    seqlens = torch.full((B,), L, dtype=torch.int32, device=inp.q.device)

    def ours(q, k, v):
        return flashforge.attention_with_kvcache(q, k, v, cache_seqlens=seqlens)
    impls.append(Impl("ours", ours, role="ours"))

    def build_paged():
        nb = B * L // page
        perm = torch.randperm(nb, device=inp.q.device)
        kp = torch.empty(nb, page, Hkv, D, dtype=inp.k.dtype, device=inp.k.device)
        vp = torch.empty_like(kp)
        kp[perm] = inp.k.reshape(nb, page, Hkv, D)
        vp[perm] = inp.v.reshape(nb, page, Hkv, D)
        table = perm.view(B, L // page).to(torch.int32)

        def paged(q, k, v):
            return flashforge.attention_with_kvcache(q, kp, vp, cache_seqlens=seqlens, block_table=table)
        return Impl("ours_paged", paged, role="ours")
    impls.append(_Deferred("ours_paged", build_paged, role="ours"))
    return impls


def _decode_reference(q, k, v):
    """float32 attention of one query per row over the whole cache, a few rows at a time."""
    B, _, Hq, D = q.shape
    L, Hkv = k.shape[1], k.shape[2]
    G = Hq // Hkv
    out = torch.empty(B, 1, Hq, D, dtype=torch.float32, device=q.device)
    step = max(1, int(2**30 // max(1, L * Hkv * D * 4)))
    for b0 in range(0, B, step):
        b1 = min(B, b0 + step)
        qf = q[b0:b1, 0].float().view(b1 - b0, Hkv, G, D)
        kf, vf = k[b0:b1].float(), v[b0:b1].float()
        s = torch.einsum("cngd,clnd->cngl", qf, kf) / math.sqrt(D)
        out[b0:b1, 0] = torch.einsum("cngl,clnd->cngd", s.softmax(-1), vf).reshape(b1 - b0, Hq, D)
    return out


class _Deferred(Impl):
    """An Impl whose setup (block masks, paged copies, imports) runs inside the per-peer error handling."""

    def __init__(self, name: str, build: Callable, role: str = "peer"):
        super().__init__(name, None, role=role)
        self.build = build


def build_impls(case: Case, inp: Inputs, device: torch.device, *, flex_compiled: bool = True,
                flex_dynamic: Optional[bool] = None, skip: Sequence[str] = ()) -> list:
    """Every implementation of a case, in run order: references first, then ours, then the others."""
    peers = [p for p in case.peers if p not in skip]
    if case.mode == "decode":
        return decode_impls(case, inp, peers, flex_compiled, flex_dynamic)
    impls: list = []
    if case.seqlens:
        impls.append(sdpa_loop_impl(case, inp))
    for name in peers:  # SDPA backends first: the first that runs is the reference
        if name in SDPA_PEERS and not case.seqlens:
            impls.append(sdpa_impl(case, inp, name))
    impls.append(ours_impl(case, inp))
    for name in peers:
        if name == "flex":
            impls.append(_Deferred("flex", functools.partial(flex_impl, case, inp, flex_compiled, flex_dynamic),
                                   "peer"))
        elif name == "varlen_attn":
            impls.append(_Deferred("varlen_attn", functools.partial(varlen_attn_impl, case, inp), "peer"))
        elif name == "ours_padded":
            impls.append(_Deferred("ours_padded", functools.partial(padded_impl, case, device), "peer"))
        elif name == "ours_default":
            impls.append(ours_impl(case, inp, "ours_default", deterministic=False))
            impls[-1].role = "peer"
    return impls


def reference_order(case: Case) -> list:
    """Names whose output may serve as the reference, best first; [] = no comparison (dropout)."""
    if case.dropout:
        return []
    if case.mode == "decode":
        return ["fp32_reference"]
    if case.seqlens:
        return ["sdpa_loop"]
    if case.dtype == "float32":
        return ["math"]
    return ["cudnn", "flash", "efficient", "math"]


def math_ref_bytes(case: Case) -> float:
    """Rough size of the float32 math reference's score tensors."""
    per = case.B * case.Hq * case.Sq * case.Sk * 4.0
    return per * (4 if case.backward else 2) + (per if case.bias else 0)


def rel_errors(out: Sequence[torch.Tensor], ref: Sequence[torch.Tensor]) -> dict:
    """||out - ref|| / ||ref|| per tensor (inf for a shape mismatch or a non-finite value)."""
    errs = {}
    for name, a, b in zip(OUTPUT_NAMES, out, ref):
        if a is None or b is None or a.shape != b.shape:
            errs[name] = math.inf
            continue
        a, b = a.float(), b.float()
        if not bool(torch.isfinite(a).all()):
            errs[name] = math.inf
            continue
        num, den = float((a - b).norm()), float(b.norm())
        errs[name] = num / den if den > 0 else num
    if len(out) != len(ref):
        errs["count"] = math.inf
    return errs


def finite_check(out: Sequence[torch.Tensor], shapes: Sequence[tuple]) -> dict:
    """Dropout rows: only shapes and finiteness (inf marks a failure)."""
    return {name: (0.0 if tuple(a.shape) == tuple(s) and bool(torch.isfinite(a.float()).all()) else math.inf)
            for name, a, s in zip(OUTPUT_NAMES, out, shapes)}
