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
