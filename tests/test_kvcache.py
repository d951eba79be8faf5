"""`flashforge.attention_with_kvcache` on both backends: against the float64
reference on the gathered keys, cache appends touch only their slots, paged
equals contiguous, RoPE inside equals `apply_rope` first, split equals unsplit."""
import pytest
import torch
import torch._dynamo

import flashforge
from flashforge import Rope, reference
from helpers import backend_device, backend_params

BACKENDS = backend_params()
B, HQ, HKV, D = 3, 4, 2, 32


def _setup(dev, S_cache=64, s_new=2, Sq=2, gen_seed=0, block_size=16, paged=False):
    gen = torch.Generator().manual_seed(gen_seed)
    rnd = lambda *s: torch.randn(*s, generator=gen).to(dev)  # noqa: E731
    q = rnd(B, Sq, HQ, D)
    k_new, v_new = (rnd(B, s_new, HKV, D) for _ in range(2)) if s_new else (None, None)
    cache_seqlens = torch.tensor([5, 40, 0], dtype=torch.int32, device=dev)
    kc, vc = rnd(B, S_cache, HKV, D), rnd(B, S_cache, HKV, D)
    if not paged:
        return q, kc, vc, k_new, v_new, cache_seqlens, None
    # the same rows, scattered over shuffled pages of a larger pool
    per_row = S_cache // block_size
    n_blocks = B * per_row + 3
    table = torch.randperm(n_blocks, generator=gen)[:B * per_row].view(B, per_row).int().to(dev)
    kp, vp = rnd(n_blocks, block_size, HKV, D), rnd(n_blocks, block_size, HKV, D)
    kp[table.long()] = kc.view(B, per_row, block_size, HKV, D)
    vp[table.long()] = vc.view(B, per_row, block_size, HKV, D)
    return q, kp, vp, k_new, v_new, cache_seqlens, table


def _rows(cache, table):
    """A cache as [B, keys, Hkv, D] rows: a paged one's blocks gathered through its table."""
    return cache if table is None else cache[table.long()].flatten(1, 2)


def _reference(q, kc, vc, k_new, v_new, cache_seqlens, causal=True, window=None, rope=None):
    """Per batch row: the cache's first cache_seqlens keys plus the new ones, in float64."""
    outs = []
    for b in range(q.shape[0]):
        n = int(cache_seqlens[b])
        kb, vb = kc[b, :n], vc[b, :n]
        qb = q[b:b + 1]
        if k_new is not None:
            kn = k_new[b:b + 1]
            if rope is not None:
                kn = reference.apply_rope(kn.double(), pos=n, theta=rope.theta, style=rope.style)
            kb, vb = torch.cat([kb.double(), kn[0].double()]), torch.cat([vb.double(), v_new[b].double()])
        L = kb.shape[0]
        if rope is not None:
            qb = reference.apply_rope(qb.double(), pos=L - q.shape[1], theta=rope.theta, style=rope.style)
        outs.append(reference.attention(qb.double(), kb[None].double(), vb[None].double(), causal=causal,
                                        causal_offset=L - q.shape[1], window=window))
    return torch.cat(outs)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("Sq, s_new, kw", [
    pytest.param(1, 1, dict(), id="decode-append"),
    pytest.param(3, 3, dict(), id="prefill-chunk-append"),
    pytest.param(2, 0, dict(), id="no-append"),
    pytest.param(1, 1, dict(window=(8, -1)), id="decode-window"),
    pytest.param(2, 2, dict(rope=Rope(theta=500.0)), id="rope"),
    pytest.param(2, 2, dict(causal=False), id="non-causal"),
])
def test_against_reference_and_append(backend, paged, Sq, s_new, kw):
    dev = backend_device(backend)
    q, kc, vc, k_new, v_new, seqlens, table = _setup(dev, Sq=Sq, s_new=s_new, paged=paged)
    kc0, vc0 = kc.clone(), vc.clone()
    versions = kc._version, vc._version
    o = flashforge.attention_with_kvcache(q, kc, vc, k_new, v_new, cache_seqlens=seqlens, block_table=table,
                                         backend=backend, **kw)
    if s_new:  # an append is an in-place write: autograd's version counters must see it
        assert kc._version > versions[0] and vc._version > versions[1]
    # contiguous view of the (pre-append) cache for the reference
    ref_k, ref_v = _rows(kc0, table), _rows(vc0, table)
    want = _reference(q.cpu(), ref_k.cpu(), ref_v.cpu(), None if k_new is None else k_new.cpu(),
                      None if v_new is None else v_new.cpu(), seqlens.cpu(), causal=kw.get("causal", True),
                      window=kw.get("window"), rope=kw.get("rope"))
    assert not torch.isnan(o).any()
    torch.testing.assert_close(o.double().cpu(), want, rtol=1e-4, atol=1e-4)
    # the cache changed exactly at the appended slots
    changed = (kc != kc0).any(-1).any(-1) | (vc != vc0).any(-1).any(-1)  # [rows or blocks, slots]
    expected = torch.zeros_like(changed)
    for b in range(B):
        for i in range(s_new):
            pos = int(seqlens[b]) + i
            if paged:
                expected[table[b, pos // kc.shape[1]], pos % kc.shape[1]] = True
            else:
                expected[b, pos] = True
    assert torch.equal(changed, expected), "the append wrote outside its slots (or missed one)"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("Sq", [1, 3])
def test_split_kv_equals_unsplit(backend, Sq):
    dev = backend_device(backend)
    q, kc, vc, k_new, v_new, seqlens, _ = _setup(dev, Sq=Sq, s_new=Sq)
    outs = []
    # 70 splits: more than the merge reads at once (64), and more than there are key tiles (empty splits)
    for splits in (1, 2, 5, 70):
        kcs, vcs = kc.clone(), vc.clone()
        o, lse = flashforge.attention_with_kvcache(q, kcs, vcs, k_new, v_new, cache_seqlens=seqlens,
                                                   num_splits=splits, return_lse=True, backend=backend)
        outs.append((o, lse))
    for o, lse in outs[1:]:
        torch.testing.assert_close(o, outs[0][0], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(lse, outs[0][1], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("backend", BACKENDS)
def test_rope_inside_equals_apply_rope_first(backend):
    dev = backend_device(backend)
    rope = Rope(theta=10000.0, style="interleaved", rotary_dim=16)
    q, kc, vc, k_new, v_new, seqlens, _ = _setup(dev, Sq=2, s_new=2)
    kc2, vc2 = kc.clone(), vc.clone()
    got = flashforge.attention_with_kvcache(q, kc, vc, k_new, v_new, cache_seqlens=seqlens, rope=rope,
                                           backend=backend)
    rot = dict(theta=rope.theta, style=rope.style, rotary_dim=rope.rotary_dim, backend=backend)
    q_r = flashforge.apply_rope(q, pos=seqlens + 2 - 2, **rot)
    k_r = flashforge.apply_rope(k_new, pos=seqlens, **rot)
    want = flashforge.attention_with_kvcache(q_r, kc2, vc2, k_r, v_new, cache_seqlens=seqlens, backend=backend)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(kc, kc2)


def test_errors():
    q, kc, vc = torch.randn(2, 1, 4, 16), torch.randn(2, 32, 2, 16), torch.randn(2, 32, 2, 16)
    with pytest.raises(ValueError, match=r"k and v must be given together"):
        flashforge.attention_with_kvcache(q, kc, vc, torch.randn(2, 1, 2, 16), cache_seqlens=3)
    with pytest.raises(ValueError, match=r"cache_seqlens must be an int or an int32/int64 tensor \[B\] = \[2\]"):
        flashforge.attention_with_kvcache(q, kc, vc, cache_seqlens=torch.tensor([1.0, 2.0]))
    with pytest.raises(ValueError, match=r"block_size 24; accepted: a power of two >= 16"):
        flashforge.attention_with_kvcache(q, torch.randn(4, 24, 2, 16), torch.randn(4, 24, 2, 16), cache_seqlens=3,
                                          block_table=torch.zeros(2, 2, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"rope.rotary_dim is 7; accepted: an even int from 2 to the head dim 16"):
        flashforge.attention_with_kvcache(q, kc, vc, cache_seqlens=3, rope=Rope(rotary_dim=7))
    with pytest.raises(TypeError, match=r"rope must be a flashforge.Rope or None, got dict"):
        flashforge.attention_with_kvcache(q, kc, vc, cache_seqlens=3, rope={"theta": 1.0})
    with pytest.raises(ValueError, match=r"num_heads \(4\) must be a multiple of num_kv_heads \(3\)"):
        flashforge.attention_with_kvcache(q, torch.randn(2, 32, 3, 16), torch.randn(2, 32, 3, 16), cache_seqlens=3)


def test_decode_step_compiles_fullgraph():
    """A decoding step (append + attend) traces without graph breaks and matches eager."""
    q, kc, vc, k_new, v_new, seqlens, table = _setup("cpu", Sq=1, s_new=1, paged=True)

    def step(q, kc, vc, k, v, lens):
        return flashforge.attention_with_kvcache(q, kc, vc, k, v, cache_seqlens=lens, block_table=table,
                                                 rope=Rope(), num_splits=2)

    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    kc2, vc2 = kc.clone(), vc.clone()
    want = step(q, kc, vc, k_new, v_new, seqlens)
    got = compiled(q, kc2, vc2, k_new, v_new, seqlens)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(kc2, kc)


def test_auto_splits_fills_the_gpu_only_when_needed():
    from flashforge.api.kvcache import auto_splits
    # decode, GQA 32/8: 8 packed programs per sequence; 16-row tiles, two programs per SM
    assert auto_splits(1, 1, 32, 8, 131072, sms=132) == 33  # 8 programs x 33: two per SM of 132
    assert auto_splits(1, 1, 32, 8, 4096, sms=132) == 16  # >= 256 keys per split
    assert auto_splits(1, 1, 32, 8, 512, sms=132) == 2
    assert auto_splits(1, 4, 32, 8, 131072, sms=132) == 8  # 32 programs x 8 (x 9 would overflow)
    assert auto_splits(1, 16, 32, 8, 131072, sms=132) == 2  # 128 programs x 2
    # 64-row tiles (one program per SM): 8 query rows x 8 heads of a group
    assert auto_splits(8, 1, 64, 8, 131072, sms=132) == 16
    assert auto_splits(8, 16, 64, 8, 131072, sms=132) == 1  # 128 programs: already one wave
    assert auto_splits(1, 32, 32, 8, 131072, sms=132) == 1  # 256 programs: already two waves
    assert auto_splits(1, 128, 32, 8, 131072, sms=132) == 1  # 1024 programs fill the GPU already
    assert auto_splits(512, 2, 32, 32, 131072, sms=132) == 1  # prefill chunk: 4 query blocks x 64 heads


@pytest.mark.parametrize("backend", [p for p in BACKENDS if p.values[0] == "triton"])
@pytest.mark.parametrize("block_n", [16, 32])
def test_paged_with_key_tiles_wider_and_narrower_than_pages(backend, block_n, monkeypatch):
    """Pages of 16 keys read by 16-key tiles (one block-table entry per tile, read ahead) and
    by 32-key tiles (a table lookup per key): both equal the contiguous cache."""
    from flashforge.ops.triton import configs
    dev = backend_device("triton")
    q, kc, vc, _, _, seqlens, _ = _setup(dev, Sq=1, s_new=0)
    qp, kp, vp, _, _, _, table = _setup(dev, Sq=1, s_new=0, paged=True)
    torch.testing.assert_close(qp, q)
    want = flashforge.attention_with_kvcache(q, kc, vc, cache_seqlens=seqlens, backend="triton")
    if torch.device(dev).type == "cpu":  # the interpreter's tiles are 16 x 16: widen the keys
        monkeypatch.setattr(configs, "_INTERPRETER", configs.TileConfig(16, block_n, 1, 1))
    got = flashforge.attention_with_kvcache(q, kp, vp, cache_seqlens=seqlens, block_table=table, backend="triton")
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("splits, rope, dtype", [
    pytest.param(None, None, torch.bfloat16, id="auto-bf16"),
    pytest.param(1, Rope(theta=500.0), torch.float32, id="unsplit-rope-fp32"),
    pytest.param(3, None, torch.float16, id="split3-fp16"),
])
def test_decode_loop_is_replayed_and_right_every_step(paged, splits, rope, dtype):
    """A decoding loop's repeated calls are served from a launch plan (ops/replay.py) after two
    recorded ones: every step, with new queries, new keys appended and longer rows, matches
    the float64 reference -- a replay that kept a recorded tensor or length would not."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (launch plans serve CUDA calls)")
    from flashforge.ops import replay
    _, kc, vc, _, _, seqlens, table = _setup("cuda", S_cache=128, s_new=0, Sq=1, paged=paged)
    kc, vc = kc.to(dtype), vc.to(dtype)
    gen = torch.Generator().manual_seed(5)
    served0 = replay.served
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    for step in range(6):
        q = torch.randn(B, 1, HQ, D, generator=gen).to("cuda", dtype)
        k_new, v_new = (torch.randn(B, 1, HKV, D, generator=gen).to("cuda", dtype) for _ in range(2))
        kc0, vc0 = kc.clone(), vc.clone()
        o = flashforge.attention_with_kvcache(q, kc, vc, k_new, v_new, cache_seqlens=seqlens, block_table=table,
                                             rope=rope, num_splits=splits, backend="triton")
        ref_k, ref_v = _rows(kc0, table), _rows(vc0, table)
        want = _reference(q.cpu().double(), ref_k.cpu().double(), ref_v.cpu().double(), k_new.cpu().double(),
                          v_new.cpu().double(), seqlens.cpu(), rope=rope)
        torch.testing.assert_close(o.double().cpu(), want, rtol=tol, atol=tol, msg=f"step {step}")
        seqlens = seqlens + 1  # a new tensor each step, as a server's would be
    assert replay.served - served0 >= 4, "the repeated calls were not replayed"


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_decode_step_in_a_cuda_graph_follows_its_inputs(paged):
    """A decoding step captured in a CUDA graph after its launch plan formed (the capture then
    replays the plan, split-KV merge included) reads the static buffers' new contents on every
    replay: new queries and keys, and one more cached key per step."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (CUDA graphs)")
    _, kc, vc, _, _, seqlens, table = _setup("cuda", S_cache=128, s_new=0, Sq=1, paged=paged)
    kc, vc = kc.to(torch.bfloat16), vc.to(torch.bfloat16)
    q = torch.zeros(B, 1, HQ, D, device="cuda", dtype=torch.bfloat16)
    k_new, v_new = (torch.zeros(B, 1, HKV, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    lens = seqlens.clone()

    def step():
        return flashforge.attention_with_kvcache(q, kc, vc, k_new, v_new, cache_seqlens=lens, block_table=table,
                                                 num_splits=3, backend="triton")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):  # warm: compiled, two recordings, then the plan serves
            step()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):  # (the warm-up's appends wrote zeros at lens: each replay overwrites them)
        out = step()
    gen = torch.Generator().manual_seed(9)
    for _ in range(3):
        for t, shape in ((q, (B, 1, HQ, D)), (k_new, (B, 1, HKV, D)), (v_new, (B, 1, HKV, D))):
            t.copy_(torch.randn(*shape, generator=gen))
        before_k, before_v = kc.clone(), vc.clone()
        graph.replay()
        torch.cuda.synchronize()
        ref_k, ref_v = _rows(before_k, table), _rows(before_v, table)
        want = _reference(q.cpu().double(), ref_k.cpu().double(), ref_v.cpu().double(), k_new.cpu().double(),
                          v_new.cpu().double(), lens.cpu())
        torch.testing.assert_close(out.double().cpu(), want, rtol=2e-2, atol=2e-2)
        lens += 1  # in place: the graph reads the new lengths


def test_appending_call_passes_the_callers_counts_and_the_added_keys(monkeypatch):
    """With new keys the kernels are handed the caller's own cache_seqlens tensor and the number
    of keys appended (they add it themselves): no `cache_seqlens + S_new` tensor, which would be
    one more kernel in every decoding step."""
    import flashforge.api.kvcache as api
    seen = {}
    real = api.attention_kvcache_function

    def spy(q, k_cache, v_cache, params, backend):
        seen["params"] = params
        return real(q, k_cache, v_cache, params, backend)
    monkeypatch.setattr(api, "attention_kvcache_function", spy)
    kc, vc = torch.randn(2, 32, 2, 16), torch.randn(2, 32, 2, 16)
    q, k, v = torch.randn(2, 3, 4, 16), torch.randn(2, 3, 2, 16), torch.randn(2, 3, 2, 16)
    lens = torch.tensor([5, 20], dtype=torch.int32)
    o = flashforge.attention_with_kvcache(q, kc, vc, k, v, cache_seqlens=lens, backend="torch")
    assert seen["params"].seqlens_k is lens and seen["params"].seqlens_k_add == 3
    want = torch.stack([reference.attention(q[b:b + 1].double(), kc[b:b + 1, :n + 3].double(),
                                            vc[b:b + 1, :n + 3].double(), causal=True, causal_offset=n)[0]
                        for b, n in enumerate(lens.tolist())])
    torch.testing.assert_close(o.double(), want, atol=1e-5, rtol=1e-5)
