"""The warp-specialized forward's barrier protocol, replayed on the CPU (tests/ws_protocol_model.py).

The model is checked against the GPU first: on 2026-12-07 (H100) the first persistent ping-pong
version hung on 14 of the forward tests' persistent variants; the model, with that version's order
(`old_tail`), must hang on exactly those 14 and finish the 14 ping-pong persistent cases of D <= 128
that passed there.  Then the kernel's current
order must finish every geometry without a deadlock or a wait passing on the wrong phase."""
import random

import pytest

import ws_protocol_model as M


def geometry(Sq, Sk, heads, causal=False, offset=0, window=None):
    """The kernels' visibility arguments for a test case (`ops/gluon/attention._right` / `_window`):
    window (left, right), -1 for no side; causal is a right side of 0."""
    left, right = window if window else (-1, -1)
    if causal:
        right = max(right, 0)
    return dict(Sq=Sq, Sk=Sk, heads=heads, causal=right >= 0, offset=offset + max(right, 0), has_wl=left >= 0,
                span=left + max(right, 0) if left >= 0 else 0)


def programs(g, BN, P=3, nc=2):
    """Each of P programs' items, as the persistent grid deals them: query blocks (causal: the
    longest, the last block, first) of each head, in snake-order rounds of P."""
    blocks = list(range(0, g["Sq"], nc * 64))
    if g["causal"]:
        blocks = blocks[::-1]
    items = [M.item(m0, g["Sq"], g["Sk"], g["offset"], g["span"], BN, g["causal"], g["has_wl"], nc)
             for _ in range(g["heads"]) for m0 in blocks]
    out = [[] for _ in range(P)]
    for k in range(0, len(items), P):
        rnd = items[k:k + P]
        for p in range(P):
            idx = p if (k // P) % 2 == 0 else P - 1 - p
            if idx < len(rnd):
                out[p].append(rnd[idx])
    return out


def outcome(g, BN, S, old_tail=False, seeds=3):
    try:
        for seed in range(seeds):
            for items in programs(g, BN):
                M.run(items, S, S, pingpong=True, persistent=True, seed=seed, old_tail=old_tail)
    except M.ProtocolError:
        return "hang"
    return "ok"


# test_gluon_sm90.py's cases (B * Hq heads) and what the first persistent version did on the GPU,
# 3 programs: ws-n128-s2-pingpong-persistent ("n128") and ws-n64-s3-pingpong-persistent ("n64")
GPU_RUN = [
    ("S777-D128", geometry(777, 777, 8), {"n128": "hang", "n64": "hang"}),
    ("Sq700-Sk200-empty-rows", geometry(700, 200, 2, causal=True, offset=-500), {"n128": "ok", "n64": "hang"}),
    ("bhsd-D64-causal", geometry(513, 513, 8, causal=True), {"n128": "hang", "n64": "hang"}),
    ("sharp-softmax", geometry(384, 640, 2), {"n128": "ok", "n64": "ok"}),
    ("Sq64-Sk333-one-query-tile", geometry(64, 333, 4), {"n128": "hang", "n64": "hang"}),
    ("Sq64-Sk1", geometry(64, 1, 4), {"n128": "ok", "n64": "ok"}),
    ("Sq200-Sk50-one-partial-tile", geometry(200, 50, 6), {"n128": "ok"}),
    ("S2048-D128-causal-gqa8/2", geometry(2048, 2048, 8, causal=True), {"n128": "ok", "n64": "ok"}),
    ("Sq300-Sk1000-bottom-right", geometry(300, 1000, 4, causal=True, offset=700), {"n128": "hang", "n64": "hang"}),
    ("S640-D128-both-sides", geometry(640, 640, 2, window=(64, 31)), {"n128": "ok", "n64": "ok"}),
    ("S515-D64-window-of-one", geometry(515, 515, 2, causal=True, window=(1, -1)), {"n128": "ok"}),
    ("S777-D64-left-only", geometry(777, 777, 2, window=(90, -1)), {"n64": "ok"}),
    ("S515-D64-right-only", geometry(515, 515, 2, window=(-1, 70)), {"n128": "hang", "n64": "hang"}),
    ("Sq300-Sk333-window-wider-than-keys", geometry(300, 333, 2, window=(5000, 4000)), {"n128": "hang"}),
    ("Sq300-Sk1000-bottom-right-window", geometry(300, 1000, 4, causal=True, offset=700, window=(200, -1)),
     {"n64": "hang"}),
    ("Sq700-Sk200-window-empty-rows", geometry(700, 200, 2, offset=-300, window=(20, 5)), {"n64": "ok"}),
    ("sharp-softmax-window", geometry(384, 640, 2, window=(150, 20)), {"n64": "ok"}),
    ("S777-D128-softcap30-gqa4/2 (test_modifiers)", geometry(777, 777, 8), {"n128": "hang"}),
]
VARIANTS = {"n128": (128, 2), "n64": (64, 3)}
RUNS = [(name, g, v, want) for name, g, outs in GPU_RUN for v, want in outs.items()]


@pytest.mark.parametrize("name,g,variant,want", RUNS, ids=[f"{r[0]}-{r[2]}" for r in RUNS])
def test_model_matches_the_first_versions_gpu_run(name, g, variant, want):
    assert outcome(g, *VARIANTS[variant], old_tail=True) == want


@pytest.mark.parametrize("name,g,variant,want", RUNS, ids=[f"{r[0]}-{r[2]}" for r in RUNS])
def test_persistent_pingpong_finishes_the_gpu_cases(name, g, variant, want):
    assert outcome(g, *VARIANTS[variant]) == "ok"


def test_every_variant_finishes_random_geometries():
    """Persistent or not, two or three consumers, ping-pong or not, K and V ring depths as the
    launcher allows (V_STAGES 1 to STAGES), random odd geometries and item orders."""
    rng = random.Random(18)
    for trial in range(1500):
        Sq = rng.choice([1, 5, 63, 64, 65, 127, 128, 129, 200, 300, 515, 640, 777, 1000])
        Sk = rng.choice([1, 5, 50, 64, 127, 128, 200, 333, 515, 777, 1000, 1500])
        causal = rng.random() < 0.6
        window = (rng.choice([-1, 0, 1, 30, 77, 200, 1023]), rng.choice([-1, 0, 5, 70, 4000]))
        g = geometry(Sq, Sk, 2, causal=causal, offset=rng.choice([0, Sk - Sq, rng.randint(-300, 300)]),
                     window=window if rng.random() < 0.5 else None)
        BN, S = rng.choice([64, 128]), rng.choice([2, 3])
        VS = rng.choice([1, 2, S])
        nc = rng.choice([2, 2, 3])
        pp = nc == 2 and rng.random() < 0.7
        persistent = rng.random() < 0.8
        items = [M.item(m0, Sq, Sk, g["offset"], g["span"], BN, g["causal"], g["has_wl"], nc)
                 for m0 in range(0, Sq, nc * 64)] * 2
        rng.shuffle(items)
        groups = [items[i::3] for i in range(3)] if persistent else [[it] for it in items]
        for group in groups:
            try:
                M.run(group, S, VS, pp, persistent, nc=nc, seed=trial)
            except M.ProtocolError as e:
                raise AssertionError(f"trial {trial}: {g}, BN {BN}, STAGES {S}/{VS}, NC {nc}, ping-pong {pp}, "
                                     f"persistent {persistent}: {e}") from None


def test_the_model_reports_a_wait_on_the_wrong_phase():
    """The one-item turn protocol (the other's turns past its issue count not waited for) run over
    several items lets one consumer run two phases ahead on a turn barrier: the reason the
    persistent kernel takes the same number of turns in both consumers."""
    items = [M.item(m0, 777, 777, 0, 0, 64, False, False) for m0 in range(0, 777, 128)][::-1] * 2
    errors = set()
    for seed in range(10):
        try:
            M.run(items, 3, 3, pingpong=True, persistent=False, seed=seed)
        except M.ProtocolError as e:
            errors.add("wrong phase" if "meant completion" in str(e) else "deadlock")
    assert "wrong phase" in errors


def test_the_kernel_takes_its_spare_turns_where_the_model_does():
    """The model's order, in the kernel's source: the spare turns before the epilogue, and a
    consumer without tiles leaving its releases to them (a tie to the code, not a proof)."""
    from flashforge.ops.gluon import attention_fwd_ws_sm90 as ws
    src = ws.consume_tile.src
    assert src.index("spare_turns(") < src.index("finish_rows(")
    assert "lead_end = gl.where(n_tiles > 0, first, base)" in src
