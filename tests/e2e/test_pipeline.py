"""Pipelined steps across two emulated GPUs (broker.pipeline): 8 concurrent streams, greedy and
seeded, give the tokens of the unpipelined split and of one stage; a worker SIGKILLed mid-pipeline
fails the running requests (their KV state died with it) and no waiting one; a VRAM resize during
pipelined decode waits for the steps in flight and changes no token."""
import os
import signal
import time

import numpy as np
import pytest

from moebus.client import Client
from moebus.common.errors import MoebusError
from tests.api.helpers import wait_for
from tests.service import Service, alive

NUM_STREAMS = 8


def requests_to_run(num: int = NUM_STREAMS, max_tokens: int = 24) -> list[dict]:
    """Prompts of different lengths; every other stream seeded sampling (its draws must not move)."""
    rng = np.random.default_rng(12)
    out = []
    for i in range(num):
        prompt = [int(t) for t in rng.integers(3, 384, size=int(rng.integers(2, 40)))]
        sampling = {"temperature": 0} if i % 2 == 0 else {"temperature": 0.9, "top_p": 0.95, "seed": 100 + i}
        out.append({"prompt_tokens": prompt, "max_tokens": max_tokens, "ignore_eos": True, **sampling})
    return out


def run_together(client: Client, reqs: list[dict]) -> list[tuple[list[int], list[float]]]:
    streams = [client.generate(**r) for r in reqs]  # all sent before any is read: they run at once
    results = [s.collect() for s in streams]
    return [(r["tokens"], r["logprobs"]) for r in results]


def assert_same(got, want) -> None:
    for (tokens, logprobs), (tokens_want, logprobs_want) in zip(got, want, strict=True):
        assert tokens == tokens_want
        np.testing.assert_allclose(logprobs, logprobs_want, atol=1e-4)


def counter(client: Client, name: str) -> int:
    return client.info()["counters"][name]


def start(tmp, tiny_model, vram, **settings) -> Service:
    return Service(tmp, tiny_model, emulated_vram_mib=vram, emulated_vram_dir=str(tmp / "vram"), command="broker",
                   max_batch=NUM_STREAMS, segment_mib=1, **settings).wait_ready(http=False)


@pytest.fixture(scope="module")
def pipelined(tmp_path_factory, tiny_model):
    svc = start(tmp_path_factory.mktemp("pipelined"), tiny_model, [32, 32], max_context=2048)
    try:
        yield svc
    finally:
        assert svc.stop() == []


@pytest.fixture(scope="module")
def client(pipelined):
    c = Client(pipelined.zmq_address, timeout_s=120)
    yield c
    c.close()


@pytest.fixture(scope="module")
def reference(pipelined, client):
    """The 8 streams on the pipelined split, checked there to have overlapped steps."""
    before = counter(client, "pipelined_steps_total")
    got = run_together(client, requests_to_run())
    assert counter(client, "pipelined_steps_total") > before + 10
    return got


def through(tmp, tiny_model, vram, **settings):
    tmp.mkdir()
    svc = start(tmp, tiny_model, vram, **settings)
    try:
        c = Client(svc.zmq_address, timeout_s=120)
        try:
            got = run_together(c, requests_to_run())
            return got, counter(c, "pipelined_steps_total")
        finally:
            c.close()
    finally:
        assert svc.stop() == []


def test_pipelined_equals_unpipelined_and_one_stage(tmp_path, tiny_model, reference):
    serial, overlapped = through(tmp_path / "serial", tiny_model, [32, 32], broker={"pipeline": False})
    assert overlapped == 0
    assert_same(reference, serial)
    one, overlapped = through(tmp_path / "one", tiny_model, [64])
    assert overlapped == 0  # one stage: nothing to overlap, whatever the setting
    assert_same(reference, one)


def test_vram_resize_during_pipelined_decode(client, reference):
    start_reply = client.vram(query=True)
    streams = [client.generate(**r) for r in requests_to_run()]
    first = [next(iter(s)) for s in streams]  # every stream is decoding
    before = counter(client, "pipelined_steps_total")
    shrunk = client.vram([f + 0.5 for f in start_reply["free_mib"]])  # one of its 1 MiB segments
    assert not shrunk.get("error") and shrunk["expert_slots"][0] < start_reply["expert_slots"][0]
    assert all(f >= r for f, r in zip(shrunk["free_mib"], shrunk["reserve_mib"])), (start_reply, shrunk)
    got = []
    for part, stream in zip(first, streams):
        rest = stream.collect()
        got.append((part.tokens + rest["tokens"], part.logprobs + rest["logprobs"]))
    assert counter(client, "pipelined_steps_total") > before  # the pipeline filled again after the resize
    back = client.vram()
    assert back["expert_slots"] == start_reply["expert_slots"]
    assert_same(got, reference)


def test_sigkill_mid_pipeline_fails_the_running_requests_only(pipelined, client, reference):
    # long enough that none can finish (and hand its slot to a queued one) on a loaded machine before the kill
    long = [{**r, "max_tokens": 1500} for r in requests_to_run()]
    queued = requests_to_run(NUM_STREAMS + 2)[NUM_STREAMS:]  # over max_batch: these wait for a slot
    running = [client.generate(**r) for r in long]
    for s in running:
        next(iter(s))
    # sent only once every long one holds a slot: the tokenizer threads hand prompts over in no fixed
    # order, so queued ones sent earlier could overtake a long one on a loaded machine
    waiting = [client.generate(**r) for r in queued]
    try:
        wait_for(lambda: client.info()["requests_waiting"] == len(queued), timeout_s=60)
    except AssertionError:
        info = client.info()
        raise AssertionError(f"the queued requests are not waiting: running {info['requests_running']}, "
                             f"waiting {info['requests_waiting']}, counters {info['counters']}") from None
    before = counter(client, "pipelined_steps_total")
    time.sleep(0.5)
    assert counter(client, "pipelined_steps_total") > before  # steps overlap at the moment of the kill
    victim = pipelined.worker_pids()[1]
    os.kill(victim, signal.SIGKILL)
    for s in running:
        with pytest.raises(MoebusError, match="gpu1"):
            s.collect()
    # the waiting requests are admitted once gpu1 is back, and come out as they would have
    got = [(r["tokens"], r["logprobs"]) for r in (s.collect() for s in waiting)]
    assert not alive(victim) and counter(client, "worker_restarts_total") >= 1
    assert_same(got, run_together(client, queued))


def test_a_cancel_mid_pipeline_frees_a_slot_that_a_waiting_request_takes(client, reference):
    reqs = requests_to_run()
    extra = {**reqs[0], "prompt_tokens": reqs[0]["prompt_tokens"][::-1]}  # a ninth: it waits for a slot
    streams = [client.generate(**r) for r in reqs]
    first = [next(iter(s)) for s in streams]
    waiting = client.generate(**extra)  # after the 8 hold their slots (prompts are not admitted in send order)
    streams[3].close()  # cancels it while its step may be at either stage
    got = []
    for i, (part, stream) in enumerate(zip(first, streams)):
        if i != 3:
            rest = stream.collect()
            got.append((part.tokens + rest["tokens"], part.logprobs + rest["logprobs"]))
    assert_same(got, reference[:3] + reference[4:])
    late = waiting.collect()
    alone = client.generate(**extra).collect()
    assert late["tokens"] == alone["tokens"]
