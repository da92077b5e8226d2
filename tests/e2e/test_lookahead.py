"""Look-ahead steps (broker.lookahead, one stage): the next decode step goes out while one runs and
takes the ids the stage sampled. Tokens and logprobs are those of the same broker without look-ahead
for greedy and seeded streams, streams that stop early on a stop token (their look-ahead row is
dropped), streams that end by length, and a request that arrives while others decode."""
import numpy as np
import pytest

from moebus.client import Client
from tests.e2e.test_pipeline import assert_same, counter, requests_to_run, run_together
from tests.service import Service


def start(tmp, tiny_model, lookahead: bool) -> Service:
    return Service(tmp, tiny_model, emulated_vram_mib=[64], emulated_vram_dir=str(tmp / "vram"), command="broker",
                   max_batch=8, max_context=512, broker={"lookahead": lookahead}).wait_ready(http=False)


@pytest.fixture(scope="module")
def brokers(tmp_path_factory, tiny_model):
    started = []
    try:
        for lookahead in (False, True):
            started.append(start(tmp_path_factory.mktemp(f"lookahead-{lookahead}"), tiny_model, lookahead))
        clients = [Client(s.zmq_address, timeout_s=60) for s in started]
        yield clients
        for c in clients:
            c.close()
    finally:
        for s in started:
            assert s.stop() == []


def with_stops(reqs: list[dict], plain: list[tuple[list[int], list[float]]]) -> list[dict]:
    """Every other request stops on a token it samples mid-way (found in a run without stops)."""
    out = []
    for i, (req, (tokens, _)) in enumerate(zip(reqs, plain)):
        out.append({**req, "stop_token_ids": [tokens[len(tokens) // 2]]} if i % 2 else req)
    return out


def test_lookahead_changes_no_token(brokers):
    plain_client, ahead_client = brokers
    reqs = requests_to_run(num=6, max_tokens=20)
    want = run_together(plain_client, reqs)
    before = counter(ahead_client, "lookahead_steps_total")
    assert_same(run_together(ahead_client, reqs), want)
    assert counter(ahead_client, "lookahead_steps_total") > before + 10
    assert counter(plain_client, "lookahead_steps_total") == 0

    stopping = with_stops(reqs, want)
    want_stopped = run_together(plain_client, stopping)
    assert any(len(t) < 20 for t, _ in want_stopped)  # some streams really end early
    assert_same(run_together(ahead_client, stopping), want_stopped)


def test_a_request_joins_while_others_look_ahead(brokers):
    reqs = requests_to_run(num=3, max_tokens=24)
    late = {"prompt_tokens": [9, 8, 7, 6, 5], "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    results = []
    for client in brokers:
        streams = [client.generate(**r) for r in reqs]
        first = next(streams[0])  # decoding has started
        streams.append(client.generate(**late))
        collected = [s.collect() for s in streams]
        collected[0]["tokens"][:0], collected[0]["logprobs"][:0] = first.tokens, first.logprobs
        results.append([(c["tokens"], c["logprobs"]) for c in collected])
    assert_same(results[1], results[0])
    assert [len(t) for t, _ in results[1]] == [24, 24, 24, 12]


def test_top_logprobs_of_a_look_ahead_step(brokers):
    req = {"prompt_tokens": [3, 4, 5, 6], "max_tokens": 10, "temperature": 0, "logprobs": 3, "ignore_eos": True}
    got = [client.generate(**req).collect() for client in brokers]
    assert got[1]["tokens"] == got[0]["tokens"]
    np.testing.assert_allclose(np.array(got[1]["logprobs"]), np.array(got[0]["logprobs"]), atol=1e-5)
    top = [[[pair[0] for pair in row] for row in g["top_logprobs"]] for g in got]
    assert len(top[0]) == 10 and top[1] == top[0]
    np.testing.assert_allclose([[pair[1] for pair in row] for row in got[1]["top_logprobs"]],
                               [[pair[1] for pair in row] for row in got[0]["top_logprobs"]], atol=1e-5)


def test_a_cancel_and_a_vram_resize_while_steps_look_ahead(brokers):
    """A cancelled stream's look-ahead row is dropped; a VRAM request waits for both steps in flight;
    the other streams give the tokens of the broker without look-ahead, and look-ahead resumes."""
    reqs = requests_to_run(num=4, max_tokens=30)
    results = []
    for client in brokers:
        start_reply = client.vram(query=True)
        streams = [client.generate(**r) for r in reqs]
        first = [next(iter(s)) for s in streams]  # every stream is decoding
        client.cancel(streams[1].id)
        resized = client.vram()  # every worker's VRAM request waits for the steps in flight
        assert not resized.get("error") and resized["expert_slots"] == start_reply["expert_slots"]
        before = counter(client, "lookahead_steps_total")
        collected = [s.collect() for s in streams]
        assert collected[1]["finish_reason"] == "cancelled"
        results.append([(p.tokens + c["tokens"], p.logprobs + c["logprobs"])
                        for i, (p, c) in enumerate(zip(first, collected)) if i != 1])
        if client is brokers[1]:
            assert counter(client, "lookahead_steps_total") > before  # it looked ahead again after the resize
    assert_same(results[1], results[0])


def test_a_row_with_logit_rules_sits_the_look_ahead_steps_out(brokers):
    """A penalised stream's next step needs its last token on the host: the others look ahead
    without it on every other step, and every stream's tokens are as without look-ahead."""
    reqs = requests_to_run(num=3, max_tokens=16)
    reqs[1] = {**reqs[1], "frequency_penalty": 0.8, "temperature": 0}
    want = run_together(brokers[0], reqs)
    before = counter(brokers[1], "lookahead_steps_total")
    assert_same(run_together(brokers[1], reqs), want)
    assert counter(brokers[1], "lookahead_steps_total") > before + 5
