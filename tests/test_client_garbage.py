"""A real Client against a real ZeroMQ peer that plays a broker answering garbage: an undecodable
reply is counted and logged, never silently dropped; when its header names a waiting request, that
request ends at once with a 500 error (not at its timeout) and is cancelled; replies that name no
request leave every other request alone."""
import logging
import os
from concurrent.futures import ThreadPoolExecutor

import msgpack
import pytest
import zmq

from moebus.client import Client
from moebus.common import wire
from moebus.common.errors import RequestError, Unavailable
from moebus.common.protocol import Cancel, Final, Generate, Info, Partial

WAIT_MS = 30_000  # generous: a loaded CI box may be slow to schedule the client's IO thread


class FakeBroker:
    """A ROUTER socket in the broker's place; the test decides every reply."""

    def __init__(self, address: str):
        self.sock = zmq.Context.instance().socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(address)
        self.peer = None

    def receive(self, kind: type):
        """The next message of ``kind`` from the client (its heartbeat PINGs are skipped)."""
        while True:
            assert self.sock.poll(WAIT_MS), f"no {kind.__name__} from the client"
            self.peer, *frames = self.sock.recv_multipart()
            msg = wire.decode(frames)
            if isinstance(msg, kind):
                return msg

    def send_raw(self, *frames: bytes) -> None:
        self.sock.send_multipart([self.peer, *frames])

    def send(self, message) -> None:
        self.send_raw(*[bytes(f) for f in wire.encode(message)])

    def close(self):
        self.sock.close()


@pytest.fixture
def pair(tmp_path):
    address = f"ipc://{tmp_path}/broker.sock"
    broker = FakeBroker(address)
    # a broker that never answers a heartbeat would be declared down after dead_after_s; this one
    # is not on trial for liveness, so that clock is out of the way
    client = Client(address, timeout_s=600, dead_after_s=600)
    yield broker, client
    client.close()
    broker.close()


def garbage_partial(request_id: str) -> list[bytes]:
    """A PARTIAL whose header is readable (and names the request) but whose token id is negative."""
    return [b"PARTIAL", msgpack.packb({"id": request_id, "tokens": [-1], "text": "x", "logprobs": [0.0]})]


def test_an_undecodable_reply_ends_its_request_with_an_error_and_cancels_it(pair, caplog):
    broker, client = pair
    caplog.set_level(logging.WARNING, logger="moebus.client")
    stream = client.generate(prompt="hi", max_tokens=4)
    request_id = broker.receive(Generate).id
    broker.send_raw(*garbage_partial(request_id))
    with pytest.raises(RequestError) as caught:
        next(stream)  # would wait 600 s for a reply if the garbage were dropped
    assert not isinstance(caught.value, Unavailable)  # a timeout raises Unavailable (503); this is not one
    assert caught.value.http_status == 500 and caught.value.code == "undecodable_reply"
    assert "undecodable reply" in caught.value.message and "tokens" in caught.value.message
    assert broker.receive(Cancel).id == request_id  # the broker is told to stop generating for nobody
    assert client.undecodable_replies == 1
    assert any("undecodable reply" in r.getMessage() and request_id in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("frames", [
    lambda rid: [b"PARTIAL", msgpack.packb({"id": rid, "tokens": [1], "text": "x", "logprobs": [0.0]}), b"\0" * 4],
    lambda rid: [b"PARTIAL_V2", msgpack.packb({"id": rid, "tokens": [1]})],  # a type this client does not know
    lambda rid: [b"FINAL", msgpack.packb({"id": rid, "finish_reason": "exploded", "prompt_tokens": 1,
                                         "completion_tokens": 1})],
], ids=["a tensor frame too many", "unknown type", "bad finish_reason"])
def test_every_refusal_that_names_the_request_ends_it(pair, frames):
    broker, client = pair
    stream = client.generate(prompt="hi", max_tokens=4)
    request_id = broker.receive(Generate).id
    broker.send_raw(*frames(request_id))
    with pytest.raises(RequestError, match="undecodable reply") as caught:
        stream.collect()
    assert caught.value.http_status == 500
    assert broker.receive(Cancel).id == request_id


GARBAGE_WITHOUT_AN_ID = {
    "random bytes": [os.urandom(64)],
    "one frame": [b"PARTIAL"],
    "unknown type": [b"LAUNCH", msgpack.packb({"id": "x"})],
    "header not msgpack": [b"FINAL", b"\xc1\xc1\xc1"],
    "header not a map": [b"FINAL", msgpack.packb([1, 2, 3])],
    "id not a string": [b"FINAL", msgpack.packb({"id": 7, "finish_reason": "stop"})],
    "an id no request has": garbage_partial("nobody-waits-for-this"),
}


def test_garbage_naming_no_waiting_request_is_counted_and_the_request_goes_on(pair):
    broker, client = pair
    stream = client.generate(prompt="hi", max_tokens=1)
    request_id = broker.receive(Generate).id
    for frames in GARBAGE_WITHOUT_AN_ID.values():
        broker.send_raw(*frames)
    broker.send(Partial(id=request_id, tokens=[5], text="a", logprobs=[-0.5]))
    broker.send(Final(id=request_id, finish_reason="length", prompt_tokens=1, completion_tokens=1))
    out = stream.collect()  # the garbage came first on the same connection, so it has been counted
    assert out["tokens"] == [5] and out["finish_reason"] == "length"
    assert client.undecodable_replies == len(GARBAGE_WITHOUT_AN_ID)


def test_a_control_call_with_an_undecodable_reply_fails_at_once(pair):
    broker, client = pair
    with ThreadPoolExecutor(1) as pool:
        answer = pool.submit(client.info)
        request_id = broker.receive(Info).id
        broker.send_raw(b"INFO_REPLY", msgpack.packb({"id": request_id, "stats": "not a map"}))
        with pytest.raises(RequestError) as caught:
            answer.result(timeout=WAIT_MS / 1000)
    assert caught.value.http_status == 500 and "stats" in caught.value.message
    assert client.undecodable_replies == 1


def test_one_requests_garbage_does_not_end_another(pair):
    broker, client = pair
    first, second = client.generate(prompt="a", max_tokens=1), client.generate(prompt="b", max_tokens=1)
    ids = [broker.receive(Generate).id, broker.receive(Generate).id]
    bad, good = (ids[0], ids[1]) if ids[0] == first.id else (ids[1], ids[0])
    broker.send_raw(*garbage_partial(bad))
    broker.send(Final(id=good, finish_reason="stop", prompt_tokens=1, completion_tokens=0))
    with pytest.raises(RequestError, match="undecodable"):
        first.collect()
    assert second.collect()["finish_reason"] == "stop"  # delivered after the garbage: the IO thread goes on
