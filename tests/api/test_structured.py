"""Structured outputs end to end, through the openai SDK against the served tiny model (random
weights: only the grammar makes its answers JSON): response_format json_schema and json_object,
chat and completions, whole, streamed and n > 1, at temperature 0.8; the SDK's ``parse`` with a
pydantic model; tool_choice required and named; vLLM's guided_* fields; hostile schemas."""
import json
import threading

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from tests.structured_schemas import SCHEMAS

USER = [{"role": "user", "content": "Answer in JSON."}]
MAX_TOKENS = 200  # every bounded schema's longest answer fits (tests/broker/test_grammar.py)
FAST = ["nested", "array", "any_of", "refs"]  # CI's subset; tools/structured_run.py runs all ten, 200 answers


def schema_format(name: str) -> dict:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": SCHEMAS[name], "strict": True}}


@pytest.mark.parametrize("name", FAST)
def test_json_schema_answers_parse_validate_and_stop(openai_client, name):
    out = openai_client.chat.completions.create(model="tiny", messages=USER, max_tokens=MAX_TOKENS, temperature=0.8,
                                                n=4, seed=7, response_format=schema_format(name))
    for choice in out.choices:
        jsonschema.validate(json.loads(choice.message.content), SCHEMAS[name])
        assert choice.finish_reason == "stop"


def test_streamed_answers_join_into_valid_json(openai_client):
    stream = openai_client.chat.completions.create(model="tiny", messages=USER, max_tokens=MAX_TOKENS, temperature=0.8,
                                                   n=2, stream=True, response_format=schema_format("refs"))
    texts, reasons = ["", ""], [None, None]
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            reasons[choice.index] = choice.finish_reason or reasons[choice.index]
    for text in texts:
        jsonschema.validate(json.loads(text), SCHEMAS["refs"])
    assert reasons == ["stop", "stop"]


def test_completions_take_response_format_and_guided_fields(openai_client):
    out = openai_client.completions.create(model="tiny", prompt="JSON:", max_tokens=MAX_TOKENS, temperature=0.8,
                                           extra_body={"response_format": schema_format("enum")})
    jsonschema.validate(json.loads(out.choices[0].text), SCHEMAS["enum"])
    choice = openai_client.completions.create(model="tiny", prompt="Pick:", max_tokens=20, temperature=1.0,
                                              extra_body={"guided_choice": ["alpha", "beta"]})
    assert choice.choices[0].text in ("alpha", "beta") and choice.choices[0].finish_reason == "stop"
    regex = openai_client.completions.create(model="tiny", prompt="Code:", max_tokens=20, temperature=1.0,
                                             extra_body={"guided_regex": "[A-Z]{2}-[0-9]{3}"})
    text = regex.choices[0].text
    assert len(text) == 6 and text[:2].isupper() and text[3:].isdigit()
    guided = openai_client.chat.completions.create(model="tiny", messages=USER, max_tokens=MAX_TOKENS,
                                                   extra_body={"guided_json": SCHEMAS["flat"]})
    jsonschema.validate(json.loads(guided.choices[0].message.content), SCHEMAS["flat"])


def test_json_object_mode_opens_an_object(openai_client):
    stream = openai_client.chat.completions.create(model="tiny", messages=USER, max_tokens=8, temperature=0.8,
                                                   stream=True, response_format={"type": "json_object"})
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text.startswith("{")  # any object is unbounded: random weights need not close it in 8 tokens


class Point(BaseModel):
    x: int = Field(ge=0, le=9)
    y: int = Field(ge=0, le=9)


class Shape(BaseModel):
    kind: str = Field(max_length=6)
    corners: list[Point] = Field(min_length=1, max_length=3)
    closed: bool


def test_sdk_parse_with_a_pydantic_model(openai_client):
    out = openai_client.chat.completions.parse(model="tiny", messages=USER, max_tokens=MAX_TOKENS, temperature=0.8,
                                               response_format=Shape)
    shape = out.choices[0].message.parsed
    assert isinstance(shape, Shape) and 1 <= len(shape.corners) <= 3
    assert out.choices[0].finish_reason == "stop"


TOOLS = [{"type": "function", "function": {"name": "move", "parameters": SCHEMAS["refs"]}},
         {"type": "function", "function": {"name": "tag", "parameters": SCHEMAS["array"]}}]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "tag"}}],
                         ids=["required", "named"])
def test_forced_tool_calls(openai_client, tool_choice, stream):
    args = dict(model="tiny", messages=USER, max_tokens=MAX_TOKENS, temperature=0.8, tools=TOOLS,
                tool_choice=tool_choice)
    if stream:
        from openai.lib.streaming.chat import ChatCompletionStreamState

        state = ChatCompletionStreamState(input_tools=TOOLS)
        for chunk in openai_client.chat.completions.create(**args, stream=True):
            state.handle_chunk(chunk)
        choice = state.get_final_completion().choices[0]
    else:
        choice = openai_client.chat.completions.create(**args).choices[0]
    (call,) = choice.message.tool_calls
    if isinstance(tool_choice, dict):
        assert call.function.name == "tag"
    params = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}[call.function.name]
    jsonschema.validate(json.loads(call.function.arguments), params)
    assert choice.finish_reason == "tool_calls"


def test_strict_tool_with_auto_constrains_a_call_if_one_is_made(openai_client):
    tools = [{"type": "function", "function": {"name": "move", "parameters": SCHEMAS["refs"], "strict": True}}]
    out = openai_client.chat.completions.create(model="tiny", messages=USER, max_tokens=40, temperature=1.0, n=2,
                                                tools=tools)
    for choice in out.choices:  # free text (that never opens a call) or one well-formed call
        assert "<tool_call>" not in (choice.message.content or "")
        for call in choice.message.tool_calls or []:
            jsonschema.validate(json.loads(call.function.arguments), SCHEMAS["refs"])


@pytest.mark.parametrize("extra, param, match", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}}}},
     "response_format.json_schema.schema", "missing"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strange"}}}},
     "response_format.json_schema.schema", "strange"),
    ({"extra_body": {"guided_regex": "(unclosed"}}, "guided_regex", "compiled"),
    ({"extra_body": {"guided_json": {"type": "object"}, "guided_regex": "a"}}, "guided_regex", "one"),
    ({"response_format": {"type": "json_object"}, "tools": TOOLS, "tool_choice": "required"}, "response_format",
     "both"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "nope"),
])
def test_bad_constraints_are_400s_naming_why(openai_client, extra, param, match):
    with pytest.raises(openai.BadRequestError) as err:
        openai_client.chat.completions.create(model="tiny", messages=USER, max_tokens=4, **extra)
    assert err.value.body["param"] == param and match in err.value.body["message"]


def _deep(depth: int) -> dict:
    schema = {"type": "integer"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


@pytest.mark.parametrize("schema", [
    _deep(200),  # beyond the grammar engine's nesting limit: 400
    {"$defs": {"n": {"type": "object", "properties": {"next": {"$ref": "#/$defs/n"}}}}, "$ref": "#/$defs/n"},
    {"type": "object", "properties": {f"p{i}": {"enum": [f"v{j}" for j in range(20)]} for i in range(150)}},
], ids=["deep", "recursive", "large"])
def test_hostile_schemas_get_an_answer_and_the_service_stays_up(openai_client, schema):
    """A 400 or an answer (a recursive schema compiles; random weights need not end it), while a
    plain request sent at the same time is served."""
    plain = []
    thread = threading.Thread(target=lambda: plain.append(openai_client.chat.completions.create(
        model="tiny", messages=USER, max_tokens=4)))
    thread.start()
    try:
        out = openai_client.chat.completions.create(
            model="tiny", messages=USER, max_tokens=16, temperature=0.8,
            response_format={"type": "json_schema", "json_schema": {"name": "h", "schema": schema}})
        assert out.choices[0].message.content.startswith("{")
    except openai.BadRequestError as e:
        assert e.body["param"] == "response_format.json_schema.schema"
    thread.join(timeout=60)
    assert plain and plain[0].choices[0].finish_reason == "length"
