"""/v1/completions: text and token-id prompts, logprobs in the legacy shape, streaming."""
import pytest

PROMPT_IDS = [5, 17, 99, 3, 42, 7, 250]


def complete(client, **kwargs):
    return client.completions.create(model="tiny", **{"prompt": PROMPT_IDS, "temperature": 0, "max_tokens": 8,
                                                      "extra_body": {"ignore_eos": True}, **kwargs})


def test_token_id_prompt_with_logprobs(openai_client):
    out = complete(openai_client, logprobs=3)
    assert out.object == "text_completion" and out.id.startswith("cmpl-")
    choice = out.choices[0]
    assert out.usage.prompt_tokens == len(PROMPT_IDS) and out.usage.completion_tokens == 8
    lp = choice.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 8
    if "\ufffd" not in "".join(lp.tokens):  # no token is a piece of a character
        assert "".join(lp.tokens) == choice.text
    offset = 0
    for token, logprob, top, at in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, lp.text_offset):
        assert at == offset
        offset += len(token)
        assert logprob <= 0 and 1 <= len(top) <= 4  # the 3 most likely, and the chosen one
        assert max(top.values()) == pytest.approx(logprob, abs=1e-4)  # greedy picks the most likely


def test_logprobs_zero_gives_the_chosen_tokens_only(openai_client):
    lp = complete(openai_client, logprobs=0).choices[0].logprobs
    assert [list(t) for t in lp.top_logprobs] == [[tok] for tok in lp.tokens]


def test_text_prompt_and_batch_of_one(openai_client):
    a = complete(openai_client, prompt="The expert cache")
    b = complete(openai_client, prompt=["The expert cache"])
    assert a.choices[0].text == b.choices[0].text and a.choices[0].logprobs is None


def test_streamed_completion(openai_client):
    whole = complete(openai_client, logprobs=1)
    chunks = list(complete(openai_client, logprobs=1, stream=True, stream_options={"include_usage": True}))
    assert all(c.object == "text_completion" for c in chunks)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    tokens = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    offsets = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.text_offset]
    assert tokens == whole.choices[0].logprobs.tokens and offsets == whole.choices[0].logprobs.text_offset
    assert chunks[-1].usage.completion_tokens == 8


def test_stop_token_ids_and_top_k_extensions(openai_client, service):
    from moebus.client import Client

    client = Client(service.zmq_address)
    try:
        first_id = client.generate(prompt_tokens=PROMPT_IDS, max_tokens=1, temperature=0).collect()["tokens"][0]
    finally:
        client.close()
    greedy = complete(openai_client).choices[0].text
    top_1 = complete(openai_client, temperature=1.0, extra_body={"top_k": 1, "ignore_eos": True})
    assert top_1.choices[0].text == greedy
    out = complete(openai_client, extra_body={"stop_token_ids": [first_id]})
    assert out.choices[0].finish_reason == "stop" and out.usage.completion_tokens == 1
