"""Host-side cost of one call, split into our Python and Triton's launches (GPU).
A diagnostic: each kernel's launch is replaced by a no-op in turn.

    PYTHONPATH=. python benchmarks/profile/host_overhead.py
"""
import sys

import torch

from decode_profile import host_us as per_call_us  # this folder is on sys.path when run as a script


def main():
    import flashforge
    from flashforge.ops.triton import attention_fwd, attention_bwd
    dev = torch.device("cuda")
    q = torch.randn(1, 1, 32, 128, device=dev, dtype=torch.bfloat16)
    k = torch.randn(1, 4096, 8, 128, device=dev, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    seqlens = torch.full((1,), 4096, dtype=torch.int32, device=dev)
    qs, ks, vs = (torch.randn(1, 128, 8, 64, device=dev, dtype=torch.bfloat16) for _ in range(3))
    qg = qs.clone().requires_grad_(True)
    do = torch.randn_like(qs)
    cases = {
        "decode (split)": lambda: flashforge.attention_with_kvcache(q, k, v, cache_seqlens=seqlens),
        "decode (1 split)": lambda: flashforge.attention_with_kvcache(q, k, v, cache_seqlens=seqlens, num_splits=1),
        "decode, int cache_seqlens": lambda: flashforge.attention_with_kvcache(q, k, v, cache_seqlens=4096),
        "fwd tiny": lambda: flashforge.attention(qs, ks, vs),
        "fwd+bwd tiny": lambda: torch.autograd.grad(flashforge.attention(qg, ks, vs), qg, do),
        "torch sdpa tiny (reference point)": lambda: torch.nn.functional.scaled_dot_product_attention(
            qs.transpose(1, 2), ks.transpose(1, 2), vs.transpose(1, 2)),
    }
    kernels = {"fwd": attention_fwd.attn_fwd_kernel, "combine": attention_fwd.attn_fwd_combine_kernel,
               "preprocess": attention_bwd.attn_bwd_preprocess_kernel, "dkdv": attention_bwd.attn_bwd_dkdv_kernel,
               "dq": attention_bwd.attn_bwd_dq_kernel}
    for name, fn in cases.items():
        full = per_call_us(fn)
        parts = []
        for kname, kern in kernels.items():
            kern.run_real = kern.run
            kern.run = lambda *a, **kw: None
            try:
                without = per_call_us(fn)
            finally:
                kern.run = kern.run_real
            if full - without > 2:
                parts.append(f"{kname} launch {full - without:.0f}")
        for kern in kernels.values():
            kern.run_real = kern.run
            kern.run = lambda *a, **kw: None
        try:
            python_only = per_call_us(fn)
        finally:
            for kern in kernels.values():
                kern.run = kern.run_real
        print(f"{name:36s} {full:7.1f} us per call; without any launch {python_only:6.1f}; " + ", ".join(parts),
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
