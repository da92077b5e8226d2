"""``n`` choices and ``stream_options.include_usage`` through the openai SDK, streamed and not."""
from collections import defaultdict

MESSAGES = [{"role": "user", "content": "Tell me about the cache."}]
N, MAX_TOKENS = 3, 6


def sampled_chat(client, **kwargs):
    args = dict(model="tiny", messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=1.0, seed=5,
                extra_body={"ignore_eos": True})
    return client.chat.completions.create(**{**args, **kwargs})


def test_n_choices_are_the_seeds_one_after_another(openai_client):
    out = sampled_chat(openai_client, n=N)
    assert [c.index for c in out.choices] == list(range(N))
    singles = [sampled_chat(openai_client, seed=5 + i) for i in range(N)]
    assert [c.message.content for c in out.choices] == [s.choices[0].message.content for s in singles]
    assert len({c.message.content for c in out.choices}) > 1
    assert out.usage.prompt_tokens == singles[0].usage.prompt_tokens  # one prompt, read n times
    assert out.usage.completion_tokens == N * MAX_TOKENS
    assert out.usage.total_tokens == out.usage.prompt_tokens + N * MAX_TOKENS


def test_n_choices_streamed_with_usage(openai_client):
    whole = sampled_chat(openai_client, n=N)
    chunks = list(sampled_chat(openai_client, n=N, stream=True, stream_options={"include_usage": True}))
    texts, roles, finishes = defaultdict(str), defaultdict(list), defaultdict(list)
    for chunk in chunks[:-1]:
        assert chunk.usage is None and len(chunk.choices) == 1
        choice = chunk.choices[0]
        texts[choice.index] += choice.delta.content or ""
        roles[choice.index] += [choice.delta.role] if choice.delta.role else []
        finishes[choice.index] += [choice.finish_reason] if choice.finish_reason else []
    assert [texts[i] for i in range(N)] == [c.message.content for c in whole.choices]
    assert all(roles[i] == ["assistant"] and finishes[i] == ["length"] for i in range(N))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == N * MAX_TOKENS


def test_completions_take_n_too(openai_client):
    args = dict(model="tiny", prompt="the cache", max_tokens=4, temperature=1.0, seed=9, n=2,
                extra_body={"ignore_eos": True})
    whole = openai_client.completions.create(**args)
    assert [c.index for c in whole.choices] == [0, 1] and whole.usage.completion_tokens == 8
    streamed = defaultdict(str)
    for chunk in openai_client.completions.create(**args, stream=True):
        for choice in chunk.choices:
            streamed[choice.index] += choice.text
    assert [streamed[0], streamed[1]] == [c.text for c in whole.choices]


def test_usage_only_when_asked(openai_client):
    chunks = list(sampled_chat(openai_client, stream=True))
    assert all(c.usage is None for c in chunks) and chunks[-1].choices[0].finish_reason == "length"
    chunks = list(sampled_chat(openai_client, stream=True, stream_options={"include_usage": False}))
    assert all(c.choices for c in chunks)
