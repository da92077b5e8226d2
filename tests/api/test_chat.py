"""/v1/chat/completions through the official openai SDK, and raw where the SDK would not send it."""
import json

import openai
import pytest

MESSAGES = [{"role": "system", "content": "You are brief."}, {"role": "user", "content": "Name a fast expert cache."}]


def chat(client, **kwargs):
    return client.chat.completions.create(model="tiny", **{"messages": MESSAGES, "temperature": 0, **kwargs})


def test_chat_completion(openai_client, tokenizer, tiny_model):
    out = chat(openai_client, max_tokens=12)
    assert out.object == "chat.completion" and out.id.startswith("chatcmpl-")
    assert out.model == tiny_model.name  # whatever name a request gives, the served model answers
    choice = out.choices[0]
    assert choice.message.role == "assistant" and isinstance(choice.message.content, str)
    assert choice.finish_reason in ("stop", "length")
    assert out.usage.prompt_tokens == len(tokenizer.encode_chat(MESSAGES))
    assert 1 <= out.usage.completion_tokens <= 12
    assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens
    assert choice.logprobs is None


def test_greedy_is_deterministic_and_max_completion_tokens_is_honoured(openai_client):
    a = chat(openai_client, max_tokens=10, extra_body={"ignore_eos": True})
    b = chat(openai_client, max_completion_tokens=10, extra_body={"ignore_eos": True})
    assert a.choices[0].message.content == b.choices[0].message.content
    assert a.usage.completion_tokens == b.usage.completion_tokens == 10
    assert a.choices[0].finish_reason == "length"


def test_streamed_chat_equals_unstreamed(openai_client):
    whole = chat(openai_client, max_tokens=16, extra_body={"ignore_eos": True})
    chunks = list(chat(openai_client, max_tokens=16, stream=True, stream_options={"include_usage": True},
                       extra_body={"ignore_eos": True}))
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 16
    assert all(c.usage is None for c in chunks[:-1])


def test_stream_ends_with_done(http):
    r = http.post(http.url("/v1/chat/completions"), stream=True, timeout=30,
                  json={"messages": MESSAGES, "max_tokens": 4, "stream": True, "temperature": 0})
    assert r.status_code == 200 and r.headers["Content-Type"].startswith("text/event-stream")
    events = [line for line in r.iter_lines() if line]
    assert all(e.startswith(b"data: ") for e in events)
    assert events[-1] == b"data: [DONE]"
    assert json.loads(events[0][6:])["choices"][0]["delta"]["role"] == "assistant"


def test_sampling_with_a_seed_repeats(openai_client):
    runs = [chat(openai_client, max_tokens=12, temperature=1.0, top_p=0.9, seed=7).choices[0].message.content
            for _ in range(2)]
    assert runs[0] == runs[1]


def test_stop_string_ends_the_answer(openai_client):
    full = chat(openai_client, max_tokens=16, extra_body={"ignore_eos": True}).choices[0].message.content
    at = next(i for i in range(1, len(full) - 1) if full.find(full[i:i + 2]) == i)  # first occurrence
    out = chat(openai_client, max_tokens=16, stop=["never there", full[at:at + 2]], extra_body={"ignore_eos": True})
    assert out.choices[0].message.content == full[:at]
    assert out.choices[0].finish_reason == "stop"


def test_logprobs_in_the_chat_shape(openai_client):
    out = chat(openai_client, max_tokens=6, logprobs=True, top_logprobs=3, extra_body={"ignore_eos": True})
    content = out.choices[0].logprobs.content
    assert len(content) == 6
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob, abs=1e-4)  # greedy: the top one
        assert entry.bytes == list(entry.token.encode())
    plain = chat(openai_client, max_tokens=6, logprobs=True, extra_body={"ignore_eos": True})
    assert [e.top_logprobs for e in plain.choices[0].logprobs.content] == [[]] * 6


def test_streamed_logprobs(openai_client):
    chunks = list(chat(openai_client, max_tokens=5, stream=True, logprobs=True, top_logprobs=2,
                       extra_body={"ignore_eos": True}))
    entries = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert len(entries) == 5 and all(len(e.top_logprobs) == 2 for e in entries)


def test_list_content_and_null_content_are_accepted(openai_client):
    messages = [{"role": "user", "content": [{"type": "text", "text": "Hello"}, {"type": "text", "text": " there"}]},
                {"role": "assistant", "content": None}, {"role": "user", "content": "again"}]
    out = openai_client.chat.completions.create(model="tiny", messages=messages, max_tokens=3)
    assert out.usage.completion_tokens >= 1


def test_image_part_is_refused_until_vision(openai_client):
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}
    with pytest.raises(openai.BadRequestError) as err:
        openai_client.chat.completions.create(model="tiny", max_tokens=3, messages=[
            {"role": "user", "content": [{"type": "text", "text": "What is this?"}, image]}])
    assert "vision" in err.value.body["message"]
    assert err.value.body["code"] == "model_has_no_vision"


@pytest.mark.parametrize("kind", ["video_url", "video", "input_video"])
def test_a_video_part_is_a_clear_400(openai_client, kind):
    video = {"type": kind, kind: {"url": "data:video/mp4;base64,AAAA"}}
    with pytest.raises(openai.BadRequestError) as err:
        openai_client.chat.completions.create(model="tiny", max_tokens=3, messages=[
            {"role": "user", "content": [{"type": "text", "text": "What happens?"}, video]}])
    assert err.value.body["code"] == "video_not_supported"
    assert err.value.body["param"] == "messages.0.content.1.type"
    assert "video inputs are not supported" in err.value.body["message"]
