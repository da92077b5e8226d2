"""Top logprobs cost only who asks: a streamed request with logprobs beside plain streams gets the
same tokens and top logprobs as it gets alone (the stage computes them for its row only)."""
import threading
import time

import pytest

MESSAGES = [{"role": "user", "content": "Count the experts."}]


def logprob_entries(client):
    chunks = client.chat.completions.create(model="tiny", messages=MESSAGES, temperature=0, max_tokens=8, stream=True,
                                            logprobs=True, top_logprobs=3, extra_body={"ignore_eos": True})
    return [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]


def plain_stream(client, started: threading.Event, last_chunk_s: list):
    chunks = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Go on."}],
                                            temperature=0, max_tokens=200, stream=True, extra_body={"ignore_eos": True})
    for chunk in chunks:
        started.set()
        if chunk.choices and chunk.choices[0].logprobs is not None:
            raise AssertionError("a plain request got logprobs")
        last_chunk_s.append(time.monotonic())


def test_logprobs_beside_plain_streams_equal_logprobs_alone(openai_client):
    alone = logprob_entries(openai_client)
    events, ends, threads = [threading.Event() for _ in range(3)], [[] for _ in range(3)], []
    for started, last in zip(events, ends):
        threads.append(threading.Thread(target=plain_stream, args=(openai_client, started, last)))
        threads[-1].start()
    assert all(e.wait(30) for e in events)
    beside = logprob_entries(openai_client)
    done_s = time.monotonic()
    for t in threads:
        t.join(60)
    assert all(last and last[-1] > done_s for last in ends)  # the plain streams ran beside it throughout
    assert len(beside) == len(alone) == 8
    for a, b in zip(alone, beside):
        assert a.token == b.token and a.logprob == pytest.approx(b.logprob, abs=1e-5)
        assert [t.token for t in a.top_logprobs] == [t.token for t in b.top_logprobs] and len(a.top_logprobs) == 3
        assert [t.logprob for t in a.top_logprobs] == pytest.approx([t.logprob for t in b.top_logprobs], abs=1e-5)
