"""The HTTP edge holds against hostile and slow clients: every number in range, strings valid
Unicode, the body limit under chunked transfer encoding too, slow-header and slow-body clients that
hold no thread, /health answering under load, more concurrent streams than the old 16 threads."""
import json
import socket
import threading
import time

import pytest
import requests

from moebus.api.auth import check_exposure
from moebus.common.errors import ConfigError
from moebus.common.settings import ApiSettings
from tests.api.conftest import MAX_BODY_BYTES
from tests.api.helpers import scrape

USER = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("extra,param", [
    ({"top_k": 2 ** 31}, "top_k"),  # issue 10: passed validation and overflowed int32 in the broker
    ({"max_tokens": 10 ** 30}, "max_tokens"),
    ({"seed": 2 ** 64}, "seed"),
    ({"stop_token_ids": [2 ** 40]}, "stop_token_ids"),
    ({"stop": ["x" * 5000]}, "stop"),
])
def test_out_of_range_numbers_are_a_400_naming_the_field(http, extra, param):
    r = http.post(http.url("/v1/chat/completions"), json={"messages": USER, "max_tokens": 2, **extra})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"].startswith(param)


def test_a_top_k_beyond_the_vocabulary_means_no_top_k(http):
    r = http.post(http.url("/v1/completions"), json={"prompt": [1, 2], "max_tokens": 3, "top_k": 2 ** 31 - 1})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3


def test_token_ids_past_int32_are_refused(http):
    r = http.post(http.url("/v1/completions"), json={"prompt": [2 ** 33], "max_tokens": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"


def test_a_lone_surrogate_is_a_400(http):
    body = b'{"messages": [{"role": "user", "content": "a\\ud800b"}], "max_tokens": 1}'
    r = http.post(http.url("/v1/chat/completions"), data=body, headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_unicode"


def test_the_body_limit_holds_for_a_chunked_body(http):
    def chunks():
        yield b'{"messages": [{"role": "user", "content": "'
        for _ in range(4 * MAX_BODY_BYTES // 4096):
            yield b"x" * 4096
        yield b'"}]}'

    r = http.post(http.url("/v1/chat/completions"), data=chunks(), headers={"Content-Type": "application/json"})
    assert r.status_code == 413
    assert http.post(http.url("/v1/chat/completions"), json={"messages": USER, "max_tokens": 1}).status_code == 200


def test_a_chunked_body_within_the_limit_is_served(http):
    body = b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}'
    r = http.post(http.url("/v1/chat/completions"), data=iter([body[:10], body[10:]]),
                  headers={"Content-Type": "application/json"})
    assert r.status_code == 200, r.text


def slow_clients(port: int, n: int, half_body: bool) -> list[socket.socket]:
    socks = []
    for _ in range(n):
        s = socket.create_connection(("127.0.0.1", port))
        if half_body:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Content-Length: 1000\r\n\r\n{\"prompt\": ")
        else:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        socks.append(s)
    return socks


def test_slow_header_and_slow_body_clients_block_nobody(service, http):
    socks = slow_clients(service.http_port, 40, half_body=False) + slow_clients(service.http_port, 40, half_body=True)
    try:
        started = time.monotonic()
        assert requests.get(service.base_url + "/health", timeout=5).status_code == 200
        r = http.post(http.url("/v1/completions"), json={"prompt": [1, 2], "max_tokens": 2}, timeout=10)
        assert r.status_code == 200
        assert time.monotonic() - started < 5
    finally:
        for s in socks:
            s.close()


def test_more_concurrent_streams_than_the_old_thread_cap_and_health_answers(service, http):
    n = 40  # max_batch 8 decode, the rest wait in the broker's queue: every one is served
    results, health = [], []

    def stream():
        body = {"prompt": [3, 4], "max_tokens": 8, "stream": True, "ignore_eos": True,
                "stream_options": {"include_usage": True}}
        with requests.post(http.url("/v1/completions"), json=body, headers=http.headers, stream=True, timeout=120) as r:
            events = [line for line in r.iter_lines() if line.startswith(b"data: ")]
            usage = [json.loads(e[6:])["usage"] for e in events[:-1] if b'"usage":{' in e]
            results.append((r.status_code, events[-1], usage[-1]["completion_tokens"] if usage else None))

    threads = [threading.Thread(target=stream) for _ in range(n)]
    for t in threads:
        t.start()
    while any(t.is_alive() for t in threads):
        t0 = time.monotonic()
        code = requests.get(service.base_url + "/health", timeout=10).status_code
        health.append((code, time.monotonic() - t0))
        time.sleep(0.2)
    for t in threads:
        t.join()
    assert len(results) == n and set(results) == {(200, b"data: [DONE]", 8)}, results
    assert health and all(code == 200 and took_s < 3 for code, took_s in health), health
    assert scrape(service.base_url)["moebus_requests_running"] == 0


def test_a_public_address_needs_a_key_or_an_explicit_opt_out():
    with pytest.raises(ConfigError, match="api.api_key"):
        check_exposure(ApiSettings(host="0.0.0.0"))
    check_exposure(ApiSettings(host="0.0.0.0", api_key="k"))
    check_exposure(ApiSettings(host="0.0.0.0", allow_unauthenticated=True))
    check_exposure(ApiSettings(host="127.0.0.1"))
    with pytest.raises(ConfigError, match="must differ"):
        check_exposure(ApiSettings(api_key="same", admin_key="same"))
