"""The request ledger under worker faults, cancels, VRAM requests, a vanished client and a 4 MiB
prompt: every submitted id reaches exactly one terminal state, and the service goes on serving."""
import os
import random
import signal
import time

import msgpack
import pytest
import requests
import zmq

from tests.api.helpers import scrape, wait_for
from tests.ledger import Ledger, LedgerClient
from tests.service import Service, alive


@pytest.fixture(scope="module")
def service(tmp_path_factory, tiny_model):
    svc = Service(tmp_path_factory.mktemp("ledger"), tiny_model, max_context=1024, max_request_bytes=8 << 20,
                  broker={"client_timeout_s": 3.0})
    try:
        yield svc.wait_ready()
    finally:
        assert svc.stop() == []


@pytest.fixture
def client(service):
    c = LedgerClient(service.zmq_address, timeout_s=60)
    yield c
    c.close()


def healthy(service) -> bool:
    return requests.get(service.base_url + "/health", timeout=5).status_code == 200


@pytest.mark.parametrize("stage,sig", [(0, signal.SIGKILL), (1, signal.SIGKILL), (1, signal.SIGSTOP)])
def test_a_worker_killed_or_hung_mid_stream(service, client, stage, sig):
    ledger = Ledger(client)
    for n in range(6):
        ledger.start(f"w{stage}{sig}-{n}")
    ledger.streaming(6)
    victim = service.worker_pids()[stage]
    os.kill(victim, sig)
    hit_s = time.monotonic()
    ledger.wait(timeout_s=20)
    outcome = ledger.check()
    assert all(v[0] == "error" for v in outcome.values()), outcome
    assert time.monotonic() - hit_s < 10  # heartbeats (3 s) or the exit tell the broker
    wait_for(lambda: not alive(victim), timeout_s=10)  # a hung worker is killed, then restarted
    wait_for(lambda: healthy(service), timeout_s=60)
    ok = client.generate(prompt_tokens=[1, 2, 3], max_tokens=4, temperature=0).collect()
    assert ok["completion_tokens"] == 4


def test_vram_requests_interleaved_with_generation_and_random_cancels(service, client):
    ledger = Ledger(client)
    for n in range(10):
        ledger.start(f"mix-{n}", max_tokens=random.Random(n).randint(5, 60))
    ledger.streaming(4)
    rng = random.Random(0)
    for _ in range(6):
        reply = client.vram([rng.choice([0, 4, 8])] if rng.random() < 0.7 else None, query=rng.random() < 0.3)
        assert reply["line"].startswith("reserve_mib=")
        client.cancel(f"mix-{rng.randrange(10)}")
    ledger.wait(timeout_s=60)
    outcome = ledger.check()
    assert {v for v in outcome.values()} <= {("final", "length"), ("final", "cancelled")}
    client.vram(None)


def test_a_vanished_zeromq_client_has_its_requests_cancelled(service):
    before = scrape(service.base_url)["moebus_requests_cancelled_total"]
    sock = zmq.Context.instance().socket(zmq.DEALER)  # a client that never pings, then goes away
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(service.zmq_address)
    sock.send_multipart([b"GENERATE", msgpack.packb({"id": "ghost", "prompt_tokens": [5, 6, 7], "sampling": {
        "max_tokens": 1000, "ignore_eos": True, "temperature": 0}})])
    assert sock.poll(10_000)
    sock.close()
    gone_s = time.monotonic()
    wait_for(lambda: scrape(service.base_url)["moebus_requests_running"] == 0, timeout_s=15)
    assert time.monotonic() - gone_s < 8  # client_timeout_s is 3 s here
    assert scrape(service.base_url)["moebus_requests_cancelled_total"] == before + 1


def test_a_4_mib_prompt_beside_running_streams(service, client):
    restarts = scrape(service.base_url)["moebus_worker_restarts_total"]
    ledger = Ledger(client)
    for n in range(4):
        ledger.start(f"beside-{n}", max_tokens=300)
    ledger.streaming(4)
    sent_s = time.monotonic()
    big = client.generate(prompt="many words to tokenize " * (4 * 1024 * 1024 // 23), max_tokens=1)
    with pytest.raises(Exception) as err:
        big.collect()
    assert getattr(err.value, "http_status", None) == 400  # longer than max_context, found off the loop
    took_s = time.monotonic() - sent_s
    ledger.wait(timeout_s=60)
    assert {v for v in ledger.check().values()} == {("final", "length")}
    gaps = [b - a for n in range(4) for a, b in zip(ledger.tokens[f"beside-{n}"], ledger.tokens[f"beside-{n}"][1:])
            if a >= sent_s - 0.1 and b <= sent_s + took_s]
    assert gaps and max(gaps) < 1.0, (took_s, max(gaps, default=None))  # they kept streaming meanwhile
    assert scrape(service.base_url)["moebus_worker_restarts_total"] == restarts
