"""SIGKILL of a GPU worker during a stream: that request ends with an error within 5 s, the broker
restarts the worker, the next request succeeds. Then SIGTERM of the service leaves no process."""
import os
import signal
import time

import openai
import pytest
import requests

from tests.api.helpers import scrape, wait_for
from tests.service import Service, alive, process_tree


@pytest.fixture(scope="module")
def service(tmp_path_factory, tiny_model):
    svc = Service(tmp_path_factory.mktemp("kill"), tiny_model, max_context=1024)
    try:
        yield svc.wait_ready()
    finally:
        svc.stop()


@pytest.fixture(scope="module")
def client(service):
    with openai.OpenAI(base_url=service.base_url + "/v1", api_key="unused", max_retries=0, timeout=60) as c:
        yield c


def test_sigkill_of_a_worker_mid_stream(service, client):
    victims = service.worker_pids()
    assert victims
    stream = client.completions.create(model="m", prompt=[5, 17, 99], max_tokens=1000, temperature=0, stream=True,
                                       extra_body={"ignore_eos": True})
    chunks = iter(stream)
    for _ in range(3):
        next(chunks)
    os.kill(victims[-1], signal.SIGKILL)
    killed_s = time.monotonic()
    with pytest.raises(openai.APIError) as err:
        for _ in chunks:
            pass
    assert time.monotonic() - killed_s < 5
    assert "gpu" in str(err.value.message)

    assert wait_for(lambda: requests.get(service.base_url + "/health").status_code == 200, timeout_s=60)
    assert not alive(victims[-1]) and set(service.worker_pids()) - set(victims)
    out = client.completions.create(model="m", prompt=[5, 17, 99], max_tokens=8, temperature=0)
    assert out.usage.completion_tokens == 8
    metrics = scrape(service.base_url)
    assert metrics["moebus_requests_running"] == 0
    assert metrics["moebus_worker_restarts_total"] >= 1


def test_sigterm_leaves_no_process(service):
    tree = process_tree(service.proc.pid)
    assert len(tree) >= 4  # broker, its workers, the api master and its worker
    assert service.stop() == []
    assert service.proc.returncode == 0
    assert not any(alive(p) for p in tree)


def test_sigkill_of_serve_leaves_no_process(tmp_path, tiny_model):
    """The parent-death signal: children of a SIGKILLed ``moebus serve`` stop by themselves."""
    svc = Service(tmp_path, tiny_model).wait_ready()
    tree = process_tree(svc.proc.pid)
    assert len(tree) >= 4
    left = svc.stop(sig=signal.SIGKILL)  # waits up to 10 s for the tree, then reports the living
    assert left == [] and not any(alive(p) for p in tree)
