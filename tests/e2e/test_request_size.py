"""An HTTP request that the broker's ZeroMQ limit (max_request_bytes) would refuse is a 413 at the
api: sent, ZeroMQ would drop the api's whole connection and every other stream on it."""

import requests

from tests.e2e.conftest import MAX_REQUEST_BYTES


def test_a_request_over_the_broker_limit_is_413_and_other_streams_go_on(service):
    body = {"prompt": [5, 17, 99], "max_tokens": 200, "temperature": 0, "ignore_eos": True, "stream": True}
    with requests.post(service.base_url + "/v1/completions", json=body, stream=True, timeout=60) as stream:
        lines = (line for line in stream.iter_lines() if line)
        assert next(lines).startswith(b"data: {")
        big = {"prompt": "word " * (MAX_REQUEST_BYTES // 4), "max_tokens": 1}
        r = requests.post(service.base_url + "/v1/completions", json=big, timeout=30)
        assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
        rest = list(lines)
    assert rest[-1] == b"data: [DONE]" and not any(b'"error"' in line for line in rest)
