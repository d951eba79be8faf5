"""Quick GPU smoke: correctness of every feature vs float64 and a few timings vs SDPA."""
import math, sys, time, torch
import torch.nn.functional as F
import triton
import flashforge
from flashforge import reference as R

dev = "cuda"
torch.manual_seed(0)

def check(B=2, Sq=300, Sk=513, Hq=4, Hkv=2, D=64, Dv=64, dtype=torch.bfloat16, mask_shape=None, mask_bool=False, mgrad=False, **kw):
    q = torch.randn(B, Sq, Hq, D, device=dev, dtype=dtype); k = torch.randn(B, Sk, Hkv, D, device=dev, dtype=dtype)
    v = torch.randn(B, Sk, Hkv, Dv, device=dev, dtype=dtype)
    mask = None
    if mask_shape is not None:
        mask = (torch.rand(mask_shape, device=dev) > 0.3) if mask_bool else torch.randn(mask_shape, device=dev)
        if mgrad: mask.requires_grad_()
    ins = [t.clone().requires_grad_() for t in (q, k, v)]
    o, lse = flashforge.attention(*ins, mask=mask, return_lse=True, **kw)
    do = torch.randn_like(o); dl = torch.randn_like(lse)
    ((o.float() * do.float()).sum() + (lse.nan_to_num(neginf=0) * dl).sum()).backward()
    refs = [t.double().clone().requires_grad_() for t in (q, k, v)]
    mref = None if mask is None else (mask.detach().double().requires_grad_() if mgrad else (mask if mask_bool else mask.double()))
    ro, rl = R.attention(*refs, mask=mref, return_lse=True, **kw)
    ((ro * do.double()).sum() + (rl.nan_to_num(neginf=0) * dl.double()).sum()).backward()
    def rel(a, b): return ((a.double() - b).norm() / b.norm().clamp_min(1e-30)).item()
    errs = [rel(o, ro), rel(lse.nan_to_num(neginf=0), rl.nan_to_num(neginf=0))] + [rel(a.grad, b.grad) for a, b in zip(ins, refs)]
    if mgrad: errs.append(rel(mask.grad, mref.grad))
    bad = any(torch.isnan(t).any().item() for t in [o, lse.nan_to_num(neginf=0)] + [i.grad for i in ins])
    tol = 2e-2 if dtype != torch.float32 else 1e-4
    ok = (max(errs) < tol) and not bad
    print("OK " if ok else "BAD", dtype, kw, mask_shape, " ".join("%.1e" % e for e in errs), "NaN!" if bad else "", flush=True)
    return ok

allok = True
for dt in (torch.bfloat16, torch.float16, torch.float32):
    for D, Dv in ((64, 64), (40, 24), (64, 24), (40, 40), (16, 64), (1, 1), (200, 72), (128, 128), (256, 256), (96, 128)):
        allok &= check(D=D, Dv=Dv, dtype=dt)
        allok &= check(D=D, Dv=Dv, dtype=dt, causal=True)
for kw in [dict(causal=True, causal_offset=200), dict(causal=True, causal_offset=torch.tensor([100, -50], device=dev)),
           dict(window=(64, 32)), dict(window=100, causal=True), dict(dropout_p=0.2, seed=3), dict(softcap=5.0),
           dict(mask_shape=(2, 1, 300, 513), mgrad=True), dict(mask_shape=(1, 4, 1, 513), mgrad=True),
           dict(mask_shape=(300, 513), mask_bool=True), dict(Hq=6, Hkv=1, causal=True, causal_offset=-100),
           dict(Sq=1, Sk=4000), dict(Sq=1000, Sk=1, causal=True)]:
    allok &= check(**kw)
# dropout mask equality on GPU
from flashforge.ops.dropout import dropout_mask
B, H, S = 2, 3, 77
v = torch.eye(S, device=dev).expand(B, S, S).unsqueeze(2).expand(B, S, H, S).contiguous()
q = torch.zeros(B, S, H, 16, device=dev); k = torch.zeros(B, S, H, 16, device=dev)
o = flashforge.attention(q, k, v, dropout_p=0.4, seed=11)
keep_gpu = (o != 0).permute(0, 2, 1, 3)
same = bool((keep_gpu.cpu() == dropout_mask(11, B, H, S, S, 0.4)).all())
print("dropout mask equal to CPU definition:", same); allok &= same

def tflops(ms, B, H, S, D, causal, mult=1.0):
    f = 4 * B * H * S * S * D * (0.5 if causal else 1.0) * mult
    return f / ms * 1e-9

print("\n%-26s %9s %9s %9s %6s" % ("case", "ours", "cudnn", "flash", "ratio"))
for D in (64, 128):
    for S in (1024, 4096, 16384):
        for causal in (False, True):
            B, H = 16384 // S, 2048 // D
            q, k, v = (torch.randn(B, S, H, D, device=dev, dtype=torch.bfloat16) for _ in range(3))
            ours = triton.testing.do_bench(lambda: flashforge.attention(q, k, v, causal=causal), return_mode="median")
            qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
            res = {}
            for name, be in (("cudnn", torch.nn.attention.SDPBackend.CUDNN_ATTENTION), ("flash", torch.nn.attention.SDPBackend.FLASH_ATTENTION)):
                try:
                    with torch.nn.attention.sdpa_kernel(be):
                        res[name] = triton.testing.do_bench(lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal), return_mode="median")
                except Exception as e:
                    res[name] = float("nan")
            fw = lambda ms: tflops(ms, B, H, S, D, causal)
            print("%-26s %9.0f %9.0f %9.0f %6.2f" % (f"fwd D{D} S{S} c{int(causal)}", fw(ours), fw(res['cudnn']), fw(res['flash']), res['cudnn'] / ours), flush=True)
            # fwd+bwd
            qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
            o = flashforge.attention(qg, kg, vg, causal=causal); do = torch.randn_like(o)
            def fb():
                o = flashforge.attention(qg, kg, vg, causal=causal); o.backward(do)
            ours = triton.testing.do_bench(fb, return_mode="median")
            qt, kt, vt = (t.transpose(1, 2).detach().requires_grad_() for t in (q, k, v))
            dot = do.transpose(1, 2)
            def fbc():
                o = F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal); o.backward(dot)
            with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.CUDNN_ATTENTION):
                cd = triton.testing.do_bench(fbc, return_mode="median")
            fb_ = lambda ms: tflops(ms, B, H, S, D, causal, 3.5)
            print("%-26s %9.0f %9.0f %9s %6.2f" % (f"f+b D{D} S{S} c{int(causal)}", fb_(ours), fb_(cd), "", cd / ours), flush=True)
print("ALL OK" if allok else "SOME BAD")
