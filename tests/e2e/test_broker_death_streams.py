"""When the broker of an all-in-one `moebus serve` dies, the api (its child) is told by the kernel
(the parent-death signal) and every open SSE stream ends with an error event and [DONE], none cut
without one (one of four was; api/server.py)."""
from __future__ import annotations

import json
import signal
import threading

import requests

from tests.api.helpers import wait_for
from tests.service import Service

NUM_STREAMS = 4


def test_every_open_stream_ends_with_an_error_event_when_the_broker_dies(tmp_path, tiny_model):
    svc = Service(tmp_path, tiny_model, max_context=1024).wait_ready()
    body = {"prompt": "once upon a time", "max_tokens": 1000, "temperature": 0, "ignore_eos": True, "stream": True}
    responses = [requests.post(svc.base_url + "/v1/completions", json=body, stream=True, timeout=60)
                 for _ in range(NUM_STREAMS)]
    events: list[list[bytes]] = [[] for _ in responses]

    def read(i: int) -> None:
        try:
            for line in responses[i].iter_lines():
                if line:
                    events[i].append(line)
        except requests.RequestException as e:  # a cut connection: recorded, and the test fails on it
            events[i].append(f"cut: {type(e).__name__}".encode())

    readers = [threading.Thread(target=read, args=(i,), daemon=True) for i in range(NUM_STREAMS)]
    try:
        for r in readers:
            r.start()
        wait_for(lambda: all(len(e) >= 2 for e in events), timeout_s=60)  # every stream is decoding
        svc.proc.send_signal(signal.SIGKILL)
        for r in readers:
            r.join(timeout=30)
        for i, lines in enumerate(events):
            assert lines[-1] == b"data: [DONE]", (i, lines[-3:])
            error = json.loads(lines[-2][len(b"data: "):])["error"]
            assert error["type"] == "service_unavailable", (i, error)
    finally:
        for r in responses:
            r.close()
        svc.stop()
