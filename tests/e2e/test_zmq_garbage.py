"""Garbage on the broker's ZeroMQ frontend gets an ERROR reply (or, past the size limit, a dropped
connection) and a counter; the broker goes on and the next valid request works."""
import os
import pickle

import msgpack
import pytest
import zmq

from moebus.common import wire
from moebus.common.protocol import Error
from tests.api.helpers import scrape
from tests.e2e.conftest import MAX_REQUEST_BYTES

GARBAGE = {
    "random bytes": [os.urandom(64)],
    "one frame": [b"GENERATE"],
    "forty frames": [b"GENERATE", msgpack.packb({"id": "x", "prompt": "hi"})] + [b"\0" * 8] * 38,
    "unknown type": [b"LAUNCH", msgpack.packb({})],
    "random header": [b"GENERATE", os.urandom(256)],
    "pickle payload": [b"GENERATE", pickle.dumps({"id": "x", "prompt": "hi"})],
    "pickle everywhere": [pickle.dumps(Error(message="x")), pickle.dumps(os.system)],
    "header not a map": [b"GENERATE", msgpack.packb([1, 2, 3])],
    "huge declared array": [b"GENERATE", b"\xdd\xff\xff\xff\xff"],
    "huge declared string": [b"GENERATE", b"\x81\xa2id\xdb\xff\xff\xff\xf0abc"],
    "huge header": [b"GENERATE", msgpack.packb({"id": "x", "prompt": "word " * (MAX_REQUEST_BYTES // 8)})],
    "bad header for a valid type": [b"GENERATE", msgpack.packb({"id": 5, "prompt": ["not", "text"]})],
    "extra field": [b"GENERATE", msgpack.packb({"id": "x", "prompt": "hi", "exec": "rm -rf /"})],
    "bad sampling": [b"GENERATE", msgpack.packb({"id": "x", "prompt": "hi", "sampling": {"max_tokens": -1}})],
    "tensor spec for a message without tensors": [
        b"GENERATE", msgpack.packb({"id": "x", "_tensors": {"a": [0, "float32", [1]]}}), b"\0" * 4],
    "worker message from a client": [b"STEP_REPLY", msgpack.packb({"step_id": 1, "generation": "x"})],
    "reply type from a client": [b"FINAL", msgpack.packb({"id": "x", "finish_reason": "stop", "prompt_tokens": 1,
                                                          "completion_tokens": 1})],
}

WELL_FORMED = {"worker message from a client", "reply type from a client"}  # decodable, but not for a client


@pytest.fixture
def dealer(service):
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(service.zmq_address)
    yield sock
    sock.close()


def reply(sock, timeout_ms=5000):
    assert sock.poll(timeout_ms), "no reply from the broker"
    return wire.decode(sock.recv_multipart())


@pytest.mark.parametrize("name", list(GARBAGE))
def test_garbage_gets_an_error_and_the_broker_goes_on(service, dealer, zmq_client, name):
    invalid_before = scrape(service.base_url)["moebus_invalid_messages_total"]
    frames = GARBAGE[name]
    dealer.send_multipart(frames)
    if sum(map(len, frames)) > MAX_REQUEST_BYTES:  # zmq drops the connection; nothing comes back
        assert not dealer.poll(1000)
    else:
        answer = reply(dealer)
        assert isinstance(answer, Error) and answer.status in (400, 500) and answer.message
    out = zmq_client.generate(prompt="still alive", max_tokens=3, temperature=0).collect()
    assert out["completion_tokens"] == 3 or out["finish_reason"] == "stop"
    undecodable = name not in WELL_FORMED and name != "huge header"
    assert scrape(service.base_url)["moebus_invalid_messages_total"] == invalid_before + undecodable


def test_negative_token_ids_are_refused(dealer):
    dealer.send_multipart([b"GENERATE", msgpack.packb({"id": "x", "prompt_tokens": [-1] * 1000})])
    answer = reply(dealer)
    assert isinstance(answer, Error) and answer.status == 400


def test_next_valid_request_works_over_http(openai_client):
    out = openai_client.chat.completions.create(model="m", messages=[{"role": "user", "content": "ok?"}], max_tokens=3)
    assert out.usage.completion_tokens >= 1
