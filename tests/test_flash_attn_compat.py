"""The stand-in `flash_attn` package that runs flash-attn's own test file against flashforge
(tests/flash_attn_compat/README.md): its two helpers mean what flash-attn's do."""
from __future__ import annotations

import os
import sys

import pytest
import torch

from flashforge import reference

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "flash_attn_compat"))
from flash_attn import flash_attn_func  # noqa: E402
from flash_attn.bert_padding import pad_input, unpad_input  # noqa: E402
from flash_attn.layers.rotary import apply_rotary_emb  # noqa: E402

import flashforge.flash_attn_interface as ours  # noqa: E402


def test_it_reexports_the_drop_ins():
    assert flash_attn_func is ours.flash_attn_func


def test_unpad_then_pad_is_identity_on_kept_tokens():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 7, 2, 4, generator=gen)
    mask = torch.tensor([[1] * 7, [1] * 3 + [0] * 4, [0] * 7], dtype=torch.bool)
    packed, idx, cu, longest, used = unpad_input(x, mask)
    assert packed.shape == (10, 2, 4) and cu.tolist() == [0, 7, 10, 10] and longest == 7
    assert used.tolist() == [7, 3, 0]
    back = pad_input(packed, idx, 3, 7)
    torch.testing.assert_close(back, x * mask[..., None, None], rtol=0, atol=0)


@pytest.mark.parametrize("interleaved", [False, True])
def test_apply_rotary_emb_is_rope_from_tables(interleaved):
    gen = torch.Generator().manual_seed(1)
    B, S, H, D, rd = 2, 5, 2, 16, 8
    x = torch.randn(B, S, H, D, generator=gen, dtype=torch.float64)
    inv = 10000.0 ** (-torch.arange(0, rd, 2, dtype=torch.float64) / rd)
    ang = torch.arange(32, dtype=torch.float64)[:, None] * inv
    offsets = torch.tensor([3, 11])
    got = apply_rotary_emb(x, ang.cos(), ang.sin(), interleaved=interleaved, seqlen_offsets=offsets)
    style = "interleaved" if interleaved else "half"
    for b in range(B):
        want = reference.apply_rope(x[b:b + 1], pos=int(offsets[b]), style=style, rotary_dim=rd)
        torch.testing.assert_close(got[b:b + 1].double(), want, rtol=1e-6, atol=1e-6)
