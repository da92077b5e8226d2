"""The request ledger under broker faults: SIGKILL of a broker that a separate `moebus api` talks to,
SIGKILL of `moebus serve`, a broker paused for 4 s (SIGSTOP/SIGCONT), SIGTERM of serve with requests
in flight. Every id ends exactly once; a dead broker is noticed at once; a paused one is survived."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import requests

from tests.api.helpers import wait_for
from tests.ledger import Ledger, LedgerClient
from tests.service import Service, alive, process_tree

LONG_HTTP = {"prompt": [5, 17, 99], "max_tokens": 240, "temperature": 0, "ignore_eos": True, "stream": True}


def start_api(svc: Service) -> subprocess.Popen:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    return subprocess.Popen([sys.executable, "-m", "moebus.cli", "api", "--config", str(svc.config_file)], env=env,
                            stdout=svc.log, stderr=subprocess.STDOUT)


def sse_stream(base_url: str):
    r = requests.post(base_url + "/v1/completions", json=LONG_HTTP, stream=True, timeout=30)
    assert r.status_code == 200
    return r, (line for line in r.iter_lines() if line)


def test_sigkill_of_the_broker_behind_a_separate_api(tmp_path, tiny_model):
    svc = Service(tmp_path, tiny_model, command="broker")
    api = start_api(svc)
    try:
        svc.wait_ready()
        streams = [sse_stream(svc.base_url) for _ in range(3)]
        for _, lines in streams:
            assert next(lines).startswith(b"data: {")
        os.kill(svc.proc.pid, signal.SIGKILL)
        killed_s = time.monotonic()
        for _, lines in streams:  # each stream ends with an error event, then [DONE]
            rest = list(lines)
            assert rest[-1] == b"data: [DONE]" and b'"error"' in rest[-2], rest[-3:]
        assert time.monotonic() - killed_s < 3  # noticed through the closed connection, not a timeout
        started_s = time.monotonic()
        r = requests.post(svc.base_url + "/v1/completions", json={**LONG_HTTP, "stream": False}, timeout=30)
        assert r.status_code == 503 and time.monotonic() - started_s < 1, r.text
        assert requests.get(svc.base_url + "/health", timeout=5).status_code == 503
    finally:
        api.terminate()
        api.wait(timeout=10)
        svc.stop()
    assert api.returncode == 0


def _cmdline(pid: int) -> str:
    try:
        return open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\0", b" ").decode()[:120]
    except OSError:
        return "?"


def test_sigkill_of_serve_ends_every_request(tmp_path, tiny_model):
    svc = Service(tmp_path, tiny_model).wait_ready(http=False)
    client = LedgerClient(svc.zmq_address, timeout_s=60)
    try:
        ledger = Ledger(client)
        for n in range(4):
            ledger.start(f"k{n}")
        ledger.streaming(4)
        tree = {pid: _cmdline(pid) for pid in process_tree(svc.proc.pid)}
        os.kill(svc.proc.pid, signal.SIGKILL)
        killed_s = time.monotonic()
        ledger.wait(timeout_s=10)
        assert set(ledger.check().values()) == {("error", 503)}
        deadline = killed_s + 30
        while any(alive(p) for p in tree) and time.monotonic() < deadline:
            time.sleep(0.05)
        left = {pid: cmd for pid, cmd in tree.items() if alive(pid)}
        assert not left, f"alive {time.monotonic() - killed_s:.0f} s after the SIGKILL: {left}\n{svc.logs()}"
    finally:
        client.close()
        svc.stop()


def test_a_paused_broker_then_sigterm_with_requests_in_flight(tmp_path, tiny_model):
    svc = Service(tmp_path, tiny_model, broker={"drain_s": 3.0}).wait_ready()
    client = LedgerClient(svc.zmq_address, timeout_s=60)
    try:
        ledger = Ledger(client)
        for n in range(4):
            ledger.start(f"p{n}", max_tokens=200)
        ledger.streaming(4)
        os.kill(svc.proc.pid, signal.SIGSTOP)  # a stalled disk, a long collection
        time.sleep(4.0)
        os.kill(svc.proc.pid, signal.SIGCONT)
        ledger.wait(timeout_s=60)
        ledger.check()
        # not frozen: the service answers, steps flow, the same workers (a pause is not a death)
        wait_for(lambda: requests.get(svc.base_url + "/health", timeout=5).status_code == 200, timeout_s=20)
        out = client.generate(prompt_tokens=[1, 2, 3], max_tokens=5, temperature=0).collect()
        assert out["completion_tokens"] == 5

        late = Ledger(client)
        for n in range(4):
            late.start(f"t{n}", max_tokens=240)
        late.streaming(4)
        svc.proc.send_signal(signal.SIGTERM)
        svc.proc.wait(timeout=20)  # drain_s 3 s, then every request fails and serve exits
        late.wait(timeout_s=10)
        assert {v[0] for v in late.check().values()} <= {"final", "error"}
        assert svc.proc.returncode == 0
    finally:
        client.close()
        assert svc.stop() == []


def test_serve_refuses_a_public_http_address_without_an_api_key(tmp_path, tiny_model):
    config = tmp_path / "public.json"
    config.write_text(json.dumps({"model": str(tiny_model), "device": "cpu", "api": {"host": "0.0.0.0"}}))
    out = subprocess.run([sys.executable, "-m", "moebus.cli", "api", "--config", str(config)], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 2 and "api.api_key" in out.stderr
    pytest.importorskip("waitress")


def test_serve_whose_api_cannot_start_exits_non_zero(tmp_path, tiny_model):
    """No half-alive service: an api that cannot start (its port is taken) ends serve at once with a
    non-zero status and the reason, instead of a broker serving nobody over HTTP."""
    import socket

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen(1)
    svc = Service(tmp_path, tiny_model, api={"port": taken.getsockname()[1]})
    try:
        svc.proc.wait(timeout=120)
        last = svc.logs().strip().splitlines()[-1]
        assert svc.proc.returncode == 2 and last.startswith("moebus: error: api cannot start: api.host / api.port"), \
            svc.logs()
        assert "in use" in last and svc.logs().count("started api") == 1  # not restarted
    finally:
        taken.close()
        assert svc.stop() == []
