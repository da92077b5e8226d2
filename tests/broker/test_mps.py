"""The vision worker's MPS client variables: what the zygote's environment gets, and the refusals."""
import re

import pytest

from moebus.broker import launch
from moebus.broker.mps import vision_client_env
from moebus.common.errors import ConfigError
from moebus.common.settings import Settings


def test_nothing_is_asked_by_default():
    assert vision_client_env({}) == {}


def test_the_priority_and_the_share_map_to_cudas_variables():
    env = vision_client_env({"MOEBUS_VISION_MPS_PRIORITY": "1", "MOEBUS_VISION_MPS_THREAD_PERCENT": "40"})
    assert env == {"CUDA_MPS_CLIENT_PRIORITY": "1", "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "40"}


@pytest.mark.parametrize("name, value, words", [
    ("MOEBUS_VISION_MPS_PRIORITY", "2", "0 (normal) or 1"),
    ("MOEBUS_VISION_MPS_PRIORITY", "low", "0 (normal) or 1"),
    ("MOEBUS_VISION_MPS_THREAD_PERCENT", "0", "a number from 1 to 100, whole"),
    ("MOEBUS_VISION_MPS_THREAD_PERCENT", "101", "a number from 1 to 100, whole"),
    ("MOEBUS_VISION_MPS_THREAD_PERCENT", "40.5", "a number from 1 to 100, whole"),
    ("MOEBUS_VISION_MPS_THREAD_PERCENT", "nan", "a number from 1 to 100, whole"),
])
def test_a_value_out_of_range_is_refused_by_name(name, value, words):
    with pytest.raises(ConfigError, match=re.escape(f"{name} must be {words}")):
        vision_client_env({name: value})


def test_only_the_zygote_of_a_cuda_service_gets_them(tmp_path, monkeypatch):
    monkeypatch.setenv("MOEBUS_VISION_MPS_PRIORITY", "1")
    settings_file = tmp_path / "settings.json"
    cuda = Settings(kernel_cache_dir=str(tmp_path), model=str(tmp_path), device="cuda", gpus=[0])
    zygote = launch._zygote_child(cuda, settings_file, "ipc://b", str(tmp_path / "control.sock"))
    worker = launch._worker_child(cuda, settings_file, 0, range(0, 1), "ipc://b")
    assert zygote.env["CUDA_MPS_CLIENT_PRIORITY"] == "1"
    assert "CUDA_MPS_CLIENT_PRIORITY" not in worker.env  # the text workers keep the normal priority
    cpu = Settings(kernel_cache_dir=str(tmp_path), model=str(tmp_path), device="cpu")
    assert "CUDA_MPS_CLIENT_PRIORITY" not in launch._zygote_child(cpu, settings_file, "ipc://b", "c").env
