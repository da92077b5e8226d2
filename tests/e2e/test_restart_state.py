"""State survives a worker restart: the new worker gets its GPU's current reserve before its first
step, and what the broker reports comes from the live worker."""
import os
import signal

import requests

from moebus.client import Client
from tests.api.helpers import scrape, wait_for
from tests.service import Service


def test_a_restarted_worker_gets_the_reserve_back(tmp_path, demo_model):
    svc = Service(tmp_path, demo_model, emulated_vram_mib=[48, 44], emulated_vram_dir=str(tmp_path / "vram"),
                  segment_mib=2, max_context=512)
    svc.wait_ready(timeout_s=180)
    client = Client(svc.zmq_address, timeout_s=60)
    try:
        full = client.vram(query=True)
        reserved = client.vram([0, full["free_mib"][1] + 8])
        assert reserved["expert_slots"][1] < full["expert_slots"][1]
        victim = svc.worker_pids()[1]
        os.kill(victim, signal.SIGKILL)
        dead = wait_for(lambda: (g := client.info()["gpus"][1]) and not g["ready"] and g, timeout_s=10)
        assert "expert_slots" not in dead and "free_mib" not in dead  # no figures of a dead worker
        wait_for(lambda: victim not in svc.worker_pids() and len(svc.worker_pids()) == 2, timeout_s=30)
        wait_for(lambda: requests.get(svc.base_url + "/health", timeout=5).status_code == 200, timeout_s=60)
        after = client.vram(query=True)
        assert after["reserve_mib"] == reserved["reserve_mib"], svc.logs()
        assert after["expert_slots"] == reserved["expert_slots"]  # not the full start-up cache
        out = client.generate(prompt_tokens=[1, 2, 3], max_tokens=4, temperature=0).collect()
        assert out["completion_tokens"] == 4
        metrics = wait_for(lambda: (m := scrape(svc.base_url)).get('moebus_gpu_expert_slots{gpu="1"}') ==
                           reserved["expert_slots"][1] and m, timeout_s=10)
        assert metrics['moebus_gpu_reserve_mib{gpu="1"}'] == reserved["reserve_mib"][1]
    finally:
        client.close()
        assert svc.stop() == []
