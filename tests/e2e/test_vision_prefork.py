"""The spare worker (the default; MOEBUS_VISION_PREFORK=0 turns it off) against a real ``moebus serve`` (tiny LLaVA, the lifecycle tests' emulated GPUs): the
vision zygote keeps a spare child forked ahead (it has opened the driver and NVML and waits, holding nothing on
the device); a cold image's start wakes that spare instead of forking, and once the worker has stopped after
its idle time a new spare is forked for the next start."""
import os
import signal
import time
from contextlib import closing

from moebus.client import Client
from tests.api.helpers import wait_for
from tests.e2e.vision_helpers import (VISION_SERVE, png_bytes, spare_pids, vision_state, vision_worker_pids,
                                      wait_cold, zygote_pid)
from tests.service import Service, alive, running
from tests.vision_models import sample_images

CONTENT = [{"type": "image"}, {"type": "text", "text": "What is it?"}]


def _image_tokens(client, image) -> int:
    return len(client.chat([{"role": "user", "content": CONTENT}], images=[image], max_tokens=2, temperature=0,
                           ignore_eos=True).collect()["tokens"])


def test_a_spare_forked_ahead_serves_each_cold_start(tmp_path, tiny_llava):
    image = png_bytes(sample_images()[0])
    svc = Service(tmp_path, tiny_llava, vision={"idle_s": 0.3, "gpu": 0}, max_step_tokens=512, max_context=256,
                  broker={}, emulated_vram_dir=str(tmp_path / "vram"), env={"MOEBUS_VISION_PREFORK": "1"},
                  **VISION_SERVE)
    with running(svc), closing(Client(svc.zmq_address, timeout_s=30)) as client:
        cold = wait_cold(client)
        zygote = zygote_pid(svc)
        spare = wait_for(lambda: spare_pids(zygote) or None, 10)
        assert vision_worker_pids(svc, zygote) == []  # a spare is named vision-spare until its start
        assert len(spare) == 1 and cold["loaded"] == 0  # a spare is no loaded worker: its room is not handed back
        for _ in range(2):
            assert _image_tokens(client, image) == 2
            during = vision_state(client)
            assert during["loaded"] == 1 and during["pid"] == spare[0] and during["slots"] < cold["slots"]
            after = wait_cold(client)
            assert after["loaded"] == 0 and after["slots"] == cold["slots"]
            # the worker exits, then the zygote forks the next spare
            spare = wait_for(lambda: [p for p in spare_pids(zygote) if p != during["pid"]] or None, 10)
            time.sleep(0.2)
            assert spare_pids(zygote) == spare and len(spare) == 1 and vision_worker_pids(svc, zygote) == []


def test_no_spare_with_prefork_off_and_a_spare_dies_with_its_zygote(tmp_path, tiny_llava):
    """MOEBUS_VISION_PREFORK=0: a cold start forks a fresh worker and no spare waits; with spares on (the
    default) a killed zygote's spare does not outlive it (its parent-death signal)."""
    image = png_bytes(sample_images()[0])
    svc = Service(tmp_path, tiny_llava, vision={"idle_s": 0.3, "gpu": 0}, max_step_tokens=512, max_context=256,
                  broker={}, emulated_vram_dir=str(tmp_path / "vram"), env={"MOEBUS_VISION_PREFORK": "0"},
                  **VISION_SERVE)
    with running(svc), closing(Client(svc.zmq_address, timeout_s=30)) as client:
        wait_cold(client)
        zygote = zygote_pid(svc)
        assert _image_tokens(client, image) == 2
        assert wait_cold(client)["loaded"] == 0
        time.sleep(0.3)
        assert spare_pids(zygote) == [] and vision_worker_pids(svc, zygote) == []
    (tmp_path / "on").mkdir()
    svc = Service(tmp_path / "on", tiny_llava, vision={"idle_s": 0.3, "gpu": 0}, max_step_tokens=512,
                  max_context=256, broker={}, emulated_vram_dir=str(tmp_path / "on" / "vram"), **VISION_SERVE)
    with running(svc), closing(Client(svc.zmq_address, timeout_s=30)) as client:
        wait_cold(client)
        zygote = zygote_pid(svc)
        spare = wait_for(lambda: spare_pids(zygote) or None, 10)
        os.kill(zygote, signal.SIGKILL)
        assert wait_for(lambda: not alive(spare[0]) or None, 5)
