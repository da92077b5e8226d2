import json

import pytest

from moebus.common.errors import ConfigError
from moebus.common.settings import load_settings


def test_defaults_file_env_and_flags_in_order(tmp_path, monkeypatch):
    cfg = tmp_path / "moebus.json"
    cfg.write_text(json.dumps({"max_batch": 4, "api": {"port": 9000, "host": "0.0.0.0"}, "vision": {"idle_s": 5}}))
    monkeypatch.setenv("MOEBUS_API__PORT", "8080")
    s = load_settings(cfg, max_batch=None, device="cpu")
    assert (s.max_batch, s.api.port, s.api.host, s.vision.idle_s, s.device) == (4, 8080, "0.0.0.0", 5, "cpu")
    assert load_settings(cfg, max_batch=2).max_batch == 2


def test_config_from_environment_variable_and_lists(tmp_path, monkeypatch):
    cfg = tmp_path / "c.json"
    cfg.write_text(json.dumps({"emulated_vram_mib": [64, 32]}))
    monkeypatch.setenv("MOEBUS_CONFIG", str(cfg))
    assert load_settings().emulated_vram_mib == [64, 32]
    monkeypatch.setenv("MOEBUS_VRAM_RESERVE_MIB", "[10, 20]")
    assert load_settings().vram_reserve_mib == [10, 20]


@pytest.mark.parametrize("env,key", [("MOEBUS_API__PORT", "api.port"), ("MOEBUS_DEVICE", "device"),
                                     ("MOEBUS_MAX_BATCH", "max_batch")])
def test_bad_values_name_key_and_value(monkeypatch, env, key):
    monkeypatch.setenv(env, "bogus-value")
    with pytest.raises(ConfigError, match=rf"'{key}'.*bogus-value"):
        load_settings()


@pytest.mark.parametrize("env,key,value", [("MOEBUS_MAX_PREFILL_COPY_MIB_BESIDE_DECODE", "max_prefill_copy_mib_beside_decode", "inf"),
                                           ("MOEBUS_VISION__HANDBACK_STEP_MIB", "vision.handback_step_mib", "nan"),
                                           ("MOEBUS_EMULATED_VRAM_MIB", "emulated_vram_mib.0", "[1e999, 64]")])
def test_infinite_and_nan_numbers_are_refused_by_name(monkeypatch, env, key, value):
    """inf passes ge=0 / gt=0 and overflows where a worker turns MiB into bytes: refused at load."""
    monkeypatch.setenv(env, value)
    with pytest.raises(ConfigError, match=rf"'{key}'.*finite"):
        load_settings()


def test_unknown_key_and_bad_file(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"max_bacth": 3}))
    with pytest.raises(ConfigError, match="max_bacth"):
        load_settings(bad)
    bad.write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        load_settings(bad)
    with pytest.raises(ConfigError, match="does not exist"):
        load_settings(tmp_path / "missing.json")
    with pytest.raises(ConfigError, match="vram_reserve_mib"):
        load_settings(vram_reserve_mib=[-1])


def test_lm_head_dtype_from_file_and_environment(tmp_path, monkeypatch):
    assert load_settings().lm_head.dtype == "bf16"
    cfg = tmp_path / "c.json"
    cfg.write_text(json.dumps({"lm_head": {"dtype": "fp8"}}))
    assert load_settings(cfg).lm_head.dtype == "fp8"
    monkeypatch.setenv("MOEBUS_LM_HEAD__DTYPE", "bf16")
    assert load_settings(cfg).lm_head.dtype == "bf16"  # the environment over the file
    monkeypatch.setenv("MOEBUS_LM_HEAD__DTYPE", "int4")
    with pytest.raises(ConfigError, match=r"'lm_head.dtype'.*'bf16' or 'fp8'.*int4"):
        load_settings()
