"""Plain eager calls skip the `torch.library` dispatch (its Python costs more than a
decoding step's kernel) and must give what the ops give; anything that traces or
wraps tensors still goes through the ops."""
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import flashforge
from flashforge.autograd import attention as attention_ops
from flashforge.autograd import rope as rope_ops
from flashforge.autograd.dispatch import eager


class _Count(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def test_eager_only_for_plain_tensors_outside_modes():
    x = torch.randn(2)
    assert eager(x, None, torch.nn.Parameter(torch.randn(2)))
    with _Count():
        assert not eager(x)
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode() as mode:
        fake = mode.from_tensor(x)
    assert not eager(fake)


def test_modes_still_see_the_custom_ops():
    q, k, v = (torch.randn(1, 5, 2, 8) for _ in range(3))
    with _Count() as seen:
        flashforge.attention(q, k, v, causal=True)
    assert any("flashforge.attention_fwd" in op for op in seen.ops), seen.ops


def _grads(q, k, v, mask, do, force_ops, monkeypatch):
    if force_ops:
        monkeypatch.setattr(attention_ops, "eager", lambda *t: False)
    leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v, mask)]
    o, lse = flashforge.attention(*leaves[:3], mask=leaves[3], causal=True, return_lse=True)
    grads = torch.autograd.grad((o, lse), leaves, (do, torch.ones_like(lse)))
    monkeypatch.undo()
    return (o, lse) + grads


def test_eager_path_equals_the_ops(monkeypatch):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 7, 4, 16, generator=g)
    k, v = (torch.randn(2, 9, 2, 16, generator=g) for _ in range(2))
    mask = torch.randn(1, 4, 7, 9, generator=g)
    do = torch.randn(2, 7, 4, 16, generator=g)
    fast = _grads(q, k, v, mask, do, False, monkeypatch)
    ops = _grads(q, k, v, mask, do, True, monkeypatch)
    for a, b in zip(fast, ops):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_eager_attention_refuses_double_backward():
    q, k, v = (torch.randn(1, 4, 2, 8, requires_grad=True) for _ in range(3))
    o = flashforge.attention(q, k, v)
    (gq,) = torch.autograd.grad(o.sum(), q, create_graph=True)
    with pytest.raises(RuntimeError):
        torch.autograd.grad(gq.sum(), q)


def test_eager_rope_gradient_equals_the_op(monkeypatch):
    x = torch.randn(2, 6, 3, 8, requires_grad=True)
    dy = torch.randn(2, 6, 3, 8)
    (fast,) = torch.autograd.grad(flashforge.apply_rope(x, 3), x, dy)
    monkeypatch.setattr(rope_ops, "eager", lambda *t: False)
    (ops,) = torch.autograd.grad(flashforge.apply_rope(x, 3), x, dy)
    torch.testing.assert_close(fast, ops, rtol=0, atol=0)
