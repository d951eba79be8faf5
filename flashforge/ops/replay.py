"""Replaying a launcher's launches for repeated calls of one shape.

A decoding loop calls the KV-cache attention once per layer and token with the same shapes,
strides, dtypes and options; only the tensors' addresses change.  Its Python -- tile lookup,
~55 kernel arguments, the launch cache's key over each of them, TMA descriptors -- cost
~100-300 us of host time per call on the device, more than the kernels (~10 us at B = 1;
eager decode ran at 1/16 of cuDNN's rate there, benchmarks/RESULTS.md v0.7.1).  Here a
launcher's work is recorded as a plan: which kernels it launched (the launch cache's compiled
kernel), with which constant arguments, and where each launch took one of the call's tensors,
a tensor made fresh for the call (outputs, scratch), or a descriptor over either.  A repeat
call with the same key replays the plan: new tensors, the same launches.  Training calls (the
sm_90 Gluon forward and ordered backward) can take plans too (`TRAINING`).

Safety: the key (`signature`) holds everything the launcher reads besides addresses -- shapes,
strides, dtypes, 16-byte alignment, every scalar option, the device and the tile table's
generation -- and a plan is only used after two recorded calls with the same key produced the
same launches (the same kernels, grids, constants and slots); a tensor argument that is neither
one of the call's, nor made fresh through the recorder, nor the same object in both recordings,
or a launch that did not pass through the recorder (`launch.launches` counts every one), leaves
the key unplanned (its calls then always take the launcher's own path).
"""
from __future__ import annotations

import os

import torch

from . import launch as launch_mod

try:
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover - a Triton without host descriptors: no descriptor slots
    TensorDescriptor = None
try:  # the Gluon kernels' host descriptors (a layout beside the fields above)
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonTensorDescriptor
except ImportError:  # pragma: no cover
    GluonTensorDescriptor = None
_DESCRIPTORS = tuple(c for c in (TensorDescriptor, GluonTensorDescriptor) if c is not None)

_MAX_PLANS = 1024  # a few kB each; a server's batch sizes x query lengths fit
_plans: dict = {}  # key -> _Plan; ("first", _Plan): recorded once, awaiting the second; or _NEVER
_NEVER = object()
served = 0  # calls served by a plan (tests read it)
# training calls (a forward or backward without a KV cache) take plans too, unless
# $FLASHFORGE_TRAINING_PLANS=0.  On the H200 (benchmarks/RESULTS.md v0.9.3) they took a forward's
# host time from 110-188 to 75-81 us and a D = 64 training step's from 1040-1141 to 574-608 us; the
# GPU test (tests/test_gluon_sm90.py, training_steps_from_launch_plans) checks that a replayed
# step equals the launchers' own, bitwise.  Decoding keeps its plans either way.
TRAINING = os.environ.get("FLASHFORGE_TRAINING_PLANS", "1") != "0"
generation = [0]  # bumped when what a launcher computes may change (tile table overrides)


def clear() -> None:
    """Forget every plan (the tile table or launch settings changed)."""
    _plans.clear()
    generation[0] += 1


def tensor_meta(t):
    if t is None:
        return None
    return t.shape, t.stride(), t.dtype, t.data_ptr() % 16 == 0


def signature(prefix: tuple, tensors: dict, options=None) -> tuple:
    """(key, named tensors) of a call: `prefix`, the metadata of `tensors` (name -> tensor) and
    of every field of the dataclass `options` (tensors by metadata and joining the named ones,
    other fields by value) -- a new field is covered without being listed here."""
    named = dict(tensors)
    key = [prefix]
    for t in tensors.values():
        key.append(tensor_meta(t))
    for name, x in (vars(options).items() if options is not None else ()):
        if isinstance(x, torch.Tensor):
            named[name] = x
            x = tensor_meta(x)
        key.append(x)
    return tuple(key), named


class Fresh:
    """What a launcher makes for each call: how to make it again."""
    __slots__ = ("fn", "args", "kwargs")

    def __init__(self, fn, args, kwargs):
        self.fn, self.args, self.kwargs = fn, args, kwargs

    def __eq__(self, other):
        return isinstance(other, Fresh) and (self.fn, self.args, self.kwargs) == (other.fn, other.args, other.kwargs)


class Direct:
    """The launcher's plain path: make tensors, launch kernels."""

    @staticmethod
    def fresh(fn, *args, **kwargs):
        return fn(*args, **kwargs)

    @staticmethod
    def launch(kernel, grid, *args, **kwargs):
        launch_mod.launch(kernel, grid, *args, **kwargs)


DIRECT = Direct()


class _Recording:
    """Stands in for `Direct` during a call: launches as it would and notes each launch."""

    def __init__(self, named: dict):
        self.names = {}  # id -> name of the call's tensors
        self.ok = True
        for name, t in named.items():
            if t is not None:
                if id(t) in self.names:  # one object under two names: which would a replay take?
                    self.ok = False
                self.names[id(t)] = name
        self.made = []  # (tensor, Fresh)
        self.launches = []  # (launch cache entry or None, grid, args)
        # launches that bypass the recorder (a launcher's path not written for plans) would be
        # missing from a replay: `plan` compares this count with the recorded launches
        self.launch_count = launch_mod.launches

    def fresh(self, fn, *args, **kwargs):
        t = fn(*args, **kwargs)
        self.made.append((t, Fresh(fn, args, kwargs)))
        return t

    def launch(self, kernel, grid, *args, **kwargs):
        self.launches.append((launch_mod.launch(kernel, grid, *args, **kwargs), grid, args))

    def plan(self, result) -> "_Plan | None":
        """The plan of what was recorded, or None where it cannot be replayed."""
        if not self.ok or not launch_mod.ENABLED or launch_mod.VERIFY:
            return None
        if launch_mod.launches - self.launch_count != len(self.launches):  # one went around the recorder
            return None
        made = {id(t): i for i, (t, _) in enumerate(self.made)}
        steps = []
        for ready, grid, args in self.launches:
            if ready is None:  # Triton's own path: nothing cached to replay
                return None
            template, slots = list(args), []
            for i, a in enumerate(args):
                if isinstance(a, torch.Tensor):
                    if id(a) in self.names:
                        slots.append((i, "in", self.names[id(a)]))
                    elif id(a) in made:
                        slots.append((i, "new", made[id(a)]))
                    else:
                        continue  # a constant: checked against the second recording
                    template[i] = None
                elif type(a) in _DESCRIPTORS:
                    # over one of the call's tensors or a fresh one, whole: the key covers its
                    # shape, strides and alignment (a fresh one's: its recipe), so a copy with
                    # the new base is as valid as this one
                    base = a.base
                    if list(a.shape) != list(base.shape) or list(a.strides) != list(base.stride()):
                        return None
                    fields = tuple((f, v) for f, v in vars(a).items() if f != "base")
                    if id(base) in self.names:
                        slots.append((i, "desc", (self.names[id(base)], fields, type(a))))
                    elif id(base) in made:
                        slots.append((i, "desc_new", (made[id(base)], fields, type(a))))
                    else:
                        return None
                    template[i] = None
            steps.append((ready, tuple(grid), template, tuple(slots)))
        outs = []
        for t in result:
            if t is None:  # (an output the call does not have, e.g. the backward's dmask)
                outs.append(None)
            elif id(t) not in made:
                return None
            else:
                outs.append(made[id(t)])
        return _Plan(steps, [f for _, f in self.made], tuple(outs))


class _Plan:
    __slots__ = ("steps", "fresh", "outs")

    def __init__(self, steps, fresh, outs):
        self.steps, self.fresh, self.outs = steps, fresh, outs

    def same(self, other: "_Plan") -> bool:
        """Whether two recordings launched the same things: compiled kernels (one launch-cache
        entry per specialization), grids, constants (the same objects, for tensors) and slots."""
        if self.fresh != other.fresh or self.outs != other.outs or len(self.steps) != len(other.steps):
            return False
        for (r1, g1, t1, s1), (r2, g2, t2, s2) in zip(self.steps, other.steps):
            if r1 is not r2 or g1 != g2 or s1 != s2 or len(t1) != len(t2):
                return False
            for a, b in zip(t1, t2):
                if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
                    if a is not b:
                        return False
                elif type(a) is not type(b) or a != b:
                    return False
        return True

    def run(self, named: dict):
        made = [f.fn(*f.args, **f.kwargs) for f in self.fresh]
        stream = None
        for ready, grid, template, slots in self.steps:
            args = list(template)
            for i, kind, ref in slots:
                if kind == "in":
                    args[i] = named[ref]
                elif kind == "new":
                    args[i] = made[ref]
                else:  # a descriptor: the recorded one's fields with the new base (no re-validation)
                    d = object.__new__(ref[2])
                    d.__dict__.update(ref[1])  # (lists shared with the plan: nothing mutates them)
                    d.base = named[ref[0]] if kind == "desc" else made[ref[0]]
                    args[i] = d
            if stream is None:
                stream = launch_mod.driver.active.get_current_stream(launch_mod.driver.active.get_current_device())
            launch_mod.launch_ready(ready, grid, stream, args)
        return tuple(None if i is None else made[i] for i in self.outs)


def usable() -> bool:
    """Whether plans may serve now: the launch cache on, not verifying, no profiler hooks."""
    return launch_mod.ENABLED and not launch_mod.VERIFY and launch_mod.JITFunction is not None \
        and not launch_mod._hooked()


def call(key, named: dict, launcher):
    """``launcher(rec)`` -- a function of the recorder (`DIRECT`-like) returning a tuple of
    tensors -- through the plan for `key`: replayed where one is ready, else run and recorded."""
    entry = _plans.get(key)
    if isinstance(entry, _Plan):
        global served
        served += 1
        return entry.run(named)
    if entry is _NEVER:
        return launcher(DIRECT)
    rec = _Recording(named)
    result = launcher(rec)
    plan = rec.plan(result)
    if entry is None:  # the first recording
        if len(_plans) >= _MAX_PLANS:
            _plans.clear()
        _plans[key] = _NEVER if plan is None else ("first", plan)
    else:  # the second: the plan serves if both agree
        _plans[key] = plan if plan is not None and entry[1].same(plan) else _NEVER
    return result
