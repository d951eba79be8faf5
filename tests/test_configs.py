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


def test_set_config_beats_the_table_even_for_causal_calls():
    cfg = TileConfig(32, 32, 4, 1)
    configs.set_config("fwd", 128, 2, cfg)
    try:
        assert configs.get_config("fwd", 100, 2, False, causal=True) == cfg
    finally:
        configs.set_config("fwd", 128, 2, None)
    assert configs.get_config("fwd", 128, 2, False) == configs._TABLE[("fwd", 128, 2)]


def test_parse_configs_and_env_file(tmp_path, monkeypatch):
    data = {"fwd/64/2": {"block_m": 64, "block_n": 32, "num_warps": 4, "num_stages": 2, "tma": True},
            "fwd_causal/128/2": {"block_m": 32, "block_n": 32, "num_warps": 4, "num_stages": 1}}
    parsed = configs.parse_configs(data)
    assert parsed[("fwd", 64, 2)] == TileConfig(64, 32, 4, 2, tma=True)
    path = tmp_path / "tiles.json"
    path.write_text(json.dumps(data))
    monkeypatch.setenv(configs.ENV_FILE, str(path))
    monkeypatch.setattr(configs, "_from_env", configs._load_env_file())
    assert configs.get_config("fwd", 64, 2, False) == TileConfig(64, 32, 4, 2, tma=True)
    assert configs.get_config("fwd", 128, 2, False, causal=True) == TileConfig(32, 32, 4, 1)
    assert configs.get_config("fwd", 128, 2, False) == configs._TABLE[("fwd", 128, 2)]  # not in the file


@pytest.mark.parametrize("key", ["fwd/64", "dq/64/2", "fwd/x/2"])
def test_parse_configs_rejects_bad_keys(key):
    with pytest.raises(ValueError):
        configs.parse_configs({key: {"block_m": 16, "block_n": 16, "num_warps": 1, "num_stages": 1}})
