"""MOEBUS_VISION_PREFORK=1 against a real ``moebus serve`` (tiny LLaVA, the lifecycle tests' emulated GPUs): the
vision zygote keeps a spare child forked ahead (it has opened the driver and NVML and waits, holding nothing on
the device); a cold image's start wakes that spare instead of forking, and once the worker has stopped after
its idle time a new spare is forked for the next start."""
import time
from contextlib import closing

from moebus.client import Client
from tests.api.helpers import wait_for
from tests.e2e.vision_helpers import VISION_SERVE, png_bytes, vision_state, vision_worker_pids, wait_cold, zygote_pid
from tests.service import Service, running
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
        spare = wait_for(lambda: vision_worker_pids(svc, zygote) or None, 10)
        assert len(spare) == 1 and cold["loaded"] == 0  # a spare is no loaded worker: its room is not handed back
        for _ in range(2):
            assert _image_tokens(client, image) == 2
            during = vision_state(client)
            assert during["loaded"] == 1 and during["pid"] == spare[0] and during["slots"] < cold["slots"]
            after = wait_cold(client)
            assert after["loaded"] == 0 and after["slots"] == cold["slots"]
            # the worker exits, then the zygote forks the next spare
            spare = wait_for(lambda: [p for p in vision_worker_pids(svc, zygote) if p != during["pid"]] or None, 10)
            time.sleep(0.2)
            assert vision_worker_pids(svc, zygote) == spare and len(spare) == 1
