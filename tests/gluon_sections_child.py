"""Causal calls whose heads fall into several L2 sections (`ops.gluon.pipeline.program_order`),
the last one partial, against the float64 reference with poisoned outputs (conftest).

Not collected on its own (no test_ prefix): `test_gluon_sm90.test_causal_sections_with_a_partial_last_one`
runs it in a child process with FLASHFORGE_L2_SECTION = BUDGET, which the kernels read at import,
and FLASHFORGE_WAVE = WAVE, a wave too wide to bound a section, so the byte budget alone decides.
The shapes here put 255-257 kB of streamed inputs on each head, so sections hold two heads
(five at GQA 6/3's forward), where the test files' shapes are one section each.
"""
import os

import pytest
import torch

from flashforge.ops.gluon import pipeline
from flashforge.ops.triton import configs
from helpers import Case, check_case

BUDGET = 655360
WAVE = 1 << 20
SM90 = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not SM90, reason="the Gluon kernels are for sm_90 GPUs"),
              pytest.mark.skipif(int(os.environ.get("FLASHFORGE_L2_SECTION", "-1")) != BUDGET,
                                 reason=f"run by test_gluon_sm90 with FLASHFORGE_L2_SECTION={BUDGET}")]
TC = configs.TileConfig
F16, BF16 = torch.float16, torch.bfloat16

# (id, case, dtype, {(kind, bucket): tiles} beside the table's)
CASES = [
    ("D64-table", Case(B=1, Sq=999, Sk=999, Hq=5, Hkv=5, D=64, causal=True), BF16, {}),
    ("D64-three-consumers-halfdq", Case(B=1, Sq=999, Sk=999, Hq=5, Hkv=5, D=64, causal=True), F16, {
        ("fwd_causal", 64): TC(192, 128, 4, 2, gluon=True, consumers=3),
        ("bwd_kv", 64): TC(128, 128, 4, 2, gluon=True, consumers=2, fused_dq=True, half_dq=True)}),
    ("D64-gqa6/3", Case(B=1, Sq=999, Sk=999, Hq=6, Hkv=3, D=64, causal=True), BF16, {}),
    ("D128-table-B3", Case(B=3, Sq=501, Sk=501, Hq=1, Hkv=1, D=128, causal=True), F16, {}),
    ("D128-halfdq", Case(B=1, Sq=501, Sk=501, Hq=5, Hkv=5, D=128, causal=True), BF16, {
        ("bwd_kv", 128): TC(64, 128, 4, 2, gluon=True, consumers=2, fused_dq=True, half_dq=True, overlap=False)}),
    ("D128-ws-dq", Case(B=1, Sq=501, Sk=501, Hq=5, Hkv=5, D=128, causal=True), F16, {
        ("bwd_kv", 128): TC(64, 64, 4, 2, gluon=True, overlap=False),
        ("bwd_q", 128): TC(128, 64, 4, 2, gluon=True, consumers=2, pingpong=True)}),
    ("D256-wide", Case(B=1, Sq=251, Sk=251, Hq=5, Hkv=5, D=256, causal=True), BF16, {
        ("bwd_kv", 256): TC(64, 64, 4, 1, gluon=True, consumers=2, fused_dq=True, half_dq=True)}),
]


def sections(heads: int, head_bytes: int) -> int:
    """Heads a section holds: `program_order`'s rule (its wave term, 2**20 programs, never binds here)."""
    return min(max(BUDGET // max(head_bytes, 1), 1), heads)


@pytest.mark.parametrize("c, dtype, tiles", [pytest.param(*x[1:], id=x[0]) for x in CASES])
def test_causal_sections(c, dtype, tiles):
    assert pipeline.L2_SECTION.value == BUDGET and pipeline.WAVE.value == WAVE
    group = c.Hq // c.Hkv
    fwd = sections(c.B * c.Hq, c.Sk * 4 * c.D // group)
    bwd = sections(c.B * c.Hkv, c.Sq * 4 * c.D * group)
    # the point of the shapes: more than one section, the last one short, forward or backward
    assert any(1 < s < n and n % s for s, n in ((fwd, c.B * c.Hq), (bwd, c.B * c.Hkv))), (fwd, bwd)
    for (kind, bucket), cfg in tiles.items():
        configs.set_config(kind, bucket, 2, cfg)
    try:
        check_case(c, "triton", device="cuda", dtype=dtype)
    finally:
        for kind, bucket in tiles:
            configs.set_config(kind, bucket, 2, None)
