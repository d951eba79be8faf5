"""Host-side pieces of the sm_90 Gluon launchers that need no GPU: the ragged descriptor's
addressing (packed batches) and the scope rules that route calls to the Gluon kernels."""
from dataclasses import replace

import pytest
import torch

from flashforge.ops.gluon import attention as gluon_attention
from flashforge.ops.params import AttnParams
from flashforge.ops.triton.configs import TileConfig

M64 = 2**64


def _element(shape, strides, coords):
    """The copy engine's view of a box corner: (in bounds, element offset modulo 2**64)."""
    inside = all(0 <= c < n for c, n in zip(coords, shape))
    return inside, sum(c * s for c, s in zip(coords, strides)) % M64


@pytest.mark.parametrize("total, H, D", [(1000, 4, 128), (7, 2, 64), (65536, 32, 64)])
def test_ragged_coordinates_name_a_sequences_rows(total, H, D):
    """(RAGGED, start + n, RAGGED - n + r, h, d) is row start + r of the packed tensor for
    r < n, and out of bounds (zero-filled, not stored) for r >= n -- the next sequence's rows
    are never reached."""
    t = torch.empty(1, total, H, D, dtype=torch.bfloat16)
    shape, strides = gluon_attention.ragged_shape_strides(t)
    R = gluon_attention.RAGGED
    assert len(shape) == 5 and strides[-1] == 1
    for start, n in ((0, total), (0, 1), (total // 3, total - total // 3), (total - 1, 1)):
        for r in {0, n // 2, n - 1, n, n + 5}:
            for h in {0, H - 1}:
                inside, off = _element(shape, strides, (R, start + n, R - n + r, h, 3 % D))
                assert inside == (r < n), (start, n, r)
                if inside:
                    assert off == (start + r) * t.stride(1) + h * t.stride(2) + 3 % D


def test_ragged_extent_matches_the_kernels():
    pytest.importorskip("triton.experimental.gluon")
    from flashforge.ops.gluon import pipeline
    assert pipeline.RAGGED.value == gluon_attention.RAGGED


def test_ragged_strides_suit_the_copy_engine():
    """Byte strides must be multiples of 16 and below 2**40 (cuTensorMapEncodeTiled)."""
    t = torch.empty(1, 4096, 16, 128, dtype=torch.float16)
    shape, strides = gluon_attention.ragged_shape_strides(t)
    for s in strides[:-1]:
        assert (s * 2) % 16 == 0 and 0 < s * 2 < 2**40
    assert all(0 < n < 2**32 for n in shape)


def _params(**kw):
    return AttnParams(scale=0.1, **kw)


@pytest.mark.parametrize("kw, ok", [
    (dict(), True),
    (dict(window_right=0), True),
    (dict(window_right=0, offset_bottom_right=True), True),
    (dict(dropout_p=0.1), False),
    (dict(softcap=3.0), True),
    (dict(window_left=64, window_right=0), True),
    (dict(window_left=64), True),
    (dict(window_right=30), True),
    (dict(alibi_slopes=torch.ones(2, 4)), True),
    (dict(seqlens_k=torch.full((2,), 100, dtype=torch.int32)), False),
])
def test_scope_of_dense_calls(kw, ok):
    q = torch.empty(2, 128, 4, 128, dtype=torch.bfloat16)
    k = torch.empty(2, 200, 2, 128, dtype=torch.bfloat16)
    assert gluon_attention._scores_in_scope(q, k, k, None, _params(**kw), (9, 0)) == ok
    assert not gluon_attention._scores_in_scope(q, k, k, None, _params(**kw), (8, 0))


@pytest.mark.parametrize("D, ok", [(64, True), (128, True), (256, True), (96, False), (192, False), (32, False)])
def test_head_dims(D, ok):
    q = torch.empty(2, 128, 4, D, dtype=torch.bfloat16)
    assert gluon_attention._scores_in_scope(q, q, q, None, _params(), (9, 0)) == ok


@pytest.mark.parametrize("kind, cfg, D, ok", [
    ("bwd_kv", TileConfig(64, 64, 4, 2, gluon=True), 128, True),
    ("bwd_kv", TileConfig(64, 64, 4, 2, gluon=True), 256, False),  # dK and dV at once: 256 registers
    ("bwd_kv", TileConfig(32, 128, 8, 2, gluon=True, split_kv=True), 256, True),
    ("bwd_kv", TileConfig(32, 64, 8, 2, gluon=True, split_kv=True), 256, False),  # 8 warps, 64 keys
    ("bwd_q", TileConfig(64, 32, 4, 2, gluon=True), 256, True),
    ("bwd_q", TileConfig(64, 32, 8, 2, gluon=True), 256, False),
    # the warp-specialized dK/dV kernel (dQ fused): 2 slots fit D = 128 (229,960 B), 3 do not
    ("bwd_kv", TileConfig(64, 128, 4, 2, gluon=True, consumers=2, fused_dq=True), 128, True),
    ("bwd_kv", TileConfig(64, 128, 4, 3, gluon=True, consumers=2, fused_dq=True), 128, False),
    ("bwd_kv", TileConfig(64, 128, 4, 3, gluon=True, consumers=2, fused_dq=True), 64, True),
])
def test_backward_tiles_fit(kind, cfg, D, ok):
    """One warp per 16 resident rows; past D = 128 the dK/dV kernel only in two launches; the
    warp-specialized one where its shared memory fits."""
    assert gluon_attention.bwd_tiles_fit(kind, cfg, D) == ok


@pytest.mark.parametrize("D, compiled", [(64, 131656), (128, 229960)])
def test_ws_dkdv_shared_bytes_cover_the_compiled_kernel(D, compiled):
    """The launcher's count of the warp-specialized dK/dV kernel's shared memory is at least what
    ptxas gave it (2 slots, v0.9.1's compile check), within 1 KB: an undercount would send a
    launch the GPU refuses, an overcount turn away tiles that fit.  (It once counted two of the
    four P / dS tiles.)"""
    cfg = TileConfig(64, 128, 4, 2, gluon=True, consumers=2, fused_dq=True)
    assert 0 <= gluon_attention.ws_dkdv_shared_bytes(cfg, D) - compiled <= 1024


def test_scope_of_packed_calls_reads_the_longest_sequence():
    """Packed batches are in scope; what counts for the 64-row minimum is the longest
    sequence, not the packed total."""
    q = torch.empty(1, 1000, 4, 64, dtype=torch.float16)
    cu = torch.tensor([0, 500, 1000], dtype=torch.int32)
    packed = dict(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_k=500)
    assert gluon_attention._scores_in_scope(q, q, q, None, _params(max_seqlen_q=500, **packed), (9, 0))
    assert not gluon_attention._scores_in_scope(q, q, q, None, _params(max_seqlen_q=40, **packed), (9, 0))


@pytest.mark.parametrize("left, right, offset, span, causal", [
    (-1, -1, 5, 0, False), (-1, 0, 5, 0, True), (100, 0, 5, 100, True), (100, -1, 5, 100, False),
    (64, 31, 36, 95, True), (-1, 70, 75, 0, True)])
def test_window_folds_into_offset_and_span(left, right, offset, span, causal):
    """Key j visible from query i iff j <= i + offset (CAUSAL) and j >= i + offset - span (HAS_WL),
    the kernels' form of i + 5 - left <= j <= i + 5 + right."""
    q = torch.empty(1, 100, 2, 64, dtype=torch.bfloat16)
    p = _params(window_left=left, window_right=right, offset=5)
    args = gluon_attention._sequences(q, q, p, None, torch.empty(1, 2, 100))
    assert args[-2] == offset
    assert gluon_attention._window(p) == dict(span=span, CAUSAL=causal, HAS_WL=left >= 0)
    i, j = torch.arange(100)[:, None], torch.arange(100)[None, :]
    want = torch.ones(100, 100, dtype=torch.bool)
    if left >= 0:
        want &= j >= i + 5 - left
    if right >= 0:
        want &= j <= i + 5 + right
    got = torch.ones(100, 100, dtype=torch.bool)
    if causal:
        got &= j <= i + offset
    if left >= 0:
        got &= j >= i + offset - span
    assert torch.equal(got, want)


@pytest.mark.parametrize("kw", [dict(), dict(softcap=7.0), dict(alibi_slopes=torch.rand(2, 4), window_right=12)])
def test_modifier_arguments(kw):
    """scale, softcap, the slopes (or a placeholder) with their strides, the window's right side
    (ALiBi's distance is from the call's offset: the kernels' offset less it), and the flags."""
    p = _params(**kw)
    placeholder = torch.empty(1)
    args, flags = gluon_attention._modifiers(p, placeholder)
    slopes = kw.get("alibi_slopes")
    assert args[:2] == (0.1, kw.get("softcap", 0.0))
    assert args[2] is (placeholder if slopes is None else slopes)
    assert args[3:5] == ((0, 0) if slopes is None else slopes.stride())
    assert args[5] == max(kw.get("window_right", -1), 0)
    assert flags == dict(HAS_SOFTCAP="softcap" in kw, HAS_ALIBI=slopes is not None)


def test_dense_bottom_right_is_folded_into_the_offset():
    q = torch.empty(2, 100, 4, 64, dtype=torch.bfloat16)
    k = torch.empty(2, 300, 4, 64, dtype=torch.bfloat16)
    lse = torch.empty(2, 4, 100)
    args = gluon_attention._sequences(q, k, _params(window_right=0, offset=5, offset_bottom_right=True), None, lse)
    B, _, s_lb, s_lh, *_, Sq, Sk, offset, br = args
    assert (B, s_lb, s_lh, Sq, Sk, offset, br) == (2, 400, 100, 100, 300, 205, 0)


@pytest.mark.parametrize("packed", [False, True])
def test_far_flags_cover_every_dkdv_program_row(packed):
    """The dQ kernel marks, and the dK/dV kernel reads, FAR[b * Hkv + hk] for every (sequence, KV
    head) of its grid.  A packed batch's lse is [1, Hq, total], so sizing the flags from lse's
    batch dim (as 9d41409 first did) gave one sequence's worth: the others' flags lay outside."""
    Hq, Hkv, D = 4, 2, 64
    if packed:
        cu = torch.tensor([0, 5, 12, 12, 30], dtype=torch.int32)
        params = _params(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=18, max_seqlen_k=18)
        q, k = torch.empty(1, 30, Hq, D), torch.empty(1, 30, Hkv, D)
        lse_lo = torch.empty(1, Hq, 30)
        B = 4
    else:
        params = _params()
        q, k = torch.empty(3, 9, Hq, D), torch.empty(3, 9, Hkv, D)
        lse_lo = torch.empty(3, Hq, 9)
        B = 3
    far = gluon_attention.far_flags(q, k, params, lse_lo)
    assert far.dtype == torch.int32 and far.shape == (B * Hkv,) and not far.any()
    assert gluon_attention.far_flags(q, k, params, None) is None


# Why a call leaves the Gluon kernels: one list (scope_reason, forward_reason, bwd_call_reason),
# which the launcher logs on "flashforge.dispatch" at DEBUG level
@pytest.mark.parametrize("shape, dtype, kw, arch, says", [
    ((2, 128, 4, 128), torch.bfloat16, dict(), (9, 0), None),
    ((2, 128, 4, 256), torch.float16, dict(window_right=0), (9, 0), None),
    ((2, 128, 4, 128), torch.bfloat16, dict(), (8, 0), "sm_80"),
    ((2, 128, 4, 128), torch.float32, dict(), (9, 0), "float32"),
    ((2, 128, 4, 96), torch.bfloat16, dict(), (9, 0), "D = 96"),
    ((2, 32, 4, 64), torch.bfloat16, dict(), (9, 0), "fewer than 64 query rows"),
    ((2, 128, 4, 64), torch.bfloat16, dict(window_left=64, window_right=0), (9, 0), None),
    ((2, 128, 4, 64), torch.bfloat16, dict(alibi_slopes=torch.ones(2, 4)), (9, 0), None),
    ((2, 128, 4, 64), torch.bfloat16, dict(dropout_p=0.1), (9, 0), "dropout"),
    ((2, 128, 4, 64), torch.bfloat16, dict(softcap=5.0), (9, 0), None),
    ((2, 128, 4, 64), torch.bfloat16, dict(q_rope=object()), (9, 0), "RoPE"),
])
def test_scope_reason_names_the_feature(shape, dtype, kw, arch, says):
    q = torch.empty(shape, dtype=dtype)
    reason = gluon_attention.scope_reason(q, q, q, None, _params(**kw), arch)
    assert (reason is None) == (says is None) and (says is None or says in reason), reason
    assert gluon_attention._scores_in_scope(q, q, q, None, _params(**kw), arch) == (says is None)


def test_forward_reason_tiles_keys_and_copy_engine():
    q = torch.empty(1, 256, 2, 64, dtype=torch.bfloat16)
    good = TileConfig(64, 64, 4, 2, gluon=True)
    assert gluon_attention.forward_reason(q, q, q, None, _params(), good, (9, 0)) is None
    assert "one warp per 16 rows" in gluon_attention.forward_reason(q, q, q, None, _params(),
                                                                    TileConfig(128, 64, 4, 2, gluon=True), (9, 0))
    assert "min_keys" in gluon_attention.forward_reason(q, q, q, None, _params(),
                                                        TileConfig(64, 64, 4, 2, gluon=True, min_keys=512), (9, 0))
    odd = torch.empty(1 + 256 * 2 * 64, dtype=torch.bfloat16)[1:].view(1, 256, 2, 64)  # 2-byte aligned base
    assert "copy engine" in gluon_attention.forward_reason(odd, q, q, None, _params(), good, (9, 0))


def test_forward_reason_warp_specialized_tiles():
    """The warp-specialized forward: 128 rows of 4-warp consumers, and tiles that fit shared memory
    (D = 256 with 128-key tiles would not launch)."""
    ws = dict(gluon=True, consumers=2)
    for D in (64, 128, 256):
        q = torch.empty(1, 256, 2, D, dtype=torch.bfloat16)
        assert gluon_attention.forward_reason(q, q, q, None, _params(), TileConfig(128, 64, 4, 2, **ws), (9, 0)) is None
    assert "warp-specialized" in gluon_attention.forward_reason(q, q, q, None, _params(),
                                                                TileConfig(64, 64, 4, 2, **ws), (9, 0))
    assert "warp-specialized" in gluon_attention.forward_reason(q, q, q, None, _params(),
                                                                TileConfig(128, 64, 8, 2, **ws), (9, 0))
    too_big = TileConfig(128, 128, 4, 2, **ws)
    assert gluon_attention.ws_shared_bytes(too_big, 256) > 232448
    assert "shared memory" in gluon_attention.forward_reason(q, q, q, None, _params(), too_big, (9, 0))
    # the estimate covers what the compiled kernels take (tools/sm90_compile_check.py: 164,216 B
    # for 128-key tiles, 2 + 2 stages at D = 128; 147,928 B for 4 + 4 at D = 64)
    assert gluon_attention.ws_shared_bytes(TileConfig(128, 128, 4, 2, **ws), 128) >= 164216
    assert gluon_attention.ws_shared_bytes(TileConfig(128, 128, 4, 4, **ws), 64) >= 147928


def test_forward_reason_three_consumers():
    """Three consumers: 192 rows at D = 64 only (at 160 registers a consumer, D = 128's accumulator
    does not fit), no ping-pong; the backward kernels take none."""
    ws3 = TileConfig(192, 64, 4, 3, gluon=True, consumers=3)
    q64, q128 = (torch.empty(1, 256, 2, D, dtype=torch.bfloat16) for D in (64, 128))
    assert gluon_attention.forward_reason(q64, q64, q64, None, _params(), ws3, (9, 0)) is None
    assert "D = 64 only" in gluon_attention.forward_reason(q128, q128, q128, None, _params(), ws3, (9, 0))
    pp = TileConfig(192, 64, 4, 3, gluon=True, consumers=3, pingpong=True)
    assert "ping-pong" in gluon_attention.forward_reason(q64, q64, q64, None, _params(), pp, (9, 0))
    rows = TileConfig(128, 64, 4, 3, gluon=True, consumers=3)
    assert "64 rows and 4 warps a consumer" in gluon_attention.forward_reason(q64, q64, q64, None, _params(), rows,
                                                                              (9, 0))
    assert not gluon_attention.bwd_tiles_fit("bwd_kv", ws3, 64)
    assert not gluon_attention.bwd_tiles_fit("bwd_q", ws3, 64)
    # the estimate covers the compiled kernels' (tools/sm90_compile_check.py: 74,228 B for 64-key
    # tiles, 3 + 3 stages; 90,556 B for 128-key tiles, 2 + 2)
    assert gluon_attention.ws_shared_bytes(ws3, 64) >= 74228
    assert gluon_attention.ws_shared_bytes(TileConfig(192, 128, 4, 2, gluon=True, consumers=3), 64) >= 90556


def test_backward_reason_dtype_of_do_and_lse():
    q = torch.empty(1, 128, 2, 64, dtype=torch.bfloat16)
    lse = torch.empty(1, 2, 128)
    assert gluon_attention.bwd_call_reason(q, q, q, q, lse, None, _params(), (9, 0)) is None
    assert "dO in float32" in gluon_attention.bwd_call_reason(q, q, q, q.float(), lse, None, _params(), (9, 0))
    assert "lse" in gluon_attention.bwd_call_reason(q, q, q, q, lse.transpose(1, 2).contiguous().transpose(1, 2),
                                                    None, _params(), (9, 0))


def test_launcher_logs_each_reason_once(caplog, monkeypatch):
    """The backward's passes on sm_90 tensors (CPU tensors, sm_90 asked for): in scope, the table's
    Gluon tiles; with dropout, the portable kernels and the reason, logged once however often."""
    from flashforge.ops.triton import attention as launchers
    from flashforge.ops.triton import configs
    monkeypatch.setattr(launchers, "_explained", set())
    q = torch.empty(1, 128, 2, 128, dtype=torch.bfloat16)
    lse = torch.empty(1, 2, 128)
    cfg_kv = configs.get_config("bwd_kv", 128, 2, False, arch=(9, 0))
    cfg_q = configs.get_config("bwd_q", 128, 2, False, arch=(9, 0))
    with caplog.at_level("DEBUG", logger="flashforge.dispatch"):
        g_kv, g_q = launchers._gluon_backward(q, q, q, q, lse, None, _params(), cfg_kv, cfg_q, (9, 0), None)
        assert g_kv == configs.gluon_config(128, 2, False, (9, 0), "bwd_kv")
        assert g_q == configs.gluon_config(128, 2, False, (9, 0), "bwd_q")
        assert not caplog.records
        for _ in range(3):
            assert launchers._gluon_backward(q, q, q, q, lse, None, _params(dropout_p=0.1), cfg_kv,
                                             cfg_q, (9, 0), None) == (None, None)
    msgs = [r.getMessage() for r in caplog.records]
    assert msgs == ["backward bwd_kv: portable kernel: dropout (not in the Gluon kernels)",
                    "backward bwd_q: portable kernel: dropout (not in the Gluon kernels)"], msgs


def test_interpreted_call_says_so(caplog, monkeypatch):
    import flashforge
    from flashforge.ops.triton import attention as launchers
    if torch.cuda.is_available():
        pytest.skip("on a GPU the kernels are compiled, not interpreted")
    monkeypatch.setattr(launchers, "_explained", set())
    q = torch.randn(1, 16, 1, 16, requires_grad=True)
    with caplog.at_level("DEBUG", logger="flashforge.dispatch"):
        flashforge.attention(q, q, q, backend="triton").sum().backward()
    msgs = [r.getMessage() for r in caplog.records]
    assert "forward: portable kernel: the Triton interpreter (TRITON_INTERPRET=1)" in msgs
    assert "backward: portable kernels: the Triton interpreter (TRITON_INTERPRET=1)" in msgs


TC = TileConfig


@pytest.mark.parametrize("cfg, D, deterministic, ok", [
    (TC(64, 64, 4, 3, gluon=True, fused_dq=True), 64, False, True),
    (TC(64, 64, 4, 3, gluon=True, fused_dq=True), 64, True, False),  # atomics: never deterministic
    (TC(64, 64, 4, 3, gluon=True), 64, False, False),  # not asked for
    (TC(64, 64, 4, 2, gluon=True, fused_dq=True, overlap=False), 128, False, True),
    (TC(32, 64, 4, 2, gluon=True, fused_dq=True), 64, False, False),  # dQ_t: one 64-row wgmma
    (TC(64, 128, 8, 2, gluon=True, fused_dq=True), 64, False, True),  # two warpgroups, 128 keys
    (TC(64, 128, 8, 2, gluon=True, fused_dq=True), 128, False, False),  # overlapped: D = 64 only
    (TC(64, 64, 2, 2, gluon=True, fused_dq=True, overlap=False), 64, False, False),  # half a warpgroup
    (TC(64, 64, 4, 2, gluon=True, fused_dq=True, split_kv=True), 256, False, False),
])
def test_fuses_dq(cfg, D, deterministic, ok):
    assert gluon_attention.fuses_dq(cfg, D, AttnParams(scale=1.0, deterministic=deterministic)) is ok


@pytest.mark.parametrize("packed", [False, True])
def test_dq_descriptor_boxes_match_the_fused_kernel(packed):
    """The fused dK/dV kernel reduces dQ_t into the float32 accumulator in [64, 32] boxes of
    128-byte swizzled rows (its DQ_N): the descriptor's box, layout and strides must say so, with
    the ragged addressing for a packed batch."""
    pytest.importorskip("triton.experimental.gluon")
    from flashforge.ops.gluon import attention_bwd_sm90  # noqa: F401  (the kernel module imports)
    acc = torch.zeros(1 if packed else 2, 300, 4, 64)
    p = _params(cu_seqlens_q=torch.tensor([0, 100, 300], dtype=torch.int32), max_seqlen_q=200) if packed else _params()
    d = gluon_attention.dq_descriptor(acc, p)
    assert d.block_shape[-1] == gluon_attention.DQ_COLS == 32 and d.block_shape[-3] == 64
    assert d.layout.swizzle_byte_width == 128 and d.layout.element_bitwidth == 32
    assert d.layout.rank == len(d.block_shape) == (5 if packed else 4)
    if packed:
        assert [list(d.shape), list(d.strides)] == [list(x) for x in gluon_attention.ragged_shape_strides(acc)]
        # float32: byte strides still multiples of 16 below 2**40, and the two leading ones still
        # cancel at the RAGGED coordinate modulo 2**64 (4-byte elements: 2**34 * 4 * 2**30 = 2**66)
        for st in d.strides[:-1]:
            assert (st * 4) % 16 == 0 and 0 < st * 4 < 2**40
        assert (d.strides[0] + d.strides[1]) * 4 * gluon_attention.RAGGED % M64 == 0
    else:
        assert list(d.strides) == list(acc.stride()) and list(d.shape) == list(acc.shape)
    assert gluon_attention.DQ_COLS * 4 == d.layout.swizzle_byte_width  # one swizzle row per box row


@pytest.mark.parametrize("packed", [False, True])
def test_repeat_calls_descriptors_share_a_launch_key(packed):
    """The launch cache (ops/launch.py) keys a descriptor by its layout's identity, so the
    descriptors a backward builds on each call -- the inputs' and the dQ accumulator's -- must key
    alike from one call to the next.  (dq_descriptor once built its layout per call: every fused
    launch missed the cache, ~0.5 ms of host time a backward on the H200, and the cache grew by an
    entry a call.)"""
    pytest.importorskip("triton.experimental.gluon")
    from flashforge.ops.gluon import attention_bwd_sm90  # noqa: F401  (the kernel module imports)
    from flashforge.ops.launch import launch_key
    p = _params(cu_seqlens_q=torch.tensor([0, 100, 300], dtype=torch.int32), max_seqlen_q=200) if packed else _params()
    shape = (1 if packed else 2, 300, 4, 64)
    ws = TC(64, 128, 4, 2, gluon=True, consumers=2, fused_dq=True)

    def keys():
        acc = torch.zeros(shape)
        q, k, v, do = (torch.randn(shape, dtype=torch.bfloat16) for _ in range(4))
        descs = [gluon_attention.dq_descriptor(acc, p), *gluon_attention.input_descriptors(q, k, v, do, p, ws, "bwd_kv")]
        return launch_key(descs)

    first, again = keys(), keys()
    assert first is not None and first == again


def test_wide_dkdv_tiles_fit_d256_only():
    """The wide dK/dV kernel (half_dq past D = 128: consumers split the head dim) takes 64 keys,
    64-query tiles and one Q / dO slot at D = 256, within sm_90's shared memory; it fuses dQ, so a
    deterministic call never takes it; other shapes of it are refused (the launcher then says why)."""
    wide = TC(64, 64, 4, 1, gluon=True, consumers=2, fused_dq=True, half_dq=True)
    assert gluon_attention.bwd_tiles_fit("bwd_kv", wide, 256)
    assert gluon_attention.ws_dkdv_shared_bytes(wide, 256) <= gluon_attention._SMEM_SM90
    for other in (dict(num_stages=2), dict(block_m=128), dict(block_n=128), dict(split_kv=True)):
        assert not gluon_attention.bwd_tiles_fit("bwd_kv", replace(wide, **other), 256), other
    assert not gluon_attention.bwd_tiles_fit("bwd_kv", wide, 192)
    if gluon_attention._reduce_ready():
        assert gluon_attention.fuses_dq(wide, 256, _params())
    assert not gluon_attention.fuses_dq(wide, 256, _params(deterministic=True))


@pytest.mark.parametrize("D", [64, 128, 256])
def test_long_backward_takes_the_warp_specialized_kernel(D):
    """The table's "bwd_kv_ws" entry (the warp-specialized dK/dV kernel, dQ fused in FA3's layout,
    half_dq) serves a backward from its min_keys keys on (a masked call: the "_causal" entry's; a
    left window: window_left + 1 at least the unmasked entry's); shorter calls, narrower windows and
    deterministic calls keep the ordered pair's Gluon tiles, not the portable kernel; a "bwd_kv"
    override is taken as it is."""
    from flashforge.ops.triton import attention as launchers
    from flashforge.ops.triton import configs
    ws = configs.gluon_config(D, 2, False, (9, 0), "bwd_kv_ws")
    pair = configs.gluon_config(D, 2, False, (9, 0), "bwd_kv")
    assert ws is not None and ws.consumers == 2 and ws.fused_dq and ws.half_dq and ws.min_keys > 0
    assert pair is not None and pair.consumers == 1
    cfg_kv = configs.get_config("bwd_kv", D, 2, False, arch=(9, 0))
    cfg_q = configs.get_config("bwd_q", D, 2, False, arch=(9, 0))
    # masked calls (causal, windowed) take the "_causal" entry where the table has one
    masked = configs.gluon_config(D, 2, True, (9, 0), "bwd_kv_ws")
    assert masked is not None and masked.half_dq and masked.min_keys >= ws.min_keys
    n, m = ws.min_keys, masked.min_keys
    cases = [(n, {}, ws), (n - 64, {}, pair), (n, dict(deterministic=True), pair),
             (m, dict(window_right=0), masked), (m - 64, dict(window_right=0), pair),
             # a left window: a key sees window_left + 1 queries, held to the unmasked entry's n
             (m, dict(window_left=n - 2, window_right=0), pair),
             (m, dict(window_left=n - 1, window_right=0), masked),
             (m - 64, dict(window_left=n - 1, window_right=0), pair),  # (the call's keys still count)
             (m, dict(window_left=n - 1, window_right=-1), masked)]
    for S, kw, want in cases:
        q = torch.empty(1, S, 2, D, dtype=torch.bfloat16)
        lse = torch.empty(1, 2, S)
        g_kv, g_q = launchers._gluon_backward(q, q, q, q, lse, None, _params(**kw), cfg_kv, cfg_q, (9, 0), None)
        assert g_kv == want, (S, kw, g_kv)
        assert g_q == configs.gluon_config(D, 2, False, (9, 0), "bwd_q")
    forced = TileConfig(64, 64, 4, 3, gluon=True, split_kv=D > 128)  # (past D = 128 the pair splits)
    q = torch.empty(1, ws.min_keys, 2, D, dtype=torch.bfloat16)
    g_kv, _ = launchers._gluon_backward(q, q, q, q, torch.empty(1, 2, ws.min_keys), None, _params(), forced, cfg_q,
                                        (9, 0), None)
    assert g_kv == forced


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("D", [64, 128])
def test_long_forward_takes_the_fwd_long_entry(D, causal):
    """The table's "fwd_long" entry serves a forward from its min_keys keys on (D = 64: three
    consumers, 192-row programs; D = 128: the plain-grid warp-specialized kernel, where the shorter
    calls take its persistent variant); shorter calls, narrower windows, other head dims and
    overridden forward tiles keep what they had."""
    from flashforge.ops.triton import attention as launchers
    from flashforge.ops.triton import configs
    long = configs.gluon_config(D, 2, causal, (9, 0), "fwd_long")
    short = configs.gluon_config(D, 2, causal, (9, 0))
    assert long is not None and short is not None and long.min_keys > 0 and long != short
    if D == 64:
        assert long.consumers == 3 and long.block_m == 192 and short.consumers == 1
    else:
        assert long.consumers == short.consumers == 2 and not long.persistent and short.persistent
    assert configs.gluon_config(256, 2, causal, (9, 0), "fwd_long") is None
    right = 0 if causal else -1
    n = long.min_keys
    for S, kw, want in [(n, {}, long), (n - 64, {}, short), (n, dict(window_left=n - 1), short),
                        (n, dict(window_left=n), long)]:
        q = torch.empty(1, S, 2, D, dtype=torch.bfloat16)
        got = launchers._long_fwd(short, q, q, q, None, _params(window_right=right, **kw), (9, 0))
        assert got == want, (S, kw, got)
    q = torch.empty(1, n, 2, 256, dtype=torch.bfloat16)
    g256 = configs.gluon_config(256, 2, causal, (9, 0))
    assert launchers._long_fwd(g256, q, q, q, None, _params(window_right=right), (9, 0)) == g256
    configs.set_config("fwd", D, 2, TileConfig(64, 64, 4, 2, gluon=True))
    try:
        assert configs.gluon_config(D, 2, causal, (9, 0), "fwd_long") is None
    finally:
        configs.set_config("fwd", D, 2, None)


def test_register_operand_ws_backward_is_for_d64_only():
    """rs (P^T and dS^T as register operands) serves D = 64; at D = 128 ptxas serializes its
    products, so the launcher takes the portable dK/dV kernel there."""
    rs = TileConfig(64, 128, 4, 2, gluon=True, consumers=2, fused_dq=True, shared_dq=True, rs=True)
    assert gluon_attention.bwd_tiles_fit("bwd_kv", rs, 64)
    assert not gluon_attention.bwd_tiles_fit("bwd_kv", rs, 128)
    assert gluon_attention.bwd_tiles_fit("bwd_kv", TileConfig(64, 128, 4, 2, gluon=True, consumers=2, fused_dq=True,
                                                              shared_dq=True), 128)


@pytest.mark.parametrize("programs", [0, 5])
def test_persistent_forward_launch(programs, monkeypatch):
    """The persistent forward (TileConfig.persistent): `persistent_programs` (or `_PROGRAMS`), never
    more than the grid's items; the kernel gets the grid's heads (B * Hq) to number them; the
    non-persistent kernel keeps its 2-D grid.  Its shared memory adds one o tile a consumer
    (D = 256's no longer fits)."""
    launches = []

    class Rec:
        def launch(self, kernel, grid, *args, **kw):
            launches.append((kernel, grid, args, kw))

        def fresh(self, fn, *a, **kw):
            return fn(*a, **kw)

    monkeypatch.setattr(gluon_attention, "_PROGRAMS", programs)
    monkeypatch.setattr(gluon_attention, "_persistent_kernel", lambda: "persistent")
    monkeypatch.setattr(gluon_attention, "_ws_kernel", lambda: "ws")
    pers = TileConfig(128, 128, 4, 2, gluon=True, consumers=2, pingpong=True, persistent=True)
    plain = replace(pers, persistent=False)
    for B, S, H in ((1, 300, 2), (4, 4096, 8)):
        q = torch.empty(B, S, H, 128, dtype=torch.bfloat16)
        items = -(-S // 128) * B * H
        for cfg in (pers, plain):
            launches.clear()
            gluon_attention.attention_forward(q, q, q, _params(window_right=0), cfg, rec=Rec())
            (kernel, grid, args, kw), = launches
            if cfg.persistent:
                want = programs or gluon_attention.persistent_programs((-(-S // 128), B * H), S * 4 * 128, True, 132)
                assert kernel == "persistent" and grid == (min(items, want),)
                assert args[-1] == B * H and kw["PINGPONG"] and kw["num_warps"] == 4
            else:
                assert kernel == "ws" and grid == (-(-S // 128), B * H)
    assert gluon_attention.ws_shared_bytes(pers, 128) == gluon_attention.ws_shared_bytes(plain, 128) + 2 * 2 * 64 * 128
    # the compiled kernel's (tools/sm90_compile_check.py: 197,080 B at D = 128, 2 + 2 stages)
    assert 197080 <= gluon_attention.ws_shared_bytes(pers, 128) <= 232448
    q = torch.empty(1, 256, 2, 256, dtype=torch.bfloat16)
    wide = TileConfig(128, 64, 4, 2, gluon=True, consumers=2, persistent=True)
    assert "shared memory" in gluon_attention.forward_reason(q, q, q, None, _params(), wide, (9, 0))


def test_persistent_programs_are_one_causal_section():
    """A causal persistent forward runs one L2 section's items a round (`pipeline.program_order`:
    as many heads as one wave holds, within L2_SECTION's bytes), so that its snake-order rounds run
    long to short and balance; without a mask, one program a multiprocessor."""
    from flashforge.ops.gluon.pipeline import L2_SECTION, WAVE
    if L2_SECTION.value != 32 << 20 or WAVE.value != 132:
        pytest.skip("the section knobs are set in this environment")
    P = gluon_attention.persistent_programs
    assert P((32, 32), 4096 * 512, True, 132) == 128  # D = 128 4k: 4 heads of 32 blocks
    assert P((8, 256), 1024 * 512, True, 132) == 128  # 1k: 16 heads of 8 blocks
    assert P((128, 16), 16384 * 512, True, 132) == 128  # 16k: 1 head of 128 blocks
    assert P((171, 8), 32768 * 256, True, 132) == 132  # more blocks than a wave: one an SM
    assert P((3, 2), 300 * 512, True, 132) == 6  # a small grid: every item a program
    assert P((32, 32), 4096 * 512, False, 132) == 132
    # sections are sized for WAVE (device 0's multiprocessors): on a device with fewer, one an SM
    assert P((32, 32), 4096 * 512, True, 114) == 114


def test_backward_exponent_forms_by_dtype():
    """`rounding.backward_fuse`: bfloat16's plain score fused in every launch, float16's only where
    the program is known near (lse_lo's first launch); any modifier keeps the rounded form, the same
    rule as the portable kernels' `fused_score`."""
    from triton.experimental.gluon import language as gl
    from flashforge.ops.gluon import rounding
    assert rounding.backward_fuse(gl.bfloat16, False) and rounding.backward_fuse(gl.bfloat16, True)
    assert rounding.backward_fuse(gl.float16, True) and not rounding.backward_fuse(gl.float16, False)
    for mod in (dict(HAS_SOFTCAP=True), dict(HAS_ALIBI=True)):
        assert not rounding.backward_fuse(gl.float16, True, **mod) and not rounding.backward_fuse(gl.bfloat16, True, **mod)
