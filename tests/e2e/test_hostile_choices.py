"""The n choices of one request are n broker requests that the api reads in turn. While it reads
one, the others' replies must not pile up in the ZeroMQ client, which cancels a request whose
replies go unread past ``MAX_PENDING_REPLIES`` (4096: a non-streamed n=2 answer of more tokens
failed). The bound is lowered here so that a short answer reaches it."""
import flask

import moebus.client
from moebus.api.responses import CompletionFormatter
from moebus.api.streaming import answer
from moebus.client import Client

MAX_TOKENS = 120
PILE_LIMIT = 32  # far below MAX_TOKENS: a choice read after another one piles up MAX_TOKENS replies


def test_choices_read_in_turn_do_not_pile_up_in_the_client(service, monkeypatch):
    monkeypatch.setattr(moebus.client, "MAX_PENDING_REPLIES", PILE_LIMIT)
    client = Client(service.zmq_address, timeout_s=60)
    try:
        streams = [client.generate(prompt="hello", max_tokens=MAX_TOKENS, ignore_eos=True, temperature=0)
                   for _ in range(2)]
        with flask.Flask(__name__).app_context():
            body = answer(streams, CompletionFormatter("tiny", n=2), None, as_events=False).get_json()
    finally:
        client.close()
    assert [c["finish_reason"] for c in body["choices"]] == ["length", "length"]
    assert body["usage"]["completion_tokens"] == 2 * MAX_TOKENS
    assert body["choices"][0]["text"] == body["choices"][1]["text"]  # greedy: the same answer twice
