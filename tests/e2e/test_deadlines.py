"""Deadlines on the broker's waits, against a remote stage whose IO stays alive while its compute
never answers: a peer that registers as gpu1 over the real protocol and keeps heartbeating, but
answers neither STEP nor VRAM (what a worker with a stuck compute loop does). Heartbeats alone
would call it alive; the per-stage deadlines must not."""
import threading
import time
import uuid

import numpy as np
import pytest
import zmq

from moebus.client import Client
from moebus.common import transport, wire
from moebus.common.errors import RequestError
from moebus.common.protocol import Heartbeat, Ready, Step, Vram
from tests.service import Service, free_port

TIMEOUT_S = 2.0


class SilentStage(threading.Thread):
    """gpu1 with live IO and a compute loop that never returns."""

    def __init__(self, address: str, model: str, layers: tuple[int, int], max_context: int):
        super().__init__(daemon=True)
        self.address, self.ready = address, Ready(gpu=1, generation=uuid.uuid4().hex[:12], layers=layers, device="cpu",
                                                  model=model, max_batch=8, max_context=max_context)
        self.stop, self.received = threading.Event(), []

    def run(self) -> None:
        sock = transport.make_socket(zmq.Context.instance(), zmq.DEALER, identity=b"gpu1")
        sock.connect(self.address)
        transport.send(sock, self.ready)
        while not self.stop.is_set():
            if sock.poll(250):
                msg = wire.decode(sock.recv_multipart())
                if isinstance(msg, (Step, Vram)):
                    self.received.append(type(msg).__name__)
            transport.send(sock, Heartbeat(generation=self.ready.generation))
        sock.close()


@pytest.fixture
def broker_with_a_silent_stage(tmp_path, tiny_model):
    backend = f"tcp://127.0.0.1:{free_port()}"
    svc = Service(tmp_path, tiny_model, command="broker", broker={
        "backend": backend, "remote_gpus": [1], "step_timeout_s": TIMEOUT_S, "vram_timeout_s": TIMEOUT_S})
    peer = SilentStage(backend, tiny_model.name, (2, 4), svc.config["max_context"])
    peer.start()
    client = Client(svc.zmq_address, timeout_s=60)
    try:
        svc.wait_ready(http=False)
        yield svc, client, peer
    finally:
        peer.stop.set()
        client.close()
        assert svc.stop() == []


def test_a_step_without_a_reply_fails_by_its_deadline(broker_with_a_silent_stage):
    svc, client, peer = broker_with_a_silent_stage
    started = time.monotonic()
    with pytest.raises(RequestError) as err:
        client.generate(prompt_tokens=[1, 2, 3], max_tokens=4).collect()
    assert "did not answer a step" in err.value.message and err.value.http_status == 500
    assert TIMEOUT_S <= time.monotonic() - started < TIMEOUT_S + 3
    assert "Step" in peer.received
    assert client.info()["gpus"][1]["ready"] is False  # given up on until it registers anew


def test_pipelined_steps_wait_for_the_stuck_stage_and_fail_by_its_deadline(broker_with_a_silent_stage):
    """Two sequences, two micro-batches (broker.pipeline): the second waits in the broker for gpu1,
    which never answers the first; gpu1 is never sent two steps at once, and both requests end by
    the first step's deadline (the late step's with its deadline error, the other as gpu1 is lost)."""
    _, client, peer = broker_with_a_silent_stage
    started = time.monotonic()
    first = client.generate(prompt_tokens=[1, 2, 3], max_tokens=4)
    time.sleep(0.5)  # its step is at gpu1 before the second request arrives
    second = client.generate(prompt_tokens=[4, 5, 6], max_tokens=4)
    errors = []
    for stream in (first, second):
        with pytest.raises(RequestError) as err:
            stream.collect()
        errors.append(err.value)
    assert time.monotonic() - started < TIMEOUT_S + 3.5
    assert "did not answer a step" in errors[0].message and errors[0].http_status == 500
    assert "missed its step deadline" in errors[1].message and errors[1].http_status == 503
    assert peer.received.count("Step") == 1
    assert client.info()["counters"]["pipelined_steps_total"] >= 1


def test_a_vram_request_without_a_reply_is_answered_by_its_deadline(broker_with_a_silent_stage):
    _, client, peer = broker_with_a_silent_stage
    started = time.monotonic()
    reply = client.vram([4, 4])
    assert TIMEOUT_S <= time.monotonic() - started < TIMEOUT_S + 3
    assert "gpu1" in reply["error"] and "Vram" in peer.received
    out = client.info()
    assert out["gpus"][1]["ready"] is False


@pytest.mark.parametrize("field,value", [("model", "another-model"), ("max_context", 99999), ("max_batch", 64),
                                         ("layers", (1, 4))])
def test_a_remote_ready_that_does_not_match_the_broker_is_told_to_shut_down(tmp_path, tiny_model, field, value):
    backend = f"tcp://127.0.0.1:{free_port()}"
    svc = Service(tmp_path, tiny_model, command="broker", broker={"backend": backend, "remote_gpus": [1]})
    try:
        ready = Ready(gpu=1, generation="g", layers=(2, 4), device="cpu", model=tiny_model.name, max_batch=8,
                      max_context=svc.config["max_context"]).model_copy(update={field: value})
        sock = transport.make_socket(zmq.Context.instance(), zmq.DEALER, identity=b"gpu1")
        sock.connect(backend)
        deadline = time.monotonic() + 60
        while not sock.poll(500):  # the broker binds once its model is loaded
            transport.send(sock, ready)
            assert time.monotonic() < deadline
        assert type(wire.decode(sock.recv_multipart())).__name__ == "Shutdown"
        sock.close()
        client = Client(svc.zmq_address)
        assert client.info()["gpus"][1]["ready"] is False
        client.close()
    finally:
        assert svc.stop() == []


def test_a_step_lost_across_a_reconnect_is_sent_again(tmp_path, tiny_model):
    """The stage receives a STEP, loses its connection (as a worker does when the broker was silent)
    and registers again as the same process: the broker sends that STEP again instead of waiting."""
    backend = f"tcp://127.0.0.1:{free_port()}"
    svc = Service(tmp_path, tiny_model, command="broker", broker={"backend": backend, "remote_gpus": [1]})
    ctx = zmq.Context.instance()
    ready = Ready(gpu=1, generation="same-process", layers=(2, 4), device="cpu", model=tiny_model.name, max_batch=8,
                  max_context=svc.config["max_context"])
    sock = transport.make_socket(ctx, zmq.DEALER, identity=b"gpu1")
    sock.connect(backend)
    client = Client(svc.zmq_address, timeout_s=60)
    try:
        deadline = time.monotonic() + 60
        while not client.ping(timeout_s=0.5):
            transport.send(sock, ready)
            assert time.monotonic() < deadline
        client.generate(prompt_tokens=[1, 2, 3], max_tokens=2)
        first = next_step(sock)
        sock.close()  # the reply, had there been one, is lost with this connection
        sock = transport.make_socket(ctx, zmq.DEALER, identity=b"gpu1")
        sock.connect(backend)
        transport.send(sock, ready)
        again = next_step(sock)
        assert again.step_id == first.step_id and np.array_equal(again.hidden, first.hidden)
    finally:
        sock.close()
        client.close()
        assert svc.stop() == []


def next_step(sock, timeout_s: float = 10.0) -> Step:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if sock.poll(200):
            msg = wire.decode(sock.recv_multipart())
            if isinstance(msg, Step):
                return msg
    raise AssertionError("no STEP")
