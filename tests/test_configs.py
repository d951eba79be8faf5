"""The tile table's lookup rules: causal entries, set_config overrides, the JSON file."""
import json

import pytest

from flashforge.ops.triton import configs
from flashforge.ops.triton.configs import TileConfig


def test_interpreter_always_gets_small_tiles():
    assert configs.get_config("fwd", 128, 2, True, causal=True) == configs._INTERPRETER


def test_causal_entry_takes_precedence_and_falls_back():
    assert configs.get_config("fwd", 128, 2, False, causal=True) == configs._TABLE[("fwd_causal", 128, 2)]
    assert configs.get_config("fwd", 128, 2, False) == configs._TABLE[("fwd", 128, 2)]
    # no causal entry for fp32: the plain one
    assert configs.get_config("fwd", 128, 4, False, causal=True) == configs._TABLE[("fwd", 128, 4)]
    # causal means nothing to the backward kinds
    assert configs.get_config("bwd_q", 64, 2, False, causal=True) == configs._TABLE[("bwd_q", 64, 2)]


def test_dropout_entry_serves_the_dkdv_kernel_only():
    """A call with dropout takes the "bwd_kv_dropout" entry (the fused dQ at D = 128: one pass
    of the mask's generator instead of two), where there is one; nothing else changes."""
    fused = configs.get_config("bwd_kv", 128, 2, False, dropout=True)
    assert fused == configs._SM90[("bwd_kv_dropout", 128, 2)] and fused.fused_dq
    assert not configs.get_config("bwd_kv", 128, 2, False).fused_dq
    assert configs.get_config("bwd_kv", 64, 2, False, dropout=True) == configs._SM90[("bwd_kv", 64, 2)]
    assert configs.get_config("bwd_q", 128, 2, False, dropout=True) == configs._SM90[("bwd_q", 128, 2)]
    assert configs.get_config("bwd_kv", 128, 2, False, dropout=True, arch=(8, 0)) == configs._GENERIC[("bwd_kv", 128, 2)]
    assert configs.get_config("bwd_kv", 128, 2, True, dropout=True) == configs._INTERPRETER


def test_set_config_beats_the_table_even_for_causal_calls():
    cfg = TileConfig(32, 32, 4, 1)
    before = configs.get_config("fwd", 100, 2, False, causal=True)  # answers are memoized: set_config must reach them
    configs.set_config("fwd", 128, 2, cfg)
    try:
        assert configs.get_config("fwd", 100, 2, False, causal=True) == cfg
    finally:
        configs.set_config("fwd", 128, 2, None)
    assert configs.get_config("fwd", 128, 2, False) == configs._TABLE[("fwd", 128, 2)]
    assert configs.get_config("fwd", 100, 2, False, causal=True) == before != cfg


def test_parse_configs_and_env_file(tmp_path, monkeypatch):
    data = {"fwd/64/2": {"block_m": 64, "block_n": 32, "num_warps": 4, "num_stages": 2, "tma": True},
            "fwd_causal/128/2": {"block_m": 32, "block_n": 32, "num_warps": 4, "num_stages": 1}}
    parsed = configs.parse_configs(data)
    assert parsed[("fwd", 64, 2)] == TileConfig(64, 32, 4, 2, tma=True)
    path = tmp_path / "tiles.json"
    path.write_text(json.dumps(data))
    assert configs.get_config("fwd", 64, 2, False) != TileConfig(64, 32, 4, 2, tma=True)  # (memoized)
    monkeypatch.setenv(configs.ENV_FILE, str(path))
    monkeypatch.setattr(configs, "_from_env", configs._load_env_file())
    assert configs.get_config("fwd", 64, 2, False) == TileConfig(64, 32, 4, 2, tma=True)
    assert configs.get_config("fwd", 128, 2, False, causal=True) == TileConfig(32, 32, 4, 1)
    assert configs.get_config("fwd", 128, 2, False) == configs._TABLE[("fwd", 128, 2)]  # not in the file


@pytest.mark.parametrize("key", ["fwd/64", "dq/64/2", "fwd/x/2"])
def test_parse_configs_rejects_bad_keys(key):
    with pytest.raises(ValueError):
        configs.parse_configs({key: {"block_m": 16, "block_n": 16, "num_warps": 1, "num_stages": 1}})


class _Recorder:
    """Stands in for a Triton kernel: `kernel[grid](*args, **kw)` records kw and runs nothing."""

    def __init__(self):
        self.calls = []

    def __getitem__(self, grid):
        return lambda *args, **kw: self.calls.append(kw)


@pytest.mark.parametrize("with_mask", [False, True])
def test_masked_forward_caps_the_key_tile(with_mask, monkeypatch):
    """128-key tiles with a pipelined mask tile overflow sm_90's shared memory (seen on the
    H200): a masked call runs with 64-key tiles whatever the table says."""
    import torch

    from flashforge.ops.params import AttnParams
    from flashforge.ops.triton import attention as launchers
    rec = _Recorder()
    monkeypatch.setattr(launchers, "attn_fwd_kernel", rec)
    monkeypatch.setattr(launchers, "get_config", lambda *a, **kw: TileConfig(128, 128, 8, 4))
    monkeypatch.setattr(launchers, "_interpreting", lambda q: False)
    q = torch.randn(1, 8, 2, 64)
    k = torch.randn(1, 8, 2, 64)
    mask = torch.randn(1, 1, 8, 8) if with_mask else None
    launchers.attention_forward(q, k, k, mask, AttnParams(scale=0.1))
    kw = rec.calls[0]
    assert kw["BLOCK_M"] == 128
    assert (kw["BLOCK_N"], kw["num_stages"]) == ((64, 3) if with_mask else (128, 4))


def test_other_architectures_get_the_generic_table():
    for arch in [(8, 0), (8, 9), (10, 0)]:
        for kind in ("fwd", "bwd_kv", "bwd_q"):
            assert configs.get_config(kind, 128, 2, False, arch=arch) == configs._GENERIC[(kind, 128, 2)]
        # no causal entry there: the plain one
        assert configs.get_config("fwd", 128, 2, False, causal=True, arch=arch) == configs._GENERIC[("fwd", 128, 2)]
    assert configs.get_config("fwd", 128, 2, False, arch=(9, 0)) == configs._SM90[("fwd", 128, 2)]
    # every kind, bucket and dtype has a generic entry, and none of them asks for TMA or
    # Gluon (sm_90 only: the Gluon forward has no generic entries)
    assert ({k for k in configs._SM90 if not k[0].endswith(("_causal", "_decode", "_gluon", "_dropout"))}
            == set(configs._GENERIC))
    assert not any(c.tma or c.ws or c.fused_dq or c.gluon for c in configs._GENERIC.values())
    for arch in [(8, 0), (10, 0)]:
        assert configs.gluon_config(128, 2, False, arch) is None


def test_gluon_config_yields_to_forward_overrides():
    """The table's Gluon entry serves sm_90 until the forward's tiles are overridden (a sweep
    timing portable candidates); an override with gluon=True is used as it is."""
    assert configs.gluon_config(128, 2, True, (9, 0)) == configs._SM90[("fwd_gluon_causal", 128, 2)]
    assert configs.gluon_config(64, 2, False, (9, 0)) == configs._SM90[("fwd_gluon", 64, 2)]
    assert configs.gluon_config(128, 4, False, (9, 0)) is None  # float32: no entry
    try:
        configs.set_config("fwd", 128, 2, configs.TileConfig(64, 64, 4, 2))
        assert configs.gluon_config(128, 2, False, (9, 0)) is None
        assert configs.gluon_config(128, 2, True, (9, 0)) is None
    finally:
        configs.set_config("fwd", 128, 2, None)
    # the backward's Gluon entries, likewise per pass
    assert configs.gluon_config(128, 2, True, (9, 0), "bwd_kv") == configs._SM90[("bwd_kv_gluon", 128, 2)]
    assert configs.gluon_config(64, 2, False, (9, 0), "bwd_q") == configs._SM90[("bwd_q_gluon", 64, 2)]
    assert configs.gluon_config(64, 2, True, (9, 0), "bwd_kv") == configs._SM90[("bwd_kv_gluon", 64, 2)]
    # D = 256: dV and dK in two launches (two [keys, 256] float32 accumulators do not fit one program)
    assert configs.gluon_config(256, 2, False, (9, 0), "bwd_kv").split_kv
    assert configs.gluon_config(96, 4, False, (9, 0), "bwd_kv") is None  # float32: no entry
    assert configs.gluon_config(128, 2, False, (8, 0), "bwd_q") is None
    try:
        configs.set_config("bwd_q", 128, 2, configs.TileConfig(64, 64, 4, 2))
        assert configs.gluon_config(128, 2, False, (9, 0), "bwd_q") is None
        assert configs.gluon_config(128, 2, False, (9, 0), "bwd_kv") is not None  # the other pass keeps its own
    finally:
        configs.set_config("bwd_q", 128, 2, None)
    assert configs.parse_configs({"fwd_gluon/128/2": {"block_m": 64, "block_n": 64, "num_warps": 4,
                                                       "num_stages": 2, "gluon": True}})


def test_decode_entry_serves_kv_cache_calls_only_where_there_is_one():
    """A KV-cache call asks with decode=True: the "fwd_decode" entry over the causal and plain
    ones at each level; without one (fp32 here), the tiles a plain call would get."""
    dec = configs.get_config("fwd", 128, 2, False, causal=True, decode=True)
    assert dec == configs._SM90[("fwd_decode", 128, 2)] and dec.block_m == 16
    assert configs.get_config("fwd", 128, 2, False, decode=True) == dec
    assert configs.get_config("fwd", 128, 4, False, causal=True, decode=True) == configs._SM90[("fwd", 128, 4)]
    assert configs.get_config("bwd_q", 128, 2, False, decode=True) == configs._SM90[("bwd_q", 128, 2)]
    cfg = TileConfig(32, 32, 4, 1)
    configs.set_config("fwd_causal", 128, 2, cfg)  # an override beats the table's decode entry
    try:
        assert configs.get_config("fwd", 128, 2, False, causal=True, decode=True) == cfg
    finally:
        configs.set_config("fwd_causal", 128, 2, None)
    assert configs.get_config("fwd", 128, 2, False, causal=True, decode=True) == dec
