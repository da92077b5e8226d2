"""Bad input gets a 400 (or its own status) with an OpenAI error object naming the parameter, and
the service goes on answering."""
import openai
import pytest

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
USER = [{"role": "user", "content": "hi"}]


def error_of(response, status):
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["message"]
    return body["error"]


@pytest.mark.parametrize("path, body, param", [
    (CHAT, {}, "messages"),
    (CHAT, {"messages": []}, "messages"),
    (CHAT, {"messages": "hi"}, "messages"),
    (CHAT, {"messages": [{"content": "no role"}]}, "messages.0.role"),
    (CHAT, {"messages": USER, "max_tokens": 0}, "max_tokens"),
    (CHAT, {"messages": USER, "max_tokens": -3}, "max_tokens"),
    (CHAT, {"messages": USER, "max_tokens": "many"}, "max_tokens"),
    (CHAT, {"messages": USER, "max_tokens": 10_000}, "max_tokens"),  # beyond max_context (256)
    (CHAT, {"messages": USER, "n": 0}, "n"),
    (CHAT, {"messages": USER, "n": 17}, "n"),
    (CHAT, {"messages": USER, "temperature": "hot"}, "temperature"),
    (CHAT, {"messages": USER, "temperature": 3}, "temperature"),
    (CHAT, {"messages": USER, "top_p": 0}, "top_p"),
    (CHAT, {"messages": USER, "stop": 7}, "stop"),
    (CHAT, {"messages": USER, "stream": "yes"}, "stream"),
    (CHAT, {"messages": USER, "top_logprobs": 2}, "top_logprobs"),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}]},
     "messages.0.content.0.type"),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "text"}]}]}, "messages.0.content.0.text"),
    (CHAT, {"messages": [{"role": "user", "content": "word " * 400}]}, "messages"),  # longer than max_context
    (COMPLETIONS, {}, "prompt"),
    (COMPLETIONS, {"prompt": []}, "prompt"),
    (COMPLETIONS, {"prompt": ["one", "two"]}, "prompt"),
    (COMPLETIONS, {"prompt": [1, -2]}, "prompt"),
    (COMPLETIONS, {"prompt": [1, 100_000]}, "prompt"),  # outside the vocabulary
    (COMPLETIONS, {"prompt": list(range(1, 300))}, "prompt"),  # longer than max_context
    (COMPLETIONS, {"prompt": "x", "logprobs": 50}, "logprobs"),
    (COMPLETIONS, {"prompt": "x", "echo": True}, "echo"),
    (COMPLETIONS, {"prompt": "x", "n": 0}, "n"),
    # integers beyond 64 bits in free-form JSON, which msgpack cannot carry (each was a 500)
    (CHAT, {"messages": [{"role": "user", "content": "hi", "n": 2 ** 64}]}, "messages.0.n"),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi", "z": -2 ** 63 - 1}]}]},
     "messages.0.content.0.z"),
    (CHAT, {"messages": USER, "chat_template_kwargs": {"x": [10 ** 30]}}, "chat_template_kwargs.x.0"),
    (CHAT, {"messages": USER, "tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "integer", "maximum": 10 ** 30}}}]}, "tools.0.function.parameters.maximum"),
    ("/tokenize", {"messages": [{"role": "user", "content": "hi", "n": 10 ** 30}]}, "messages.0.n"),
])
def test_bad_request_names_the_param(http, path, body, param):
    err = error_of(http.post(http.url(path), json=body), 400)
    assert err["param"] == param
    assert err["type"] == "invalid_request_error"


@pytest.mark.parametrize("stream", [False, True])
def test_rejected_stream_gets_its_status_not_an_event(http, stream):
    err = error_of(http.post(http.url(CHAT), json={"messages": USER, "max_tokens": 10_000, "stream": stream}), 400)
    assert err["code"] == "context_length_exceeded"


@pytest.mark.parametrize("raw", [b"{", b"not json", b'{"messages": [}', b"\xff\xfe\x00", b"[1, 2]", b"null", b"",
                                 b"[" * 60_000])
def test_malformed_json(http, raw):
    err = error_of(http.post(http.url(CHAT), data=raw, headers={"Content-Type": "application/json"}), 400)
    assert err["code"] == "invalid_json"


def test_sdk_raises_bad_request(openai_client):
    with pytest.raises(openai.BadRequestError) as err:
        openai_client.chat.completions.create(model="tiny", messages=USER, n=0)
    assert err.value.status_code == 400 and err.value.body["param"] == "n"


def test_sdk_with_an_integer_beyond_64_bits(openai_client):
    with pytest.raises(openai.BadRequestError) as err:
        openai_client.chat.completions.create(model="tiny", messages=USER, max_tokens=2,
                                              extra_body={"chat_template_kwargs": {"big": 2 ** 64}})
    assert err.value.body["param"] == "chat_template_kwargs.big"
    big_ok = openai_client.chat.completions.create(model="tiny", messages=USER, max_tokens=2,
                                                   extra_body={"chat_template_kwargs": {"big": 2 ** 64 - 1}})
    assert big_ok.choices[0].message.role == "assistant"  # msgpack's own range is taken


def test_unknown_route_and_method(http):
    assert error_of(http.get(http.url("/v1/nothing")), 404)["type"] == "not_found_error"
    assert error_of(http.get(http.url(CHAT)), 405)["code"] == "method_not_allowed"
    assert error_of(http.get(http.url("/v1/models/other-model")), 404)["param"] == "model"


def test_next_valid_request_works(openai_client):
    out = openai_client.completions.create(model="tiny", prompt="after the errors", max_tokens=3)
    assert out.usage.completion_tokens >= 1
