"""Continuous batching does not change a request's greedy output: 8 streams at once, each equal to
the same request alone."""
from concurrent.futures import ThreadPoolExecutor

import numpy as np

NUM_STREAMS = 8


def requests_to_run():
    rng = np.random.default_rng(3)
    return [{"prompt": [int(t) for t in rng.integers(3, 384, size=int(n))], "max_tokens": int(m)}
            for n, m in zip(rng.integers(2, 60, NUM_STREAMS), rng.integers(8, 40, NUM_STREAMS))]


def streamed(client, req) -> tuple[str, list[str], list[float]]:
    stream = client.completions.create(model="m", temperature=0, logprobs=0, stream=True,
                                       extra_body={"ignore_eos": True}, **req)
    text, tokens, logprobs = [], [], []
    for chunk in stream:
        choice = chunk.choices[0]
        text.append(choice.text)
        if choice.logprobs:
            tokens += choice.logprobs.tokens
            logprobs += choice.logprobs.token_logprobs
    return "".join(text), tokens, logprobs


def test_concurrent_streams_equal_their_solo_output(openai_client, service):
    reqs = requests_to_run()
    solo = [streamed(openai_client, r) for r in reqs]
    with ThreadPoolExecutor(NUM_STREAMS) as pool:
        together = list(pool.map(lambda r: streamed(openai_client, r), reqs))
    for r, (text, tokens, logprobs), (text2, tokens2, logprobs2) in zip(reqs, solo, together):
        assert len(tokens) == r["max_tokens"]
        assert (text2, tokens2) == (text, tokens)
        np.testing.assert_allclose(logprobs2, logprobs, atol=1e-4)
