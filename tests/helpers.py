"""Shared test machinery: random inputs, runs of `flashforge.attention` and of the
float64 reference with the same arguments, and the tolerance policy.

Tolerance policy (STYLE.md): the error of ours against the float64 reference may
be at most ``C`` times the error PyTorch itself makes computing the reference in
the inputs' dtype, plus a rounding floor (per dtype, relative to the size of the
values compared).  Outputs and gradients are checked the same way: o, lse, dq,
dk, dv and the float mask's gradient.
"""
from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass, replace
from typing import Any, Optional, Union

import pytest
import torch

import flashforge
from flashforge import reference

HAS_TRITON = importlib.util.find_spec("triton") is not None
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"

#: Rounding floor per dtype, relative to max(1, max |reference|).
FLOOR = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
#: Allowed multiple of PyTorch's own same-dtype error.
C_ERR = 3.0

MASK_SHAPES = ("SqSk", "11SqSk", "B1SqSk", "1HSqSk", "BHSqSk", "B11Sk")


def backend_device(backend: str) -> str:
    """Where a backend's tests run: the CPU path on CPU; Triton on CUDA, or on CPU
    tensors through the Triton interpreter when there is no GPU."""
    if backend == "torch":
        return "cpu"
    return "cpu" if INTERPRET or not torch.cuda.is_available() else "cuda"


def backend_params():
    """`pytest.param`s for the two backends, Triton skipped (with the reason) where it cannot run."""
    triton_ok = HAS_TRITON and (INTERPRET or torch.cuda.is_available())
    return [
        pytest.param("torch", id="torch"),
        pytest.param("triton", id="triton", marks=pytest.mark.skipif(
            not triton_ok, reason="triton is not installed, or neither CUDA nor TRITON_INTERPRET=1")),
    ]


@dataclass(frozen=True)
class Case:
    """One attention call: shapes and options, described in plain values."""
    B: int = 2
    Sq: int = 17
    Sk: int = 17
    Hq: int = 2
    Hkv: int = 2
    D: int = 16
    Dv: Optional[int] = None  # None: = D
    causal: bool = False
    causal_offset: Union[int, tuple] = 0  # a tuple becomes an int tensor [B]
    offset_dtype: torch.dtype = torch.int32
    window: Any = None
    mask: Optional[str] = None  # None, "bool", "float", "float_grad", "bool_empty_rows", "float_neginf_rows"
    mask_shape: str = "BHSqSk"  # one of MASK_SHAPES, or for rank 2/3 inputs: "SqSk", "NSqSk", "1SqSk"
    dropout_p: float = 0.0
    seed: int = 0
    softcap: float = 0.0
    scale: Optional[float] = None
    layout: str = "bshd"  # "bshd" contiguous, "bhsd" ([B,H,S,D] transposed), "strided" (last-dim stride 2)
    lse_grad: bool = True  # the loss also uses lse (return_lse=True output gets a gradient)
    rank: int = 4  # 4: [B, S, H, D]; 3: flat [N, S, D] (N = B, H = 1); 2: [S, D] (B = H = 1)
    input_scale: float = 1.0  # q and k are multiplied by this (large: sharp softmax)
    alibi: Optional[str] = None  # None, "H" (slopes [Hq]) or "BH" (slopes [B, Hq])

    @property
    def dv(self) -> int:
        return self.D if self.Dv is None else self.Dv

    def kwargs(self, offset, alibi_slopes=None) -> dict:
        """Keyword arguments shared by `flashforge.attention` and the reference."""
        kw = dict(causal=self.causal, causal_offset=offset, window=self.window, dropout_p=self.dropout_p,
                  seed=self.seed, scale=self.scale, softcap=self.softcap)
        if alibi_slopes is not None:
            kw["alibi_slopes"] = alibi_slopes
        return kw


@dataclass
class Inputs:
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    mask: Optional[torch.Tensor]
    causal_offset: Union[int, torch.Tensor]
    do: torch.Tensor
    dlse: Optional[torch.Tensor]
    alibi_slopes: Optional[torch.Tensor] = None


def _layout(shape4, layout: str, gen: torch.Generator, scale: float, device, dtype, rank: int) -> torch.Tensor:
    """A random leaf tensor of the case's rank, with the requested strides.

    "bhsd": made as [B, H, S, D] (flat: [S, N, D]) and transposed, so the sequence
    dim is not the outer one; "strided": the last dim has stride 2 (the public layer
    must copy it once).  For [S, D] inputs "bhsd" gives a row stride of 2*D.
    """
    B, S, H, D = shape4
    shape = {2: (S, D), 3: (B, S, D), 4: (B, S, H, D)}[rank]
    if layout == "bshd":
        base, view = shape, (lambda t: t)
    elif layout == "bhsd" and rank == 4:
        base, view = (B, H, S, D), (lambda t: t.transpose(1, 2))
    elif layout == "bhsd" and rank == 3:
        base, view = (S, B, D), (lambda t: t.transpose(0, 1))
    elif layout == "bhsd":
        base, view = (2 * S, D), (lambda t: t[::2])
    elif layout == "strided":
        base, view = (*shape[:-1], 2 * D), (lambda t: t[..., ::2])
    else:
        raise ValueError(f"unknown layout {layout!r}")
    # scale and cast the storage, then take the view: elementwise ops may not keep odd strides
    x = (torch.randn(base, generator=gen) * scale).to(device=device, dtype=dtype)
    return view(x).detach().requires_grad_()


def _mask_shape(case: Case) -> tuple:
    B, Hq, Sq, Sk = case.B, case.Hq, case.Sq, case.Sk
    table = {"SqSk": (Sq, Sk), "11SqSk": (1, 1, Sq, Sk), "B1SqSk": (B, 1, Sq, Sk), "1HSqSk": (1, Hq, Sq, Sk),
             "BHSqSk": (B, Hq, Sq, Sk), "B11Sk": (B, 1, 1, Sk), "NSqSk": (B, Sq, Sk), "1SqSk": (1, Sq, Sk)}
    return table[case.mask_shape]


def make_mask(case: Case, device, dtype, gen: torch.Generator) -> Optional[torch.Tensor]:
    if case.mask is None:
        return None
    shape = _mask_shape(case)
    if case.mask.startswith("bool"):
        m = torch.rand(shape, generator=gen) < 0.75
    else:
        m = torch.randn(shape, generator=gen)
    if case.mask.endswith("_rows"):
        # empty some rows: every third query row, or (no query dim) all of batch 0
        empty = False if m.dtype == torch.bool else float("-inf")
        if shape[-2] > 1:
            m[..., 1::3, :] = empty
        else:
            m[0] = empty
    m = m.to(device=device, dtype=torch.bool if m.dtype == torch.bool else dtype)
    if case.mask in ("float_grad", "float_neginf_rows"):
        m.requires_grad_()
    return m


def make_inputs(case: Case, device="cpu", dtype=torch.float32, gen_seed: int = 0) -> Inputs:
    gen = torch.Generator().manual_seed(gen_seed)
    B, Sq, Sk, Hq, Hkv = case.B, case.Sq, case.Sk, case.Hq, case.Hkv
    q = _layout((B, Sq, Hq, case.D), case.layout, gen, case.input_scale, device, dtype, case.rank)
    k = _layout((B, Sk, Hkv, case.D), case.layout, gen, case.input_scale, device, dtype, case.rank)
    v = _layout((B, Sk, Hkv, case.dv), case.layout, gen, 1.0, device, dtype, case.rank)
    mask = make_mask(case, device, dtype, gen)
    if isinstance(case.causal_offset, tuple):
        offset = torch.tensor(case.causal_offset, dtype=case.offset_dtype, device=device)
    else:
        offset = case.causal_offset
    o_shape = {4: (B, Sq, Hq, case.dv), 3: (B, Sq, case.dv), 2: (Sq, case.dv)}[case.rank]
    lse_shape = {4: (B, Hq, Sq), 3: (B, Sq), 2: (Sq,)}[case.rank]
    do = torch.randn(o_shape, generator=gen).to(device=device, dtype=dtype)
    if case.layout == "bhsd" and case.rank == 4:  # a non-contiguous upstream gradient too
        do = torch.randn(B, Hq, Sq, case.dv, generator=gen).to(device=device, dtype=dtype).transpose(1, 2)
    dlse = torch.randn(lse_shape, generator=gen).to(device) if case.lse_grad else None
    slopes = None
    if case.alibi is not None:  # ALiBi's geometric slopes, scaled per batch row for "BH"
        base = 2.0 ** (-8.0 * torch.arange(1, Hq + 1, dtype=torch.float32) / Hq)
        slopes = base if case.alibi == "H" else base * torch.arange(1, B + 1, dtype=torch.float32).view(B, 1)
        slopes = slopes.to(device)
    return Inputs(q, k, v, mask, offset, do, dlse, slopes)


def _to4(x: torch.Tensor, rank: int) -> torch.Tensor:
    if rank == 2:
        return x.unsqueeze(0).unsqueeze(2)
    if rank == 3:
        return x.unsqueeze(2)
    return x


def _lse4(lse: torch.Tensor, rank: int) -> torch.Tensor:
    if rank == 2:
        return lse.view(1, 1, -1)
    if rank == 3:
        return lse.unsqueeze(1)
    return lse


def _grads(o, lse, inputs: Inputs, leaves):
    """Gradients of the leaves (None for those not requiring grad) for upstream do and, if any, dlse."""
    outs, grads_out = [o], [inputs.do.to(o.dtype)]
    if inputs.dlse is not None:
        outs.append(lse)
        grads_out.append(inputs.dlse.to(lse.dtype))
    needs = [t for t in leaves if t is not None and t.requires_grad]
    got = torch.autograd.grad(outs, needs, grads_out, allow_unused=True)
    it = iter(got)
    return [next(it) if (t is not None and t.requires_grad) else None for t in leaves]


def run_flashforge(case: Case, inputs: Inputs, backend: Optional[str], **extra) -> dict:
    """Our forward and backward; results in 4-D form (o, lse, dq, dk, dv) plus dmask (the mask's shape)."""
    kw = case.kwargs(inputs.causal_offset, inputs.alibi_slopes)
    kw.update(extra)
    o, lse = flashforge.attention(inputs.q, inputs.k, inputs.v, mask=inputs.mask, return_lse=True,
                                  backend=backend, **kw)
    dq, dk, dv, dmask = _grads(o, lse, inputs, [inputs.q, inputs.k, inputs.v, inputs.mask])
    r = case.rank
    return dict(o=_to4(o, r), lse=_lse4(lse, r), dq=_to4(dq, r), dk=_to4(dk, r), dv=_to4(dv, r), dmask=dmask)


def run_reference(case: Case, inputs: Inputs, dtype: torch.dtype) -> dict:
    """`flashforge.reference.attention` on detached clones of the inputs cast to `dtype`."""
    r = case.rank

    def leaf(t):
        return t.detach().to(dtype).requires_grad_(t.requires_grad)

    q, k, v = leaf(inputs.q), leaf(inputs.k), leaf(inputs.v)
    mask = None
    if inputs.mask is not None:
        mask = inputs.mask.detach().clone() if inputs.mask.dtype == torch.bool else leaf(inputs.mask)
    mask4 = mask
    if mask is not None and r == 3 and mask.dim() == 3:
        mask4 = mask.unsqueeze(1)
    o, lse = reference.attention(_to4(q, r), _to4(k, r), _to4(v, r), mask=mask4, return_lse=True,
                                 **case.kwargs(inputs.causal_offset, inputs.alibi_slopes))
    ref_inputs = Inputs(q, k, v, mask, inputs.causal_offset, inputs.do, inputs.dlse, inputs.alibi_slopes)
    o_r = o.reshape(inputs.do.shape) if r != 4 else o
    lse_r = lse.reshape(inputs.dlse.shape) if (r != 4 and inputs.dlse is not None) else lse
    dq, dk, dv, dmask = _grads(o_r, lse_r, ref_inputs, [q, k, v, mask])
    return dict(o=o.detach(), lse=lse.detach(), dq=_to4(dq, r), dk=_to4(dk, r), dv=_to4(dv, r), dmask=dmask)


def _snapshot(inputs: Inputs):
    ts = [inputs.q, inputs.k, inputs.v, inputs.mask, inputs.causal_offset, inputs.do, inputs.dlse]
    return [t.detach().clone() if isinstance(t, torch.Tensor) else t for t in ts]


def assert_inputs_unchanged(inputs: Inputs, before) -> None:
    after = [inputs.q, inputs.k, inputs.v, inputs.mask, inputs.causal_offset, inputs.do, inputs.dlse]
    names = ["q", "k", "v", "mask", "causal_offset", "do", "dlse"]
    for name, a, b in zip(names, after, before):
        if isinstance(a, torch.Tensor):
            assert torch.equal(a.detach(), b), f"input {name} was modified in place"


def assert_no_nan(name: str, x: Optional[torch.Tensor]) -> None:
    if x is None:
        return
    bad = torch.isnan(x)
    assert not bad.any(), (f"{name}: {int(bad.sum())} NaN of {x.numel()} (unwritten output?); "
                           f"first at {tuple(bad.nonzero()[0].tolist())}")
    if name != "lse":
        assert torch.isfinite(x).all(), f"{name}: contains +-Inf"


def assert_close(name: str, ours: torch.Tensor, ref64: torch.Tensor, ref_lowp: torch.Tensor,
                 dtype: torch.dtype, C: float = C_ERR, floor: Optional[float] = None) -> None:
    """max|ours - ref64| <= C * max|ref_lowp - ref64| + floor * max(1, max|ref64|),
    floor defaulting to FLOOR[dtype]."""
    assert ours.shape == ref64.shape, f"{name}: shape {tuple(ours.shape)}, expected {tuple(ref64.shape)}"
    if ours.numel() == 0:
        return
    err = (ours.double() - ref64).abs().max().item()
    base = (ref_lowp.double() - ref64).abs().max().item()
    floor = (FLOOR[dtype] if floor is None else floor) * max(1.0, ref64.abs().max().item())
    tol = C * base + floor
    assert err <= tol, (f"{name}: max error {err:.3e} > {tol:.3e} "
                        f"(= {C} x PyTorch {dtype} error {base:.3e} + floor {floor:.1e})")


def compare(ours: dict, ref64: dict, ref_lowp: dict, dtype: torch.dtype, C: float = C_ERR,
            floor: Optional[float] = None) -> None:
    """Check o, lse and every gradient of ours against the float64 reference."""
    for name in ("o", "dq", "dk", "dv", "dmask"):
        if ref64[name] is None:
            assert ours[name] is None, f"{name}: got a gradient where the reference has none"
            continue
        assert ours[name] is not None, f"{name}: no gradient returned"
        assert_no_nan(name, ours[name])
        assert ours[name].dtype == (ref_lowp[name].dtype), f"{name}: dtype {ours[name].dtype}"
    assert_no_nan("lse", ours["lse"])
    assert ours["lse"].dtype == torch.float32, f"lse dtype {ours['lse'].dtype}, expected float32"

    # lse: -inf exactly where the reference has it (fully masked rows), close elsewhere
    lse, lse64 = ours["lse"], ref64["lse"]
    empty = lse64 == float("-inf")
    assert not (lse == float("inf")).any(), "lse: contains +Inf"
    assert torch.equal(lse == float("-inf"), empty), (
        f"lse: -inf at {int((lse == float('-inf')).sum())} rows, reference at {int(empty.sum())}")
    fin = ~empty
    assert_close("lse", lse[fin], lse64[fin], ref_lowp["lse"][fin].double(), dtype, C, floor)
    if empty.any():
        rows = empty.transpose(1, 2)  # [B, Sq, Hq]
        assert (ours["o"][rows] == 0).all(), "o: fully masked rows must be exactly 0"
        if ours["dq"] is not None:
            assert (ours["dq"][rows] == 0).all(), "dq: fully masked rows must be exactly 0"

    for name in ("o", "dq", "dk", "dv", "dmask"):
        if ref64[name] is not None:
            assert_close(name, ours[name], ref64[name], ref_lowp[name], dtype, C, floor)


def check_case(case: Case, backend: Optional[str], device=None, dtype=torch.float32, C: float = C_ERR,
               floor: Optional[float] = None, gen_seed: int = 0, **extra) -> dict:
    """Run ours and the references on one case and compare everything; returns our results."""
    device = device or backend_device(backend or "torch")
    inputs = make_inputs(case, device, dtype, gen_seed)
    before = _snapshot(inputs)
    ours = run_flashforge(case, inputs, backend, **extra)
    assert_inputs_unchanged(inputs, before)
    ref64 = run_reference(case, inputs, torch.float64)
    ref_lowp = run_reference(case, inputs, dtype)
    compare(ours, ref64, ref_lowp, dtype, C, floor)
    return ours


def attention_keep_mask(backend: Optional[str], device, seed: int, B: int, Hq: int, Hkv: int, Sq: int, Sk: int,
                        p: float, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The dropout keep mask [B, Hq, Sq, Sk] as attention applies it (Sk <= 256).

    q = 0 makes P uniform (1/Sk) and v[j] = e_j makes o[i] = P'[i], so
    o * Sk * (1 - p) is exactly the 0/1 keep mask; checks the 1/(1-p) scaling too.
    """
    q = torch.zeros(B, Sq, Hq, 16, device=device, dtype=dtype)
    k = torch.zeros(B, Sk, Hkv, 16, device=device, dtype=dtype)
    v = torch.eye(Sk, device=device, dtype=dtype).view(1, Sk, 1, Sk).expand(B, Sk, Hkv, Sk)
    o = flashforge.attention(q, k, v, dropout_p=p, seed=seed, backend=backend)  # [B, Sq, Hq, Sk]
    scaled = (o.transpose(1, 2).float() * (Sk * (1 - p))).cpu()  # [B, Hq, Sq, Sk]
    keep = scaled > 0.5
    torch.testing.assert_close(scaled, keep.float(), rtol=0, atol=1e-4)
    return keep


def with_(case: Case, **changes) -> Case:
    return replace(case, **changes)
