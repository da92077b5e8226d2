"""Nothing is accepted and ignored: every field that the installed openai SDK can send either works
(tested in the files beside this one) or gets 400 naming it, and so does a field nobody defines."""
import openai
import pytest

USER = [{"role": "user", "content": "hi"}]

# fields that work; a bookkeeping field (user, metadata, ...) works by having no effect on an answer
CHAT_IMPLEMENTED = {"messages", "model", "frequency_penalty", "presence_penalty", "logit_bias", "logprobs",
                    "top_logprobs", "max_tokens", "max_completion_tokens", "n", "seed", "stop", "stream_options",
                    "temperature", "top_p", "tools", "tool_choice", "response_format", "user", "safety_identifier",
                    "metadata", "prompt_cache_key", "prompt_cache_retention", "prompt_cache_options",
                    "parallel_tool_calls", "store", "service_tier", "modalities"}
# a value of each other field (or of a partly implemented one) that asks for what is not implemented
CHAT_REFUSED = {
    "audio": {"voice": "alloy", "format": "wav"}, "modalities": ["text", "audio"], "prediction": {"type": "content",
                                                                                                    "content": "x"},
    "web_search_options": {}, "reasoning_effort": "high", "verbosity": "low", "moderation": {"model": "x"},
    "functions": [{"name": "f"}], "function_call": "auto", "store": True, "service_tier": "flex",
    "parallel_tool_calls": False,
}
COMPLETION_IMPLEMENTED = {"model", "prompt", "frequency_penalty", "presence_penalty", "logit_bias", "logprobs",
                          "max_tokens", "n", "seed", "stop", "stream_options", "temperature", "top_p", "user",
                          "best_of", "echo", "suffix"}
COMPLETION_REFUSED = {"echo": True, "suffix": "and then", "best_of": 2}


def _sdk_fields(module) -> set[str]:
    return set(module.CompletionCreateParamsBase.__annotations__)


def test_every_chat_field_of_the_sdk_is_decided():
    from openai.types.chat import completion_create_params

    assert _sdk_fields(completion_create_params) <= CHAT_IMPLEMENTED | set(CHAT_REFUSED)


def test_every_completion_field_of_the_sdk_is_decided():
    from openai.types import completion_create_params

    assert _sdk_fields(completion_create_params) <= COMPLETION_IMPLEMENTED | set(COMPLETION_REFUSED)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("field", sorted(CHAT_REFUSED))
def test_unimplemented_chat_field_is_refused(openai_client, field, stream):
    with pytest.raises(openai.BadRequestError) as err:
        openai_client.chat.completions.create(model="tiny", messages=USER, max_tokens=2, stream=stream,
                                              **{field: CHAT_REFUSED[field]})
    assert err.value.body["param"] == field and field in err.value.body["message"]


@pytest.mark.parametrize("field", sorted(COMPLETION_REFUSED))
def test_unimplemented_completion_field_is_refused(openai_client, field):
    with pytest.raises(openai.BadRequestError) as err:
        openai_client.completions.create(model="tiny", prompt="x", max_tokens=2, **{field: COMPLETION_REFUSED[field]})
    assert err.value.body["param"] == field


@pytest.mark.parametrize("create, args", [("chat", {"messages": USER}), ("completions", {"prompt": "x"})])
def test_unknown_fields_are_refused(openai_client, create, args):
    endpoint = openai_client.chat.completions if create == "chat" else openai_client.completions
    with pytest.raises(openai.BadRequestError) as err:
        endpoint.create(model="tiny", max_tokens=2, **args, extra_body={"some_future_field": {"a": 1}})
    assert err.value.body["param"] == "some_future_field" and err.value.body["code"] == "unknown_field"


@pytest.mark.parametrize("extra, param", [
    ({"tools": [{"type": "function", "function": {"name": "f", "strict": "yes"}}]}, "tools.0.function.strict"),
    ({"tools": [{"type": "custom", "custom": {"name": "f"}}]}, "tools.0.type"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools.0.function.name"),
    ({"tool_choice": {"type": "function", "function": {"name": "f"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),  # no tools to call
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}}, "response_format.json_schema.name"),
    ({"extra_body": {"grammar": "root ::= \"a\""}}, "grammar"),  # llama.cpp's GBNF: not taken
    ({"extra_body": {"guided_grammar": "start: \"a\""}}, "guided_grammar"),
    ({"stream_options": {"include_obfuscation": True}}, "stream_options.include_obfuscation"),
    ({"logit_bias": {"not-an-id": 1}}, "logit_bias"),
    ({"logit_bias": {"\u00b2": 1}}, "logit_bias"),  # isdigit() but no int (was a 500)
    ({"logit_bias": {"\u0661\u0662": 1}}, "logit_bias"),  # Arabic-Indic digits are no token id
    ({"logit_bias": {"01": 1, "1": 2}}, "logit_bias"),  # one token named twice
    ({"logit_bias": {"9" * 30: 1}}, "logit_bias"),
    ({"logit_bias": {"5": 101}}, "logit_bias"),
    ({"logit_bias": {"100000": 1}}, "logit_bias"),  # outside the vocabulary
    ({"frequency_penalty": 2.5}, "frequency_penalty"),
    ({"presence_penalty": -3}, "presence_penalty"),
    ({"extra_body": {"repetition_penalty": 0}}, "repetition_penalty"),
    ({"extra_body": {"min_p": 1.5}}, "min_p"),
    ({"extra_body": {"chat_template_kwargs": {"messages": []}}}, "chat_template_kwargs.messages"),
])
def test_bad_values_of_implemented_fields(openai_client, extra, param):
    with pytest.raises(openai.BadRequestError) as err:
        openai_client.chat.completions.create(model="tiny", messages=USER, max_tokens=2, **extra)
    assert err.value.body["param"] == param


def test_values_that_ask_for_nothing_are_accepted(openai_client):
    out = openai_client.chat.completions.create(
        model="tiny", messages=USER, max_tokens=2, store=False, service_tier="auto", modalities=["text"],
        parallel_tool_calls=True, response_format={"type": "text"}, tool_choice="none", user="me",
        safety_identifier="someone", metadata={"k": "v"}, prompt_cache_key="k",
        stream_options=None)
    assert out.choices[0].message.role == "assistant"
