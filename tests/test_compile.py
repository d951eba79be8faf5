"""torch.compile traces flashforge without graph breaks (custom ops with fake
implementations and registered autograd), with dynamic sequence lengths, and
gives eager's outputs and gradients."""
import pytest
import torch
import torch._dynamo

import flashforge


class Block(torch.nn.Module):
    """A pre-norm transformer block: GQA attention with RoPE, then an MLP."""

    def __init__(self, dim=64, heads=4, kv_heads=2, dropout_p=0.0):
        super().__init__()
        self.h, self.hkv, self.d = heads, kv_heads, dim // heads
        self.norm1 = torch.nn.LayerNorm(dim)
        self.qkv = torch.nn.Linear(dim, (heads + 2 * kv_heads) * self.d)
        self.out = torch.nn.Linear(heads * self.d, dim)
        self.norm2 = torch.nn.LayerNorm(dim)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(dim, 2 * dim), torch.nn.GELU(), torch.nn.Linear(2 * dim, dim))
        self.dropout_p = dropout_p

    def forward(self, x, bias=None, seed=None):
        B, S, _ = x.shape
        q, k, v = self.qkv(self.norm1(x)).split([self.h * self.d, self.hkv * self.d, self.hkv * self.d], dim=-1)
        q = flashforge.apply_rope(q.view(B, S, self.h, self.d))
        k = flashforge.apply_rope(k.view(B, S, self.hkv, self.d))
        v = v.view(B, S, self.hkv, self.d)
        a = flashforge.attention(q, k, v, causal=True, mask=bias, dropout_p=self.dropout_p, seed=seed,
                                 softcap=20.0)
        x = x + self.out(a.reshape(B, S, -1))
        return x + self.mlp(self.norm2(x))


def _run(model, x, bias=None, seed=None):
    x = x.detach().clone().requires_grad_()
    y = model(x, bias, seed)
    y.square().mean().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    out = [y.detach(), x.grad]
    if bias is not None:
        out.append(bias.grad.clone())
        bias.grad = None
    return out + grads


DEVICES = [pytest.param("cpu", id="cpu"), pytest.param("cuda", id="cuda", marks=pytest.mark.gpu)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_block_compiles_fullgraph_and_matches_eager(backend, device):
    """CPU: the PyTorch path; CUDA: the Triton kernels (default backend for CUDA tensors)."""
    torch.manual_seed(0)
    model = Block(dropout_p=0.1).to(device)
    x = torch.randn(2, 19, 64, device=device)
    bias = torch.randn(1, 4, 19, 19, device=device, requires_grad=True)
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend=backend)
    eager = _run(model, x, bias, seed=5)
    got = _run(compiled, x, bias, seed=5)
    for i, (a, b) in enumerate(zip(got, eager)):
        torch.testing.assert_close(a, b, rtol=2e-4, atol=2e-5, msg=f"output {i}")


def test_unseeded_dropout_traces_and_follows_manual_seed():
    model = Block(dropout_p=0.2)
    x = torch.randn(1, 9, 64)
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    torch.manual_seed(3)
    a = compiled(x)
    torch.manual_seed(3)
    b = compiled(x)
    c = compiled(x)
    assert torch.equal(a, b)
    assert not torch.equal(a, c)


@pytest.mark.parametrize("device", DEVICES)
def test_dynamic_sequence_length_does_not_recompile(device):
    model = Block().to(device)
    torch._dynamo.reset()
    counts = {"n": 0}

    def counting_backend(gm, example_inputs):
        counts["n"] += 1
        return gm.forward

    compiled = torch.compile(model, fullgraph=True, dynamic=True, backend=counting_backend)
    for S in (7, 13, 31, 64):
        x = torch.randn(2, S, 64, device=device)
        torch.testing.assert_close(compiled(x), model(x), rtol=1e-5, atol=1e-6)
    assert counts["n"] == 1, f"compiled {counts['n']} times for 4 sequence lengths"


def test_lse_output_and_per_batch_offsets_trace():
    def f(q, k, v, off):
        o, lse = flashforge.attention(q, k, v, causal=True, causal_offset=off, window=(4, -1), return_lse=True)
        return o.sum() + lse.exp().sum()

    q, k, v = (torch.randn(2, 5, 2, 16, requires_grad=True) for _ in range(3))
    off = torch.tensor([0, 3])
    torch._dynamo.reset()
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    ref = torch.autograd.grad(f(q, k, v, off), (q, k, v))
    got = torch.autograd.grad(compiled(q, k, v, off), (q, k, v))
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b)


def test_ops_are_registered_with_fake_impls():
    q, k, v = (torch.empty(2, 8, 4, 32, device="meta") for _ in range(3))
    # q, k, v, mask, offset_tensor, alibi_slopes, seed_tensor, cu_seqlens_q, cu_seqlens_k, scale, window_left,
    # window_right, offset, offset_bottom_right, softcap, dropout_p, seed, deterministic, allow_tf32,
    # max_seqlen_q, max_seqlen_k, backend
    rest = (0.1, -1, 0, 0, False, 0.0, 0.0, 0, False, False, 0, 0, "torch")
    o, lse, lse_lo = torch.ops.flashforge.attention_fwd(q, k, v, None, None, None, None, None, None, *rest)
    assert o.shape == (2, 8, 4, 32) and lse.shape == lse_lo.shape == (2, 4, 8)
    assert lse.dtype == lse_lo.dtype == torch.float32
    torch.library.opcheck(torch.ops.flashforge.attention_fwd,
                          (torch.randn(1, 3, 2, 8), torch.randn(1, 4, 2, 8), torch.randn(1, 4, 2, 8), None, None,
                           None, None, None, None, *rest))


@pytest.mark.gpu
def test_block_under_cuda_graphs_matches_eager():
    """torch.compile(mode="reduce-overhead") replays the block through CUDA graphs."""
    torch.manual_seed(0)
    model = Block().cuda()
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, mode="reduce-overhead")
    for _ in range(3):  # warm-up, record, replay
        x = torch.randn(2, 64, 64, device="cuda")
        got = compiled(x).clone()
        torch.testing.assert_close(got, model(x), rtol=1e-4, atol=1e-5)
