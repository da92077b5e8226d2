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


FIELD_SETS = {
    "seeded_sampling": {"temperature": 0.9, "top_p": 0.8, "seed": 3, "extra_body": {"top_k": 20, "min_p": 0.05}},
    "penalties_and_bias": {"temperature": 0, "frequency_penalty": 0.5, "presence_penalty": 0.3,
                           "logit_bias": {"60": 2.0}, "extra_body": {"repetition_penalty": 1.1}},
    "stops": {"temperature": 0, "stop": ["e", "the"], "extra_body": {"stop_token_ids": [61]}},
    "newer_names": {"temperature": 0, "max_completion_tokens": 5, "user": "u", "metadata": {"k": "v"}},
    "tools_not_offered": {"temperature": 0, "tool_choice": "none",
                          "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]},
    "template_kwargs": {"temperature": 0, "extra_body": {"chat_template_kwargs": {"enable_thinking": False}}},
}


def test_every_field_set_streams_as_it_answers_whole(openai_client):
    for name, fields in FIELD_SETS.items():
        args = {"model": "tiny", "messages": MESSAGES, "max_tokens": 8, **fields}
        whole = openai_client.chat.completions.create(**args)
        chunks = list(openai_client.chat.completions.create(**args, stream=True))
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text == whole.choices[0].message.content, name
        assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason, name
