"""Launch plans (flashforge/ops/replay.py): a plan serves only after two recordings agree, and
a replay passes the call's own tensors, fresh ones and rebased descriptors where the
recording had them.  Runs on the CPU with the launch layer faked (the real one needs a GPU,
where tests/test_kvcache.py checks replayed decoding against the reference)."""
import pytest
import torch

from flashforge.ops import launch as launch_mod
from flashforge.ops import replay

TensorDescriptor = pytest.importorskip("triton.tools.tensor_descriptor").TensorDescriptor


class _Fake:
    """The launch layer: `launch` compiles (a _Ready per key), `launch_ready` records."""

    def __init__(self, monkeypatch):
        self.ready = {}
        self.launched = []  # ("launch" | "ready", kernel name, args)
        monkeypatch.setattr(launch_mod, "ENABLED", True)
        monkeypatch.setattr(launch_mod, "VERIFY", False)
        monkeypatch.setattr(launch_mod, "_compiled", {})
        monkeypatch.setattr(launch_mod, "launches", 0)
        monkeypatch.setattr(launch_mod, "launch", self.launch)
        monkeypatch.setattr(launch_mod, "launch_ready", self.launch_ready)
        monkeypatch.setattr(launch_mod, "cache_key", lambda k, d, a, kw: (k, d, len(a), tuple(kw.items())))

        class _Active:
            @staticmethod
            def get_current_device():
                return 0

            @staticmethod
            def get_current_stream(device):
                return 7

        class _Driver:
            active = _Active()
        monkeypatch.setattr(launch_mod, "driver", _Driver())
        monkeypatch.setattr(replay, "_plans", {})

    def launch(self, kernel, grid, *args, **kwargs):
        launch_mod.launches += 1  # (as the real one counts every launch)
        key = launch_mod.cache_key(kernel, 0, args, kwargs)
        self.launched.append(("launch", kernel, args))
        return launch_mod._compiled.setdefault(key, ("ready", kernel))

    def launch_ready(self, ready, grid, stream, args):
        assert stream == 7
        self.launched.append(("ready", ready[1], tuple(args)))


def _launcher(q, k, constant, temp=None):
    """Like a forward launcher: an output made fresh, a descriptor over k, a constant tensor,
    ints; `temp` (if given) an unrecorded per-call tensor."""
    def run(rec):
        o = rec.fresh(torch.empty, q.shape, dtype=q.dtype)
        desc = TensorDescriptor(k, list(k.shape), list(k.stride()), [2, 16])
        rec.launch("kern", (3, 1), q, desc, o, constant, q.stride(0), 5, *(() if temp is None else (temp(),)),
                   BLOCK=16)
        return (o,)
    return run


def _call(key, q, k, launcher):
    return replay.call(key, {"q": q, "k": k}, launcher)


def test_plan_serves_after_two_agreeing_recordings(monkeypatch):
    fake = _Fake(monkeypatch)
    constant = torch.zeros(4)
    for step in range(4):
        q, k = torch.randn(4, 16), torch.randn(8, 16)
        (o,) = _call("key", q, k, _launcher(q, k, constant))
        kind, kernel, args = fake.launched[-1]
        # two recordings take the launcher's path; then the plan replays
        assert kind == ("launch" if step < 2 else "ready"), step
        assert args[0] is q and args[2] is o and args[3] is constant and args[4:6] == (16, 5)
        assert type(args[1]) is TensorDescriptor and args[1].base is k
        assert args[1].block_shape == [2, 16] and args[1].shape == [8, 16]
        assert o.shape == q.shape and o.dtype == q.dtype


def test_unrecorded_per_call_tensor_is_never_planned(monkeypatch):
    fake = _Fake(monkeypatch)
    constant = torch.zeros(4)
    for _ in range(4):
        q, k = torch.randn(4, 16), torch.randn(8, 16)
        _call("key", q, k, _launcher(q, k, constant, temp=lambda: torch.zeros(2)))
        assert fake.launched[-1][0] == "launch"  # always the launcher's own path
    assert replay._plans["key"] is replay._NEVER


def test_recordings_that_differ_are_never_planned(monkeypatch):
    fake = _Fake(monkeypatch)
    for i in range(4):  # a new constant object each call: not safe to freeze
        q, k = torch.randn(4, 16), torch.randn(8, 16)
        _call("key", q, k, _launcher(q, k, torch.zeros(4)))
        assert fake.launched[-1][0] == "launch"


def test_one_tensor_under_two_names_is_never_planned(monkeypatch):
    fake = _Fake(monkeypatch)
    constant = torch.zeros(4)
    for _ in range(3):
        q = torch.randn(8, 16)
        _call("key", q, q, _launcher(q, q, constant))
        assert fake.launched[-1][0] == "launch"


def test_clear_forgets_plans(monkeypatch):
    fake = _Fake(monkeypatch)
    constant = torch.zeros(4)
    q, k = torch.randn(4, 16), torch.randn(8, 16)
    for _ in range(3):
        _call("key", q, k, _launcher(q, k, constant))
    assert fake.launched[-1][0] == "ready"
    g = replay.generation[0]
    replay.clear()
    assert replay.generation[0] == g + 1 and not replay._plans
    _call("key", q, k, _launcher(q, k, constant))
    assert fake.launched[-1][0] == "launch"


def test_not_usable_while_verifying(monkeypatch):
    _Fake(monkeypatch)
    monkeypatch.setattr(launch_mod, "JITFunction", object)
    monkeypatch.setattr(launch_mod, "_hooked", lambda: False)
    assert replay.usable()
    monkeypatch.setattr(launch_mod, "VERIFY", True)
    assert not replay.usable()


def test_launch_around_the_recorder_is_never_planned(monkeypatch):
    """A launcher path that calls the launch layer itself (not through `rec`) would be missing from
    a replay: its key is never planned."""
    fake = _Fake(monkeypatch)
    constant = torch.zeros(4)
    inner = _launcher
    for _ in range(4):
        q, k = torch.randn(4, 16), torch.randn(8, 16)

        def run(rec, q=q, k=k):
            out = inner(q, k, constant)(rec)
            launch_mod.launch("side", (1,), q)  # around the recorder
            return out
        _call("key", q, k, run)
        assert fake.launched[-1][0] == "launch"
    assert replay._plans["key"] is replay._NEVER


def test_descriptor_over_a_fresh_tensor_and_a_missing_output(monkeypatch):
    """A descriptor over a tensor the launcher makes (the Gluon kernels' outputs), of either
    descriptor class, is rebuilt over the replay's new tensor; a None output stays None."""
    fake = _Fake(monkeypatch)
    classes = [TensorDescriptor]
    try:
        from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonTensorDescriptor
        classes.append(GluonTensorDescriptor)
    except ImportError:
        pass
    for cls in classes:
        replay._plans.clear()
        for step in range(4):
            q, k = torch.randn(4, 16), torch.randn(8, 16)

            def run(rec, q=q):
                o = rec.fresh(torch.empty, q.shape, dtype=q.dtype)
                d = object.__new__(cls)
                d.__dict__.update(base=o, shape=list(o.shape), strides=list(o.stride()), block_shape=[2, 16])
                rec.launch("kern", (1,), q, d)
                return o, None
            o, none = _call(("key", cls), q, k, run)
            kind, _, args = fake.launched[-1]
            assert kind == ("launch" if step < 2 else "ready") and none is None
            assert type(args[1]) is cls and args[1].base is o and args[1].block_shape == [2, 16]


def _same_launch(a, b, mine: dict, pairs: dict):
    """Whether launch args `a` (a replay's) match `b` (the launcher's own, same call): the call's
    tensors the same objects, fresh tensors alike in shape and dtype and paired one-to-one across
    the call's launches (`pairs`: id in a -> id in b), descriptors alike over matching bases,
    everything else equal."""
    if len(a) != len(b):
        return False
    for x, y in zip(a, b):
        if isinstance(y, torch.Tensor):
            if id(y) in mine:  # one of the call's own tensors
                if x is not y:
                    return False
            elif not (isinstance(x, torch.Tensor) and x.shape == y.shape and x.dtype == y.dtype and id(x) not in mine):
                return False
            elif pairs.setdefault(id(x), id(y)) != id(y) or list(pairs.values()).count(id(y)) != 1:
                return False
        elif hasattr(y, "block_shape") and hasattr(y, "base"):
            if type(x) is not type(y) or not _same_launch([x.base], [y.base], mine, pairs):
                return False
            if {f: v for f, v in vars(x).items() if f != "base"} != {f: v for f, v in vars(y).items() if f != "base"}:
                return False
        elif type(x) is not type(y) or x != y:
            return False
    return True


@pytest.mark.parametrize("D, Hkv, lo, kw", [
    (64, 2, False, {}),
    (64, 1, True, dict(window_right=0)),  # causal, GQA, lse_lo's two dK/dV launches and far flags
    (128, 2, False, dict(window_left=100, window_right=0, softcap=20.0)),  # the WS forward
    (128, 2, True, dict(window_right=0, deterministic=True)),
    (256, 2, False, {}),  # dV and dK in two launches
])
def test_training_launchers_replay_what_they_launch(monkeypatch, D, Hkv, lo, kw):
    """The sm_90 training launchers (the Gluon forward and the ordered Gluon backward, on CPU
    tensors with sm_90 asked for): their plans serve from the third call, and each replayed launch
    has the arguments the launcher itself would pass for that call."""
    gluon = pytest.importorskip("flashforge.ops.gluon.attention")
    if gluon._kernel() is None or gluon._bwd_kernels() is None:
        pytest.skip("this Triton has no Gluon for Hopper")
    from flashforge.ops.params import AttnParams
    from flashforge.ops.triton import attention as L
    fake = _Fake(monkeypatch)
    monkeypatch.setattr(L, "_interpreting", lambda q: False)
    monkeypatch.setattr(L, "_arch", lambda q: (9, 0))
    p = AttnParams(scale=D ** -0.5, **kw)
    for step in range(3):
        q, do = (torch.randn(2, 256, 2, D).to(torch.bfloat16) for _ in range(2))
        k, v = (torch.randn(2, 256, Hkv, D).to(torch.bfloat16) for _ in range(2))
        lse_lo = torch.empty(2, 2, 256) if lo else None
        n0 = len(fake.launched)
        o, lse = replay.call("fwd", dict(q=q, k=k, v=v, lse_lo=lse_lo),
                             lambda rec: L._forward(q, k, v, None, p, rec, lse_lo))
        n1 = len(fake.launched)
        grads = replay.call("bwd", dict(do=do, dlse=None, q=q, k=k, v=v, o=o, lse=lse, lse_lo=lse_lo),
                            lambda rec: L._backward(rec, do, None, q, k, v, None, o, lse, p, False, lse_lo))
        got_fwd, got_bwd = fake.launched[n0:n1], fake.launched[n1:]
        assert len(got_fwd) == 1 and len(got_bwd) >= 2
        assert all(kind == ("launch" if step < 2 else "ready") for kind, _, _ in got_fwd + got_bwd), step
        assert grads[3] is None and all(g.shape == t.shape for g, t in zip(grads, (q, k, v)))
    # the launcher's own launches for the last call, beside the replay's
    n2 = len(fake.launched)
    L._forward(q, k, v, None, p, replay.DIRECT, lse_lo)
    n3 = len(fake.launched)
    L._backward(replay.DIRECT, do, None, q, k, v, None, o, lse, p, False, lse_lo)
    own_fwd, own_bwd = fake.launched[n2:n3], fake.launched[n3:]
    for got, own, ins in ((got_fwd, own_fwd, (q, k, v, lse_lo)), (got_bwd, own_bwd, (q, k, v, do, o, lse, lse_lo))):
        assert len(own) == len(got)
        mine, pairs = {id(t): t for t in ins if t is not None}, {}
        for (_, kern_a, args_a), (_, kern_b, args_b) in zip(got, own):
            name = getattr(getattr(kern_b, "fn", kern_b), "__name__", kern_b)
            assert kern_a is kern_b, name
            assert _same_launch(args_a, list(args_b), mine, pairs), name


def test_fused_training_backward_is_never_planned(monkeypatch):
    """The warp-specialized backward with dQ fused (the table's, from its min_keys keys) makes its float32
    accumulator and converts it outside the recorder: its key is never planned (each call takes
    the launcher's own path), rather than replayed without them."""
    gluon = pytest.importorskip("flashforge.ops.gluon.attention")
    if gluon._kernel() is None or gluon._bwd_kernels() is None:
        pytest.skip("this Triton has no Gluon for Hopper")
    from flashforge.ops.params import AttnParams
    from flashforge.ops.triton import attention as L
    from flashforge.ops.triton import configs
    ws = configs.gluon_config(64, 2, False, (9, 0), "bwd_kv_ws")
    fake = _Fake(monkeypatch)
    monkeypatch.setattr(L, "_interpreting", lambda q: False)
    monkeypatch.setattr(L, "_arch", lambda q: (9, 0))
    monkeypatch.setattr(gluon, "_reduce_ready", lambda: True)
    monkeypatch.setattr(L, "launch", fake.launch)  # (the preprocess kernel's launch: CPU tensors, a GPU's driver)
    p = AttnParams(scale=0.125)
    S = ws.min_keys
    for _ in range(3):
        q, k, v, do, o = (torch.randn(1, S, 1, 64).to(torch.bfloat16) for _ in range(5))
        lse = torch.randn(1, 1, S)
        n0 = len(fake.launched)
        replay.call("bwd", dict(do=do, dlse=None, q=q, k=k, v=v, o=o, lse=lse, lse_lo=None),
                    lambda rec: L._backward(rec, do, None, q, k, v, None, o, lse, p, False, None))
        names = [getattr(getattr(kern, "fn", kern), "__name__", kern) for _, kern, _ in fake.launched[n0:]]
        assert "attn_bwd_dkdv_halfdq_sm90_kernel" in names and all(kind == "launch" for kind, _, _ in fake.launched[n0:])
    assert replay._plans["bwd"] is replay._NEVER
