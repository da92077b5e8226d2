"""A prompt chunk that spans steps, through a real broker and worker on the cpu (workers/
spanning_chunk.py, STEP_REPLY ``pending_rows``): with half of the experts cached and a budget of one
expert's copy a step, a stream keeps decoding while a long prompt is read in many steps; both answer
what they answer alone. A cancel in the middle drops the chunk the worker holds."""
import time

import numpy as np
import pytest

from moebus.client import Client
from tests.service import Service

LONG = {"prompt_tokens": list(range(3, 153)), "max_tokens": 4, "temperature": 0, "ignore_eos": True}
STREAM = {"prompt_tokens": [5, 6, 7], "max_tokens": 60, "temperature": 0, "ignore_eos": True}
BLOB_MIB = 0.012  # the tiny model's expert: 3 x 64 x 32 bf16 = 12 KiB


# held_ahead (the default): the held chunk's steps go as look-ahead steps that name it (broker/lookahead.py's
# HELD_CHUNK_AHEAD, Step.held_row) and, in ordinary steps, without its image rows (steps.KEEP_HELD_FEED);
# resent: both off (the ordinary step after the look-ahead step's reply, the feed sent again)
@pytest.fixture(scope="module", params=[{}, {"MOEBUS_HELD_CHUNK_AHEAD": "0", "MOEBUS_KEEP_HELD_FEED": "0"}],
                ids=["held_ahead", "resent"])
def served(tmp_path_factory, tiny_model, request):
    tmp = tmp_path_factory.mktemp("spanning")
    svc = Service(tmp, tiny_model, env=request.param, emulated_vram_mib=[1.6], emulated_vram_dir=str(tmp / "vram"),
                  command="broker", vram_elastic=False, max_batch=4, max_context=256,
                  max_prefill_copy_mib_beside_decode=BLOB_MIB).wait_ready(http=False)
    client = Client(svc.zmq_address, timeout_s=60)
    try:
        yield client
    finally:
        client.close()
        assert svc.stop() == []


def worker_stats(client: Client, **at_least) -> dict:
    """The worker's figures as the broker last polled them, once they reach ``at_least``."""
    deadline = time.monotonic() + 15
    while True:
        gpu = client.info()["gpus"][0]
        if all(gpu.get(k, -1) >= v for k, v in at_least.items()) or time.monotonic() > deadline:
            return gpu
        time.sleep(0.2)


def test_a_stream_decodes_while_a_long_prompt_is_read_in_pieces(served, request):
    held_ahead = "held_ahead" in request.node.callspec.id
    gpu = worker_stats(served, expert_slots=1)
    assert 0 < gpu["expert_slots"] < 32  # of 4 layers x 8 experts: the chunk must copy experts in
    want_long, want_stream = served.generate(**LONG).collect(), served.generate(**STREAM).collect()
    before = worker_stats(served)
    stream = served.generate(**STREAM)
    tokens, logprobs, long = [], [], None
    for part in stream:  # (a part may carry several tokens when the machine is busy: >=, not ==)
        tokens += part.tokens
        logprobs += part.logprobs
        if long is None and len(tokens) >= 3:
            long = served.generate(**LONG)
    got_long = long.collect()
    # the stream's rows run alone while the chunk is held; beside the long request's decode rows after
    assert tokens == want_stream["tokens"]
    np.testing.assert_allclose(logprobs, want_stream["logprobs"], atol=1e-4)
    assert got_long["tokens"][0] == want_long["tokens"][0]
    assert got_long["logprobs"][0] == want_long["logprobs"][0]  # bit for bit: the same kernels, rows, order
    assert got_long["tokens"] == want_long["tokens"]
    np.testing.assert_allclose(got_long["logprobs"], want_long["logprobs"], atol=1e-4)
    after = worker_stats(served, chunks_spanned=before["chunks_spanned"] + 1)
    assert after["chunks_spanned"] == before["chunks_spanned"] + 1
    assert after["chunk_steps"] - before["chunk_steps"] > 3  # the prompt was read in many steps
    ahead = served.info()["counters"]["held_chunk_lookahead_steps_total"]  # the chunk's steps after its first
    assert ahead > 0 if held_ahead else ahead == 0


def test_a_cancel_in_the_middle_drops_the_held_chunk(served):
    """The cancel must reach the worker while it holds the chunk: the client sees the stream's tokens
    late on a busy machine (and a part may carry several), so an attempt's cancel can come before the
    chunk's first step (nothing held) or after its last (spanned, not dropped); another attempt then
    cancels at another point. Every attempt must end with the worker holding no chunk."""
    dropped = False
    for cancel_after in (3, 1, 2, 5, 8):  # tokens of the stream after the long request went
        before = worker_stats(served)
        stream = served.generate(**STREAM)
        count, long, cancelled = 0, None, False
        for part in stream:
            count += len(part.tokens)
            if long is None and count >= 3:
                long, sent_at = served.generate(**LONG), count
            elif long is not None and not cancelled and count >= sent_at + cancel_after:
                long.close()  # cancels it: its chunk is some steps in
                cancelled = True
        assert count == STREAM["max_tokens"]
        ended = before["chunks_dropped"] + before["chunks_spanned"] + 1
        after = _until(served, lambda g: g["chunks_dropped"] + g["chunks_spanned"] >= ended, before)
        if after["chunks_dropped"] == before["chunks_dropped"] + 1:
            assert after["chunks_spanned"] == before["chunks_spanned"] and after["chunk_steps"] > before["chunk_steps"]
            dropped = True
            break
        # too late (the chunk was done: spanned) or too early (never held: neither counter moved)
        assert after["chunks_dropped"] + after["chunks_spanned"] <= ended
    assert dropped, "no attempt's cancel reached the worker while it held the chunk"


def _until(client: Client, done, before: dict, timeout_s: float = 5.0) -> dict:
    """The worker's figures once ``done`` holds for them, or after ``timeout_s`` (INFO is polled)."""
    deadline = time.monotonic() + timeout_s
    while True:
        gpu = client.info()["gpus"][0]
        if done(gpu) or time.monotonic() > deadline:
            return gpu
        time.sleep(0.2)
