"""What runs a case (needs a device; the CPU works for the main job, --cpu-smoke and the tests):
flashforge and its peers -- SDPA with a backend forced or its own choice, FA4 (fa4.py), FlexAttention
(flex.py), PyTorch's varlen_attn, our padded kernel -- and the references, as Impl objects in run order."""

from __future__ import annotations

import contextlib
import functools
import inspect
import itertools
import math
from typing import Optional, Sequence

import torch
import torch.nn.functional as F

import flashforge

from .cases import Case
from .fa4 import fa4_impl
from .flex import flex_impl
from .impl import Deferred, Impl
from .inputs import Inputs

# "sdpa": SDPA's own choice of backend (the CPU's yardstick); the others force one with sdpa_kernel
SDPA_PEERS = ("cudnn", "flash", "efficient", "sdpa")
DROPOUT_SEED = 1234


def _sdpa_ctx(name: str):
    if name == "sdpa":
        return contextlib.nullcontext
    from torch.nn.attention import SDPBackend, sdpa_kernel
    be = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
          "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}[name]
    return lambda: sdpa_kernel(be)


def _window_arg(case: Case):
    return None if case.window is None else (case.window, 0)


def ours_impl(case: Case, inp: Inputs, name: str = "ours", deterministic: Optional[bool] = None) -> Impl:
    det = case.deterministic if deterministic is None else deterministic
    if case.seqlens:
        longest = max(case.seqlens)

        def packed(q, k, v):
            return flashforge.attention_varlen(q, k, v, inp.cu, inp.cu, longest, longest, causal=case.causal,
                                               window=_window_arg(case), deterministic=det)
        return Impl(name, packed, role="ours")
    opts = dict(causal=case.causal, causal_offset=case.offset, window=_window_arg(case), dropout_p=case.dropout,
                seed=DROPOUT_SEED if case.dropout else None, deterministic=det, softcap=case.softcap)

    def fn(q, k, v, bias=inp.bias):
        return flashforge.attention(q, k, v, mask=bias, **opts)
    return Impl(name, fn, role="ours")


def sdpa_impl(case: Case, inp: Inputs, name: str, float32: bool = False) -> Impl:
    """SDPA (backend `name`) on transposed [B, H, S, D] views of our BSHD tensors; float32=True is the
    float32 math reference."""
    mask = inp.keep
    is_causal = case.causal and mask is None
    kw = dict(dropout_p=case.dropout, is_causal=is_causal)
    if case.Hq != case.Hkv:
        kw["enable_gqa"] = True

    def fn(q, k, v, bias=inp.bias):
        if case.softcap:
            raise NotImplementedError("SDPA has no softcap")
        m = bias if bias is not None else mask
        if float32:
            q, k, v = q.float(), k.float(), v.float()
            m = m.float() if m is not None and m.dtype != torch.bool else m
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                           attn_mask=m, **kw)
        return o.transpose(1, 2)
    return Impl(name, fn, _sdpa_ctx(name), timed=not float32, role="ref" if float32 else "peer")


def torch_reference_impl(case: Case) -> Impl:
    """Reference of the rows SDPA cannot compute (softcap): flashforge's PyTorch path (`backend="torch"`,
    chunked torch ops, none of our kernels) on float32 copies of the inputs."""
    def fn(q, k, v):
        return flashforge.attention(q.float(), k.float(), v.float(), causal=case.causal, causal_offset=case.offset,
                                    window=_window_arg(case), softcap=case.softcap, backend="torch")
    return Impl("fp32_torch", fn, timed=False, role="ref")


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
    longest = max(case.seqlens)

    def fn(q, k, v):
        return varlen_attn(q, k, v, inp.cu, inp.cu, longest, longest, **kw)
    return Impl("varlen_attn", fn)


def padded_impl(case: Case, device: torch.device) -> Impl:
    """Our dense kernel on the batch padded to its longest sequence (own inputs; not compared)."""
    n, longest = len(case.seqlens), max(case.seqlens)
    dtype = getattr(torch, case.dtype)
    g = torch.Generator(device=device).manual_seed(1)
    leaves = [torch.randn(n, longest, h, case.D, generator=g, device=device, dtype=dtype)
              for h in (case.Hq, case.Hkv, case.Hkv)]
    do = torch.randn(n, longest, case.Hq, case.D, generator=g, device=device, dtype=dtype) if case.backward else None
    for t in leaves if case.backward else ():
        t.requires_grad_(True)

    def fn(q, k, v):
        return flashforge.attention(q, k, v, causal=case.causal, window=_window_arg(case))
    return Impl("ours_padded", fn, leaves=leaves, do=do)


def sdpa_loop_impl(case: Case, inp: Inputs) -> Impl:
    """Varlen reference: SDPA on each sequence alone (math backend for float32)."""
    bounds = [0, *itertools.accumulate(case.seqlens)]

    def fn(q, k, v):
        outs = []
        for a, b in zip(bounds[:-1], bounds[1:]):
            qs, ks, vs = (t[a:b].transpose(0, 1).unsqueeze(0) for t in (q, k, v))
            outs.append(F.scaled_dot_product_attention(qs, ks, vs, is_causal=case.causal)[0].transpose(0, 1))
        return torch.cat(outs, 0)
    ctx = _sdpa_ctx("math") if case.dtype == "float32" else contextlib.nullcontext
    return Impl("sdpa_loop", fn, ctx, timed=False, role="ref")


def decode_reference(q, k, v):
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


def decode_impls(case: Case, inp: Inputs, peers: Sequence[str], flex_compiled: bool, flex_dynamic) -> list:
    """Decode: q [B, 1, Hq, D] against full caches [B, L, Hkv, D]; ours contiguous and paged."""
    B, L, Hkv, D = case.B, case.Sk, case.Hkv, case.D
    page = 256 if L % 256 == 0 else 16  # 16: the shrunk caches of --cpu-smoke
    impls = [Impl("fp32_reference", decode_reference, timed=False, role="ref")]
    for name in peers:
        if name in SDPA_PEERS:
            impls.append(sdpa_impl(case, inp, name))

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
    impls.append(Deferred("ours_paged", build_paged, role="ours"))
    # the other peers after ours: one that breaks the device cannot cost our numbers
    for name in peers:
        if name == "flex":
            impls.append(Deferred(name, functools.partial(flex_impl, case, inp, flex_compiled, flex_dynamic)))
        elif name == "fa4":
            impls.append(Deferred(name, functools.partial(fa4_impl, case, inp)))
    return impls


def build_impls(case: Case, inp: Inputs, device: torch.device, *, flex_compiled: bool = True,
                flex_dynamic: Optional[bool] = None, skip: Sequence[str] = ()) -> list:
    """Every implementation of a case, in run order: references and SDPA first, then ours, then the others
    (one that breaks the device -- a compiler crash, an illegal access -- cannot cost our numbers)."""
    peers = [p for p in case.peers if p not in skip]
    if case.mode == "decode":
        return decode_impls(case, inp, peers, flex_compiled, flex_dynamic)
    impls: list = []
    if case.seqlens:
        impls.append(sdpa_loop_impl(case, inp))
    if case.softcap:
        impls.append(torch_reference_impl(case))
    for name in peers:  # SDPA backends first: the first that runs is the reference
        if name in SDPA_PEERS and not case.seqlens:
            impls.append(sdpa_impl(case, inp, name))
    impls.append(ours_impl(case, inp))
    for name in peers:
        if name == "flex":
            impls.append(Deferred("flex", functools.partial(flex_impl, case, inp, flex_compiled, flex_dynamic)))
        elif name == "fa4":
            impls.append(Deferred("fa4", functools.partial(fa4_impl, case, inp)))
        elif name == "varlen_attn":
            impls.append(Deferred("varlen_attn", functools.partial(varlen_attn_impl, case, inp)))
        elif name == "ours_padded":
            impls.append(Deferred("ours_padded", functools.partial(padded_impl, case, device)))
        elif name == "ours_default":
            impls.append(ours_impl(case, inp, "ours_default", deterministic=False))
            impls[-1].role = "peer"
    return impls
