"""The sm_90 Gluon forward (ops/gluon/attention_fwd_sm90.py) against the float64
reference on an H100/H200: odd lengths, causal offsets either way (rows with
nothing visible), GQA, transposed inputs, both 16-bit dtypes and both head dims it
serves; the backward runs on its o and lse.  Outputs come from poisoned
allocations (conftest), so unwritten rows fail.  Also: calls outside its scope take
the portable kernel, and both kernels agree; packed (varlen) batches, forward and
backward, equal each sequence run alone.
"""
import pytest
import torch

import flashforge
from flashforge import reference
from flashforge.ops.gluon import attention as gluon_attention
from flashforge.ops.params import AttnParams
from flashforge.ops.triton import configs
from helpers import Case, check_case

SM90 = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not SM90, reason="the Gluon kernels are for sm_90 GPUs (H100/H200)")]
F16, BF16 = torch.float16, torch.bfloat16
TC = configs.TileConfig


# forward tiles that ask for the Gluon kernels: one or two warpgroups a program, and the
# warp-specialized kernel (a loader warp, two consumer warpgroups; with and without ping-pong)
FWD_VARIANTS = {
    "64x64": TC(64, 64, 4, 2, gluon=True),
    "64x128-v1": TC(64, 128, 4, 2, gluon=True, v_stages=1),
    "128x128-2wg": TC(128, 128, 8, 2, gluon=True),
    "ws-n128-s2": TC(128, 128, 4, 2, gluon=True, consumers=2),
    "ws-n64-s3-pingpong": TC(128, 64, 4, 3, gluon=True, consumers=2, pingpong=True),
    "ws-n128-s3-v2-pingpong": TC(128, 128, 4, 3, gluon=True, v_stages=2, consumers=2, pingpong=True),
    # half or all of the interior tiles' exponentials on the FMA pipes (`rounding.exp2_split`)
    "64x128-poly1": TC(64, 128, 4, 2, gluon=True, poly_exp2=1),
    "64x64-poly2": TC(64, 64, 4, 2, gluon=True, poly_exp2=2),
    # the persistent forward, run by 3 programs (`PERSISTENT_PROGRAMS`): each runs many items, so
    # ring indices, barrier phases and ping-pong turns carry over from item to item
    "ws-n128-s2-pingpong-persistent": TC(128, 128, 4, 2, gluon=True, consumers=2, pingpong=True, persistent=True),
    "ws-n64-s3-pingpong-persistent": TC(128, 64, 4, 3, gluon=True, consumers=2, pingpong=True, persistent=True),
    "ws-n128-s2-persistent": TC(128, 128, 4, 2, gluon=True, consumers=2, persistent=True),
}
PERSISTENT_PROGRAMS = 3


def few_programs(cfg, monkeypatch):
    """A persistent config's grid of PERSISTENT_PROGRAMS programs (others: nothing to do)."""
    if cfg is not None and cfg.persistent:
        monkeypatch.setattr(gluon_attention, "_PROGRAMS", PERSISTENT_PROGRAMS)


def set_forward_tiles(cfg):
    for kind in ("fwd", "fwd_causal"):
        for bucket in (64, 128):
            configs.set_config(kind, bucket, 2, cfg)


@pytest.fixture(params=list(FWD_VARIANTS), ids=list(FWD_VARIANTS))
def gluon_calls(request, monkeypatch):
    """Forward configs that ask for the Gluon kernel (FWD_VARIANTS); yields the list of its calls."""
    set_forward_tiles(FWD_VARIANTS[request.param])
    few_programs(FWD_VARIANTS[request.param], monkeypatch)
    calls = []
    real = gluon_attention.attention_forward

    def spy(q, *args, **kw):
        calls.append(tuple(q.shape))
        return real(q, *args, **kw)

    monkeypatch.setattr(gluon_attention, "attention_forward", spy)
    yield calls
    set_forward_tiles(None)


def case(id, dtype, **kw):
    return pytest.param(Case(**kw), dtype, id=f"{id}-{str(dtype)[6:]}")


CASES = [
    case("S777-D128", F16, B=2, Sq=777, Sk=777, Hq=4, Hkv=4, D=128),
    case("S1000-D64-causal-gqa4/2", BF16, B=2, Sq=1000, Sk=1000, Hq=4, Hkv=2, D=64, causal=True),
    case("S2048-D128-causal-gqa8/2", BF16, B=1, Sq=2048, Sk=2048, Hq=8, Hkv=2, D=128, causal=True),
    case("Sq300-Sk1000-bottom-right", F16, B=2, Sq=300, Sk=1000, Hq=2, Hkv=1, D=64, causal=True, causal_offset=700),
    case("Sq700-Sk200-empty-rows", BF16, B=1, Sq=700, Sk=200, Hq=2, Hkv=2, D=128, causal=True, causal_offset=-500),
    case("Sq200-Sk50-one-partial-tile", F16, B=3, Sq=200, Sk=50, Hq=2, Hkv=1, D=128),
    case("Sq64-Sk1", BF16, B=2, Sq=64, Sk=1, Hq=2, Hkv=2, D=64),
    case("bhsd-D64-causal", BF16, B=2, Sq=513, Sk=513, Hq=4, Hkv=2, D=64, causal=True, layout="bhsd"),
    case("sharp-softmax", F16, B=1, Sq=384, Sk=640, Hq=2, Hkv=2, D=128, input_scale=4.0),
    # one query tile a key block (the WS kernels' turn-taking: a single, odd tile)
    case("Sq64-Sk333-one-query-tile", BF16, B=2, Sq=64, Sk=333, Hq=2, Hkv=2, D=64),
]


@pytest.mark.parametrize("c, dtype", CASES)
def test_against_reference(c, dtype, gluon_calls):
    check_case(c, "triton", device="cuda", dtype=dtype)
    assert gluon_calls, "the Gluon forward was not used"


# Sliding windows: a query block visits only the key tiles of its band (and a key block, in the
# dK/dV kernel, only the query tiles of its band), masking the tiles its edges cross; the right
# side rides on the causal offset.  Windows of one key, wider than the sequence, right-only,
# both sides, bottom-right offsets, and rows whose band holds no key (lse = -inf, o = 0).
WINDOW_CASES = [
    case("S1000-D128-causal-window100-gqa4/2", BF16, B=2, Sq=1000, Sk=1000, Hq=4, Hkv=2, D=128, causal=True,
         window=(100, -1)),
    case("S777-D64-left-only", F16, B=1, Sq=777, Sk=777, Hq=2, Hkv=2, D=64, window=(90, -1)),
    case("S640-D128-both-sides", BF16, B=1, Sq=640, Sk=640, Hq=2, Hkv=1, D=128, window=(64, 31)),
    case("S515-D64-right-only", F16, B=1, Sq=515, Sk=515, Hq=2, Hkv=2, D=64, window=(-1, 70)),
    case("Sq300-Sk1000-bottom-right-window", F16, B=2, Sq=300, Sk=1000, Hq=2, Hkv=1, D=64, causal=True,
         causal_offset=700, window=(200, -1)),
    case("Sq700-Sk200-window-empty-rows", BF16, B=1, Sq=700, Sk=200, Hq=2, Hkv=2, D=128, causal_offset=-300,
         window=(20, 5)),
    case("S515-D64-window-of-one", BF16, B=1, Sq=515, Sk=515, Hq=2, Hkv=2, D=64, causal=True, window=(1, -1)),
    case("Sq300-Sk333-window-wider-than-keys", F16, B=1, Sq=300, Sk=333, Hq=2, Hkv=2, D=128, window=(5000, 4000)),
    case("S333-D256-causal-window77", BF16, B=1, Sq=333, Sk=333, Hq=2, Hkv=2, D=256, causal=True, window=(77, -1)),
    case("sharp-softmax-window", F16, B=1, Sq=384, Sk=640, Hq=2, Hkv=2, D=128, input_scale=4.0, window=(150, 20)),
]


@pytest.mark.parametrize("c, dtype", WINDOW_CASES)
def test_window_against_reference(c, dtype, gluon_calls):
    """The forward with the fixture's tiles (D = 256: the table's), the table's backward."""
    check_case(c, "triton", device="cuda", dtype=dtype)
    assert gluon_calls, "the Gluon forward was not used"


# Score modifiers: softcap (tanh, and its gradient's 1 - t^2) and ALiBi (per-head or per-row
# slopes, at distances from the call's offset, not the kernels' offset with a window's right side
# folded in), alone, together, with windows and offsets, at every head dim
MOD_CASES = [
    case("S777-D128-softcap30-gqa4/2", BF16, B=2, Sq=777, Sk=777, Hq=4, Hkv=2, D=128, softcap=30.0),
    case("S640-D64-causal-softcap5", F16, B=1, Sq=640, Sk=640, Hq=2, Hkv=2, D=64, causal=True, softcap=5.0),
    case("S515-D128-causal-alibi-H-gqa4/2", BF16, B=2, Sq=515, Sk=515, Hq=4, Hkv=2, D=128, causal=True, alibi="H"),
    case("Sq300-Sk1000-bottom-right-alibi-BH", F16, B=2, Sq=300, Sk=1000, Hq=2, Hkv=1, D=64, causal=True,
         causal_offset=700, alibi="BH"),
    case("Sq300-Sk500-alibi-window-right-offset", BF16, B=1, Sq=300, Sk=500, Hq=2, Hkv=2, D=128, causal_offset=50,
         window=(80, 40), alibi="H"),
    case("S640-D64-window-softcap-alibi", BF16, B=1, Sq=640, Sk=640, Hq=2, Hkv=2, D=64, window=(100, 20), softcap=10.0,
         alibi="BH"),
    case("Sq700-Sk200-softcap-empty-rows", F16, B=1, Sq=700, Sk=200, Hq=2, Hkv=2, D=128, causal=True,
         causal_offset=-500, softcap=20.0),
    case("S333-D256-causal-softcap-alibi", BF16, B=1, Sq=333, Sk=333, Hq=2, Hkv=2, D=256, causal=True, softcap=20.0,
         alibi="BH"),
    case("sharp-softcap50", F16, B=1, Sq=384, Sk=640, Hq=2, Hkv=2, D=128, input_scale=4.0, softcap=50.0),
]


@pytest.mark.parametrize("c, dtype", MOD_CASES)
def test_modifiers_against_reference(c, dtype, gluon_calls):
    """The forward with the fixture's tiles (D = 256: the table's), the table's backward."""
    check_case(c, "triton", device="cuda", dtype=dtype)
    assert gluon_calls, "the Gluon forward was not used"


# D = 256: the Gluon forward with the table's tiles and the variants a sweep may pick (one or
# two warpgroups, 32- or 64-key tiles, a one-slot V ring), the table's backward on its o and lse
D256_VARIANTS = {"table": None, "64x32": TC(64, 32, 4, 2, gluon=True), "64x64-v1": TC(64, 64, 4, 2, gluon=True, v_stages=1),
                 "128x32-s3": TC(128, 32, 8, 3, gluon=True), "128x64-2wg": TC(128, 64, 8, 2, gluon=True),
                 "ws-n64-s2-pingpong": TC(128, 64, 4, 2, gluon=True, consumers=2, pingpong=True),
                 "ws-n32-s3": TC(128, 32, 4, 3, gluon=True, consumers=2)}


@pytest.fixture(params=list(D256_VARIANTS), ids=list(D256_VARIANTS))
def gluon_calls_256(request, monkeypatch):
    tiles = D256_VARIANTS[request.param]
    if tiles is not None:
        for kind in ("fwd", "fwd_causal"):
            configs.set_config(kind, 256, 2, tiles)
    calls = []
    real = gluon_attention.attention_forward

    def spy(q, *args, **kw):
        calls.append(tuple(q.shape))
        return real(q, *args, **kw)

    monkeypatch.setattr(gluon_attention, "attention_forward", spy)
    yield calls
    for kind in ("fwd", "fwd_causal"):
        configs.set_config(kind, 256, 2, None)


D256_CASES = [
    case("S333-D256", BF16, B=2, Sq=333, Sk=333, Hq=2, Hkv=2, D=256),
    case("S515-D256-causal-gqa4/2", F16, B=1, Sq=515, Sk=515, Hq=4, Hkv=2, D=256, causal=True),
    case("Sq100-Sk700-bottom-right", BF16, B=2, Sq=100, Sk=700, Hq=2, Hkv=1, D=256, causal=True, causal_offset=600),
    case("Sq300-Sk90-empty-rows", F16, B=1, Sq=300, Sk=90, Hq=2, Hkv=2, D=256, causal=True, causal_offset=-150),
    case("Sq64-Sk33", BF16, B=3, Sq=64, Sk=33, Hq=1, Hkv=1, D=256),
    case("sharp-softmax-D256", BF16, B=1, Sq=200, Sk=456, Hq=2, Hkv=2, D=256, input_scale=4.0),
]


@pytest.mark.parametrize("c, dtype", D256_CASES)
def test_d256_against_reference(c, dtype, gluon_calls_256):
    check_case(c, "triton", device="cuda", dtype=dtype)
    # the tiles asked for Gluon (a variant), or the table has a Gluon entry for D = 256
    wanted = _gluon_tiles("fwd", 256, c.causal) is not None
    assert bool(gluon_calls_256) == wanted, f"Gluon forward calls {gluon_calls_256}, wanted: {wanted}"


# D = 256 in the Gluon backward: dV and dK in two launches of the dK/dV kernel (split_kv), with
# the table's tiles and the variants a sweep may pick (32-query tiles over 128 or 64 keys, 2 or 3
# slots; dQ over 32-key tiles with one or two warpgroups); and one pass Gluon, the other portable
D256_BWD_VARIANTS = {
    "table": None,
    "kv-32x128-s3+q-128x32": (TC(32, 128, 8, 3, gluon=True, split_kv=True), TC(128, 32, 8, 2, gluon=True)),
    "kv-32x64+q-64x32-s2": (TC(32, 64, 4, 2, gluon=True, split_kv=True), TC(64, 32, 4, 2, gluon=True)),
    "kv-64x64+portable-q": (TC(64, 64, 4, 2, gluon=True, split_kv=True), TC(128, 32, 8, 2)),
    "portable-kv+q-64x32": (TC(16, 128, 8, 3, split_kv=True), TC(64, 32, 4, 2, gluon=True)),
    # the wide dK/dV kernel (consumers split the head dim, dQ fused: no dQ kernel runs)
    "kv-wide": (TC(64, 64, 4, 1, gluon=True, consumers=2, fused_dq=True, half_dq=True), TC(64, 32, 4, 3, gluon=True)),
}
WIDE = D256_BWD_VARIANTS["kv-wide"][0]


def _bwd_spies(monkeypatch):
    """{kind: [q's shape per call]} of the Gluon backward launchers, recorded from now on;
    "fused": the dK/dV calls that also computed dQ (FUSED_DQ); "fused_cfg": their tiles."""
    calls = {"bwd_kv": [], "bwd_q": [], "fused": [], "fused_cfg": []}
    for kind, name in (("bwd_kv", "attention_bwd_dkdv"), ("bwd_q", "attention_bwd_dq")):
        real = getattr(gluon_attention, name)

        def spy(q, *args, real=real, kind=kind, **kw):
            calls[kind].append(tuple(q.shape))
            if kw.get("dq_acc") is not None:
                calls["fused"].append(tuple(q.shape))
                calls["fused_cfg"].append(args[6] if len(args) > 6 else kw.get("cfg"))
            return real(q, *args, **kw)

        monkeypatch.setattr(gluon_attention, name, spy)
    return calls


@pytest.fixture(params=list(D256_BWD_VARIANTS), ids=list(D256_BWD_VARIANTS))
def gluon_bwd_calls_256(request, monkeypatch):
    """{kind: calls} of the Gluon backward launchers, and the tiles asked for (None: the table's)."""
    pair = D256_BWD_VARIANTS[request.param]
    if pair is not None:
        configs.set_config("bwd_kv", 256, 2, pair[0])
        configs.set_config("bwd_q", 256, 2, pair[1])
    calls = _bwd_spies(monkeypatch)
    yield calls, pair
    configs.set_config("bwd_kv", 256, 2, None)
    configs.set_config("bwd_q", 256, 2, None)


# (with the D = 256 windows and score modifiers of the forward's cases, and a two-sided window)
D256_BWD_CASES = D256_CASES + [p for p in WINDOW_CASES + MOD_CASES if p.values[0].D == 256] + [
    case("Sq200-Sk456-D256-both-sides", F16, B=2, Sq=200, Sk=456, Hq=2, Hkv=1, D=256, causal_offset=100,
         window=(90, 45))]


@pytest.mark.parametrize("c, dtype", D256_BWD_CASES)
def test_d256_backward_against_reference(c, dtype, gluon_bwd_calls_256):
    calls, pair = gluon_bwd_calls_256
    check_case(c, "triton", device="cuda", dtype=dtype)
    if pair is not None and pair[0].half_dq:  # the wide kernel: dQ fused, no dQ kernel
        assert calls["fused"] and not calls["bwd_q"], calls
        return
    assert not calls["fused"], calls
    for i, kind in enumerate(("bwd_kv", "bwd_q")):
        asked = pair[i].gluon if pair is not None else configs.gluon_config(256, 2, False, (9, 0), kind) is not None
        assert bool(calls[kind]) == asked, f"Gluon {kind} calls {calls[kind]}, wanted: {asked}"


# Three consumers (the warp-specialized forward's 192-row programs, D = 64 only): every D = 64 case
# above, plain, causal, windows, softcap, ALiBi, GQA, offsets, empty rows, one partial tile
WS3_VARIANTS = {"ws3-n64-s3": TC(192, 64, 4, 3, gluon=True, consumers=3),
                "ws3-n128-s2": TC(192, 128, 4, 2, gluon=True, consumers=3),
                "ws3-n128-s2-persistent": TC(192, 128, 4, 2, gluon=True, consumers=3, persistent=True)}
D64_CASES = [p for p in CASES + WINDOW_CASES + MOD_CASES if p.values[0].D == 64]


@pytest.mark.parametrize("variant", list(WS3_VARIANTS))
@pytest.mark.parametrize("c, dtype", D64_CASES)
def test_three_consumers_against_reference(c, dtype, variant, monkeypatch):
    calls = []
    real = gluon_attention.attention_forward
    monkeypatch.setattr(gluon_attention, "attention_forward", lambda q, *a, **kw: calls.append(q.shape) or real(q, *a, **kw))
    few_programs(WS3_VARIANTS[variant], monkeypatch)
    for kind in ("fwd", "fwd_causal"):
        configs.set_config(kind, 64, 2, WS3_VARIANTS[variant])
    try:
        check_case(c, "triton", device="cuda", dtype=dtype)
    finally:
        for kind in ("fwd", "fwd_causal"):
            configs.set_config(kind, 64, 2, None)
    assert calls, "the Gluon forward was not used"


@pytest.mark.parametrize("c, dtype", [
    case("S4100-D64-table", BF16, B=1, Sq=4100, Sk=4100, Hq=2, Hkv=1, D=64),
    case("S8200-D64-causal-table", F16, B=1, Sq=8200, Sk=8200, Hq=1, Hkv=1, D=64, causal=True)])
def test_table_long_d64_forward_takes_three_consumers(c, dtype, monkeypatch):
    """The table's own path: from its "fwd_long" entry's min_keys on, D = 64 runs three consumers."""
    cfgs = []
    real = gluon_attention.attention_forward
    monkeypatch.setattr(gluon_attention, "attention_forward",
                        lambda q, k, v, params, cfg, *a, **kw: cfgs.append(cfg) or real(q, k, v, params, cfg, *a, **kw))
    check_case(c, "triton", device="cuda", dtype=dtype)
    assert cfgs and all(g.consumers == 3 for g in cfgs), cfgs


def test_three_consumers_refused_past_d64_take_the_portable_kernel(monkeypatch):
    """Three consumers at D = 128 do not fit their registers: the launcher refuses them, and the
    portable kernel runs the call with a power-of-two number of rows (not 192)."""
    calls = []
    real = gluon_attention.attention_forward
    monkeypatch.setattr(gluon_attention, "attention_forward", lambda q, *a, **kw: calls.append(q.shape) or real(q, *a, **kw))
    configs.set_config("fwd", 128, 2, WS3_VARIANTS["ws3-n64-s3"])
    try:
        check_case(CASES[0].values[0], "triton", device="cuda", dtype=F16)
    finally:
        configs.set_config("fwd", 128, 2, None)
    assert not calls


# features the Gluon kernels lack (built when called: the tensors live on the GPU)
OUT_OF_SCOPE = [lambda: dict(mask=torch.zeros(1, 1, 256, 256, device="cuda")),
                lambda: dict(causal=True, causal_offset=torch.tensor([3], device="cuda")),
                lambda: dict(dropout_p=0.1, seed=3)]


@pytest.mark.parametrize("kw", OUT_OF_SCOPE, ids=["bias", "per-batch-offsets", "dropout"])
def test_out_of_scope_takes_portable_kernel(kw, gluon_calls):
    kw = kw()
    q, k, v = (torch.randn(1, 256, 2, 64, device="cuda", dtype=BF16) for _ in range(3))
    flashforge.attention(q, k, v, backend="triton", **kw)
    flashforge.attention(q[:, :8], k, v, backend="triton")  # a short query block: GQA packing's kernel
    assert not gluon_calls


@pytest.mark.parametrize("causal", [False, True])
def test_matches_portable_kernel(causal, gluon_calls):
    gen = torch.Generator(device="cuda").manual_seed(1)
    q, k, v = (torch.randn(2, 1111, 4, 128, device="cuda", dtype=BF16, generator=gen) for _ in range(3))
    o, lse = flashforge.attention(q, k, v, causal=causal, backend="triton", return_lse=True)
    assert gluon_calls
    for kind in ("fwd", "fwd_causal"):
        configs.set_config(kind, 128, 2, configs.TileConfig(128, 128, 8, 3))
    o_ref, lse_ref = flashforge.attention(q, k, v, causal=causal, backend="triton", return_lse=True)
    assert len(gluon_calls) == 1
    torch.testing.assert_close(o, o_ref, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(lse, lse_ref, atol=1e-4, rtol=1e-4)


# The Gluon backward (ops/gluon/attention_bwd_sm90.py): dK/dV and dQ kernels, each with the
# table's tiles and with the variants the table may pick (one query tile at a time or
# overlapped, 2- and 3-slot rings, 32-query tiles, 128-key tiles, a one-slot V ring)
BWD_VARIANTS = {
    "table": None,
    "kv-one-at-a-time-s3+q-128keys": (TC(64, 64, 4, 3, gluon=True, overlap=False), TC(64, 128, 4, 2, gluon=True)),
    "kv-32q+q-s3-v1": (TC(32, 64, 4, 2, gluon=True), TC(64, 64, 4, 3, gluon=True, v_stages=1)),
    "kv-overlap-s3+q-s2": (TC(64, 64, 4, 3, gluon=True), TC(64, 64, 4, 2, gluon=True)),
    # dQ inside the dK/dV kernel (TMA reduce-adds; the dQ kernel serves deterministic=True calls only)
    "kv-fused-overlap-s2": (TC(64, 64, 4, 2, gluon=True, fused_dq=True), TC(64, 64, 4, 3, gluon=True)),
    "kv-fused-one-at-a-time-s3": (TC(64, 64, 4, 3, gluon=True, overlap=False, fused_dq=True),
                                  TC(64, 64, 4, 3, gluon=True)),
    # the warp-specialized dQ kernel (a loader warp, two 64-row consumers sharing each K/V tile)
    "kv-one-at-a-time-s2+q-ws": (TC(64, 64, 4, 2, gluon=True, overlap=False),
                                 TC(128, 64, 4, 2, gluon=True, consumers=2)),
    "kv-one-at-a-time-s2+q-ws-pingpong": (TC(64, 64, 4, 2, gluon=True, overlap=False),
                                          TC(128, 64, 4, 2, gluon=True, consumers=2, pingpong=True)),
    # the warp-specialized dK/dV kernel (two 64-key consumers, dQ fused through a writer warp's
    # reduce-adds; deterministic=True: the portable dK/dV kernel and the table's dQ kernel)
    "kv-ws-fused-s2": (TC(64, 128, 4, 2, gluon=True, consumers=2, fused_dq=True), TC(64, 64, 4, 3, gluon=True)),
    "kv-ws-fused-s3": (TC(64, 128, 4, 3, gluon=True, consumers=2, fused_dq=True), TC(64, 64, 4, 3, gluon=True)),
    # ... with one dQ product over all 128 keys a query tile, the consumers taking turns (shared_dq)
    "kv-ws-fused-shared-s2": (TC(64, 128, 4, 2, gluon=True, consumers=2, fused_dq=True, shared_dq=True),
                              TC(64, 64, 4, 3, gluon=True)),
    "kv-ws-fused-shared-s3": (TC(64, 128, 4, 3, gluon=True, consumers=2, fused_dq=True, shared_dq=True),
                              TC(64, 64, 4, 3, gluon=True)),
    # ... with the scores keys by queries and P^T, dS^T as register operands (rs: D = 64 only; at
    # D = 128 these take the portable dK/dV kernel)
    "kv-ws-fused-rs-s2": (TC(64, 128, 4, 2, gluon=True, consumers=2, fused_dq=True, rs=True),
                          TC(64, 64, 4, 3, gluon=True)),
    "kv-ws-fused-shared-rs-s2": (TC(64, 128, 4, 2, gluon=True, consumers=2, fused_dq=True, shared_dq=True, rs=True),
                                 TC(64, 64, 4, 3, gluon=True)),
    # ... each consumer computing half of every tile's dQ (half_dq, FA3's layout): 128-query tiles
    # at D = 64, 64-query tiles at D = 128 (a {bucket: pair} entry); a tile's dQ part issued with the
    # next tile's products (overlap) or with its own
    **{f"kv-halfdq-s{st}{'' if ov else '-lockstep'}": {
        64: (TC(128, 128, 4, st, gluon=True, consumers=2, fused_dq=True, half_dq=True, overlap=ov),
             TC(64, 64, 4, 3, gluon=True)),
        128: (TC(64, 128, 4, st, gluon=True, consumers=2, fused_dq=True, half_dq=True, overlap=ov),
              TC(64, 64, 4, 3, gluon=True))} for st, ov in ((2, True), (3, True), (2, False))},
}


def _gluon_tiles(kind: str, D: int, causal: bool = False):
    """The Gluon tiles the launcher takes for pass `kind` (16-bit, sm_90): an override with
    gluon=True asks for Gluon itself, else the table's Gluon entry (None: none)."""
    cfg = configs.get_config(kind, D, 2, False, causal=causal, arch=(9, 0))
    return cfg if cfg.gluon else configs.gluon_config(D, 2, causal, (9, 0), kind)


def _fused(D: int) -> bool:
    """Whether a default (non-deterministic) backward of head dim D fuses dQ into the dK/dV kernel."""
    cfg = _gluon_tiles("bwd_kv", D)
    return cfg is not None and gluon_attention.bwd_tiles_fit("bwd_kv", cfg, D) and \
        gluon_attention.fuses_dq(cfg, D, AttnParams(scale=1.0))


@pytest.fixture(params=list(BWD_VARIANTS), ids=list(BWD_VARIANTS))
def gluon_bwd_calls(request, monkeypatch):
    """Backward configs that ask for the Gluon kernels; yields {kind: calls}."""
    pair = BWD_VARIANTS[request.param]
    if pair is not None:
        for bucket in (64, 128):
            kv_q = pair[bucket] if isinstance(pair, dict) else pair
            configs.set_config("bwd_kv", bucket, 2, kv_q[0])
            configs.set_config("bwd_q", bucket, 2, kv_q[1])
    calls = _bwd_spies(monkeypatch)
    yield calls
    for bucket in (64, 128):
        configs.set_config("bwd_kv", bucket, 2, None)
        configs.set_config("bwd_q", bucket, 2, None)


BWD_CASES = [
    case("S777-D128", F16, B=2, Sq=777, Sk=777, Hq=4, Hkv=4, D=128),
    case("S1000-D64-causal-gqa4/2", BF16, B=2, Sq=1000, Sk=1000, Hq=4, Hkv=2, D=64, causal=True),
    case("S640-D128-causal-gqa8/2", BF16, B=1, Sq=640, Sk=640, Hq=8, Hkv=2, D=128, causal=True),
    case("Sq300-Sk1000-bottom-right", F16, B=2, Sq=300, Sk=1000, Hq=2, Hkv=1, D=64, causal=True, causal_offset=700),
    case("Sq700-Sk200-empty-rows", BF16, B=1, Sq=700, Sk=200, Hq=2, Hkv=2, D=128, causal=True, causal_offset=-500),
    case("Sq200-Sk50-one-partial-tile", F16, B=3, Sq=200, Sk=50, Hq=2, Hkv=1, D=128),
    case("Sq130-Sk1000-offset", BF16, B=1, Sq=130, Sk=1000, Hq=2, Hkv=2, D=64, causal=True, causal_offset=100),
    case("sharp-softmax", F16, B=1, Sq=384, Sk=640, Hq=2, Hkv=2, D=128, input_scale=4.0),
    # one query tile a key block (the WS kernels' turn-taking: a single, odd tile)
    case("Sq64-Sk333-one-query-tile", BF16, B=2, Sq=64, Sk=333, Hq=2, Hkv=2, D=64),
    # plain scores with a partial last query tile at D = 64 (128 queries a tile: 51 padded rows a
    # head), GQA: the half-dQ kernel leaves those rows' lse2 unmasked, and their zero-filled Q, dO,
    # lse2 and delta must add nothing
    case("Sq333-Sk520-D64-padded-queries-gqa4/2", F16, B=2, Sq=333, Sk=520, Hq=4, Hkv=2, D=64),
]


# (with the windows and score modifiers of the forward's cases)
@pytest.mark.parametrize("c, dtype", BWD_CASES + [p for p in WINDOW_CASES + MOD_CASES if p.values[0].D <= 128])
def test_backward_against_reference(c, dtype, gluon_bwd_calls):
    check_case(c, "triton", device="cuda", dtype=dtype)
    fused = _fused(c.D)
    assert bool(gluon_bwd_calls["fused"]) == fused
    for kind in ("bwd_kv",) if fused else ("bwd_kv", "bwd_q"):  # (the table may leave one pass to the portable kernel)
        if configs.gluon_config(c.D, 2, False, (9, 0), kind) is not None:
            assert gluon_bwd_calls[kind], f"the Gluon {kind} kernel was not used"
    if fused:
        assert not gluon_bwd_calls["bwd_q"], "the dQ kernel ran beside the fused dK/dV kernel"


@pytest.mark.parametrize("causal", [False, True])
def test_backward_far_negative_scores_with_keys_past_the_tile(causal, gluon_bwd_calls):
    """Every score of a row near -120 (lse far below 0), Sk = 200 not a multiple of the key block:
    a zero-filled key past Sk scores 0, and unmasked its P would be exp(0 - lse) = inf, which a
    fused dQ_t = dS K turns into NaN (inf * 0).  The gradients, dQ's above all, are finite and match
    the float64 reference, on every backward variant (the fused ones mask those keys)."""
    kv = _gluon_tiles("bwd_kv", 64, causal)
    if kv is not None and not gluon_attention.bwd_tiles_fit("bwd_kv", kv, 64):
        pytest.skip(f"bwd_kv {kv} does not fit D = 64's shared memory (its calls take the portable dK/dV kernel)")
    _check_far_negative(causal, 64)
    assert gluon_bwd_calls["bwd_kv"] or gluon_bwd_calls["fused"], "no Gluon backward ran"


@pytest.mark.parametrize("causal", [False, True])
def test_wide_backward_far_negative_scores_with_keys_past_the_tile(causal, monkeypatch):
    """The same at D = 256 through the wide dK/dV kernel (its key blocks crossing Sk mask those keys)."""
    calls = _bwd_spies(monkeypatch)
    configs.set_config("bwd_kv", 256, 2, WIDE)
    try:
        _check_far_negative(causal, 256)
    finally:
        configs.set_config("bwd_kv", 256, 2, None)
    assert calls["fused"] and not calls["bwd_q"], calls


def _check_far_negative(causal: bool, D: int):
    gen = torch.Generator(device="cuda").manual_seed(7)
    B, Sq, Sk, H = 1, 150, 200, 2
    u = torch.randn(1, 1, H, D, device="cuda", generator=gen)
    u = u / u.norm(dim=-1, keepdim=True)
    # q . k * D ** -0.5 = -120 + noise (std ~1.2): lse near -117, exp(-lse) past float32's range
    k = (u + 0.01 * torch.randn(B, Sk, H, D, device="cuda", generator=gen)) * 4.0
    q = -u.expand(B, Sq, H, D) * (30.0 * D ** 0.5)
    v, do = (torch.randn(B, n, H, D, device="cuda", generator=gen) for n in (Sk, Sq))
    leaves = [t.to(BF16).requires_grad_() for t in (q, k, v)]
    o = flashforge.attention(*leaves, causal=causal, backend="triton")
    grads = torch.autograd.grad(o, leaves, do.to(BF16))
    ref_leaves = [t.detach().double().requires_grad_() for t in leaves]
    ref = reference.attention(*ref_leaves, causal=causal)
    ref_grads = torch.autograd.grad(ref, ref_leaves, do.double())
    # (dQ = dS K cancels heavily here: the CPU path's bf16 dQ is 3% of its largest entry off)
    for name, g, r, tol in zip("qkv", grads, ref_grads, (0.1, 5e-2, 5e-2)):
        assert torch.isfinite(g).all(), f"d{name} has non-finite entries"
        err = ((g.double() - r).abs().max() / r.abs().max().clamp_min(1e-12)).item()
        assert err < tol, f"d{name}: max error {err:.3g} of its largest entry"


@pytest.mark.parametrize("c, dtype", [p for p in BWD_CASES if p.values[0].D <= 128][:4] + [
    p for p in WINDOW_CASES + MOD_CASES if p.values[0].D <= 128][:2])
def test_deterministic_backward_is_bitwise_and_unfused(c, dtype, gluon_bwd_calls):
    """deterministic=True: the ordered dK/dV + dQ kernels (never the fused atomics), bitwise the
    same on a rerun, and against the float64 reference."""
    first = check_case(c, "triton", device="cuda", dtype=dtype, deterministic=True)
    assert not gluon_bwd_calls["fused"]
    again = check_case(c, "triton", device="cuda", dtype=dtype, deterministic=True)
    for name in ("dq", "dk", "dv"):
        assert torch.equal(first[name], again[name]), f"{name} differs between two deterministic runs"


@pytest.mark.parametrize("c, dtype", [BWD_CASES[1], BWD_CASES[2], BWD_CASES[8]])
def test_table_long_backward_takes_the_ws_kernel(c, dtype, monkeypatch):
    """The table's long-sequence dK/dV entry ("bwd_kv_ws"), min_keys lowered to 0 here so that
    small cases reach it: the warp-specialized kernel with dQ fused, against the float64
    reference; deterministic=True keeps the ordered Gluon pair (not the portable kernels)."""
    from dataclasses import replace
    bucket = 64 if c.D <= 64 else 128
    lowered = replace(configs.gluon_config(c.D, 2, False, (9, 0), "bwd_kv_ws"), min_keys=0)
    configs.set_config("bwd_kv_ws_gluon", bucket, 2, lowered)
    try:
        calls = _bwd_spies(monkeypatch)
        check_case(c, "triton", device="cuda", dtype=dtype)
        assert calls["fused"] and not calls["bwd_q"], calls
        assert all(cfg == lowered for cfg in calls["fused_cfg"]), calls["fused_cfg"]
        fused, calls["bwd_kv"][:] = len(calls["fused"]), []
        check_case(c, "triton", device="cuda", dtype=dtype, deterministic=True)
        assert calls["bwd_kv"] and calls["bwd_q"] and len(calls["fused"]) == fused, calls
    finally:
        configs.set_config("bwd_kv_ws_gluon", bucket, 2, None)


@pytest.mark.parametrize("c, dtype", [
    pytest.param(Case(B=1, Sq=2085, Sk=2085, Hq=2, Hkv=1, D=64, causal=True, window=(1023, 0)), torch.bfloat16,
                 id="S2085-D64-causal-window1023-bfloat16"),
    pytest.param(Case(B=1, Sq=2049, Sk=2049, Hq=2, Hkv=2, D=128, window=(1100, -1)), torch.float16,
                 id="S2049-D128-left1100-float16")])
def test_long_window_backward_takes_the_ws_kernel(c, dtype, monkeypatch):
    """At the table's own thresholds (no lowered min_keys): a left window of at least the unmasked
    "bwd_kv_ws" entry's min_keys - 1 keys, in a call with the masked entry's keys, takes the
    warp-specialized kernel with dQ fused (`_long_bwd_kv`), against the float64 reference."""
    plain = configs.gluon_config(c.D, 2, False, (9, 0), "bwd_kv_ws")
    masked = configs.gluon_config(c.D, 2, True, (9, 0), "bwd_kv_ws")
    assert c.window[0] + 1 >= plain.min_keys and c.Sk >= masked.min_keys
    calls = _bwd_spies(monkeypatch)
    check_case(c, "triton", device="cuda", dtype=dtype)
    assert calls["fused"] and all(cfg == masked for cfg in calls["fused_cfg"]), calls


@pytest.mark.parametrize("D, Hkv, causal", [(64, 4, False), (128, 2, True)])
def test_training_steps_from_launch_plans_match_the_launchers(D, Hkv, causal, monkeypatch):
    """Training steps of one shape: from the third on, the forward and backward replay launch plans
    (ops/replay.py); each step's outputs and gradients equal, bitwise, those of the launchers' own
    path on the same inputs (plans off), and the third step's match the float64 reference."""
    from flashforge.ops import replay
    gen = torch.Generator(device="cuda").manual_seed(11)
    served = replay.served

    def step(q, k, v, do):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        o = flashforge.attention(*leaves, causal=causal, backend="triton")
        return (o, *torch.autograd.grad(o, leaves, do))

    for i in range(4):
        q, do = (torch.randn(2, 333, 4, D, device="cuda", dtype=BF16, generator=gen) for _ in range(2))
        k, v = (torch.randn(2, 333, Hkv, D, device="cuda", dtype=BF16, generator=gen) for _ in range(2))
        monkeypatch.setattr(replay, "TRAINING", True)
        planned = step(q, k, v, do)
        monkeypatch.setattr(replay, "TRAINING", False)
        own = step(q, k, v, do)
        for name, a, b in zip(("o", "dq", "dk", "dv"), planned, own):
            assert torch.equal(a, b), f"step {i}: {name} differs between the plan and the launcher"
    assert replay.served - served >= 4, "the plans did not serve steps 3 and 4 (forward and backward)"
    monkeypatch.setattr(replay, "TRAINING", True)
    c = Case(B=2, Sq=333, Sk=333, Hq=4, Hkv=Hkv, D=D, causal=causal)
    for seed in range(3):  # (the third call replays)
        check_case(c, "triton", device="cuda", dtype=BF16, gen_seed=seed)


def test_backward_out_of_scope_takes_portable_kernels(gluon_bwd_calls):
    q, k, v = (torch.randn(1, 256, 2, 64, device="cuda", dtype=BF16, requires_grad=True) for _ in range(3))
    for kw in (make() for make in OUT_OF_SCOPE):
        flashforge.attention(q, k, v, backend="triton", **kw).sum().backward()
    assert not gluon_bwd_calls["bwd_kv"] and not gluon_bwd_calls["bwd_q"]


@pytest.mark.parametrize("causal", [False, True])
def test_backward_matches_portable_kernels(causal, gluon_bwd_calls):
    """Same gradients (to rounding) as the portable backward, and bitwise the same on a rerun."""
    gen = torch.Generator(device="cuda").manual_seed(2)
    q, k, v, do = (torch.randn(2, 1111, 4, 128, device="cuda", dtype=BF16, generator=gen) for _ in range(4))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    kv = _gluon_tiles("bwd_kv", 128, causal)
    if kv is not None and not gluon_attention.bwd_tiles_fit("bwd_kv", kv, 128):
        pytest.skip(f"bwd_kv {kv} does not fit D = 128's shared memory (its calls take the portable dK/dV kernel)")
    o = flashforge.attention(*leaves, causal=causal, backend="triton")
    g1 = torch.autograd.grad(o, leaves, do, retain_graph=True)
    g2 = torch.autograd.grad(o, leaves, do, retain_graph=True)
    assert gluon_bwd_calls["bwd_kv"] and (gluon_bwd_calls["bwd_q"] or gluon_bwd_calls["fused"])
    for a, b in zip(g1, g2):
        if gluon_bwd_calls["fused"] and a is g1[0]:  # dQ by reduce-adds in varying order: float32 rounding apart
            torch.testing.assert_close(a, b, atol=1e-2, rtol=1e-2)
        else:
            assert torch.equal(a, b)
    for bucket in (64, 128):
        configs.set_config("bwd_kv", bucket, 2, configs.TileConfig(64, 128, 8, 2))
        configs.set_config("bwd_q", bucket, 2, configs.TileConfig(128, 64, 8, 2))
    n = len(gluon_bwd_calls["bwd_kv"])
    g_ref = torch.autograd.grad(o, leaves, do)
    assert len(gluon_bwd_calls["bwd_kv"]) == n
    for a, b in zip(g1, g_ref):
        torch.testing.assert_close(a, b, atol=2e-2, rtol=2e-2)


def test_delta_comes_from_the_dq_kernel(monkeypatch):
    """When both Gluon backward kernels serve, the dQ kernel computes delta (rowsum(o * dO) -
    dlse) and no preprocess kernel runs; the gradients, dlse's included, match the portable
    backward's."""
    from flashforge.ops.triton import attention as launchers
    if configs.gluon_config(128, 2, False, (9, 0), "bwd_kv") is None or \
            configs.gluon_config(128, 2, False, (9, 0), "bwd_q") is None:
        pytest.skip("the table leaves a D = 128 backward pass to the portable kernels")
    launched = []
    real = launchers.launch

    def spy(kernel, grid, *args, **kw):
        launched.append(kernel)
        return real(kernel, grid, *args, **kw)

    gen = torch.Generator(device="cuda").manual_seed(4)
    q, k, v, do = (torch.randn(2, 700, 4, 128, device="cuda", dtype=BF16, generator=gen) for _ in range(4))
    dlse = torch.randn(2, 4, 700, device="cuda", generator=gen)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    o, lse = flashforge.attention(*leaves, causal=True, backend="triton", return_lse=True)
    monkeypatch.setattr(launchers, "launch", spy)
    grads = torch.autograd.grad((o, lse), leaves, (do, dlse))
    assert launchers.attn_bwd_preprocess_kernel not in launched
    for bucket in (64, 128):  # the portable kernels' tiles: the preprocess kernel's delta
        configs.set_config("bwd_kv", bucket, 2, configs.TileConfig(64, 128, 8, 2))
        configs.set_config("bwd_q", bucket, 2, configs.TileConfig(128, 64, 8, 2))
    try:
        o2, lse2 = flashforge.attention(*leaves, causal=True, backend="triton", return_lse=True)
        ref = torch.autograd.grad((o2, lse2), leaves, (do, dlse))
    finally:
        for bucket in (64, 128):
            configs.set_config("bwd_kv", bucket, 2, None)
            configs.set_config("bwd_q", bucket, 2, None)
    assert launchers.attn_bwd_preprocess_kernel in launched
    for a, b in zip(grads, ref):
        torch.testing.assert_close(a, b, atol=2e-2, rtol=2e-2)


# Packed (varlen) batches through the ragged descriptors: every sequence's rows, and no
# other's, against the float64 reference run on each sequence alone.  Lengths below a tile,
# of one row and of none sit next to long ones, so a tile that read or wrote past its
# sequence's end would show in its neighbour.
VARLEN_CASES = [
    pytest.param(dict(lq=[700, 64, 1, 300, 129], lk=None, Hq=4, Hkv=2, D=128), dict(), BF16, id="D128-gqa"),
    pytest.param(dict(lq=[700, 64, 1, 300, 129], lk=None, Hq=2, Hkv=2, D=64), dict(causal=True), F16,
                 id="D64-causal"),
    pytest.param(dict(lq=[150, 0, 333, 65], lk=[400, 7, 333, 1000], Hq=4, Hkv=1, D=128),
                 dict(causal=True, causal_offset="bottom_right"), BF16, id="D128-causal-bottom-right-cross"),
    pytest.param(dict(lq=[257, 90], lk=[100, 513], Hq=2, Hkv=2, D=64), dict(causal=True, causal_offset=40), F16,
                 id="D64-causal-offset-cross"),
    pytest.param(dict(lq=[300, 77, 129], lk=None, Hq=2, Hkv=1, D=256), dict(causal=True), BF16, id="D256-causal-gqa"),
    pytest.param(dict(lq=[70, 200], lk=[333, 64], Hq=2, Hkv=2, D=256), dict(), F16, id="D256-cross"),
    pytest.param(dict(lq=[300, 77, 129], lk=[350, 77, 500], Hq=4, Hkv=2, D=128),
                 dict(causal=True, causal_offset="bottom_right", window=(90, -1), softcap=8.0), BF16,
                 id="D128-window-softcap-bottom-right-cross"),
]


@pytest.fixture
def gluon_spies(monkeypatch):
    calls = {"fwd": 0, "bwd_kv": 0, "bwd_q": 0}
    for kind, name in (("fwd", "attention_forward"), ("bwd_kv", "attention_bwd_dkdv"), ("bwd_q", "attention_bwd_dq")):
        real = getattr(gluon_attention, name)

        def spy(*args, real=real, kind=kind, **kw):
            calls[kind] += 1
            return real(*args, **kw)

        monkeypatch.setattr(gluon_attention, name, spy)
    return calls


@pytest.mark.parametrize("shape, kw, dtype", VARLEN_CASES)
def test_varlen_against_each_sequence_alone(shape, kw, dtype, gluon_spies):
    from flashforge import reference
    gen = torch.Generator(device="cuda").manual_seed(7)
    lq, lk = shape["lq"], shape["lk"] or shape["lq"]
    Hq, Hkv, D = shape["Hq"], shape["Hkv"], shape["D"]

    def pack(lengths, H):
        cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
        return torch.randn(sum(lengths), H, D, device="cuda", generator=gen).to(dtype).requires_grad_(), cu

    (q, cu_q), (k, cu_k), (v, _) = pack(lq, Hq), pack(lk, Hkv), pack(lk, Hkv)
    kw = dict(kw)
    offset = kw.pop("causal_offset", 0)
    offsets = [b - a for a, b in zip(lq, lk)] if offset == "bottom_right" else [offset] * len(lq)
    o, lse = flashforge.attention_varlen(q, k, v, cu_q, cu_k, max(lq), max(lk), causal_offset=offset,
                                         return_lse=True, backend="triton", **kw)
    do = torch.randn(o.shape, device="cuda", generator=gen).to(dtype)
    dq, dk, dv = torch.autograd.grad(o, (q, k, v), do)
    assert gluon_spies["fwd"] == (_gluon_tiles("fwd", D, "causal" in kw) is not None)
    for kind in ("bwd_q", "bwd_kv"):
        g = _gluon_tiles(kind, D)
        serves = g is not None and gluon_attention.bwd_tiles_fit(kind, g, D)
        assert gluon_spies[kind] == (serves and not (kind == "bwd_q" and _fused(D)))

    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    outs, lses = [], []
    for b, (off, a0, a1, c0, c1) in enumerate(zip(offsets, cu_q[:-1].tolist(), cu_q[1:].tolist(),
                                                  cu_k[:-1].tolist(), cu_k[1:].tolist())):
        ob, lb = reference.attention(q64[None, a0:a1], k64[None, c0:c1], v64[None, c0:c1], causal_offset=off,
                                     return_lse=True, **kw)
        outs.append(ob[0])
        lses.append(lb[0])
    o_ref, lse_ref = torch.cat(outs), torch.cat(lses, dim=1)
    grads_ref = torch.autograd.grad(o_ref, (q64, k64, v64), do.double())
    for name, got, want in zip(("o", "lse", "dq", "dk", "dv"), (o, lse, dq, dk, dv), (o_ref, lse_ref, *grads_ref)):
        got, want = got.detach().double(), want.detach()
        assert not torch.isnan(got).any(), f"{name} has NaN (an unwritten row?)"
        finite = torch.isfinite(want)
        assert torch.equal(torch.isinf(got), ~finite), f"{name}: -inf entries differ"
        scale = want[finite].abs().max().item() if finite.any() else 1.0
        err = (got[finite] - want[finite]).abs().max().item() if finite.any() else 0.0
        assert err <= 2e-2 * max(1.0, scale), f"{name}: max error {err:.3e} (scale {scale:.2e})"


@pytest.mark.parametrize("variant", ["ws-n128-s2", "ws-n64-s3-pingpong", "ws-n128-s2-pingpong-persistent"])
@pytest.mark.parametrize("shape, kw, dtype", [p for p in VARLEN_CASES if p.values[0]["D"] <= 128])
def test_varlen_warp_specialized_forward(variant, shape, kw, dtype, gluon_spies, monkeypatch):
    """Packed batches through the warp-specialized forward (each program's two halves may fall
    on either side of a sequence's end; persistent: a program's items in several sequences), the
    table's backward on its o and lse."""
    few_programs(FWD_VARIANTS[variant], monkeypatch)
    set_forward_tiles(FWD_VARIANTS[variant])
    try:
        test_varlen_against_each_sequence_alone(shape, kw, dtype, gluon_spies)
    finally:
        set_forward_tiles(None)


@pytest.mark.parametrize("variant", list(WS3_VARIANTS))
@pytest.mark.parametrize("shape, kw, dtype", [p for p in VARLEN_CASES if p.values[0]["D"] == 64])
def test_varlen_three_consumers(variant, shape, kw, dtype, gluon_spies, monkeypatch):
    """Packed batches through the three-consumer forward (a program's 192 rows may span a
    sequence's end anywhere), the table's backward on its o and lse."""
    few_programs(WS3_VARIANTS[variant], monkeypatch)
    for kind in ("fwd", "fwd_causal"):
        configs.set_config(kind, 64, 2, WS3_VARIANTS[variant])
    try:
        test_varlen_against_each_sequence_alone(shape, kw, dtype, gluon_spies)
    finally:
        for kind in ("fwd", "fwd_causal"):
            configs.set_config(kind, 64, 2, None)


@pytest.mark.parametrize("shape, kw, dtype", [p for p in VARLEN_CASES if p.values[0]["D"] == 256])
def test_varlen_wide_dkdv(shape, kw, dtype, gluon_spies):
    """Packed batches through the wide dK/dV kernel (D = 256, dQ fused): a 64-key block or a
    query tile may cross a sequence's end."""
    configs.set_config("bwd_kv", 256, 2, WIDE)
    try:
        test_varlen_against_each_sequence_alone(shape, kw, dtype, gluon_spies)
    finally:
        configs.set_config("bwd_kv", 256, 2, None)


@pytest.mark.parametrize("causal", [False, True])
def test_wide_deterministic_takes_the_ordered_kernels(causal, monkeypatch):
    """deterministic=True with the wide tiles asked for: the wide kernel adds dQ in varying order,
    so the call takes the ordered kernels, and a rerun is bitwise the same."""
    calls = _bwd_spies(monkeypatch)
    configs.set_config("bwd_kv", 256, 2, WIDE)
    try:
        gen = torch.Generator(device="cuda").manual_seed(3)
        q, k, v, do = (torch.randn(1, 333, 2, 256, device="cuda", dtype=BF16, generator=gen) for _ in range(4))
        runs = []
        for _ in range(2):
            leaves = [t.clone().requires_grad_() for t in (q, k, v)]
            o = flashforge.attention(*leaves, causal=causal, backend="triton", deterministic=True)
            runs.append(torch.autograd.grad(o, leaves, do))
    finally:
        configs.set_config("bwd_kv", 256, 2, None)
    assert not calls["fused"], calls
    for a, b in zip(*runs):
        assert torch.equal(a, b)


@pytest.mark.parametrize("shape, kw, dtype", [p for p in VARLEN_CASES if p.values[0]["D"] <= 128])
def test_varlen_warp_specialized_dq(shape, kw, dtype, gluon_spies):
    """Packed batches through the warp-specialized dQ kernel (with ping-pong; a program's two
    halves may fall on either side of a sequence's end)."""
    for bucket in (64, 128):
        configs.set_config("bwd_q", bucket, 2, BWD_VARIANTS["kv-one-at-a-time-s2+q-ws-pingpong"][1])
    try:
        test_varlen_against_each_sequence_alone(shape, kw, dtype, gluon_spies)
    finally:
        for bucket in (64, 128):
            configs.set_config("bwd_q", bucket, 2, None)


def test_causal_sections_with_a_partial_last_one():
    """Causal programs run longest-first in L2 sections of heads (`pipeline.program_order`); this
    file's shapes are one section each, so a child process reads a small FLASHFORGE_L2_SECTION
    (at import, as the kernels do) and runs tests/gluon_sections_child.py: several sections, the
    last one short, every forward and backward kernel family."""
    import os
    import re
    import subprocess
    import sys

    here = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, FLASHFORGE_L2_SECTION="655360", FLASHFORGE_WAVE=str(1 << 20))
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
                           os.path.join(here, "gluon_sections_child.py")], env=env, capture_output=True, text=True,
                          cwd=os.path.dirname(here))
    tail = proc.stdout[-4000:] + proc.stderr[-2000:]
    assert proc.returncode == 0, tail
    assert re.search(r"\b7 passed", proc.stdout) and "skipped" not in proc.stdout, tail
