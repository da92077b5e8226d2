"""``mps``: the vision worker's MPS client variables, which processes get the daemon's pipes, and the
starts refused where a private MPS daemon cannot apply (its own run is tests/cuda/test_mps_daemon.py)."""
import pytest

from moebus.broker import launch
from moebus.broker.mps import vision_client_env
from moebus.common.errors import ConfigError
from moebus.common.settings import Settings, VisionSettings, load_settings

PIPES = {"CUDA_MPS_PIPE_DIRECTORY": "/run/x/mps-pipe", "CUDA_MPS_LOG_DIRECTORY": "/run/x/mps-log"}


def test_the_vision_worker_asks_to_come_after_the_text_by_default():
    assert vision_client_env(VisionSettings()) == {"CUDA_MPS_CLIENT_PRIORITY": "1"}
    env = vision_client_env(VisionSettings(mps_priority="normal", mps_sm_percent=40))
    assert env == {"CUDA_MPS_CLIENT_PRIORITY": "0", "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "40"}


@pytest.mark.parametrize("key, value", [("MOEBUS_VISION__MPS_PRIORITY", "low"),
                                        ("MOEBUS_VISION__MPS_SM_PERCENT", "0"),
                                        ("MOEBUS_VISION__MPS_SM_PERCENT", "101")])
def test_a_value_out_of_range_is_refused_by_its_key(monkeypatch, key, value):
    monkeypatch.setenv(key, value)
    with pytest.raises(ConfigError, match="config key 'vision.mps_"):
        load_settings()


def test_the_workers_get_the_pipes_and_only_the_zygote_the_priority(tmp_path):
    settings_file = tmp_path / "settings.json"
    cuda = Settings(kernel_cache_dir=str(tmp_path), model=str(tmp_path), device="cuda", gpus=[0], mps=True)
    zygote = launch._zygote_child(cuda, settings_file, "ipc://b", str(tmp_path / "control.sock"), PIPES)
    worker = launch._worker_child(cuda, settings_file, 0, range(0, 1), "ipc://b", PIPES)
    assert zygote.env["CUDA_MPS_CLIENT_PRIORITY"] == "1"
    assert "CUDA_MPS_CLIENT_PRIORITY" not in worker.env  # the text workers keep the normal priority
    assert all(zygote.env[k] == worker.env[k] == v for k, v in PIPES.items())
    cpu = Settings(kernel_cache_dir=str(tmp_path), model=str(tmp_path), device="cpu")
    assert "CUDA_MPS_CLIENT_PRIORITY" not in launch._zygote_child(cpu, settings_file, "ipc://b", "c").env


def test_mps_is_refused_on_the_cpu_before_anything_starts():
    with pytest.raises(ConfigError, match="'mps': true needs device cuda"):
        launch.run_broker(Settings(device="cpu", mps=True))


def test_mps_without_nvidias_control_program_says_what_is_missing(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # an empty directory: no nvidia-cuda-mps-control on it
    with pytest.raises(ConfigError, match="needs NVIDIA's nvidia-cuda-mps-control .* on PATH"):
        launch._mps_control(Settings(mps=True), "cuda", spawn_workers=True)
    with pytest.raises(ConfigError, match="--no-spawn"):
        launch._mps_control(Settings(mps=True), "cuda", spawn_workers=False)


def test_a_daemon_that_cannot_start_ends_the_start_with_its_own_words(tmp_path, monkeypatch):
    # the real control program cannot be made to fail on demand: a program of that name that exits at once
    # (as it does where no driver is loaded) stands in for its failure, and only for that
    from moebus.broker.mps import MpsDaemon

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    control = bin_dir / "nvidia-cuda-mps-control"
    control.write_text("#!/bin/sh\necho 'cannot find a CUDA driver' >&2\nexit 1\n")
    control.chmod(0o755)
    monkeypatch.setenv("PATH", str(bin_dir))
    daemon = MpsDaemon(tmp_path / "run", MpsDaemon.find_binary())
    with pytest.raises(ConfigError, match="did not start: it exited with status 1 .*cannot find a CUDA driver"):
        daemon.start()
    assert daemon.proc is None  # nothing left running
