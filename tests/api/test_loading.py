"""/health before the model is ready: a broker that waits for workers started elsewhere (none come)
and ``moebus api`` on its own, as separate processes."""
import json
import subprocess
import sys
import time

import pytest
import requests

from tests.service import alive, free_port, process_tree


@pytest.fixture
def broker_without_workers(tmp_path, tiny_model):
    http_port, zmq_port = free_port(), free_port()
    config = tmp_path / "moebus.json"
    config.write_text(json.dumps({"model": str(tiny_model), "device": "cpu",
                                  "api": {"port": http_port, "workers": 2, "threads": 2},
                                  "broker": {"frontend": f"tcp://127.0.0.1:{zmq_port}"}}))
    log = open(tmp_path / "log.txt", "w+")
    procs = [subprocess.Popen([sys.executable, "-m", "moebus.cli", role, *extra, "--config", str(config)],
                              stdout=log, stderr=subprocess.STDOUT)
             for role, extra in (("broker", ["--no-spawn"]), ("api", []))]
    tree = []
    try:
        yield f"http://127.0.0.1:{http_port}"
    finally:
        for p in procs:
            tree += process_tree(p.pid)
            p.terminate()
        for p in procs:
            p.wait(timeout=15)
        time.sleep(0.2)
        log.close()
        assert [p for p in tree if alive(p)] == []


def wait_http(url: str, timeout_s: float = 30.0) -> requests.Response:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return requests.get(url, timeout=5)
        except requests.ConnectionError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def test_health_is_503_while_loading(broker_without_workers):
    r = wait_http(broker_without_workers + "/health")
    assert r.status_code == 503
    assert r.json()["error"]["type"] == "service_unavailable"
    metrics = requests.get(broker_without_workers + "/metrics", timeout=5)
    assert metrics.status_code == 200 and "moebus_ready 0.0" in metrics.text
