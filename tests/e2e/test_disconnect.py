"""A client that goes away cancels its request: the sequence is freed, requests_running returns to 0."""
import json
import socket

import requests

from tests.api.helpers import scrape, wait_for

LONG = {"prompt": [5, 17, 99], "max_tokens": 1000, "temperature": 0, "ignore_eos": True}


def idle(base_url) -> dict | None:
    m = scrape(base_url)
    return m if m["moebus_requests_running"] == 0 and m["moebus_requests_waiting"] == 0 else None


def test_disconnect_mid_stream_frees_the_sequence(service):
    before = scrape(service.base_url)
    r = requests.post(service.base_url + "/v1/completions", json={**LONG, "stream": True}, stream=True, timeout=30)
    lines = r.iter_lines()
    got = [line for line, _ in zip((x for x in lines if x), range(3))]
    assert all(line.startswith(b"data: {") for line in got)
    assert scrape(service.base_url)["moebus_requests_running"] == 1
    r.close()
    after = wait_for(lambda: idle(service.base_url), timeout_s=30)
    assert after["moebus_requests_cancelled_total"] == before["moebus_requests_cancelled_total"] + 1
    assert after["moebus_generation_tokens_total"] - before["moebus_generation_tokens_total"] < 1000


def test_disconnect_while_waiting_for_an_unstreamed_answer(service):
    before = scrape(service.base_url)
    body = json.dumps(LONG).encode()
    with socket.create_connection(("127.0.0.1", service.http_port)) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        wait_for(lambda: scrape(service.base_url)["moebus_requests_running"] == 1, timeout_s=30)
    after = wait_for(lambda: idle(service.base_url), timeout_s=30)
    assert after["moebus_requests_cancelled_total"] == before["moebus_requests_cancelled_total"] + 1
    assert after["moebus_generation_tokens_total"] - before["moebus_generation_tokens_total"] < 1000


def test_next_request_after_disconnects(openai_client):
    out = openai_client.completions.create(model="m", prompt=[1, 2, 3], max_tokens=4, temperature=0)
    assert out.usage.completion_tokens >= 1
